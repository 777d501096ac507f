"""Using a fine-tuned or pretrained BERT: `experiments.bert --mode=predict|evaluate|fill_mask`.

A tiny classifier is fine-tuned in-process (from a random BERT written as an HF directory by our
own exporter, so no torch is needed) on a keyword-sentiment task; the CLI then predicts and
evaluates with it. fill_mask is checked against transformers' fill-mask pipeline (parity).
"""

import json
import os
import pathlib
import shutil
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import REPO_ROOT

from experiments.configs.bert_common import finetune_config, pretrain_config
from transformer_jax.cli.workdir import save_config
from transformer_jax.convert.hf_bert import bert_config_to_hf, export_bert_state_dict
from transformer_jax.errors import ConfigError
from transformer_jax.files import write_atomically
from transformer_jax.models.bert import Bert, bert_config
from transformer_jax.workflows import bert as workflow
from transformer_jax.workflows import bert_use

SPECIAL = ['[PAD]', '[UNK]', '[CLS]', '[SEP]', '[MASK]']
POSITIVE, NEGATIVE = ['great', 'lovely', 'good', 'fine'], ['dull', 'boring', 'bad', 'awful']
FILLER = ['the', 'a', 'film', 'movie', 'plot', 'was', 'very', 'and', 'cast', 'songs']
SST2 = os.path.join('experiments', 'configs', 'sst2_minilm.py')


def write_tiny_hf_bert(directory, words, *, seed=0, max_len=32, width=32, layers=1) -> str:
  """A random (default 1-layer, 32-wide) BERT as an HF directory (config.json, model.safetensors,
  vocab.txt) written by `export_bert_state_dict`: what `hf_bert.load` reads, without torch."""
  from safetensors.numpy import save_file
  vocab = SPECIAL + list(words)
  cfg = bert_config(vocab_size=len(vocab), emb_dim=width, num_heads=2, mlp_dim=2 * width,
                    num_encoder_layers=layers, max_len=max_len)
  tokens = jnp.ones((1, 4), jnp.int32)
  params = Bert(cfg, mlm=False, sentence_classes=0).init(jax.random.key(seed), tokens)['params']
  params = jax.tree.map(np.asarray, nn.meta.unbox(params))
  os.makedirs(directory, exist_ok=True)
  save_file(export_bert_state_dict(cfg, params), os.path.join(directory, 'model.safetensors'))
  config = bert_config_to_hf(cfg, type_vocab_size=2, mlm=False, sentence_classes=0)
  write_atomically(os.path.join(directory, 'config.json'), json.dumps(config))
  write_atomically(os.path.join(directory, 'vocab.txt'), '\n'.join(vocab) + '\n')
  return str(directory)


def tiny_finetune_config(hf_dir, data_dir, *, steps=40, **data):
  config = finetune_config()
  config.init.hf_dir = hf_dir
  config.data.dir = data_dir
  config.data.max_len = 16
  config.data.batch_size = 8
  config.data.update(data)
  config.model.dropout_rate = config.model.attention_dropout_rate = 0.0
  config.optimizer.learning_rate = 1e-3
  config.optimizer.warmup_steps = 2
  config.optimizer.decay_steps = steps
  config.train.num_steps = steps
  config.train.eval_every = steps
  config.train.checkpoint_every = steps
  config.train.log_every = steps
  return config


def _sentence(rng, label):
  words = list(rng.choice(FILLER, 3)) + [rng.choice(POSITIVE if label else NEGATIVE)]
  rng.shuffle(words)
  return ' '.join(words)


def _cli(*args, stdin=None):
  env = dict(os.environ, JAX_PLATFORMS='cpu', TRANSFORMER_JAX_ALLOCATOR='system',
             TF_CPP_MIN_LOG_LEVEL='2')
  env['PYTHONPATH'] = os.pathsep.join(filter(None, [REPO_ROOT, env.get('PYTHONPATH')]))
  return subprocess.run([sys.executable, '-m', 'experiments.bert', *args], cwd=REPO_ROOT, env=env,
                        input=stdin, capture_output=True, text=True, timeout=300, check=False)


