"""Tests for loading TFDS corpora, run offline on TFDS's generated mock data."""

import os
import subprocess
import sys

import pytest
import tensorflow_datasets as tfds

from transformer_jax.data import tfds_text
from transformer_jax.errors import DataError

WMT = 'wmt14_translate/de-en'
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _raw_examples(name, split, num):
  """Reads the mock examples directly with TFDS, for comparison."""
  return list(tfds.as_numpy(tfds.load(name, split=split).take(num)))


@pytest.mark.slow
def test_load_parallel_maps_languages_to_src_and_tgt():
  with tfds.testing.mock_data(num_examples=12):
    en, de = tfds_text.load_tfds_parallel(WMT, 'train', 'en', 'de')
    de2, en2 = tfds_text.load_tfds_parallel(WMT, 'train', 'de', 'en')
    raw = _raw_examples(WMT, 'train', 12)
  assert len(en) == len(de) == 12
  assert all(isinstance(s, str) and s for s in en + de)
  assert en == [ex['en'].decode().strip() for ex in raw]
  assert de == [ex['de'].decode().strip() for ex in raw]
  assert (en2, de2) == (en, de)
  assert en != de


@pytest.mark.slow
def test_load_parallel_max_examples():
  with tfds.testing.mock_data(num_examples=10):
    src, tgt = tfds_text.load_tfds_parallel(WMT, 'validation', 'de', 'en', max_examples=4)
    full_src, _ = tfds_text.load_tfds_parallel(WMT, 'validation', 'de', 'en')
  assert len(src) == len(tgt) == 4
  assert src == full_src[:4]


@pytest.mark.slow
def test_load_text():
  with tfds.testing.mock_data(num_examples=6):
    texts = tfds_text.load_tfds_text('lm1b', 'train')
    raw = _raw_examples('lm1b', 'train', 6)
  assert texts == [ex['text'].decode() for ex in raw]
  assert all(isinstance(t, str) for t in texts)


@pytest.mark.slow
def test_unknown_language_lists_features():
  with tfds.testing.mock_data(num_examples=3):
    with pytest.raises(DataError, match=r"no feature 'fr'.*\['de', 'en'\]"):
      tfds_text.load_tfds_parallel(WMT, 'train', 'fr', 'en')


def test_unknown_dataset():
  with pytest.raises(DataError, match='no dataset named'):
    tfds_text.load_tfds_text('no_such_corpus_xyz', 'train')


def test_missing_data_gives_advice(monkeypatch):

  def fail(*args, **kwargs):
    raise AssertionError('Dataset wmt14_translate: could not find data in /nowhere.\n'
                         'Please make sure to call dataset_builder.download_and_prepare()')

  monkeypatch.setattr(tfds, 'load', fail)
  with pytest.raises(DataError) as info:
    tfds_text.load_tfds_parallel(WMT, 'train', 'de', 'en', data_dir='/nowhere')
  message = str(info.value)
  assert 'could not find data in /nowhere' in message
  assert f'tfds build {WMT}' in message and 'data_dir' in message
  assert '\n' not in message  # One readable line.


def test_import_does_not_load_tensorflow():
  code = ('import sys, transformer_jax.data.tfds_text, transformer_jax.data.batching, '
          'transformer_jax.data.text, transformer_jax.data.numbers; '
          'print("tensorflow" in sys.modules)')
  result = subprocess.run([sys.executable, '-c', code], cwd=REPO_ROOT, capture_output=True,
                          text=True, check=True, env={**os.environ, 'PYTHONPATH': REPO_ROOT})
  assert result.stdout.strip() == 'False'


def test_without_the_tfds_extra_a_tfds_corpus_is_one_line_naming_it(monkeypatch):
  """TensorFlow Datasets is the `tfds` extra, not a dependency (setup.cfg): a run that reads a
  TFDS corpus without it says how to install it instead of an ImportError's traceback."""
  monkeypatch.setitem(sys.modules, 'tensorflow_datasets', None)  # `import` raises ImportError
  with pytest.raises(DataError, match=r'needs TensorFlow Datasets .*pip install -e "\.\[tfds\]"'):
    tfds_text.load_tfds_parallel(WMT, 'train', 'en', 'de')
