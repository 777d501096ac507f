"""Tests for the pictures (transformer_jax/visualize/, experiments/visualize.py).

The attention weights must be the model's own: rows that sum to 1, exactly zero where the
padding or causal mask hides a key, and the same whatever attention implementation the config
picks. Pictures must have the size they promise, index.html must show every one, and training
must write the attention grids to TensorBoard at every evaluation.
"""

import os
import re
import struct
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax.visualize import attention_maps, canvas, curves, heatmaps, positions
from transformer_jax.data import lm as lm_data
from transformer_jax.errors import DataError
from transformer_jax.model_config import ATTENTION_IMPLEMENTATIONS, TransformerConfig
from transformer_jax.models import GPT, EncoderDecoder, gpt2_config

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tiny_encoder_decoder(**overrides):
  values = dict(vocab_size=24, emb_dim=16, num_heads=2, mlp_dim=32, num_encoder_layers=2,
                num_decoder_layers=2, max_len=16, dropout_rate=0.0, attention_dropout_rate=0.0)
  values.update(overrides)
  cfg = TransformerConfig(**values)
  model = EncoderDecoder(cfg)
  dummy = jnp.ones((1, 4), jnp.int32)
  return model, nn.meta.unbox(model.init(jax.random.key(0), dummy, dummy)['params'])


def tiny_gpt(**overrides):
  cfg = gpt2_config(vocab_size=30, emb_dim=16, num_heads=2, mlp_dim=32, num_decoder_layers=3,
                    max_len=16, dropout_rate=0.0, attention_dropout_rate=0.0, **overrides)
  model = GPT(cfg)
  params = nn.meta.unbox(model.init(jax.random.key(1), jnp.ones((1, 4), jnp.int32))['params'])
  return model, params


# -- the weights ----------------------------------------------------------------------------------

# Row 0: 4 real source tokens then padding; row 1: no padding.
SOURCE = np.asarray([[5, 6, 7, 1, 0, 0, 0], [5, 6, 7, 8, 9, 10, 1]], np.int32)
TARGET = np.asarray([[4, 5, 1, 0, 0], [4, 9, 9, 9, 1]], np.int32)


@pytest.mark.slow
def test_encoder_decoder_weights_sum_to_one_and_are_zero_where_masked():
  model, params = tiny_encoder_decoder()
  maps = attention_maps.collect_attention(model, params, jnp.asarray(SOURCE), jnp.asarray(TARGET))
  assert list(maps) == [
      'encoder/layer_0/self_attention', 'encoder/layer_1/self_attention',
      'decoder/layer_0/self_attention', 'decoder/layer_0/cross_attention',
      'decoder/layer_1/self_attention', 'decoder/layer_1/cross_attention'
  ]
  valid = SOURCE != 0
  for name, w in maps.items():
    assert w.dtype == np.float32 and np.all(w >= 0), name
    if name.startswith('encoder'):
      assert w.shape == (2, 2, 7, 7)
      # Real queries: a distribution over the real keys only; padding queries see nothing.
      np.testing.assert_allclose(w.sum(-1)[valid[:, None, :].repeat(2, 1)], 1.0, atol=1e-5)
      assert np.all(w[~valid[:, None, None, :].repeat(2, 1).repeat(7, 2)] == 0.0)
      assert np.all(w[0, :, 4:, :] == 0.0)
    elif 'cross' in name:
      assert w.shape == (2, 2, 5, 7)
      np.testing.assert_allclose(w.sum(-1), 1.0, atol=1e-5)
      assert np.all(w[0, :, :, 4:] == 0.0)  # padded source tokens get no attention
      assert np.all(w[0, :, :, :4] > 0.0)
    else:
      assert w.shape == (2, 2, 5, 5)
      np.testing.assert_allclose(w.sum(-1), 1.0, atol=1e-5)
      future = np.triu(np.ones((5, 5), bool), k=1)
      assert np.all(w[..., future] == 0.0)  # causal: no query sees a later token
      assert np.all(w[..., ~future] > 0.0)