def _errors(stderr):
  return [line for line in stderr.splitlines() if line.startswith('error:')]


def _listing(directory):
  return sorted((str(p), p.stat().st_mtime_ns) for p in pathlib.Path(directory).rglob('*'))


@pytest.fixture(scope='module')
def finetuned(tmp_path_factory):
  """(workdir, rng) of a keyword-sentiment classifier fine-tuned for 40 steps."""
  root = tmp_path_factory.mktemp('predict')
  hf_dir = write_tiny_hf_bert(root / 'hf', POSITIVE + NEGATIVE + FILLER)
  rng = np.random.default_rng(0)
  data = root / 'data'
  data.mkdir()
  for split, n in (('train', 64), ('dev', 16)):
    labels = [i % 2 for i in range(n)]
    rows = ''.join(f'{y}\t{_sentence(rng, y)}\n' for y in labels)
    (data / f'{split}.tsv').write_text('label\tsentence\n' + rows)
  workdir = str(root / 'work')
  config = tiny_finetune_config(hf_dir, str(data), label_names=('negative', 'positive'))
  results = workflow.finetune(config, workdir)
  assert results['dev_accuracy'] >= 0.9, results
  return workdir, rng


def test_predict_probabilities_and_evaluate_scores(finetuned, tmp_path):
  workdir, rng = finetuned
  # 10 labelled lines, three of them labelled against their keyword (so accuracy is not 1).
  truth = [i % 2 for i in range(10)]
  sentences = [_sentence(rng, y) for y in truth]
  given = [1 - y if i in (1, 4, 7) else y for i, y in enumerate(truth)]
  test = tmp_path / 'test.tsv'
  test.write_text('sentence\tlabel\n' + ''.join(f'{s}\t{y}\n' for s, y in zip(sentences, given)))
  long_line = ' '.join(['the film was very good'] * 12)  # 60 tokens > the model's 32
  result = _cli('--mode=predict', f'--workdir={workdir}', '--format=jsonl',
                stdin='\n'.join(sentences + [long_line]) + '\n')
  assert result.returncode == 0, result.stderr[-3000:]
  rows = [json.loads(line) for line in result.stdout.splitlines()]
  assert len(rows) == 11
  assert '1 of 11 inputs were longer than the model\'s 32 tokens' in result.stderr
  for row in rows:
    probs = row['probabilities']
    assert set(probs) == {'negative', 'positive'}
    assert abs(sum(probs.values()) - 1.0) <= 1e-5
    assert row['probability'] == max(probs.values()) and probs[row['label']] == row['probability']
  predicted = [['negative', 'positive'].index(r['label']) for r in rows[:10]]
  assert predicted == truth  # the keyword decides, and the model has learnt it

  # Text format: the same labels, one 'label<TAB>probability' per line, to a file.
  out, source = tmp_path / 'out.txt', tmp_path / 'in.txt'
  source.write_text('\n'.join(sentences) + '\n')
  result = _cli('--mode=predict', f'--workdir={workdir}', f'--input={source}', f'--output={out}')
  assert result.returncode == 0, result.stderr[-3000:]
  text_rows = [line.split('\t') for line in out.read_text().splitlines()]
  assert [r[0] for r in text_rows] == [r['label'] for r in rows[:10]]
  assert all(abs(float(p) - r['probability']) < 1e-4 for (_, p), r in zip(text_rows, rows))

  result = _cli('--mode=evaluate', f'--workdir={workdir}', f'--config={SST2}',
                f'--config.data.test={test}')
  assert result.returncode == 0, result.stderr[-3000:]
  scores = json.loads(result.stdout.strip().splitlines()[-1])
  # Hand counts from predict's labels and the file's labels.
  y, p = np.array(given), np.array(predicted)
  assert scores['examples'] == 10 and scores['accuracy'] == sum(y == p) / 10 == 0.7
  tp, fp, fn = sum((p == 1) & (y == 1)), sum((p == 1) & (y == 0)), sum((p == 0) & (y == 1))
  precision, recall = tp / (tp + fp), tp / (tp + fn)
  assert abs(scores['f1'] - 2 * precision * recall / (precision + recall)) < 1e-9
  assert abs(scores['mcc'] - np.corrcoef(y, p)[0, 1]) < 1e-9  # MCC = Pearson's r of 0/1 vectors
  lines = open(os.path.join(workdir, 'predictions.tsv')).read().splitlines()
  assert lines[0] == 'index\tlabel\tprediction\tprobability' and len(lines) == 11
  assert [line.split('\t')[2] for line in lines[1:]] == [r['label'] for r in rows[:10]]


