"""Continued pretraining from a Hugging Face folder (`--config.init.hf_dir=DIR` in a pretraining
config) for each family that has it: BERT, ALBERT and RoBERTa through experiments.bert
(workflows/bert_continue.py), T5 through experiments.translate's span corruption
(workflows/t5_init.py).

Each family's small random model is built by transformers (weights perturbed, so that a
mis-mapped one would show) and saved with its tokenizer, as a user downloads one; the family's
own pretraining config (not shrunk: the folder's config replaces config.model) trains a few steps
from it on a tiny corpus. The params at step 0 are the import's, bit for bit; their loss on the
first held-out batch is transformers' loss on that batch; the training loss falls; the workdir
exports back to a folder transformers loads, whose import is the trained params and whose
tokenizer gives the original folder's ids.
"""

import gzip
import random
import shutil

import flax
import jax
import numpy as np
import pytest

torch = pytest.importorskip('torch', reason='needs the parity extra: pip install -e ".[parity]"')
transformers = pytest.importorskip('transformers',
                                   reason='needs the parity extra: pip install -e ".[parity]"')

from conftest import set_path
from test_hf_encoder_uses import SMALL, WORDS, _albert_tokenizer, _perturbed
from test_hf_roberta_parity import roberta_tokenizer
import test_t5_finetune
from test_t5_finetune import eval_loss, shrink, train_losses

from transformer_jax.cli.workdir import load_saved_config
from transformer_jax.convert import families
from transformer_jax.errors import ConfigError
from transformer_jax.workflows import bert, translation
from transformer_jax.workflows.export import export_workdir

pytestmark = pytest.mark.parity

# tests/test_t5_finetune.py's fixtures: Trainer.fit's starting state recorded; the T5 folder.
fit_calls = test_t5_finetune.fit_calls
hf_t5_dir = test_t5_finetune.hf_t5_dir

BERT_SPECIAL = ['[PAD]', '[UNK]', '[CLS]', '[SEP]', '[MASK]']
TEXTS = ['the film was very good', 'a dull plot and boring songs', 'lovely cast']
# family -> (its pretraining config, the tokenizer.type its import gives, the transformers
# class saved, the Auto class that loads the export, the sentence-label argument of its loss).
ENCODERS = {
    'bert': ('bert_pretrain_small', 'wordpiece', 'BertForPreTraining', 'AutoModelForPreTraining',
             'next_sentence_label'),
    'albert': ('albert_pretrain_small', 'sentencepiece', 'AlbertForPreTraining',
               'AutoModelForPreTraining', 'sentence_order_label'),
    'roberta':
        ('roberta_pretrain_small', 'byte_bpe', 'RobertaForMaskedLM', 'AutoModelForMaskedLM', ''),
}
# The shrunk run: the data and schedule, never the model (the folder's replaces it).
RUN = {
    'data.lines_per_document': 0, 'data.valid_fraction': 0.1, 'data.max_len': 32,
    'data.max_predictions': 5, 'data.batch_size': 8, 'data.eval_batches': 1, 'train.num_steps': 8,
    'train.log_every': 2, 'train.eval_every': 0, 'train.checkpoint_every': 8,
    'optimizer.learning_rate': 5e-3, 'optimizer.warmup_steps': 1, 'optimizer.decay_steps': 100
}


def _flat(params) -> dict:
  return {
      '/'.join(k): np.asarray(v)
      for k, v in flax.traverse_util.flatten_dict(jax.device_get(params)).items()
  }


def _assert_bitwise(got: dict, expected: dict):
  assert sorted(got) == sorted(expected)
  for name, value in expected.items():
    assert got[name].dtype == value.dtype and np.array_equal(got[name], value), name


def _documents_file(path) -> str:
  """40 documents of 4 lines of 6 of WORDS (every tokenizer here encodes them without <unk>)."""
  rng = random.Random(0)
  docs = [
      '\n'.join(' '.join(rng.choice(WORDS) for _ in range(6)) for _ in range(4)) for _ in range(40)
  ]
  path.write_text('\n\n'.join(docs) + '\n')
  return str(path)


