"""Text-to-text fine-tuning of a pretrained T5 through the translate workflow (init.* configs).

From a span-corruption workdir of ours (init.workdir): t5_span_corruption.py shrunk and trained
a few steps on Tiny Shakespeare, then t5_multi30k.py shrunk alike and fine-tuned on Multi30k;
the fine-tuned run starts (step 0) with exactly the pretrained params, its loss falls, it
resumes from its own checkpoints without reading the pretrained workdir again.

From a Hugging Face T5 directory (init.hf_dir; `parity`: needs transformers and torch): a tiny
random T5ForConditionalGeneration and a T5 tokenizer built here (a SentencePiece unigram model
with T5's ids, pad 0 eos 1 unk 2 and no bos, read by transformers' T5 tokenizer with 10 extra
ids): the first params are `hf_t5.load`'s bitwise, our loss on the first validation batch is
transformers' loss on it, the loss falls, and `--mode=translate` on the fine-tuned workdir
alone prints the translations the workflow gives in-process.

Bad input (two init sources, missing or non-T5 ones, a tokenizer larger than the embedding, a
model that differs from the pretrained one) is one ConfigError line before anything is written.
"""

import gzip
import io
import json
import os
import shutil

import jax
import numpy as np
import pytest

from experiments.configs import t5_multi30k, t5_span_corruption
from experiments.configs.translate_quickstart import get_config as quickstart_config
from transformer_jax.cli.workdir import load_saved_config, save_config
from transformer_jax.errors import ConfigError
from transformer_jax.data.t5_tokenizer import load_hf_t5_tokenizer
from transformer_jax.training import trainer as trainer_lib
from transformer_jax.workflows import translation, translation_model

TINY_MODEL = dict(emb_dim=32, num_heads=2, mlp_dim=64, num_encoder_layers=1, num_decoder_layers=1)
PREFIX = 'translate English to German: '


def shrink(config, num_steps: int = 12):
  """A tiny model, one batch shape, `num_steps` steps, evaluation at the end on the first
  validation batch and 2 greedy translations."""
  config.model.update(TINY_MODEL)
  config.tokenizer.max_sentences = 3_000
  config.data.update(
      dict(max_len=32, buckets=(32,), batch_tokens=512, overflow='truncate',
           max_train_examples=300))
  config.optimizer.update(dict(learning_rate=5e-3, warmup_steps=5))
  config.train.update(
      dict(num_steps=num_steps, log_every=4, eval_every=0, checkpoint_every=0, eval_max_batches=1))
  config.eval.update(dict(bleu_sentences=2, beam_size=1, test_prefix='', average_last=0))
  return config


def finetune_config(data_dir, **init):
  """t5_multi30k.py shrunk like the pretraining run, starting from `init`."""
  config = shrink(t5_multi30k.get_config())
  assert config.data.source_prefix == PREFIX
  config.data.dir = str(data_dir)
  config.init.update(init)
  return config


def train_losses(workdir) -> list[float]:
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    records = [json.loads(line) for line in f]
  return [r['train/loss'] for r in records if 'train/loss' in r]


@pytest.fixture
def fit_calls(monkeypatch):
  """Records, for each `Trainer.fit`, the state it starts from (host params, step), the task
  and the first validation batch, then trains as usual."""
  calls = []
  fit = trainer_lib.Trainer.fit

  def recording_fit(self, train_data, eval_batches_fn=None, state=None):
    assert state is not None, 'a fine-tuning run hands fit its starting state'
    calls.append(
        dict(params=jax.device_get(state.params), step=int(jax.device_get(state.step)),
             task=self.task, batch=next(iter(eval_batches_fn()))))
    return fit(self, train_data, eval_batches_fn, state)

  monkeypatch.setattr(trainer_lib.Trainer, 'fit', recording_fit)
  return calls


def eval_loss(task, params, batch) -> float:
  """NLL per target token of `params` on `batch`, as the trainer's evaluation computes it."""
  _, sums = task.loss_fn(params, {k: batch[k] for k in ('inputs', 'targets')}, None, True)
  return float(sums['loss'] / sums['weight'])


def read_bytes(directory, name: str) -> bytes:
  with open(os.path.join(directory, name), 'rb') as f:
    return f.read()