@pytest.mark.slow
def test_capture_uses_the_weight_returning_path_whatever_the_implementation():
  """Each configured implementation yields the same weights, and capturing them leaves the
  model's output unchanged."""
  model, params = tiny_encoder_decoder(num_encoder_layers=1, num_decoder_layers=1)
  reference = attention_maps.collect_attention(model, params, jnp.asarray(SOURCE),
                                               jnp.asarray(TARGET))
  logits = model.apply({'params': params}, SOURCE, TARGET)
  captured, _ = model.apply({'params': params}, SOURCE, TARGET, mutable=['intermediates'])
  np.testing.assert_allclose(captured, logits, atol=1e-5)
  for implementation in [i for i in ATTENTION_IMPLEMENTATIONS if i != 'cudnn']:
    other = EncoderDecoder(model.cfg.replace(attention_implementation=implementation))
    maps = attention_maps.collect_attention(other, params, jnp.asarray(SOURCE), jnp.asarray(TARGET))
    for name in reference:
      np.testing.assert_array_equal(maps[name], reference[name], err_msg=implementation)


@pytest.mark.slow
def test_gpt_weights_are_causal_and_labelled_with_the_characters():
  model, params = tiny_gpt()
  tokenizer = lm_data.CharTokenizer(list('abcdefgh ij\nklmnopqrstuvwxyz.,'))
  maps = attention_maps.lm_attention(model, params, tokenizer, 'a cab\nfed')
  assert [m.name for m in maps] == [f'stack/layer_{i}/self_attention' for i in range(3)]
  for amap in maps:
    assert amap.queries == amap.keys == ['a', '␣', 'c', 'a', 'b', '\\n', 'f', 'e', 'd']
    assert amap.weights.shape == (2, 9, 9)
    np.testing.assert_allclose(amap.weights.sum(-1), 1.0, atol=1e-5)
    assert np.all(amap.weights[:, np.triu(np.ones((9, 9), bool), 1)] == 0.0)
  with pytest.raises(DataError, match='at most 16'):
    attention_maps.lm_attention(model, params, tokenizer, 'abcdefgh' * 3)


def test_lm_task_summary_images_skip_characters_the_vocabulary_lacks():
  from transformer_jax.tasks.lm import LanguageModelTask
  model, params = tiny_gpt()
  tokenizer = lm_data.CharTokenizer(list(' abeinorst,.'))  # no 'T', 'h', 'q', 'u'
  task = LanguageModelTask(model.cfg, tokenizer=tokenizer)
  images = task.summary_images(params)
  assert list(images) == ['attention/stack/self_attention']
  image = images['attention/stack/self_attention']
  assert image.dtype == np.uint8 and image.ndim == 3 and image.shape[2] == 3
  assert image.shape[0] > 3 * 100  # three layers of panels
  assert LanguageModelTask(model.cfg, tokenizer=None).summary_images(params) == {}


def test_bert_weights_see_only_the_real_tokens():
  """BERT masks keys only: every query, padding ones too, spreads its weight over real tokens."""
  from transformer_jax.models.bert import Bert, bert_config

  class Vocabulary:

    def id_to_token(self, i):
      return {0: '[PAD]', 2: '[CLS]', 3: '[SEP]'}.get(i, f'w{i}')

  cfg = bert_config(vocab_size=30, emb_dim=16, num_heads=2, mlp_dim=32, num_encoder_layers=2,
                    max_len=16)
  model = Bert(cfg, mlm=False, sentence_classes=0)
  tokens = jnp.ones((1, 4), jnp.int32)
  params = nn.meta.unbox(model.init(jax.random.key(2), tokens, jnp.zeros_like(tokens))['params'])
  ids = [2, 7, 8, 9, 3, 0, 0]
  maps = attention_maps.encoder_attention(model, params, Vocabulary(), ids,
                                          jnp.zeros((1, 7), jnp.int32), method='encode')
  assert [m.name for m in maps
         ] == ['encoder/layer_0/self_attention', 'encoder/layer_1/self_attention']
  for amap in maps:
    assert amap.keys == ['[CLS]', 'w7', 'w8', 'w9', '[SEP]', '[PAD]', '[PAD]']
    np.testing.assert_allclose(amap.weights.sum(-1), 1.0, atol=1e-5)
    assert np.all(amap.weights[:, :, 5:] == 0.0) and np.all(amap.weights[:, :, :5] > 0.0)


def test_scanned_layers_give_the_same_maps_as_unrolled_ones():
  from transformer_jax.layers import scan_layout
  model, params = tiny_gpt()
  scanned = GPT(model.cfg.replace(scan_layers=True))
  tokens = jnp.asarray([[3, 4, 5, 6, 7]], jnp.int32)
  unrolled_maps = attention_maps.collect_attention(model, params, tokens)
  scanned_maps = attention_maps.collect_attention(scanned, scan_layout.stack_layers(params), tokens)
  assert list(scanned_maps) == list(unrolled_maps)
  for name, weights in unrolled_maps.items():
    np.testing.assert_allclose(scanned_maps[name], weights, atol=1e-6)


