"""Token classification: the CoNLL reader, first-sub-word labels, and a tagger that learns a
per-word task no sentence classifier can express ("tag every number word"), from a BERT, RoBERTa
or ALBERT folder."""

import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hf_encoders import assert_encoder_matches, need_transformers, save_encoder

from experiments.configs import conll_tagging
from transformer_jax.convert.export import write_hf_directory
from transformer_jax.convert.hf_bert import bert_config_to_hf, export_bert_state_dict
from transformer_jax.data import conll
from transformer_jax.data.wordpiece import SPECIAL_TOKENS, WordPieceTokenizer
from transformer_jax.errors import DataError
from transformer_jax.models.bert import Bert, bert_config
from transformer_jax.workflows import bert_init, token_classification

# Number words, some split into sub-words by the vocabulary below. 'for' is an ordinary word
# (tag O), the first sub-word of 'forest' (O) and of 'forty' (NUM): telling them apart needs the
# next sub-word, so a per-sub-word lookup table cannot reach 100%.
NUMBERS = ('one', 'two', 'three', 'seven', 'twelve', 'forty', 'fifty', 'hundred')
WORDS = ('the', 'cat', 'dog', 'sat', 'on', 'mat', 'ran', 'to', 'park', 'saw', 'birds', 'and', 'a',
         'big', 'red', 'house', 'for', 'garden', 'forest')
PIECES = ('for', '##ty', 'fif', 'hun', '##dred', 'twel', '##ve', 'gar', '##den', '##est')
VOCAB = list(SPECIAL_TOKENS) + sorted(
    set(NUMBERS + WORDS) - {'forty', 'fifty', 'hundred', 'twelve', 'garden', 'forest'})
VOCAB += [p for p in PIECES if p not in VOCAB]

# family -> the dev accuracy (overall and per tag) the tagger must reach. RoBERTa and ALBERT start
# from transformers' init (tests/hf_encoders.py), and RoBERTa's byte-level BPE learnt here splits
# most words, starting number and other words with the same piece ('Ġth' of 'the' and 'three'),
# so more tags hang on a next sub-word: 0.93-1.0 per tag after the 240 steps below.
TAGGING_ACCURACY = {'bert': 0.95, 'roberta': 0.9, 'albert': 0.9}


def _tokenizer():
  return WordPieceTokenizer({t: i for i, t in enumerate(VOCAB)})


def test_reader_labels_first_sub_words_only(tmp_path):
  path = tmp_path / 'tiny.conll'
  path.write_text('-DOCSTART- -X- -X- O\n'
                  '\n'
                  'the DT B-NP O\n'
                  'forty CD I-NP NUM\n'
                  'birds NNS I-NP O\n'
                  '\n'
                  '\n'
                  '-DOCSTART- -X- -X- O\n'
                  'garden NN B-NP O\n'
                  'for IN B-PP O\n'
                  'twelve CD B-NP NUM\n')
  sentences = conll.read_conll(str(path))
  assert [s.words for s in sentences] == [('the', 'forty', 'birds'), ('garden', 'for', 'twelve')]
  assert [s.tags for s in sentences] == [('O', 'NUM', 'O'), ('O', 'O', 'NUM')]
  assert [s.line for s in sentences] == [3, 9]
  labels = conll.tag_vocabulary(sentences)
  assert labels == ['O', 'NUM']
  tokenizer = _tokenizer()
  encoded = conll.encode_sentences(tokenizer, sentences, labels, max_len=16)
  ids = lambda *tokens: [tokenizer.vocab[t] for t in tokens]
  ignore = conll.IGNORE
  # [CLS] the for ##ty birds [SEP]: 'forty' labelled on 'for', its '##ty' ignored.
  assert encoded.rows[0].tolist() == ids('[CLS]', 'the', 'for', '##ty', 'birds', '[SEP]')
  assert encoded.labels[0].tolist() == [ignore, 0, 1, ignore, 0, ignore]
  assert encoded.rows[1].tolist() == ids('[CLS]', 'gar', '##den', 'for', 'twel', '##ve', '[SEP]')
  assert encoded.labels[1].tolist() == [ignore, 0, ignore, 0, 1, ignore, ignore]
  assert encoded.truncated == 0
  # Batches: weight 1 exactly on the labelled sub-words; padding and IGNORE weigh 0.
  batch = conll.make_batch(encoded.rows, encoded.labels, [16], 3)
  assert batch['weights'].sum() == 6 and batch['weights'][2].sum() == 0
  assert batch['labels'][0, :6].tolist() == [0, 0, 1, 0, 0, 0]
  # Truncation to 5 sub-words (3 + [CLS] [SEP]) is counted: 'birds' and 'twelve' are lost; at 6,
  # only twelve's '##ve' is cut, which loses no labelled word.
  short = conll.encode_sentences(tokenizer, sentences, labels, max_len=5)
  assert (short.truncated, short.words_dropped) == (2, 2)
  assert short.labels[0].tolist() == [ignore, 0, 1, ignore, ignore]
  assert short.labels[1].tolist() == [ignore, 0, ignore, 0, ignore]
  cut = conll.encode_sentences(tokenizer, sentences, labels, max_len=6)
  assert (cut.truncated, cut.words_dropped) == (1, 0)
  assert cut.labels[1].tolist() == [ignore, 0, ignore, 0, 1, ignore]