def assert_same_tree(actual, expected):
  """Same tree, every leaf bitwise equal."""
  assert jax.tree.structure(actual) == jax.tree.structure(expected)
  jax.tree.map(np.testing.assert_array_equal, actual, expected)


def assert_falls(calls, results, workdir) -> tuple[float, float]:
  """The final eval loss (the first validation batch) is well below the step-0 params' loss
  on that batch, and the train loss falls; returns (step-0 loss, final loss)."""
  first = calls[0]
  before = eval_loss(first['task'], first['params'], first['batch'])
  losses = train_losses(workdir)
  print(f'eval loss on the first validation batch: {before:.4f} at step 0 -> '
        f'{results["eval_loss"]:.4f} at step {results["step"]}; train losses '
        f'{[round(x, 3) for x in losses]}')
  assert results['eval_loss'] < before - 0.3, (before, results['eval_loss'])
  assert losses[-1] < losses[0] - 0.3, losses
  return before, results['eval_loss']


# -- init.workdir: a span-corruption workdir of ours --------------------------------------------


@pytest.fixture(scope='module')
def span_workdir(tiny_shakespeare, tmp_path_factory):
  """(config, workdir) of t5_span_corruption.py shrunk and trained 12 steps on Tiny Shakespeare."""
  config = shrink(t5_span_corruption.get_config())
  config.tokenizer.vocab_size = 200
  config.data.text_path = tiny_shakespeare
  workdir = str(tmp_path_factory.mktemp('t5_span'))
  translation.train_and_evaluate(config, workdir)
  return config, workdir


@pytest.mark.slow  # trains twice (and once more to resume)
def test_finetunes_a_span_corruption_workdir(span_workdir, corpus, tmp_path, fit_calls):
  """Step 0 holds the pretrained params (the same tree, bitwise), the tokenizer is the
  pretrained one (spm.model copied, 200 pieces + 100 sentinels), the loss falls; the workdir
  alone restores for inference; a rerun resumes from its checkpoint without the pretrained
  workdir."""
  span_config, span_dir = span_workdir
  workdir = str(tmp_path / 'finetuned')
  config = finetune_config(corpus('multi30k'), workdir=span_dir)
  assert config.tokenizer.vocab_size == 8_000  # t5_multi30k's own, replaced by the workdir's
  results = translation.train_and_evaluate(config, workdir)

  pretrained = jax.device_get(translation.restore_for_inference(span_config, span_dir).params)
  assert fit_calls[0]['step'] == 0
  assert_same_tree(fit_calls[0]['params'], pretrained)
  assert_falls(fit_calls, results, workdir)

  assert read_bytes(span_dir, 'spm.model') == read_bytes(workdir, 'spm.model')
  saved = load_saved_config(workdir)
  assert saved.tokenizer.to_dict() == load_saved_config(span_dir).tokenizer.to_dict()
  assert saved.init.workdir == span_dir and saved.data.source_prefix == PREFIX
  assert saved.model.dropout_rate == 0.1  # the fine-tuning config's (pretraining: 0.0)

  # Without the pretrained workdir (moved away): inference reads the fine-tuned one alone, and
  # a rerun resumes from its checkpoint at step 12 (the init applies at step 0 only).
  moved = str(tmp_path / 'gone')
  shutil.move(span_dir, moved)
  try:
    model = translation.restore_for_inference(saved, workdir)
    task, params = model.task, jax.device_get(model.params)
    assert task.cfg.vocab_size == 300 and task.tgt_tokenizer.encode('<extra_id_0>') == [299]
    config.train.num_steps = 14
    results = translation.train_and_evaluate(config, workdir)
  finally:
    shutil.move(moved, span_dir)
  assert fit_calls[1]['step'] == 12 and results['step'] == 14
  assert_same_tree(fit_calls[1]['params'], params)


