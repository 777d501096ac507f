"""Language models train from prepared shards (workflows/lm.py): a small file is prepared into
the workdir with the batches it had before, a prepared folder is read as it is, a resume
tokenizes nothing, and GPT-2's config runs on 8 devices with fsdp and resumes on 2."""

import hashlib
import os
import shutil
import sys

import numpy as np
import pytest

from conftest import REPO_ROOT, set_path
from test_elastic_resume import check_resumed_like_reference, rewind
from transformer_jax import xla_options
from transformer_jax.corpus import prepare, tokenizers
from transformer_jax.corpus.reader import PreparedCorpus
from transformer_jax.data import lm as lm_data
from transformer_jax.errors import ConfigError, DataError


def _digest(batches) -> str:
  digest = hashlib.sha256()
  for batch in batches:
    for key in sorted(batch):
      digest.update(key.encode() + np.ascontiguousarray(batch[key]).tobytes())
  return digest.hexdigest()


def _char_config(path: str, **values):
  from experiments.configs import shakespeare_char
  config = shakespeare_char.get_config()
  config.data.path = path
  settings = {
      'model.num_decoder_layers': 1, 'model.emb_dim': 32, 'model.num_heads': 2, 'model.mlp_dim': 64,
      'data.block_size': 16, 'data.batch_size': 4, 'data.eval_batches': 1, 'train.num_steps': 3,
      'train.log_every': 1, 'train.eval_every': 0, 'train.checkpoint_every': 3,
      'eval.sample_tokens': 0, **values
  }
  for key, value in settings.items():
    set_path(config, key, value)
  return config


def test_a_character_file_gives_the_batches_of_its_text_in_memory(tmp_path, tiny_shakespeare):
  """The same windows, array for array, as random windows of the encoded text (the code before
  shards): a character corpus's stream is its text, so its results stay valid."""
  from transformer_jax.workflows import lm
  config = _char_config(tiny_shakespeare, **{'data.batch_size': 16, 'data.block_size': 64})
  sections = lm.sections_of(config)
  corpus = lm.prepared_corpus(sections, str(tmp_path))
  tokenizer = lm.load_tokenizer(sections.tokenizer, str(tmp_path))
  train_text, valid_text = lm_data.split_train_val(lm_data.read_text(tiny_shakespeare), 0.9)
  assert tokenizer.chars == sorted(set(train_text))
  in_memory = [np.asarray(tokenizer.encode(t), np.uint16) for t in (train_text, valid_text)]
  sharded = lm.make_data(sections, corpus.split('train'), corpus.split('valid'))
  unsharded = lm.make_data(sections, *in_memory)
  for step in (0, 1, 57):
    assert _digest([sharded[0].batch(step)]) == _digest([unsharded[0].batch(step)])
  assert _digest(sharded[1]) == _digest(unsharded[1])


def _prepared(tmp_path, source: str, kind: str = 'byte_bpe', vocab: int = 300) -> str:
  root = str(tmp_path / f'prepared_{kind}')
  prepare.prepare(
      prepare.Options(sources=(source,), tokenizer=kind, vocab_size=vocab, valid_fraction=0.05,
                      unit_bytes=1 << 18), root)
  return root


def test_a_prepared_folder_trains_and_a_resume_tokenizes_nothing(tmp_path, tiny_shakespeare,
                                                                 monkeypatch):
  from transformer_jax.workflows import lm
  root = _prepared(tmp_path, tiny_shakespeare)
  values = {
      'data.source': 'prepared', 'data.prepared': root, 'tokenizer.type': 'byte_bpe',
      'data.pack': True
  }
  workdir = str(tmp_path / 'run')
  results = lm.train_and_evaluate(_char_config('', **values), workdir)
  assert results['step'] == 3 and np.isfinite(results['eval_loss'])
  assert not os.path.exists(os.path.join(workdir, lm.CORPUS_DIR))  # read where it is
  PreparedCorpus(root).check_tokenizer(os.path.join(workdir, 'tokenizer'))

  def never(*args, **kwargs):
    raise AssertionError('a resumed run tokenized or prepared something')

  monkeypatch.setattr(prepare, 'prepare', never)
  monkeypatch.setattr(tokenizers, 'train', never)
  from transformer_jax.data.hf_tokenizer import HFTokenizer
  monkeypatch.setattr(HFTokenizer, 'encode_batch', never)
  results = lm.train_and_evaluate(_char_config('', **values, **{'train.num_steps': 5}), workdir)
  assert results['step'] == 5