# -- the pictures ---------------------------------------------------------------------------------


def test_pictures_have_the_promised_pixel_size(tmp_path):
  model, params = tiny_encoder_decoder()
  raw = attention_maps.collect_attention(model, params, jnp.asarray(SOURCE[:1]),
                                         jnp.asarray(TARGET[:1]))
  labels = [str(i) for i in range(7)]
  amap = attention_maps.AttentionMap('decoder/layer_0/cross_attention',
                                     raw['decoder/layer_0/cross_attention'][0], labels[:5], labels)
  path = canvas.save_png(heatmaps.plot_attention(amap, 1), str(tmp_path / 'head.png'))
  width, height = heatmaps.heatmap_figsize(5, 7)
  assert canvas.png_size(path) == (round(width * canvas.DPI), round(height * canvas.DPI))
  # Longer sequences get smaller cells but stay bounded.
  assert heatmaps.heatmap_figsize(500, 500)[0] < heatmaps.heatmap_figsize(40, 40)[0] * 2
  path = canvas.save_png(positions.plot_positions(50, 32), str(tmp_path / 'positions.png'))
  assert canvas.png_size(path) == (1600, 480)
  figure = heatmaps.plot_grid([amap, amap], 'two rows')
  image = canvas.figure_to_array(figure)
  assert image.dtype == np.uint8 and image.shape == (round(
      figure.get_figheight() * canvas.DPI), round(figure.get_figwidth() * canvas.DPI), 3)
  assert image.std() > 10  # something was drawn


@pytest.mark.slow
def test_report_index_shows_every_picture(tmp_path):
  model, params = tiny_encoder_decoder()
  raw = attention_maps.collect_attention(model, params, jnp.asarray(SOURCE[1:]),
                                         jnp.asarray(TARGET[1:]))
  maps = [
      attention_maps.AttentionMap(name, w[0], [f'q{i}' for i in range(w.shape[2])],
                                  [f'k{i}' for i in range(w.shape[3])]) for name, w in raw.items()
  ]
  index = heatmaps.write_attention_report(str(tmp_path), maps, title='t <&> "q"',
                                          description='source: x < y')
  pngs = sorted(n for n in os.listdir(tmp_path) if n.endswith('.png'))
  # 6 attention modules x 2 heads, plus one grid per layer (2 encoder + 2 decoder layers).
  assert len(pngs) == 6 * 2 + 4
  with open(index, encoding='utf-8') as f:
    page = f.read()
  assert sorted(set(re.findall(r'src="([^"]+)"', page))) == pngs
  assert 't &lt;&amp;&gt; &quot;q&quot;' in page and 'x &lt; y' in page


def test_read_metrics_keeps_the_last_value_of_a_rewritten_step_and_plots(tmp_path):
  path = tmp_path / 'metrics.jsonl'
  path.write_text('{"step": 10, "train/loss": 3.0, "train/learning_rate": 0.1}\n'
                  '{"step": 20, "train/loss": 2.0, "train/learning_rate": 0.2}\n'
                  '{"step": 20, "eval/loss": 2.5, "eval/bleu": 5.0}\n'
                  '{"step": 20, "train/loss": 1.5, "train/learning_rate": 0.2}\n'
                  '{"step": 30, "train/loss": 0.01, "train/learning_rate": 0.2}\n')
  metrics = curves.read_metrics(str(path))
  np.testing.assert_array_equal(metrics['train/loss'][0], [10, 20, 30])
  np.testing.assert_array_equal(metrics['train/loss'][1], [3.0, 1.5, 0.01])
  figure = curves.plot_curves(metrics)
  out = canvas.save_png(figure, str(tmp_path / 'curves.png'))
  assert canvas.png_size(out) == (1500, 380)  # three panels: loss, BLEU, learning rate
  path.write_text('{"step": 1, "train/loss": 1.0}\nnot json\n')
  with pytest.raises(DataError, match=r'metrics.jsonl:2'):
    curves.read_metrics(str(path))


# -- training and the command line ----------------------------------------------------------------


def read_image_events(directory: str) -> dict[str, list[tuple[int, int, int]]]:
  """{tag: [(step, width, height)]} of the image summaries in a TensorBoard event directory."""
  from tensorboardX.proto import event_pb2
  images = {}
  for name in sorted(os.listdir(directory)):
    with open(os.path.join(directory, name), 'rb') as f:
      data = f.read()
    offset = 0
    while offset < len(data):  # TFRecord: length, length crc, payload, payload crc
      (length,) = struct.unpack('<Q', data[offset:offset + 8])
      event = event_pb2.Event.FromString(data[offset + 12:offset + 12 + length])
      offset += 16 + length
      for value in event.summary.value:
        if value.HasField('image'):
          images.setdefault(value.tag, []).append(
              (event.step, value.image.width, value.image.height))
  return images