def test_malformed_file_is_one_error_line_naming_file_and_line(tmp_path):
  path = tmp_path / 'bad.conll'
  path.write_text('the O\ncat O\n\nseven\nbirds O\n')
  with pytest.raises(DataError) as error:
    conll.read_conll(str(path))
  message = str(error.value)
  assert f'{path}:4:' in message and '\n' not in message, message
  # A dev tag the training file never had: file:line as well.
  (tmp_path / 'dev.conll').write_text('the O\nseven NUM\n\nred ADJ\n')
  dev = conll.read_conll(str(tmp_path / 'dev.conll'))
  with pytest.raises(DataError, match=r'dev\.conll:4: tag .ADJ.'):
    conll.check_tags(str(tmp_path / 'dev.conll'), dev, ['O', 'NUM'])
  # Through the workflow: the same line, and nothing written.
  config = conll_tagging.get_config()
  config.data.train, config.data.dev = str(path), str(path)
  config.init.hf_dir = str(tmp_path / 'unused')
  workdir = tmp_path / 'work'
  with pytest.raises(DataError, match=f'{path}:4:'):
    token_classification.finetune(config, str(workdir))
  assert not workdir.exists()


def test_tagging_is_not_bert_run_and_is_not_packed(tmp_path):
  """workflows/bert.run refuses a tagging config (experiments.bert picks the tagger, above
  both workflows); the tagger refuses data.pack=True as experiments.bert always did."""
  from transformer_jax.errors import ConfigError
  from transformer_jax.workflows import bert
  config = conll_tagging.get_config()
  config.data.train = config.data.dev = str(tmp_path / 'unused.conll')
  workdir = tmp_path / 'work'
  with pytest.raises(ConfigError, match='token_classification.finetune'):
    bert.run(config, str(workdir), 'finetune')
  config.data.pack = True
  with pytest.raises(ConfigError, match='fine-tuning is not packed'):
    token_classification.finetune(config, str(workdir))
  assert not workdir.exists()


def _write_conll(path, rng, sentences):
  lines = []
  for _ in range(sentences):
    for _ in range(rng.integers(3, 9)):
      if rng.random() < 0.35:
        lines.append(f'{rng.choice(NUMBERS)} NUM')
      else:
        lines.append(f'{rng.choice(WORDS)} O')
    lines.append('')
  path.write_text('\n'.join(lines) + '\n')


