"""RoBERTa's data and runs: FULL-SENTENCES packing, the byte-level BPE tokenizer in our id space,
and a test-sized `roberta_pretrain_small` pretraining (MLM loss falls) then fine-tuning from it
as an HF RoBERTa directory (init.hf_dir)."""

import json
import os
import random

import flax
import numpy as np
import pytest

from transformer_jax.convert import hf_roberta
from transformer_jax.data.roberta_tokenizer import RobertaTokenizer
from transformer_jax.data import bert_lines, bert_pretrain
from transformer_jax.errors import ConfigError, DataError

SEP = 3


class _FakeTokenizer:
  """The special-token surface PretrainBatches needs, over a 5,000-id vocabulary."""
  pad_id, unk_id, cls_id, sep_id, mask_id = 0, 1, 2, SEP, 4
  special_ids = np.arange(5)
  vocab_size = 5000

  def build_pair(self, a, b, max_len=None):
    assert b is None and len(a) <= max_len - 2
    ids = [self.cls_id] + list(a) + [self.sep_id]
    return ids, [0] * len(ids)


def _documents():
  """Documents whose every token names its (document, line): 1000 + 100 d + line, repeated
  over lines of varied lengths (one too long for a row, so it is cut)."""
  rng = np.random.default_rng(0)
  docs = []
  for d in range(12):
    lengths = rng.integers(1, 8, size=int(rng.integers(1, 5)))
    if d == 5:
      lengths[0] = 25  # longer than the 18-token budget of max_len 20
    docs.append([np.full(n, 1000 + 100 * d + i, np.int32) for i, n in enumerate(lengths)])
  return docs


def _key(token: int) -> tuple[int, int]:
  return (token - 1000) // 100, (token - 1000) % 100


def _runs(row) -> list[tuple[int, int, int]]:
  """[(document, line, tokens)] of a packed row's lines, in order (separators skipped)."""
  runs = []
  for t in row.tolist():
    if t != SEP:
      if runs and runs[-1][:2] == _key(t):
        runs[-1] = (*_key(t), runs[-1][2] + 1)
      else:
        runs.append((*_key(t), 1))
  return runs


def test_full_sentences_pack_whole_lines_across_documents():
  docs = _documents()
  rows, truncated = bert_lines.pack_full_sentences(docs, budget=18, separator=SEP)
  assert truncated == 1  # document 5's first line, cut to a row of its own
  seen, crossing = [], 0
  for r, row in enumerate(rows):
    assert 0 < len(row) <= 18
    runs = _runs(row)
    for d, i, n in runs:  # whole lines only (the long one cut to the whole row)
      assert n == min(len(docs[d][i]), 18), (r, d, i)
    changes = 0
    for (d0, i0, _), (d1, i1, _) in zip(runs, runs[1:]):
      if d1 == d0:
        assert i1 == i0 + 1  # consecutive lines of one document
      else:  # the next document starts where this one ends
        assert (d1, i1) == (d0 + 1, 0) and i0 == len(docs[d0]) - 1
        changes += 1
    tokens = row.tolist()
    assert tokens.count(SEP) == changes  # one separator per document boundary, no other
    for k, t in enumerate(tokens):
      if t == SEP:  # between the last token of a document and the first of the next
        assert 0 < k < len(tokens) - 1 and _key(tokens[k + 1])[0] == _key(tokens[k - 1])[0] + 1
    crossing += changes > 0
    if r + 1 < len(rows):  # rows are full: the next row's first line (+ separator) did not fit
      d, i, _ = _runs(rows[r + 1])[0]
      assert len(row) + min(len(docs[d][i]), 18) + (i == 0) > 18
    seen += [(d, i) for d, i, _ in runs]
  assert crossing >= 3  # rows do cross document boundaries
  # Every line exactly once, in corpus order: nothing split across rows, nothing lost.
  assert seen == [(d, i) for d, doc in enumerate(docs) for i in range(len(doc))]