def test_a_workdir_tokenizer_other_than_the_corpus_is_refused(tmp_path, tiny_shakespeare):
  from transformer_jax.workflows import lm
  root = _prepared(tmp_path, tiny_shakespeare)
  other = _prepared(tmp_path / 'other', tiny_shakespeare, vocab=280)
  workdir = tmp_path / 'run'
  workdir.mkdir()
  shutil.copytree(os.path.join(other, 'tokenizer'), workdir / 'tokenizer')
  values = {'data.source': 'prepared', 'data.prepared': root, 'tokenizer.type': 'byte_bpe'}
  with pytest.raises(DataError, match='is not the one .* was prepared with'):
    lm.train_and_evaluate(_char_config('', **values), str(workdir))
  with pytest.raises(ConfigError, match="tokenized with a byte_bpe tokenizer but "
                     "tokenizer.type='char'"):
    lm.train_and_evaluate(_char_config('', **{'data.source': 'prepared', 'data.prepared': root}),
                          str(tmp_path / 'char'))
  with pytest.raises(ConfigError, match='pass --config.data.prepared=DIR'):
    lm.validate(_char_config('', **{'data.source': 'prepared'}))


# GPT-2 small's config at a tiny size, on a SentencePiece corpus prepared from Tiny Shakespeare.
GPT2_TINY = {
    'model.num_decoder_layers': 1, 'model.emb_dim': 32, 'model.num_heads': 2, 'model.mlp_dim': 64,
    'data.block_size': 16, 'data.batch_size': 8, 'data.eval_batches': 1, 'data.source': 'prepared',
    'tokenizer.vocab_size': 200, 'optimizer.warmup_steps': 2, 'train.log_every': 1,
    'train.eval_every': 0, 'train.checkpoint_every': 3, 'train.keep_checkpoints': 5,
    'train.record_batches': True, 'eval.sample_tokens': 0
}


def _gpt2_small(translate_cli, prepared: str, workdir, steps: int, devices: int, mesh: dict):
  import subprocess
  values = {**GPT2_TINY, 'data.prepared': prepared, 'train.num_steps': steps, **mesh}
  command = [
      sys.executable, '-m', 'experiments.lm', '--config=experiments/configs/gpt2_small.py',
      f'--workdir={workdir}'
  ] + [f'--config.{k}={v}' for k, v in values.items()]
  env = xla_options.host_devices_env(devices, translate_cli.env())
  proc = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                        timeout=600, check=False)
  assert proc.returncode == 0, proc.stderr[-4000:]
  return proc


@pytest.mark.slow
def test_gpt2_small_on_prepared_shards_with_fsdp_resumes_on_two_devices(
    tmp_path, tiny_shakespeare, translate_cli):
  """gpt2_small.py shrunk, reading a prepared SentencePiece corpus: 6 steps on 8 devices with
  params and optimizer state split 8 ways (fsdp=8); the same run killed after step 3 and resumed
  on 2 devices (data=2) trains on the same global batches to the same losses."""
  prepared = _prepared(tmp_path, tiny_shakespeare, kind='sentencepiece', vocab=200)
  reference = tmp_path / 'reference'
  fsdp = {'mesh.data': 1, 'mesh.fsdp': 8}
  _gpt2_small(translate_cli, prepared, reference, 6, 8, fsdp)
  resumed = tmp_path / 'resumed'
  rewind(reference, resumed, 3)
  proc = _gpt2_small(translate_cli, prepared, resumed, 6, 2, {'mesh.data': 2, 'mesh.fsdp': 1})
  assert 'resuming the run saved at step 3 on 8 devices' in proc.stderr
  assert 'prepare:' not in proc.stderr  # nothing tokenized
  check_resumed_like_reference(reference, resumed, 'fsdp8 -> data2')