def _random_hf_bert(directory):
  """A tiny randomly initialised BERT written as a Hugging Face directory (no torch needed)."""
  cfg = bert_config(vocab_size=len(VOCAB), emb_dim=32, num_heads=2, mlp_dim=64,
                    num_encoder_layers=2, max_len=32, dropout_rate=0.0, attention_dropout_rate=0.0)
  model = Bert(cfg, mlm=False, sentence_classes=0)
  tokens = jnp.ones((1, 8), jnp.int32)
  params = jax.device_get(nn.meta.unbox(model.init(jax.random.key(1), tokens)['params']))
  write_vocab = lambda d: open(os.path.join(d, 'vocab.txt'), 'w').write('\n'.join(VOCAB) + '\n')
  write_hf_directory(str(directory), bert_config_to_hf(cfg, 2, mlm=False, sentence_classes=0),
                     export_bert_state_dict(cfg, params), write_vocab)


def _assert_tagged_as_transformers(family, config, model, sentences):
  """The rows the tagger trains on are transformers' ids of the words given one by one
  (`is_split_into_words`; RoBERTa: each after a space), labelled on each word's first sub-word as
  transformers' `word_ids` place them, and the encoder it starts from computes transformers'
  hidden states on them."""
  transformers = need_transformers()
  cfg, params, tokenizer, _ = bert_init.load_init(config)
  prefix = dict(add_prefix_space=True) if family == 'roberta' else {}
  reference = transformers.AutoTokenizer.from_pretrained(config.init.hf_dir, **prefix)
  labels = conll.tag_vocabulary(sentences)
  encoded = conll.encode_sentences(tokenizer, sentences, labels, config.data.max_len)
  assert encoded.truncated == 0
  split = 0  # words of several sub-words
  for sentence, row, row_labels in zip(sentences, encoded.rows, encoded.labels):
    expected = reference(list(sentence.words), is_split_into_words=True)
    ids = row.tolist()
    assert (tokenizer.to_hf(ids) if family == 'roberta' else ids) == expected.input_ids
    words = expected.word_ids()
    first = [w is not None and (j == 0 or words[j - 1] != w) for j, w in enumerate(words)]
    assert [y != conll.IGNORE for y in row_labels] == first
    assert [labels[y] for y in row_labels if y != conll.IGNORE] == list(sentence.tags)
    split += len(words) - 2 - len(sentence.words)
  print(f'{family}: {split} sub-words after the first of a word')
  assert split > 0
  assert_encoder_matches(model, cfg, params, encoded.rows[0].tolist(),
                         reference(list(sentences[0].words), is_split_into_words=True).input_ids)


@pytest.mark.slow
@pytest.mark.parametrize('family', [
    'bert',
    pytest.param('roberta', marks=pytest.mark.parity),
    pytest.param('albert', marks=pytest.mark.parity),
])
def test_tagger_learns_number_words(family, tmp_path):
  rng = np.random.default_rng(0)
  _write_conll(tmp_path / 'train.conll', rng, 256)
  _write_conll(tmp_path / 'dev.conll', rng, 64)
  if family == 'bert':
    _random_hf_bert(tmp_path / 'hf')
    hf_dir = str(tmp_path / 'hf')
  else:
    # The words BERT's vocabulary spells whole, and the first pieces of the others: ALBERT's
    # unigram splits 'forty' as '▁for' 't' 'y', as BERT's 'for' '##ty'.
    whole = [t for t in VOCAB if t not in SPECIAL_TOKENS and not t.startswith('##')]
    hf_dir, model, _ = save_encoder(family, tmp_path / 'hf', whole, max_len=32, scale=0.05)
  config = conll_tagging.get_config()
  config.init.hf_dir = hf_dir
  config.data.train, config.data.dev = str(tmp_path / 'train.conll'), str(tmp_path / 'dev.conll')
  config.data.max_len, config.data.batch_size = 32, 16
  config.model.dropout_rate = config.model.attention_dropout_rate = 0.0
  config.optimizer.update(learning_rate=3e-3, warmup_steps=10, decay_steps=240)
  config.train.update(num_steps=240, log_every=40, eval_every=120, checkpoint_every=240)
  if family != 'bert':  # fine-tuning starts from what transformers computes
    _assert_tagged_as_transformers(family, config, model, conll.read_conll(config.data.dev)[:8])
  workdir = str(tmp_path / 'work')
  results = token_classification.finetune(config, workdir)
  print({k: v for k, v in results.items() if k.startswith(('dev_', 'eval_'))})
  accuracy = TAGGING_ACCURACY[family]
  assert results['dev_accuracy'] >= accuracy, results
  assert results['dev_accuracy_NUM'] >= accuracy and results['dev_accuracy_O'] >= accuracy, results
  # The workdir holds what a later predict/evaluate mode needs: tags, tokenizer, config.
  assert token_classification.load_labels(workdir) == ['O', 'NUM']
  words = list(NUMBERS + WORDS)
  assert bert_init.finetune_tokenizer(config, workdir).encode_words(words) == \
      bert_init.load_init(config)[2].encode_words(words)
  # Rerunning resumes at the last step (nothing left to train) and scores the same.
  again = token_classification.finetune(config, workdir)
  assert again['step'] == 240 and again['dev_accuracy'] == pytest.approx(results['dev_accuracy'])