def _save_encoder(family: str, root):
  """(folder, transformers model, transformers tokenizer): a random small pretraining model of
  `family` saved by transformers with its tokenizer."""
  folder = root / family
  folder.mkdir()
  if family == 'bert':
    (folder / 'vocab.txt').write_text('\n'.join(BERT_SPECIAL + WORDS) + '\n')
    tokenizer = transformers.BertTokenizerFast.from_pretrained(str(folder))
    model = transformers.BertForPreTraining(
        transformers.BertConfig(**SMALL, vocab_size=len(tokenizer), max_position_embeddings=32))
  elif family == 'albert':
    tokenizer = _albert_tokenizer()
    model = transformers.AlbertForPreTraining(
        transformers.AlbertConfig(**SMALL, vocab_size=len(tokenizer), embedding_size=16,
                                  max_position_embeddings=32))
  else:
    (root / 'bpe_files').mkdir()
    tokenizer = roberta_tokenizer([' '.join(WORDS)] * 20 + WORDS * 5, 300, root / 'bpe_files')
    model = transformers.RobertaForMaskedLM(
        transformers.RobertaConfig(**SMALL, vocab_size=len(tokenizer) + 3, type_vocab_size=1,
                                   max_position_embeddings=40, pad_token_id=1, layer_norm_eps=1e-5))
  _perturbed(model).save_pretrained(str(folder), safe_serialization=True)
  tokenizer.save_pretrained(str(folder))
  return folder, model, tokenizer


def _transformers_loss(family, model, tokenizer, batch) -> float:
  """transformers' pretraining loss (MLM mean + sentence-task mean) on one of our batches."""
  inputs = np.asarray(batch['inputs'])
  labels = np.full(inputs.shape, -100, np.int64)
  positions, targets = np.asarray(batch['mlm_positions']), np.asarray(batch['mlm_ids'])
  rows, slots = np.nonzero(np.asarray(batch['mlm_weights']) > 0)
  labels[rows, positions[rows, slots]] = targets[rows, slots]
  to_hf = getattr(tokenizer, 'to_hf', lambda ids: ids)  # RoBERTa's ids swap 0 and its pad id
  ids = to_hf(inputs)
  labels = np.where(labels >= 0, to_hf(np.maximum(labels, 0)), -100)
  arguments = dict(input_ids=torch.from_numpy(np.asarray(ids, np.int64)),
                   attention_mask=torch.from_numpy((inputs != 0).astype(np.int64)),
                   token_type_ids=torch.from_numpy(np.asarray(batch['segments'], np.int64)),
                   labels=torch.from_numpy(labels))
  sentence_argument = ENCODERS[family][4]
  if sentence_argument:
    arguments[sentence_argument] = torch.from_numpy(np.asarray(batch['sentence_labels'], np.int64))
  with torch.no_grad():
    return float(model(**arguments).loss)