def test_full_sentences_batches_feed_every_row_once_per_epoch():
  docs = _documents()
  options = bert_pretrain.PretrainOptions(max_len=20, max_predictions=4,
                                          sentence_task='full_sentences')
  data = bert_pretrain.PretrainBatches(docs, _FakeTokenizer(), options, batch_size=4, seed=3)
  rows, _ = bert_lines.pack_full_sentences(docs, 18, SEP)
  count = data.rows_per_epoch
  assert count == len(rows) and data.truncated_lines == 1
  steps = -(-2 * count // 4)  # two epochs
  fed = []
  for step in range(steps):
    b = data.batch(step)
    assert (b['segments'] == 0).all() and (b['sentence_labels'] == 0).all()
    for r in range(4):
      ids = b['inputs'][r].copy()
      scored = b['mlm_weights'][r] > 0
      ids[b['mlm_positions'][r][scored]] = b['mlm_ids'][r][scored]  # undo the masking
      length = int(np.count_nonzero(ids))
      assert ids[0] == 2 and ids[length - 1] == SEP and not ids[length:].any()
      fed.append(ids[1:length - 1])
  key = lambda row: tuple(row.tolist())
  first, second = fed[:count], fed[count:2 * count]
  assert sorted(map(key, first)) == sorted(map(key, rows))  # each row exactly once
  assert sorted(map(key, second)) == sorted(map(key, rows))
  assert list(map(key, first)) != list(map(key, second))  # reshuffled every epoch
  # A pure function of the step (resuming), masks drawn anew per batch.
  again = bert_pretrain.PretrainBatches(docs, _FakeTokenizer(), options, batch_size=4, seed=3)
  np.testing.assert_array_equal(again.batch(5)['inputs'], data.batch(5)['inputs'])
  with pytest.raises(DataError, match='packed by PretrainBatches'):
    bert_pretrain.make_pair(docs, 0, 0, options, np.random.default_rng(0))
  with pytest.raises(DataError, match='sentence_task must be one of'):
    bert_pretrain.PretrainBatches(docs, _FakeTokenizer(),
                                  bert_pretrain.PretrainOptions(sentence_task='full'), batch_size=4,
                                  seed=0)


def test_byte_level_bpe_rows_show_the_separator_between_documents(tmp_path):
  texts = ['the cat sat on the mat.', 'a dog ran in the park!', 'birds sang songs all day.']
  tokenizer = RobertaTokenizer.train(texts * 20, vocab_size=300)
  # Our ids: <pad> is 0 (so zero-filled batches are padding), HF's <pad> is 1 and <s> 0.
  assert (tokenizer.pad_id, tokenizer.hf_pad_id, tokenizer.to_hf([tokenizer.cls_id])) == (0, 1, [0])
  assert set(tokenizer.special_ids.tolist()) == {0, 1, 2, 3, 4}
  tokenizer.save(str(tmp_path / 'tok'))
  again = RobertaTokenizer.from_dir(str(tmp_path / 'tok'))
  assert again.encode(texts[0]) == tokenizer.encode(texts[0])
  docs = bert_pretrain.tokenize_documents(tokenizer, [texts[:2], texts[2:]])
  rows, truncated = bert_lines.pack_full_sentences(docs, 62, tokenizer.sep_id)
  assert truncated == 0 and len(rows) == 1
  ids, segments = tokenizer.build_pair(rows[0], None, 64)
  assert tokenizer.decode(ids) == f'<s>{texts[0]}{texts[1]}</s>{texts[2]}</s>'
  assert set(segments) == {0}


# -- runs -----------------------------------------------------------------------------------------

TINY = {
    'model.emb_dim': 32, 'model.num_heads': 2, 'model.mlp_dim': 64, 'model.num_encoder_layers': 1,
    'model.max_len': 32, 'data.max_len': 32, 'data.max_predictions': 5, 'data.batch_size': 8,
    'data.eval_batches': 2, 'data.lines_per_document': 0, 'data.valid_fraction': 0.1,
    'tokenizer.vocab_size': 300, 'train.num_steps': 40, 'train.log_every': 5,
    'train.eval_every': 40, 'train.checkpoint_every': 40, 'optimizer.warmup_steps': 2,
    'optimizer.decay_steps': 200, 'optimizer.learning_rate': 2e-3
}


def tiny_sst2_finetune(hf_dir, data_dir, steps: int):
  """sst2_minilm.py fine-tuning `steps` steps from `hf_dir` on a keyword task written to
  `data_dir` (train.tsv = dev.tsv, 32 rows)."""
  from experiments.configs import sst2_minilm
  data_dir.mkdir()
  rows = [(1, 'a great and lovely film'), (0, 'a dull and boring mess')] * 16
  for split in ('train', 'dev'):
    (data_dir / f'{split}.tsv').write_text('label\tsentence\n' +
                                           ''.join(f'{y}\t{s}\n' for y, s in rows))
  return _config(
      sst2_minilm, {
          'init.hf_dir': str(hf_dir), 'data.dir': str(data_dir), 'data.batch_size': 8,
          'data.max_len': 16, 'train.num_steps': steps, 'train.eval_every': steps,
          'train.checkpoint_every': steps, 'train.log_every': steps // 2, 'optimizer.warmup_steps':
              1
      })


def _config(module, values):
  config = module.get_config()
  for key, value in values.items():
    node = config
    *parents, leaf = key.split('.')
    for name in parents:
      node = node[name]
    node[leaf] = value
  return config


def _write_text(tmp_path):
  words = 'the cat sat on a mat while dogs ran in the park and birds sang songs'.split()
  rng = random.Random(0)
  docs = [
      '\n'.join(' '.join(rng.choice(words) for _ in range(6)) for _ in range(4)) for _ in range(40)
  ]
  path = tmp_path / 'text.txt'
  path.write_text('\n\n'.join(docs) + '\n')
  return str(path)


@pytest.mark.slow
def test_roberta_pretrain_small_lowers_mlm_loss_then_finetunes_from_hf(tmp_path):
  from experiments.configs import roberta_pretrain_small
  from transformer_jax.convert import hf_bert
  from transformer_jax.workflows import bert
  config = _config(roberta_pretrain_small, dict(TINY, **{'data.paths': _write_text(tmp_path)}))
  assert (config.data.sentence_task, config.tokenizer.type) == ('full_sentences', 'byte_bpe')
  pre = str(tmp_path / 'pre')
  results = bert.run(config, pre)
  with open(os.path.join(pre, 'metrics.jsonl')) as f:
    losses = [m['train/loss'] for m in map(json.loads, f) if 'train/loss' in m]
  print('roberta_pretrain_small MLM loss by log step:', [round(x, 3) for x in losses], 'eval loss',
        round(results['eval_loss'], 3))
  assert len(losses) == 8 and losses[-1] < 0.7 * losses[0]
  assert os.path.exists(os.path.join(pre, 'tokenizer', 'tokenizer.json'))

  # The pretrained workdir as an HF RoBERTa directory (the converter's export), then fine-tuning
  # from it through init.hf_dir: the dispatch on model_type reads it with hf_roberta.load.
  cfg, params, tokenizer = bert.restore_pretrained(pre)
  assert params['segment_embedding'].shape == (1, 32) and 'sentence_head' not in params
  hf_dir = tmp_path / 'hf'
  hf_dir.mkdir()
  from safetensors.numpy import save_file
  heads = hf_bert.bert_heads(params)
  (hf_dir / 'config.json').write_text(
      json.dumps(hf_roberta.roberta_config_to_hf(cfg, **heads, **tokenizer.hf_special_ids)))
  save_file(hf_roberta.export_roberta_state_dict(cfg, params), str(hf_dir / 'model.safetensors'))
  tokenizer.save(str(hf_dir))
  fine = tiny_sst2_finetune(hf_dir, tmp_path / 'sst2', steps=6)
  cfg2, loaded, tokenizer2, types = bert.load_init(fine)  # what fine-tuning starts from
  assert types == 1 and isinstance(tokenizer2, RobertaTokenizer)
  same = dict(dropout_rate=0.0, attention_dropout_rate=0.0, dtype=cfg.dtype)  # fine-tuning's
  assert cfg2.replace(**same) == cfg.replace(**same)
  flat = lambda tree: {k: np.asarray(v) for k, v in flax.traverse_util.flatten_dict(tree).items()}
  want, got = flat(params), flat(loaded)
  assert sorted(want) == sorted(got) and all(np.array_equal(want[k], got[k]) for k in want)
  results = bert.run(fine, str(tmp_path / 'fine'))
  assert 0.0 <= results['dev_accuracy'] <= 1.0
  assert os.path.exists(tmp_path / 'fine' / 'tokenizer' / 'tokenizer.json')
  # --mode=evaluate reads the workdir's RoBERTa tokenizer back and scores dev as training did.
  import subprocess
  import sys
  from conftest import REPO_ROOT
  evaluated = subprocess.run([
      sys.executable, '-m', 'experiments.bert', '--mode=evaluate', f'--workdir={tmp_path / "fine"}',
      f'--input={tmp_path / "sst2" / "dev.tsv"}'
  ], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
  assert evaluated.returncode == 0, evaluated.stderr[-3000:]
  scores = json.loads(evaluated.stdout.strip().splitlines()[-1])
  assert scores['examples'] == 32
  assert scores['accuracy'] == pytest.approx(results['dev_accuracy'], abs=1e-6)


def test_hf_dir_families_for_finetuning(tmp_path):
  from transformer_jax.workflows import bert
  for model_type in ('albert', 'gpt2', 'roberta'):
    (tmp_path / model_type).mkdir()
    (tmp_path / model_type / 'config.json').write_text(json.dumps({'model_type': model_type}))
  assert bert.hf_family(str(tmp_path / 'roberta')).name == 'roberta'
  assert bert.hf_family(str(tmp_path / 'albert')).name == 'albert'
  with pytest.raises(ConfigError,
                     match="model_type='gpt2'; fine-tuning starts from bert, albert, roberta"):
    bert.hf_family(str(tmp_path / 'gpt2'))
  with pytest.raises(ConfigError, match='init.hf_dir: .*config.json does not exist'):
    bert.hf_family(str(tmp_path / 'missing'))


@pytest.mark.slow  # runs the command line in a subprocess
def test_bad_roberta_checkpoint_is_one_error_line(translate_cli, tmp_path):
  """A RoBERTa directory missing a tensor, given to fine-tuning: exit 1, one line naming the
  tensor, nothing written in the workdir."""
  import subprocess
  import sys

  import jax
  from conftest import REPO_ROOT
  from safetensors.numpy import save_file

  from transformer_jax.models.bert import Bert, roberta_config
  cfg = roberta_config(vocab_size=300, emb_dim=32, num_heads=2, mlp_dim=64, num_encoder_layers=1,
                       max_len=32)
  model = Bert(cfg, type_vocab_size=1, mlm=True, sentence_classes=0)
  params = flax.linen.meta.unbox(
      model.init(jax.random.key(0), np.ones((1, 4), np.int32), mlm_positions=np.zeros(
          (1, 1), np.int32)))['params']
  state = hf_roberta.export_roberta_state_dict(cfg, jax.device_get(params))
  del state['roberta.encoder.layer.0.output.dense.weight']
  hf_dir = tmp_path / 'hf'
  hf_dir.mkdir()
  (hf_dir / 'config.json').write_text(
      json.dumps(hf_roberta.roberta_config_to_hf(cfg, type_vocab_size=1)))
  save_file(state, str(hf_dir / 'model.safetensors'))
  RobertaTokenizer.train(['a few words of text'] * 10, vocab_size=270).save(str(hf_dir))
  for split in ('train', 'dev'):  # data is read (and checked) before the model
    (tmp_path / f'{split}.tsv').write_text('label\tsentence\n1\tgood\n0\tbad\n')
  workdir = tmp_path / 'fine'
  result = subprocess.run([
      sys.executable, '-m', 'experiments.bert', '--config=experiments/configs/sst2_minilm.py',
      f'--workdir={workdir}', f'--config.init.hf_dir={hf_dir}', f'--config.data.dir={tmp_path}'
  ], cwd=REPO_ROOT, env=translate_cli.env(), capture_output=True, text=True, timeout=600,
                          check=False)
  errors = translate_cli.error_lines(result.stderr)
  assert result.returncode == 1 and 'Traceback' not in result.stderr, result.stderr[-2000:]
  assert len(errors) == 1 and 'encoder.layer.0.output.dense.weight' in errors[0], errors
  assert not [p for p in workdir.rglob('*')]  # nothing written