@pytest.mark.slow  # needs the trained span-corruption workdir
def test_a_model_other_than_the_pretrained_one_is_named(span_workdir, tmp_path):
  """A model 64 wide with 3 encoder layers against the pretrained one (32 wide, 1+1 layers):
  one line naming each field and the flags that match it."""
  _, span_dir = span_workdir
  config = finetune_config('unused', workdir=span_dir)
  config.data.source = 'numbers'
  config.model.update(dict(emb_dim=64, num_encoder_layers=3))
  message = one_line_error(config, tmp_path / 'work')
  assert 'model.emb_dim=64 (32 there)' in message
  assert 'model.num_encoder_layers=3 (1 there)' in message
  assert '--config.model.emb_dim=32 --config.model.num_encoder_layers=1' in message
  assert 'head_dim' not in message  # derived: follows emb_dim


# -- init.hf_dir: a Hugging Face T5 directory ---------------------------------------------------


def train_t5_sentencepiece(lines, path: str, vocab_size: int):
  """A SentencePiece unigram model with T5's ids: pad 0, eos 1, unk 2, no bos."""
  import sentencepiece as spm
  model = io.BytesIO()
  spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=model,
                                 vocab_size=vocab_size, model_type='unigram', pad_id=0, eos_id=1,
                                 unk_id=2, bos_id=-1, minloglevel=2)
  with open(path, 'wb') as f:
    f.write(model.getvalue())


@pytest.fixture(scope='module')
def hf_t5_dir(corpus, tmp_path_factory):
  """(directory, transformers model, transformers tokenizer, spiece.model path): a random T5
  v1.0 of width 32 whose embedding has 264 rows, and a 250-piece T5 tokenizer + 10 sentinels
  (260 ids) trained on Multi30k, saved together as save_pretrained writes them."""
  pytest.importorskip('torch', reason='needs the parity extra: pip install -e ".[parity]"')
  transformers = pytest.importorskip('transformers',
                                     reason='needs the parity extra: pip install -e ".[parity]"')
  import torch
  root = tmp_path_factory.mktemp('hf_t5')
  lines = []
  for lang in ('en', 'de'):
    with gzip.open(corpus('multi30k') / f'train.{lang}.gz', 'rt', encoding='utf-8') as f:
      lines += [next(f).rstrip('\n') for _ in range(2_000)]
  spiece = str(root / 'spm' / 'spiece.model')
  os.makedirs(os.path.dirname(spiece))
  train_t5_sentencepiece(lines + [PREFIX] * 20, spiece, 250)
  # transformers 5 converts a spiece.model when loading a folder that holds one (its T5
  # tokenizer's constructor takes a vocabulary, not vocab_file).
  tokenizer = transformers.T5TokenizerFast.from_pretrained(os.path.dirname(spiece), extra_ids=10)
  assert len(tokenizer) == 260 and tokenizer.convert_tokens_to_ids('<extra_id_0>') == 259
  torch.manual_seed(0)
  model = transformers.T5ForConditionalGeneration(
      transformers.T5Config(vocab_size=264, d_model=32, d_kv=16, num_heads=2, d_ff=64, num_layers=1,
                            num_decoder_layers=1, dropout_rate=0.0, feed_forward_proj='relu',
                            decoder_start_token_id=0, pad_token_id=0, eos_token_id=1))
  with torch.no_grad():  # norms away from 1, so a mis-mapped norm would show
    for p in model.parameters():
      if p.ndim == 1:
        p.add_(0.1 * torch.randn_like(p))
  directory = str(root / 'model')
  model.save_pretrained(directory)
  tokenizer.save_pretrained(directory)
  return directory, model.eval(), tokenizer, spiece