@pytest.mark.slow  # trains, then exports
@pytest.mark.parametrize('family', sorted(ENCODERS))
def test_encoder_pretraining_continues_from_an_hf_folder(family, tmp_path, fit_calls):
  """bert_pretrain_small.py, albert_pretrain_small.py and roberta_pretrain_small.py with
  init.hf_dir = a BertForPreTraining, AlbertForPreTraining or RobertaForMaskedLM folder."""
  import importlib
  config_name, tokenizer_type, hf_class, auto_class, _ = ENCODERS[family]
  folder, model, hf_tokenizer = _save_encoder(family, tmp_path)
  config = importlib.import_module(f'experiments.configs.{config_name}').get_config()
  values = dict(RUN)
  values.update({'data.paths': _documents_file(tmp_path / 'text.txt'), 'init.hf_dir': str(folder)})
  for key, value in values.items():
    set_path(config, key, value)
  workdir = str(tmp_path / 'work')
  bert.run(config, workdir)

  # Step 0: the folder's params, bit for bit (RoBERTa's MLM class has no pooler: ours is fresh).
  first = fit_calls[0]
  assert first['step'] == 0
  imported = _flat(families.named(family).load(str(folder)).params)
  started = _flat(first['params'])
  fresh = sorted(set(started) - set(imported))
  assert fresh == (['pooler/bias', 'pooler/kernel'] if family == 'roberta' else []), fresh
  _assert_bitwise({k: started[k] for k in imported}, imported)
  # Their loss on the first held-out batch is transformers' (MLM, and NSP or SOP).
  ours = float(first['task'].loss_fn(first['params'], first['batch'], None, True)[0])
  saved = load_saved_config(workdir)  # the config as the folder rewrote it
  theirs = _transformers_loss(family, model, bert.pretrain_tokenizer(saved, workdir),
                              first['batch'])
  losses = train_losses(workdir)
  print(f'{family}: step-0 loss on a held-out batch: ours {ours:.6f}, transformers '
        f'{theirs:.6f}; train loss {[round(x, 3) for x in losses]}')
  assert abs(ours - theirs) <= 1e-4 * max(1.0, abs(theirs))
  assert len(losses) == 4 and losses[-1] < losses[0] - 0.3, losses

  # The workdir holds the folder's model and tokenizer: it restores and exports alone.
  assert (saved.model.emb_dim, saved.model.num_encoder_layers) == (32, 2)  # not the config's
  assert saved.tokenizer.type == tokenizer_type and saved.init.hf_dir == str(folder)
  cfg, params, tokenizer = bert.restore_pretrained(workdir)
  assert cfg.vocab_size == model.config.vocab_size
  out = tmp_path / 'exported'
  assert export_workdir(workdir, str(out)) == family
  _assert_bitwise(_flat(families.named(family).load(str(out)).params), _flat(params))
  exported, info = getattr(transformers, auto_class).from_pretrained(str(out),
                                                                     output_loading_info=True)
  assert type(exported).__name__ == hf_class and not info['missing_keys'], info
  exported_tokenizer = transformers.AutoTokenizer.from_pretrained(str(out))
  for text in TEXTS:
    assert exported_tokenizer(text).input_ids == hf_tokenizer(text).input_ids, text

  # Fine-tuning starts from the workdir (init.bert_workdir) as from one trained from scratch.
  from experiments.configs import sst2_minilm
  fine = sst2_minilm.get_config()
  set_path(fine, 'init.hf_dir', '')
  set_path(fine, 'init.bert_workdir', workdir)
  assert bert.init_model_config(fine)[0].vocab_size == model.config.vocab_size
  _, loaded, loaded_tokenizer, _ = bert.load_init(fine)
  assert type(loaded_tokenizer) is type(tokenizer)
  _assert_bitwise(_flat(loaded), _flat(params))

  # A rerun resumes from the workdir's checkpoint (step 8) without the folder.
  shutil.rmtree(folder)
  set_path(config, 'train.num_steps', 10)
  assert bert.run(config, workdir)['step'] == 10
  assert fit_calls[1]['step'] == 8
  _assert_bitwise(_flat(fit_calls[1]['params']), _flat(params))


@pytest.mark.parametrize('case, expected', [
    ('causal_lm', "model_type='gpt2'; supported encoders"),
    ('missing', 'init.hf_dir: '),
    ('one_segment_type', "has 1 segment type, but data.sentence_task='nsp'"),
    ('prepared', 'brings its own tokenizer, but data.prepared='),
    ('vocab_file', "tokenizer.vocab_file='vocab.txt' is not read with init.hf_dir"),
    ('sentencepiece', "tokenizer.type='sentencepiece' is ALBERT's tokenizer of an import"),
])
def test_a_bad_start_is_one_line_before_anything_is_written(case, expected, tmp_path):
  from experiments.configs import bert_pretrain_small
  config = bert_pretrain_small.get_config()
  config.data.paths = 'never_read.txt'
  folder = tmp_path / 'folder'
  folder.mkdir()
  config.init.hf_dir = str(folder)
  if case == 'causal_lm':
    (folder / 'config.json').write_text('{"model_type": "gpt2"}')
  elif case == 'missing':
    config.init.hf_dir = str(tmp_path / 'nowhere')
  elif case == 'one_segment_type':  # NSP's sentence B has segment id 1
    (folder / 'vocab.txt').write_text('\n'.join(BERT_SPECIAL + WORDS) + '\n')
    transformers.BertForPreTraining(
        transformers.BertConfig(**SMALL, vocab_size=len(BERT_SPECIAL + WORDS),
                                type_vocab_size=1)).save_pretrained(str(folder))
  elif case == 'prepared':
    config.data.update(dict(source='prepared', prepared='never_read', paths=''))
  elif case == 'vocab_file':
    config.tokenizer.vocab_file = 'vocab.txt'
  elif case == 'sentencepiece':
    config.init.hf_dir = ''
    config.tokenizer.type = 'sentencepiece'
  workdir = tmp_path / 'work'
  with pytest.raises(ConfigError) as info:
    bert.run(config, str(workdir))
  message = str(info.value)
  print(message)
  assert '\n' not in message and expected in message
  assert not workdir.exists()