def test_wrong_workdirs_are_one_line_and_write_nothing(finetuned, tmp_path):
  workdir, _ = finetuned
  pretraining = tmp_path / 'pretrain'
  pretraining.mkdir()
  save_config(pretrain_config(), str(pretraining))
  bare = tmp_path / 'no_checkpoint'
  bare.mkdir()
  for name in ('config.json', 'vocab.txt'):
    shutil.copy(os.path.join(workdir, name), bare / name)
  before = _listing(tmp_path), _listing(workdir)
  out = tmp_path / 'out.txt'
  cases = [('--mode=predict', pretraining, 'is a BERT pretrain workdir'),
           ('--mode=evaluate', bare, 'no checkpoint in'),
           ('--mode=fill_mask', workdir, 'is a BERT finetune workdir')]
  for mode, directory, message in cases:
    result = _cli(mode, f'--workdir={directory}', f'--output={out}', f'--input={os.devnull}')
    errors = _errors(result.stderr)
    assert result.returncode == 1 and len(errors) == 1, result.stderr[-2000:]
    assert message in errors[0] and 'Traceback' not in result.stderr
  assert (_listing(tmp_path), _listing(workdir)) == before and not out.exists()
  # A translation-style config (no BERT mode) and a missing workdir, in-process.
  with pytest.raises(ConfigError, match='not a BERT workdir'):
    (tmp_path / 'other').mkdir()
    (tmp_path / 'other' / 'config.json').write_text('{"model": {}}')
    bert_use.restore_classifier(str(tmp_path / 'other'))
  with pytest.raises(ConfigError, match='has no config.json'):
    bert_use.restore_classifier(str(tmp_path / 'missing'))
  assert not (tmp_path / 'missing').exists()


def assert_fills_equal(result, lines, fill, mask: str, name: str) -> list[dict]:
  """The objects `experiments.bert --mode=fill_mask --format=jsonl` printed (`result`: its
  CompletedProcess) for `lines`, after checking them against transformers' pipeline `fill`: the
  same top-k ids and token texts at every `mask`, probabilities within 1e-4."""
  assert result.returncode == 0, result.stderr[-3000:]
  ours = [json.loads(line) for line in result.stdout.splitlines()]
  assert [o['text'] for o in ours] == lines
  worst = 0.0
  for line, row in zip(lines, ours):
    theirs = fill(line)
    theirs = [theirs] if line.count(mask) == 1 else theirs
    assert len(row['masks']) == len(theirs) == line.count(mask)
    for found, reference in zip(row['masks'], theirs):
      assert [m['id'] for m in found] == [r['token'] for r in reference]
      assert [m['token'] for m in found] == [r['token_str'] for r in reference]
      worst = max(worst, max(abs(m['probability'] - r['score']) for m, r in zip(found, reference)))
  print(f'{name} fill-mask max |score difference| {worst:.2e}')
  assert worst <= 1e-4
  return ours


