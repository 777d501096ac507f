"""`experiments.bert --mode=fill_mask --hf_dir=DIR` for every encoder family of the registry.

Each family's small random masked LM is built and saved by `transformers` with its tokenizer (the
way a user downloads one); the command's top-k fills (ids in the folder's numbering, token texts,
probabilities) must equal transformers' `pipeline("fill-mask")` on the same folder. BERT's case
is tests/test_bert_predict.py; this file adds the families whose tokenizers are not WordPiece.
"""

import subprocess
import sys

import pytest

torch = pytest.importorskip('torch', reason='needs the parity extra: pip install -e ".[parity]"')
transformers = pytest.importorskip('transformers',
                                   reason='needs the parity extra: pip install -e ".[parity]"')

from conftest import REPO_ROOT
from hf_encoders import albert_tokenizer, perturbed
from test_bert_predict import assert_fills_equal
from test_hf_roberta_parity import roberta_tokenizer
from test_roberta_data import tiny_sst2_finetune
from transformer_jax.convert import families
from transformer_jax.data.albert_tokenizer import AlbertTokenizer

pytestmark = pytest.mark.parity

WORDS = [
    'the', 'a', 'film', 'movie', 'plot', 'was', 'very', 'and', 'cast', 'songs', 'great', 'dull',
    'good', 'bad', 'lovely', 'boring'
]
CORPUS = [' '.join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(9)) for i in range(60)]
SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
             hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def _perturbed(model):
  return perturbed(model, 0.3)


def _albert_tokenizer():
  """ALBERT's unigram SentencePiece over WORDS (plus letters, so any word encodes)."""
  return albert_tokenizer(WORDS)


def _save_masked_lm(name, directory):
  """(folder, transformers model, tokenizer) of family `name`, saved with its tokenizer."""
  if name == 'roberta':  # positions start after the pad id
    (directory / 'bpe_files').mkdir()
    tokenizer = roberta_tokenizer(CORPUS, 300, directory / 'bpe_files')
    config = transformers.RobertaConfig(**SMALL, vocab_size=len(tokenizer), type_vocab_size=1,
                                        max_position_embeddings=40, pad_token_id=1,
                                        layer_norm_eps=1e-5)
    model = transformers.RobertaForMaskedLM(config)
  else:
    tokenizer = _albert_tokenizer()
    config = transformers.AlbertConfig(**SMALL, vocab_size=len(tokenizer), embedding_size=16,
                                       max_position_embeddings=32)
    model = transformers.AlbertForMaskedLM(config)
  folder = directory / name
  _perturbed(model).save_pretrained(str(folder), safe_serialization=True)
  tokenizer.save_pretrained(str(folder))
  return folder, model, tokenizer


@pytest.mark.parametrize('name', ['roberta', 'albert'])
def test_fill_mask_of_an_hf_folder_matches_transformers_pipeline(name, tmp_path):
  assert families.named(name).kind == families.ENCODER
  folder, model, tokenizer = _save_masked_lm(name, tmp_path)
  assert families.of_directory(str(folder)).name == name
  mask = tokenizer.mask_token
  lines = [
      f'the film was {mask}', f'a {mask} plot and very good songs', f'{mask} cast',
      f'the {mask} movie was {mask} and lovely'
  ]
  fill = transformers.pipeline('fill-mask', model=model, tokenizer=tokenizer, top_k=5, device='cpu')
  result = subprocess.run([
      sys.executable, '-m', 'experiments.bert', '--mode=fill_mask', f'--hf_dir={folder}',
      '--format=jsonl', '--top_k=5'
  ], input='\n'.join(lines) + '\n', capture_output=True, text=True, cwd=REPO_ROOT, timeout=300)
  ours = assert_fills_equal(result, lines, fill, mask, name)
  # Peaked, not flat: the ids compared above are the model's choice, not ties.
  assert ours[0]['masks'][0][0]['probability'] > 2 / model.config.vocab_size


def test_albert_tokenizer_gives_transformers_ids_and_saves_what_it_reads(tmp_path):
  reference = _albert_tokenizer()
  reference.save_pretrained(str(tmp_path / 'hf'))
  ours = AlbertTokenizer.from_dir(str(tmp_path / 'hf'))
  texts = ['the Film was [MASK] zz', 'a   lovely, boring cast!', '', 'ünïcode 東京']
  for text in texts:
    assert ours.encode_pair(text)[0] == reference(text).input_ids, text
  first, second = 'the plot', 'very dull songs'
  ids, segments = ours.encode_pair(first, second)
  expected = reference(first, second, return_token_type_ids=True)
  assert ids == expected.input_ids and segments == expected.token_type_ids
  assert (ours.pad_id, ours.mask_id) == (0, reference.mask_token_id)
  ours.save(str(tmp_path / 'saved'))
  again = transformers.AutoTokenizer.from_pretrained(str(tmp_path / 'saved'))
  for text in texts:
    assert again(text).input_ids == reference(text).input_ids
    assert AlbertTokenizer.from_dir(str(tmp_path / 'saved')).encode_pair(text)[0] == \
        reference(text).input_ids