def test_token_head_scores_every_position():
  cfg = bert_config(vocab_size=50, emb_dim=32, num_heads=2, mlp_dim=64, num_encoder_layers=1,
                    max_len=16, dropout_rate=0.0, attention_dropout_rate=0.0)
  model = Bert(cfg, mlm=False, sentence_classes=0, num_labels=2, num_token_labels=5)
  tokens = jnp.asarray([[2, 7, 8, 9, 3, 0], [2, 11, 3, 0, 0, 0]], jnp.int32)
  variables = nn.meta.unbox(model.init(jax.random.key(0), tokens))
  assert {'token_classifier', 'classifier', 'pooler'} <= set(variables['params'])
  out = model.apply(variables, tokens)
  assert out['token_logits'].shape == (2, 6, 5) and out['class_logits'].shape == (2, 2)
  # The logits are the head's dense layer applied to each position's final hidden vector.
  head = variables['params']['token_classifier']
  expected = np.einsum('btd,dl->btl', out['hidden'], head['kernel']) + head['bias']
  np.testing.assert_allclose(out['token_logits'], expected, atol=1e-5)
  # Without the attribute the model has no such head (existing checkpoints keep their params).
  plain = Bert(cfg, mlm=False, sentence_classes=0).init(jax.random.key(0), tokens)['params']
  assert 'token_classifier' not in plain and 'token_logits' not in Bert(
      cfg, mlm=False, sentence_classes=0).apply({'params': plain}, tokens)


def test_experiments_bert_runs_the_tagging_config(tmp_path):
  """`python -m experiments.bert --config=experiments/configs/conll_tagging.py` dispatches on
  data.task to the tagger: it trains, and a missing dev file is one error line, exit 1."""
  import json
  import subprocess
  import sys
  rng = np.random.default_rng(0)
  _write_conll(tmp_path / 'train.conll', rng, 64)
  _write_conll(tmp_path / 'dev.conll', rng, 16)
  _random_hf_bert(tmp_path / 'hf')
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

  def run(workdir, dev):
    return subprocess.run([
        sys.executable, '-m', 'experiments.bert', '--config=experiments/configs/conll_tagging.py',
        f'--workdir={workdir}', f'--config.init.hf_dir={tmp_path / "hf"}',
        f'--config.data.train={tmp_path / "train.conll"}', f'--config.data.dev={dev}',
        '--config.data.max_len=32', '--config.data.batch_size=16', '--config.train.num_steps=4',
        '--config.train.eval_every=4', '--config.train.checkpoint_every=4'
    ], cwd=repo, capture_output=True, text=True, timeout=300)

  done = run(tmp_path / 'w', tmp_path / 'dev.conll')
  assert done.returncode == 0, done.stderr[-2000:]
  assert (tmp_path / 'w' / 'labels.txt').read_text().split() == ['O', 'NUM']
  assert json.loads((tmp_path / 'w' / 'metrics.jsonl').read_text().splitlines()[-1])['step'] == 4
  bad = run(tmp_path / 'w2', tmp_path / 'missing.conll')
  assert bad.returncode == 1
  errors = [line for line in bad.stderr.splitlines() if line.startswith('error:')]
  assert len(errors) == 1 and 'missing.conll' in errors[0], bad.stderr[-2000:]