@pytest.mark.parity
def test_fill_mask_matches_transformers_pipeline(tmp_path):
  torch = pytest.importorskip('torch')
  transformers = pytest.importorskip('transformers')
  words = POSITIVE + NEGATIVE + FILLER + [f'w{i}' for i in range(40)]
  config = transformers.BertConfig(vocab_size=len(SPECIAL) + len(words), hidden_size=32,
                                   num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                                   max_position_embeddings=32, hidden_dropout_prob=0.0,
                                   attention_probs_dropout_prob=0.0)
  model = transformers.BertForMaskedLM(config)
  torch.manual_seed(1)
  with torch.no_grad():  # HF's zero biases and unit norms would hide a mis-mapped one
    for p in model.parameters():
      p.add_(0.3 * torch.randn_like(p))
  model.eval().save_pretrained(str(tmp_path), safe_serialization=True)
  (tmp_path / 'vocab.txt').write_text('\n'.join(SPECIAL + words) + '\n')
  # from_pretrained: transformers 5's BertTokenizerFast(vocab_file=...) ignores the file.
  tokenizer = transformers.BertTokenizerFast.from_pretrained(str(tmp_path))
  assert tokenizer('w3 [MASK]').input_ids == [2, 5 + words.index('w3'), 4, 3]
  fill = transformers.pipeline('fill-mask', model=model, tokenizer=tokenizer, top_k=5, device='cpu')
  lines = [
      'the film was [MASK]', 'a [MASK] plot and very good songs', '[MASK] cast',
      'the [MASK] movie was [MASK] and w3'
  ]
  result = _cli('--mode=fill_mask', f'--hf_dir={tmp_path}', '--format=jsonl',
                stdin='\n'.join(lines) + '\n')
  ours = assert_fills_equal(result, lines, fill, '[MASK]', 'bert')
  # The scores are not flat (a random-looking but peaked distribution), so the ids mean something.
  assert ours[0]['masks'][0][0]['probability'] > 2 / config.vocab_size


def test_fill_mask_from_a_pretraining_workdir(tmp_path):
  rng = np.random.default_rng(0)
  text = tmp_path / 'text.txt'
  docs = ['\n'.join(' '.join(rng.choice(FILLER, 6)) for _ in range(4)) for _ in range(20)]
  text.write_text('\n\n'.join(docs) + '\n')
  config = pretrain_config()
  config.data.update(paths=str(text), valid_fraction=0.1, max_len=16, max_predictions=3,
                     batch_size=4, eval_batches=1)
  config.tokenizer.vocab_size = 60
  config.model.update(emb_dim=32, num_heads=2, mlp_dim=64, num_encoder_layers=1, max_len=16)
  config.optimizer.update(warmup_steps=1, decay_steps=4)
  config.train.update(num_steps=2, eval_every=2, checkpoint_every=2, log_every=2)
  workdir = str(tmp_path / 'pre')
  workflow.pretrain(config, workdir)
  model, params, tokenizer = bert_use.restore_mlm(workdir)
  lines = ['the [MASK] was', '[MASK] film [MASK] very good and the cast ' * 3]  # truncated
  results = bert_use.fill_mask(model, params, tokenizer, lines, top_k=3)
  # Hand check: softmax over the vocabulary of the MLM logits at each [MASK] of [CLS] line [SEP].
  for line, masks in zip(lines, results):
    ids, _ = tokenizer.build_pair(tokenizer.encode(line), None, 16)
    positions = [i for i, t in enumerate(ids) if t == tokenizer.mask_id]
    assert len(masks) == len(positions) >= 1
    logits = model.apply({'params': params}, np.array([ids]),
                         mlm_positions=np.array([positions]))['mlm_logits'][0]
    probs = np.asarray(jax.nn.softmax(logits, axis=-1))
    for mask, p in zip(masks, probs):
      assert [i for i, _ in mask] == list(np.argsort(-p)[:3])
      np.testing.assert_allclose([q for _, q in mask], np.sort(p)[::-1][:3], atol=1e-6)
  with pytest.raises(ConfigError, match='one model'):
    bert_use.restore_mlm(workdir, hf_dir=workdir)
