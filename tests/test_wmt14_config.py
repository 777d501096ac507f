"""The WMT'14 and Multi30k configs run their real loading paths end to end.

WMT'14 runs offline on TFDS mock data (random letters in the real feature layout); Multi30k
reads the real files from the shared data directory. Both are shrunk to a tiny model, a tiny
vocabulary and a few steps; what is tested is the wiring from config to checkpoint.
"""

import gzip
import json
import math
import os

import jax
import pytest
import tensorflow_datasets as tfds
from conftest import DEFAULT_SHARED_DATA

from experiments.configs import multi30k, wmt14
from transformer_jax.data.tokenizer import Tokenizer
from transformer_jax.model_config import model_config_from_dict
from transformer_jax.models import EncoderDecoder
from transformer_jax.workflows import translation

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TINY_MODEL = dict(emb_dim=32, num_heads=2, mlp_dim=64, num_encoder_layers=1, num_decoder_layers=1)


def shrink(config, *, vocab_size: int, num_steps: int = 3):
  """Tiny model/vocabulary/steps; evaluation reduced to one batch and two BLEU sentences."""
  config.model.update(TINY_MODEL)
  config.tokenizer.vocab_size = vocab_size
  config.data.max_len = 32
  config.data.overflow = 'truncate'
  config.data.batch_tokens = 512
  config.train.update(
      dict(num_steps=num_steps, log_every=1, eval_every=0, checkpoint_every=0, eval_max_batches=1))
  config.eval.update(dict(bleu_sentences=2, test_prefix='', beam_size=2))
  return config


@pytest.mark.slow
def test_wmt14_config_trains_end_to_end_on_tfds_mock_data(tmp_path):
  """wmt14.py's tfds source ('wmt14_translate/de-en', splits train/validation, en->de) loads,
  trains a tokenizer on the text, runs 3 steps, evaluates and writes a checkpoint."""
  config = shrink(wmt14.get_config(), vocab_size=100)
  with tfds.testing.mock_data(num_examples=64):
    results = translation.train_and_evaluate(config, str(tmp_path))
  assert results['step'] == 3 and not results['interrupted']
  assert results['tokens'] > 0
  assert 'eval_loss' in results and 'eval_bleu' in results
  assert os.listdir(tmp_path / 'checkpoints') == ['3']
  tokenizer = Tokenizer.from_file(str(tmp_path / 'spm.model'))
  assert tokenizer.vocab_size == 100
  with open(tmp_path / 'config.json') as f:
    saved = json.load(f)
  assert saved['data']['source'] == 'tfds'
  assert saved['data']['tfds_name'] == 'wmt14_translate/de-en'


def multi30k_dir(config, corpus) -> str:
  """The corpus that config.data.dir names: data.dir is relative to the repository root (where
  runs start) and must point at shared/data/multi30k beside the checkout; the files are read
  from the `corpus` fixture's folder (the same one unless TRANSFORMER_JAX_SHARED_DATA moves it)."""
  configured = os.path.normpath(os.path.join(REPO_ROOT, config.data.dir))
  assert configured == str(DEFAULT_SHARED_DATA / 'multi30k'), configured
  return str(corpus('multi30k'))


def first_line(path: str) -> str:
  with gzip.open(path, 'rt', encoding='utf-8') as f:
    return f.readline().strip()


def test_multi30k_config_paths_point_at_the_real_files(corpus):
  """data.dir (from the repo root) with train/val/test_2016_flickr and en/de resolves to the
  shared gzip files, read aligned and in order."""
  config = multi30k.get_config()
  config.data.dir = multi30k_dir(config, corpus)
  for prefix in (config.data.train_prefix, config.data.valid_prefix, config.eval.test_prefix):
    src, tgt = translation.load_split(config, prefix)
    assert len(src) == len(tgt) > 0
    assert src[0] == first_line(os.path.join(config.data.dir, f'{prefix}.en.gz'))
    assert tgt[0] == first_line(os.path.join(config.data.dir, f'{prefix}.de.gz'))


@pytest.mark.slow
def test_multi30k_config_trains_end_to_end_on_the_real_data(corpus, tmp_path):
  """multi30k.py on the real files, limited to 300 training pairs: tokenizer, 3 steps,
  evaluation and a checkpoint."""
  config = shrink(multi30k.get_config(), vocab_size=200)
  config.data.dir = multi30k_dir(config, corpus)
  config.data.max_train_examples = 300
  results = translation.train_and_evaluate(config, str(tmp_path))
  assert results['step'] == 3 and not results['interrupted']
  assert 'eval_loss' in results and 'eval_bleu' in results
  assert os.listdir(tmp_path / 'checkpoints') == ['3']
  assert os.path.isfile(tmp_path / 'spm.model')


def test_wmt14_model_is_the_transformer_base_of_the_paper():
  """6+6 layers, d_model 512, 8 heads, d_ff 2048, post-LN, sinusoidal positions, shared
  tied embeddings, dropout 0.1: about 60M parameters with a 32k vocabulary."""
  config = wmt14.get_config()
  model = config.model
  assert (model.num_encoder_layers, model.num_decoder_layers) == (6, 6)
  assert (model.emb_dim, model.num_heads, model.mlp_dim) == (512, 8, 2048)
  assert model.norm_position == 'post' and model.position == 'sinusoidal'
  assert model.activation == 'relu'
  assert model.share_embeddings and model.tie_output and config.tokenizer.joint
  assert model.dropout_rate == 0.1 and config.loss.label_smoothing == 0.1
  assert config.tokenizer.vocab_size == 32_000
  assert (config.optimizer.schedule, config.optimizer.warmup_steps) == ('rsqrt', 4_000)
  assert (config.optimizer.b1, config.optimizer.b2) == (0.9, 0.98)

  cfg = model_config_from_dict(config.model, vocab_size=config.tokenizer.vocab_size,
                               max_len=config.data.max_len)
  tokens = jax.ShapeDtypeStruct((1, 8), 'int32')
  variables = jax.eval_shape(lambda rng, x: EncoderDecoder(cfg).init(rng, x, x), jax.random.key(0),
                             tokens)
  leaves = jax.tree.leaves(variables['params'])
  num_params = sum(math.prod(getattr(x, 'value', x).shape) for x in leaves)
  # The paper reports 65M with a 37k vocabulary; 32k shared embeddings give ~60.5M.
  assert 58e6 < num_params < 63e6, num_params