@pytest.mark.slow  # trains, then exports
def test_t5_span_corruption_continues_from_an_hf_folder(hf_t5_dir, corpus, tmp_path, fit_calls):
  """t5_span_corruption.py with init.hf_dir = a T5ForConditionalGeneration folder (264
  embedding rows, a 260-id tokenizer whose top 10 are the sentinels)."""
  from experiments.configs import t5_span_corruption
  directory, model, tokenizer, _ = hf_t5_dir
  text = tmp_path / 'text.txt'
  with gzip.open(corpus('multi30k') / 'train.en.gz', 'rt', encoding='utf-8') as f:
    text.write_text(''.join(next(f) for _ in range(600)))
  config = shrink(t5_span_corruption.get_config())
  config.data.text_path = str(text)
  config.init.hf_dir = directory
  config.optimizer.learning_rate = 1e-2
  workdir = str(tmp_path / 'work')
  translation.train_and_evaluate(config, workdir)

  first = fit_calls[0]
  assert first['step'] == 0 and first['task'].cfg.vocab_size == 264
  _assert_bitwise(_flat(first['params']), _flat(families.named('t5').load(directory).params))
  # The spans are cut out with the checkpoint's own sentinels: each target starts with
  # '<extra_id_0>', transformers' id for it.
  inputs, targets = (np.asarray(first['batch'][k]) for k in ('inputs', 'targets'))
  assert (targets[:, 0] == tokenizer.convert_tokens_to_ids('<extra_id_0>')).all()
  assert (inputs == tokenizer.convert_tokens_to_ids('<extra_id_1>')).any()
  ours = eval_loss(first['task'], first['params'], first['batch'])
  with torch.no_grad():
    theirs = float(
        model(input_ids=torch.from_numpy(inputs).long(), attention_mask=torch.from_numpy(
            (inputs != 0).astype(np.int64)),
              labels=torch.from_numpy(np.where(targets == 0, -100, targets)).long()).loss)
  losses = train_losses(workdir)
  print(f't5: step-0 loss on a held-out batch: ours {ours:.6f}, transformers {theirs:.6f}; '
        f'train loss {[round(x, 3) for x in losses]}')
  assert abs(ours - theirs) <= 1e-5
  assert losses[-1] < losses[0] - 0.3, losses

  saved = load_saved_config(workdir)
  assert (saved.tokenizer.vocab_size, saved.tokenizer.num_sentinels) == (250, 10)
  assert saved.model.vocab_size == 264 and saved.model.activation == 'relu'  # the folder's
  trained = jax.device_get(translation.restore_for_inference(saved, workdir).params)
  out = tmp_path / 'exported'
  assert export_workdir(workdir, str(out)) == 't5'
  _assert_bitwise(_flat(families.named('t5').load(str(out)).params), _flat(trained))
  exported = transformers.AutoModelForSeq2SeqLM.from_pretrained(str(out))
  assert type(exported).__name__ == 'T5ForConditionalGeneration'
  exported_tokenizer = transformers.AutoTokenizer.from_pretrained(str(out))
  for line in ('A dog <extra_id_0> on the beach.', 'Two men <extra_id_9> football.'):
    assert exported_tokenizer(line).input_ids == tokenizer(line).input_ids, line