@pytest.mark.slow  # trains, then translates in a subprocess
@pytest.mark.parity
def test_finetunes_a_hugging_face_t5(hf_t5_dir, corpus, tmp_path, fit_calls, translate_cli):
  """init.hf_dir: step 0 is `hf_t5.load`'s params bitwise, our loss on the first validation
  batch is transformers' (the batch tokenized with the checkpoint's tokenizer and the T5
  prefix), the loss falls; --mode=translate with the workdir alone prints the in-process
  translations."""
  import torch
  from transformer_jax.convert import hf_t5
  directory, model, tokenizer, _ = hf_t5_dir
  workdir = str(tmp_path / 'finetuned')
  config = finetune_config(corpus('multi30k'), hf_dir=directory)
  config.optimizer.learning_rate = 2e-2  # 12 steps past translating into spaces only ('▁')
  results = translation.train_and_evaluate(config, workdir)

  params = hf_t5.load(directory).params
  first = fit_calls[0]
  assert first['step'] == 0 and first['task'].cfg.vocab_size == 264
  assert_same_tree(first['params'], params)
  # The sources as transformers tokenizes them, prefix included; every batch row starts so.
  sources, _ = translation.load_split(config, 'val')
  for source in sources[:20]:
    assert first['task'].src_tokenizer.encode(source) == tokenizer(
        PREFIX + source, add_special_tokens=False).input_ids
  prefix_ids = tokenizer(PREFIX, add_special_tokens=False).input_ids
  inputs, targets = (np.asarray(first['batch'][k]) for k in ('inputs', 'targets'))
  assert (inputs[:, :len(prefix_ids)] == prefix_ids).all()
  with torch.no_grad():
    theirs = float(
        model(input_ids=torch.from_numpy(inputs).long(), attention_mask=torch.from_numpy(
            (inputs != 0).astype(np.int64)),
              labels=torch.from_numpy(np.where(targets == 0, -100, targets)).long()).loss)
  ours, _ = assert_falls(fit_calls, results, workdir)
  print(f'loss on the first validation batch: ours {ours:.7f}, transformers {theirs:.7f}, '
        f'|difference| {abs(ours - theirs):.2g}')
  assert abs(ours - theirs) <= 1e-5

  assert sorted(os.listdir(os.path.join(workdir, translation_model.HF_TOKENIZER_DIR))) == [
      'config.json', 'tokenizer.json', 'tokenizer_config.json'
  ]
  saved = load_saved_config(workdir)
  assert saved.model.vocab_size == 264  # 250 pieces + the tokenizer's own 10 sentinels
  assert (saved.tokenizer.vocab_size, saved.tokenizer.num_sentinels) == (250, 10)
  assert saved.model.emb_dim == 32 and saved.model.activation == 'relu'  # not t5_multi30k's
  model = translation.restore_for_inference(saved, workdir)
  sentences = ['A dog runs on the beach.', 'Two men are playing football in a park.']
  expected = model.task.translate(model.params, sentences, model.mesh)
  result = translate_cli.run(f'--workdir={workdir}', '--mode=translate',
                             stdin=''.join(s + '\n' for s in sentences))
  assert result.returncode == 0, result.stderr[-3000:]
  print('translations:', result.stdout.split('\n'))
  assert result.stdout == ''.join(e + '\n' for e in expected)
  assert any(e.strip() for e in expected)


@pytest.mark.parity
def test_a_bare_spiece_model_gives_the_tokenizer_json_ids(hf_t5_dir, tmp_path):
  """A directory with spiece.model and tokenizer_config.json's extra_ids only (as
  google/t5-v1_1-* ship) encodes and decodes like its tokenizer.json, sentinels included."""
  directory, _, _, spiece = hf_t5_dir
  bare = tmp_path / 'bare'
  bare.mkdir()
  shutil.copy(spiece, bare / 'spiece.model')
  (bare / 'tokenizer_config.json').write_text(json.dumps({'extra_ids': 10}))
  fast, slow = (load_hf_t5_tokenizer(d) for d in (directory, str(bare)))
  assert fast.vocab_size == slow.vocab_size == 260
  for text in ('A dog runs on the beach.', 'Zwei <extra_id_0> spielen <extra_id_9> Park.'):
    ids = fast.encode(text)
    assert slow.encode(text) == ids
    assert slow.decode(ids + [1, 5]) == fast.decode(ids + [1, 5])
  assert fast.encode('<extra_id_0>') == [259] and fast.decode([259, 2, 263, 0, 1, 7]) == (
      '<extra_id_0><unk>')  # unk (2) kept, rows beyond the tokenizer and PAD dropped, cut at EOS


# -- bad input ----------------------------------------------------------------------------------


def one_line_error(config, workdir) -> str:
  """The ConfigError of training `config` in `workdir`: one line, and nothing written."""
  with pytest.raises(ConfigError) as info:
    translation.train_and_evaluate(config, str(workdir))
  message = str(info.value)
  assert '\n' not in message
  assert not os.path.exists(workdir) or not os.listdir(workdir), os.listdir(workdir)
  return message