@pytest.fixture(scope='module')
def trained_translation(tmp_path_factory):
  """A tiny translation workdir trained for 30 steps, evaluated at steps 15 and 30."""
  from tests.conftest import tiny_translate_config
  from transformer_jax.workflows import translation
  workdir = str(tmp_path_factory.mktemp('viz') / 'work')
  config = tiny_translate_config(train__num_steps=30, train__eval_every=15, eval__bleu_sentences=2)
  translation.train_and_evaluate(config, workdir)
  return workdir


@pytest.mark.slow
def test_training_writes_attention_grids_to_tensorboard_at_every_eval(trained_translation):
  images = read_image_events(os.path.join(trained_translation, 'tensorboard'))
  assert sorted(images) == [
      'attention/decoder/cross_attention', 'attention/decoder/self_attention',
      'attention/encoder/self_attention'
  ]
  for tag, events in images.items():
    assert [step for step, _, _ in events] == [15, 30], tag
    assert all(width > 100 and height > 100 for _, width, height in events), tag


def run_cli(*flags):
  env = dict(os.environ, TRANSFORMER_JAX_ALLOCATOR='system', JAX_PLATFORMS='cpu',
             TF_CPP_MIN_LOG_LEVEL='2')
  env['PYTHONPATH'] = os.pathsep.join(filter(None, [REPO_ROOT, env.get('PYTHONPATH')]))
  return subprocess.run([sys.executable, '-m', 'experiments.visualize', *flags], cwd=REPO_ROOT,
                        env=env, capture_output=True, text=True, timeout=600, check=False)


@pytest.mark.slow
def test_cli_draws_every_layer_and_head_of_a_trained_workdir(trained_translation, tmp_path):
  from transformer_jax.data.tokenizer import Tokenizer
  out = str(tmp_path / 'pictures')
  source, target = 'she bought five flowers', 'sie kaufte fünf blumen'
  result = run_cli(f'--workdir={trained_translation}', f'--text={source}', f'--target={target}',
                   '--curves', '--positions', '--length=20', '--width=16', f'--out={out}')
  assert result.returncode == 0, result.stderr[-3000:]
  assert result.stdout.strip() == f'10 pictures in {out}; open {out}/index.html'
  # 1 encoder + 1 decoder layer of 2 heads: encoder self, decoder self, cross; two grids.
  expected = {
      f'{module}_head{h}.png' for h in (0, 1)
      for module in ('encoder_layer_0_self_attention', 'decoder_layer_0_self_attention',
                     'decoder_layer_0_cross_attention')
  }
  expected |= {
      'encoder_layer_0_grid.png', 'decoder_layer_0_grid.png', 'curves.png', 'positions.png'
  }
  assert set(os.listdir(out)) == expected | {'index.html'}
  with open(os.path.join(out, 'index.html'), encoding='utf-8') as f:
    page = f.read()
  assert set(re.findall(r'src="([^"]+)"', page)) == expected
  assert 'sie kaufte fünf blumen' in page
  tokenizer = Tokenizer.from_file(os.path.join(trained_translation, 'spm.model'))
  src_len, tgt_len = len(tokenizer.encode(source)) + 1, len(tokenizer.encode(target)) + 1
  for name, rows, cols in (('encoder_layer_0_self_attention_head0.png', src_len, src_len),
                           ('decoder_layer_0_cross_attention_head1.png', tgt_len, src_len)):
    width, height = heatmaps.heatmap_figsize(rows, cols)
    assert canvas.png_size(os.path.join(out, name)) == (round(width * canvas.DPI),
                                                        round(height * canvas.DPI))


@pytest.mark.slow
def test_cli_bad_input_is_one_error_line(trained_translation, tmp_path):
  result = run_cli(f'--workdir={trained_translation}', '--target=sie')
  assert result.returncode == 1
  last = result.stderr.strip().splitlines()[-1]
  assert last == 'error: --target needs --text (the source sentence)'
  assert 'Traceback' not in result.stderr
  result = run_cli(f'--workdir={tmp_path / "missing"}', '--text=hello')
  assert result.returncode == 1 and 'does not exist' in result.stderr.strip().splitlines()[-1]