def test_a_folder_without_what_fill_mask_needs_is_one_line(tmp_path):
  # An ALBERT without its tokenizer, and one without the masked-LM head.
  config = transformers.AlbertConfig(**SMALL, vocab_size=len(_albert_tokenizer()),
                                     embedding_size=16, max_position_embeddings=32)
  transformers.AlbertForMaskedLM(config).save_pretrained(str(tmp_path / 'bare'))
  transformers.AlbertModel(config).save_pretrained(str(tmp_path / 'headless'))
  _albert_tokenizer().save_pretrained(str(tmp_path / 'headless'))
  for folder, expected in (('bare', 'has no tokenizer this albert import reads'),
                           ('headless', 'has no masked-LM head')):
    result = subprocess.run([
        sys.executable, '-m', 'experiments.bert', '--mode=fill_mask',
        f'--hf_dir={tmp_path / folder}'
    ], input='the [MASK]\n', capture_output=True, text=True, cwd=REPO_ROOT, timeout=300)
    assert result.returncode != 0 and result.stdout == ''
    last = result.stderr.strip().splitlines()[-1]
    assert expected in last and last.startswith('error:'), result.stderr[-2000:]


def test_albert_fine_tunes_from_an_hf_folder_and_predicts_from_its_workdir(tmp_path):
  """init.hf_dir = an ALBERT saved by transformers with its tokenizer: the weights and ids
  fine-tuning starts from are transformers' own, the workdir keeps the tokenizer, and
  --mode=predict reads it back."""
  import flax
  import numpy as np
  from transformer_jax.workflows import bert, bert_use
  tokenizer = _albert_tokenizer()
  config = transformers.AlbertConfig(**SMALL, vocab_size=len(tokenizer), embedding_size=16,
                                     max_position_embeddings=32)
  model = _perturbed(transformers.AlbertModel(config))
  folder = tmp_path / 'albert'
  model.save_pretrained(str(folder), safe_serialization=True)
  tokenizer.save_pretrained(str(folder))
  fine = tiny_sst2_finetune(folder, tmp_path / 'sst2', steps=4)
  cfg, params, ours, types = bert.load_init(fine)
  assert isinstance(ours, AlbertTokenizer) and types == config.type_vocab_size
  assert cfg.share_layers and cfg.embedding_size == 16
  text = 'a lovely plot'
  assert ours.encode_pair(text)[0] == tokenizer(text).input_ids
  # The imported encoder computes transformers' hidden states for those ids.
  from transformer_jax.models.bert import Bert, bert_heads
  ids = np.asarray([tokenizer(text).input_ids])
  hidden = Bert(cfg.replace(dropout_rate=0.0, attention_dropout_rate=0.0),
                **bert_heads(params)).apply({'params': params}, ids, np.zeros_like(ids))['hidden']
  with torch.no_grad():
    expected = model(torch.tensor(ids)).last_hidden_state.numpy()
  assert np.max(np.abs(np.asarray(hidden) - expected)) < 1e-4
  workdir = tmp_path / 'fine'
  results = bert.run(fine, str(workdir))
  assert 0.0 <= results['dev_accuracy'] <= 1.0
  assert (workdir / 'tokenizer' / 'tokenizer.json').exists()
  assert isinstance(bert.finetune_tokenizer(fine, str(workdir)), AlbertTokenizer)
  predicted = subprocess.run(
      [sys.executable, '-m', 'experiments.bert', '--mode=predict', f'--workdir={workdir}'],
      input='a great film\na boring plot\n', capture_output=True, text=True, cwd=REPO_ROOT,
      timeout=300)
  assert predicted.returncode == 0, predicted.stderr[-3000:]
  lines = predicted.stdout.splitlines()
  assert len(lines) == 2
  for line in lines:
    label, probability = line.split('\t')
    assert label in ('0', '1') and 0.5 <= float(probability) <= 1.0, line
  flat = flax.traverse_util.flatten_dict
  assert flat(params).keys() <= flat(bert_use.restore_classifier(str(workdir))[2]).keys()