def write_hf_config(directory, **values):
  os.makedirs(directory, exist_ok=True)
  with open(os.path.join(directory, 'config.json'), 'w') as f:
    json.dump(values, f)
  return str(directory)


def word_level_tokenizer_json(directory, words: int):
  """A tokenizer.json (`tokenizers` only) with T5's specials and `words` more tokens."""
  from tokenizers import Tokenizer, models
  vocab = {'<pad>': 0, '</s>': 1, '<unk>': 2, **{f'w{i}': i + 3 for i in range(words)}}
  Tokenizer(models.WordLevel(vocab,
                             unk_token='<unk>')).save(os.path.join(directory, 'tokenizer.json'))


T5_CONFIG = dict(model_type='t5', vocab_size=64, d_model=32, d_kv=16, num_heads=2, d_ff=64,
                 num_layers=1, pad_token_id=0, eos_token_id=1)


@pytest.mark.parametrize('case, expected', [
    ('both', 'are both set'),
    ('missing_workdir', 'does not exist'),
    ('not_t5_workdir', "is not a T5: its model has norm_type='layernorm'"),
    ('missing_hf_dir', 'does not exist'),
    ('not_t5_hf_dir', "is not a T5: config.json has model_type='bert'"),
    ('tokenizer_too_large', 'has 67 ids but the model\'s embedding has 64 rows'),
    ('span_corruption_prepared', 'brings its own tokenizer, but data.prepared='),
    ('span_corruption_workdir', 'span corruption continues from a Hugging Face T5'),
])
def test_bad_init_is_one_line_before_anything_is_written(case, expected, tmp_path):
  config = finetune_config('unused')
  config.data.source = 'numbers'
  if case == 'both':
    config.init.update(dict(workdir=str(tmp_path), hf_dir=str(tmp_path)))
  elif case == 'missing_workdir':
    config.init.workdir = str(tmp_path / 'nowhere')
  elif case == 'not_t5_workdir':  # a trained-looking quickstart workdir: the original Transformer
    save_config(quickstart_config(), str(tmp_path / 'quickstart'))
    config.init.workdir = str(tmp_path / 'quickstart')
  elif case == 'missing_hf_dir':
    config.init.hf_dir = str(tmp_path / 'nowhere')
  elif case == 'not_t5_hf_dir':
    config.init.hf_dir = write_hf_config(tmp_path / 'bert', model_type='bert', hidden_size=32)
  elif case == 'tokenizer_too_large':  # checked before any weight is read (there are none)
    config.init.hf_dir = write_hf_config(tmp_path / 't5', **T5_CONFIG)
    word_level_tokenizer_json(config.init.hf_dir, 64)
  elif case == 'span_corruption_prepared':  # continued pretraining reads text, not ids
    config.data.update(dict(task='span_corruption', prepared='never_read', source_prefix=''))
    config.init.hf_dir = str(tmp_path)
  elif case == 'span_corruption_workdir':
    config.data.update(dict(task='span_corruption', text_path='never_read.txt', source_prefix=''))
    config.init.workdir = str(tmp_path)
  message = one_line_error(config, tmp_path / 'work')
  print(message)
  assert expected in message


@pytest.mark.slow  # a subprocess: the command line's own error handling
def test_a_missing_init_dir_is_one_error_line_from_the_command_line(translate_cli, tmp_path):
  workdir, missing = tmp_path / 'work', tmp_path / 'no_t5_here'
  result = translate_cli.run(f'--workdir={workdir}', '--config=experiments/configs/t5_multi30k.py',
                             '--config.data.source=numbers', f'--config.init.hf_dir={missing}')
  assert result.returncode == 1, result.stderr[-3000:]
  assert 'Traceback' not in result.stderr
  errors = translate_cli.error_lines(result.stderr)
  assert len(errors) == 1 and result.stderr.strip().splitlines()[-1] == errors[0], result.stderr
  assert f'init.hf_dir {missing} does not exist' in errors[0]
  assert not os.listdir(workdir)  # the command line created it, and wrote nothing in it
