"""Pictures of what a Transformer does: attention heat maps, position encodings, loss curves.

The attention weights come from the model itself: every `MultiHeadAttention` sows its
softmax weights [B, H, T, S] into the 'intermediates' collection when that collection is
mutable (and then always uses the weight-returning reference attention, whatever
`attention_implementation` says). `collect_attention` runs one forward pass that way; nothing
here re-implements attention.

Drawing uses matplotlib's object API on the Agg canvas (no pyplot, no global backend, no
display), so it is safe inside a training process. A figure's pixel size is its size in inches
times `dpi` exactly (no tight bounding box), which makes the output predictable.

    maps = translation_attention(model, params, src_tok, tgt_tok, 'five', 'fünf')
    write_attention_report('/tmp/pictures', maps, title='numbers')   # PNGs + index.html
"""

import collections
import dataclasses
import functools
import html
import json
import math
import os
import re
from typing import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax.special_tokens import BOS_ID, EOS_ID, PAD_ID, UNK_ID
from transformer_jax.errors import DataError
from transformer_jax.files import write_atomically

WEIGHTS_NAME = 'attention_weights'  # what MultiHeadAttention sows
DPI = 100
_CELL_INCHES = 0.26  # one token's row/column in a single-head heat map
_MAX_MAP_INCHES = 14.0  # longer sequences get smaller cells (and every k-th label)
_GRID_PANEL_INCHES = 2.4

# ---------------------------------------------------------------------------------------------
# Collecting attention weights from a model


@dataclasses.dataclass
class AttentionMap:
  """The weights of one attention module for one sequence, with what its axes mean."""
  name: str  # module path, e.g. 'decoder/layer_1/cross_attention'
  weights: np.ndarray  # [H, T, S]; each row (a query) sums to 1 over the keys it may see
  queries: list[str]  # T row labels
  keys: list[str]  # S column labels
  query_axis: str = 'query'
  key_axis: str = 'key'

  @property
  def layer(self) -> str:
    """The module path without its last part: 'decoder/layer_1'."""
    return self.name.rsplit('/', 1)[0] if '/' in self.name else self.name

  @property
  def kind(self) -> str:
    """The stack and attention type without the layer: 'decoder/cross_attention'."""
    return '/'.join(p for p in self.name.split('/') if not _LAYER.fullmatch(p))


_LAYER = re.compile(r'layer_(\d+)')
_STACK_ORDER = {'encoder': 0, 'decoder': 1}
_ATTENTION_ORDER = {'self_attention': 0, 'cross_attention': 1}


def _module_order(name: str):
  """Encoder before decoder, layer 2 before layer 10, self- before cross-attention."""
  key = []
  for part in name.split('/'):
    layer = _LAYER.fullmatch(part)
    if layer:
      key.append((1, int(layer.group(1)), ''))
    else:
      key.append((0, _STACK_ORDER.get(part, _ATTENTION_ORDER.get(part, 2)), part))
  return key


@functools.partial(jax.jit, static_argnames=('model', 'method'))
def _sown_weights(model: nn.Module, params, args, method: str | None):
  _, state = model.apply({'params': params}, *args, method=method, mutable=['intermediates'])
  return state['intermediates']


def collect_attention(model: nn.Module, params, *args,
                      method: str | None = None) -> dict[str, np.ndarray]:
  """{module path: float32 [B, H, T, S]} from one deterministic forward pass, in model order.

  `args` are the model's (or `method`'s, named by a string) positional inputs. The pass is
  jit-compiled (once per model, method and input shapes) and replicated, not split over a
  mesh: it is a handful of rows.
  """
  with nn.logical_axis_rules(()):
    sown = _sown_weights(model, params, tuple(args), method)
  if jax.process_count() > 1:  # the output may be split over hosts: gather it everywhere
    from jax.experimental import multihost_utils
    sown = multihost_utils.process_allgather(sown, tiled=True)
  sown = jax.device_get(sown)
  found = {}
  for path, values in jax.tree_util.tree_flatten_with_path(
      sown, is_leaf=lambda x: isinstance(x, tuple))[0]:
    names = [getattr(p, 'key', str(p)) for p in path]
    if not names or names[-1] != WEIGHTS_NAME:
      continue
    modules = names[:-1]
    for i, value in enumerate(values):  # a module called twice sows twice
      value = np.asarray(value, np.float32)
      suffix = '' if len(values) == 1 else f'#{i}'
      if 'layers' in modules and value.ndim == 5:  # nn.scan stacked the layers: [L, B, H, T, S]
        at = modules.index('layers')
        for layer, per_layer in enumerate(value):
          renamed = modules[:at] + [f'layer_{layer}'] + modules[at + 1:]
          found['/'.join(renamed) + suffix] = per_layer
      else:
        found['/'.join(modules) + suffix] = value
  if not found:
    raise ValueError(f'{type(model).__name__} sowed no {WEIGHTS_NAME!r}: does it use '
                     'transformer_jax.layers.attention.MultiHeadAttention?')
  return {name: found[name] for name in sorted(found, key=_module_order)}


# ---------------------------------------------------------------------------------------------
# Token labels


def _visible(text: str) -> str:
  """A label that shows whitespace instead of being blank."""
  return (text.replace('\n', '\\n').replace('\t', '\\t').replace(' ', '␣') or '∅')


class TokenLabeler:
  """Readable labels for token ids: SentencePiece pieces ('▁' starts a word), WordPiece tokens
  or characters."""

  def __init__(self, tokenizer):
    self.tokenizer = tokenizer
    self._pieces = None
    proto = getattr(tokenizer, 'serialized_proto', None)
    if proto is not None:
      import sentencepiece as spm
      processor = spm.SentencePieceProcessor()
      processor.LoadFromSerializedProto(proto)
      self._pieces = [processor.id_to_piece(i) for i in range(processor.get_piece_size())]

  def __call__(self, ids: Sequence[int]) -> list[str]:
    ids = [int(i) for i in ids]
    if hasattr(self.tokenizer, 'id_to_token'):  # WordPiece: '##' continues a word
      return [self.tokenizer.id_to_token(i) for i in ids]
    if self._pieces is None:  # a character vocabulary: no special ids
      chars = getattr(self.tokenizer, 'chars', None)
      return [
          _visible(chars[i] if chars and 0 <= i < len(chars) else self.tokenizer.decode([i]))
          for i in ids
      ]
    special = {PAD_ID: '<pad>', EOS_ID: '</s>', BOS_ID: '<s>', UNK_ID: '<unk>'}
    return [special.get(i) or (self._pieces[i] if i < len(self._pieces) else '<unk>') for i in ids]


def _crop(weights: np.ndarray, rows: int, cols: int) -> np.ndarray:
  return weights[:, :rows, :cols]


# ---------------------------------------------------------------------------------------------
# Model runs with labelled axes


def translation_attention(model, params, src_tokenizer, tgt_tokenizer, source: str, target: str,
                          max_len: int | None = None) -> list[AttentionMap]:
  """Encoder self-, decoder self- and cross-attention of an `EncoderDecoder` for one pair.

  The target is teacher-forced (as in training): decoder position i reads the previous target
  token ('<s>' first) and predicts target token i, so decoder rows are labelled with the token
  they predict and decoder self-attention columns with the token each position reads.
  """
  max_len = max_len or model.cfg.max_len
  src = src_tokenizer.encode(source)[:max_len - 1] + [EOS_ID]
  tgt = tgt_tokenizer.encode(target)[:max_len - 1] + [EOS_ID]
  src_labels, tgt_labels = TokenLabeler(src_tokenizer)(src), TokenLabeler(tgt_tokenizer)(tgt)
  read_labels = ['<s>'] + tgt_labels[:-1]
  raw = collect_attention(model, params, jnp.asarray([src], jnp.int32), jnp.asarray([tgt],
                                                                                    jnp.int32))
  maps = []
  for name, weights in raw.items():
    if name.startswith('encoder'):
      rows, cols, axes = src_labels, src_labels, ('source token', 'source token')
    elif 'cross_attention' in name:
      rows, cols, axes = tgt_labels, src_labels, ('predicting target token', 'source token')
    else:
      rows, cols, axes = tgt_labels, read_labels, ('predicting target token', 'target token read')
    maps.append(AttentionMap(name, _crop(weights[0], len(rows), len(cols)), rows, cols, *axes))
  return maps


def lm_attention(model, params, tokenizer, text: str, *,
                 ids: Sequence[int] | None = None) -> list[AttentionMap]:
  """Causal self-attention of a `GPT` reading `text` (or the given token `ids`)."""
  if ids is None:
    from transformer_jax.data import lm as lm_data
    ids = lm_data.prompt_ids(tokenizer, text)  # what generation feeds: EOS first for subwords
  ids = list(ids)
  if len(ids) > model.cfg.max_len:
    raise DataError(f'the text is {len(ids)} tokens but the model reads at most '
                    f'{model.cfg.max_len}; shorten it')
  labels = TokenLabeler(tokenizer)(ids)
  raw = collect_attention(model, params, jnp.asarray([ids], jnp.int32))
  return [
      AttentionMap(name, w[0], labels, labels, 'query token', 'key token')
      for name, w in raw.items()
  ]


def encoder_attention(model, params, tokenizer, ids: Sequence[int], *args,
                      method: str | None = None) -> list[AttentionMap]:
  """Bidirectional self-attention of an encoder-only model (e.g. BERT) over token `ids`.

  `args` are the model's further inputs after the token ids (e.g. segment ids).
  """
  labels = TokenLabeler(tokenizer)(ids)
  raw = collect_attention(model, params, jnp.asarray([list(ids)], jnp.int32), *args, method=method)
  return [
      AttentionMap(name, w[0], labels, labels, 'query token', 'key token')
      for name, w in raw.items()
  ]


# ---------------------------------------------------------------------------------------------
# Drawing


def _new_figure(width: float, height: float):
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure
  figure = Figure(figsize=(width, height), dpi=DPI, layout='constrained')
  FigureCanvasAgg(figure)
  return figure


def save_png(figure, path: str, dpi: int = DPI) -> str:
  """Writes `figure` as a PNG of exactly figsize x dpi pixels (atomically)."""
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  tmp = path + '.tmp.png'
  figure.savefig(tmp, dpi=dpi, format='png')
  os.replace(tmp, path)
  return path


def figure_to_array(figure, dpi: int = DPI) -> np.ndarray:
  """uint8 [height, width, 3] (RGB, HWC), e.g. for TensorBoard's add_image."""
  figure.set_dpi(dpi)
  figure.canvas.draw()
  return np.asarray(figure.canvas.buffer_rgba())[..., :3].copy()


def png_size(path: str) -> tuple[int, int]:
  """(width, height) in pixels, read from the PNG header."""
  with open(path, 'rb') as f:
    header = f.read(24)
  if header[:8] != b'\x89PNG\r\n\x1a\n':
    raise ValueError(f'{path} is not a PNG')
  return int.from_bytes(header[16:20], 'big'), int.from_bytes(header[20:24], 'big')


def _cell(count: int) -> float:
  return min(_CELL_INCHES, _MAX_MAP_INCHES / max(count, 1))


def heatmap_figsize(rows: int, cols: int) -> tuple[float, float]:
  """Inches of a single-head heat map of rows x cols tokens (room for labels and colorbar)."""
  cell = min(_cell(rows), _cell(cols))
  return round(2.6 + cols * cell, 2), round(2.3 + rows * cell, 2)


def _tick_step(count: int, room_inches: float) -> int:
  """Label every k-th token so labels (~0.11 in of height each) never overlap."""
  return max(1, math.ceil(count * 0.11 / max(room_inches, 1e-3)))


def _draw_map(ax, weights: np.ndarray, queries, keys, *, fontsize: float, room: tuple[float, float],
              row_labels: bool = True, col_labels: bool = True):
  """One [T, S] panel, scaled to its own maximum (a diffuse head stays visible)."""
  image = ax.imshow(weights, cmap='viridis', vmin=0.0, vmax=max(float(weights.max()), 1e-6),
                    aspect='auto', interpolation='nearest')
  for axis, labels, show, inches, setter in (('y', queries, row_labels, room[1], ax.set_yticks),
                                             ('x', keys, col_labels, room[0], ax.set_xticks)):
    if show:
      step = _tick_step(len(labels), inches)
      positions = list(range(0, len(labels), step))
      setter(positions, [labels[i] for i in positions], fontsize=fontsize,
             **({'rotation': 90} if axis == 'x' else {}))
    else:
      setter([])
  ax.tick_params(length=0)
  return image


def plot_attention(amap: AttentionMap, head: int, title: str | None = None):
  """A labelled heat map of one head: rows are queries, columns the keys they attend to."""
  weights = amap.weights[head]
  width, height = heatmap_figsize(*weights.shape)
  figure = _new_figure(width, height)
  ax = figure.add_subplot()
  cell = min(_cell(weights.shape[0]), _cell(weights.shape[1]))
  image = _draw_map(ax, weights, amap.queries, amap.keys, fontsize=7,
                    room=(weights.shape[1] * cell, weights.shape[0] * cell))
  ax.set_ylabel(amap.query_axis, fontsize=8)
  ax.set_xlabel(amap.key_axis, fontsize=8)
  ax.set_title(title or f'{amap.name} head {head}', fontsize=9)
  figure.colorbar(image, ax=ax, shrink=0.8).ax.tick_params(labelsize=7)
  return figure


def plot_grid(maps: Sequence[AttentionMap], title: str, *, labels: bool = True,
              panel_inches: float = _GRID_PANEL_INCHES, rows_by: str = 'auto'):
  """Rows = attention modules (e.g. one layer's self and cross, or every layer), columns = heads.

  Each panel is scaled to its own maximum; token labels are drawn while they fit. Rows are
  named by their layer (`rows_by='layer'`), their attention type ('module'), or ('auto') by
  whichever tells them apart.
  """
  heads = max(m.weights.shape[0] for m in maps)
  longest = max(max(m.weights.shape[1:]) for m in maps)
  show = labels and longest <= 48
  margin = 0.9 if show else 0.35
  width = round(0.6 + heads * (panel_inches + (margin if show else 0.1)), 2)
  height = round(0.5 + len(maps) * (panel_inches + margin), 2)
  figure = _new_figure(width, height)
  figure.suptitle(title, fontsize=10)
  axes = figure.subplots(len(maps), heads, squeeze=False)
  # Name each row by what tells the rows apart: the layer, or the attention type within one.
  if rows_by == 'layer' or (rows_by == 'auto' and len({m.layer for m in maps}) > 1):
    row_names = [m.layer.rsplit('/', 1)[-1] for m in maps]
  else:
    row_names = [m.name.rsplit('/', 1)[-1] for m in maps]
  for r, amap in enumerate(maps):
    for h in range(heads):
      ax = axes[r, h]
      if h >= amap.weights.shape[0]:
        ax.set_axis_off()
        continue
      _draw_map(ax, amap.weights[h], amap.queries, amap.keys, fontsize=5,
                room=(panel_inches, panel_inches), row_labels=show and h == 0, col_labels=show)
      ax.set_title(f'{row_names[r]} · head {h}' if h == 0 else f'head {h}', fontsize=7)
  return figure


def group_by_layer(maps: Sequence[AttentionMap]) -> dict[str, list[AttentionMap]]:
  """{'encoder/layer_0': [self], 'decoder/layer_0': [self, cross], ...}, in model order."""
  groups = collections.OrderedDict()
  for amap in maps:
    groups.setdefault(amap.layer, []).append(amap)
  return groups


def group_by_kind(maps: Sequence[AttentionMap]) -> dict[str, list[AttentionMap]]:
  """{'encoder/self_attention': [layer 0, layer 1, ...], ...}: one overview per stack and type."""
  groups = collections.OrderedDict()
  for amap in maps:
    groups.setdefault(amap.kind, []).append(amap)
  return groups


def overview_images(maps: Sequence[AttentionMap],
                    prefix: str = 'attention') -> dict[str, np.ndarray]:
  """{tag: uint8 HWC image}: one layers x heads grid per stack and attention type, for
  TensorBoard (`add_image(tag, image, step, dataformats='HWC')`)."""
  images = {}
  for kind, group in group_by_kind(maps).items():
    figure = plot_grid(group, f'{kind} (rows: layers, columns: heads)', panel_inches=1.8,
                       rows_by='layer')
    images[f'{prefix}/{kind}'] = figure_to_array(figure)
  return images


def _filename(name: str, suffix: str) -> str:
  return re.sub(r'[^A-Za-z0-9_.-]+', '_', name) + suffix + '.png'


def write_attention_report(out_dir: str, maps: Sequence[AttentionMap], *, title: str,
                           description: str = '', extra: Sequence[tuple[str, str]] = (),
                           dpi: int = DPI) -> str:
  """Per-head heat maps, a grid per layer and `index.html` showing them all; returns its path.

  `extra` are (caption, file name in out_dir) of other pictures to show first (curves,
  position encodings).
  """
  os.makedirs(out_dir, exist_ok=True)
  sections = []
  for layer, group in group_by_layer(maps).items():
    grid = _filename(layer, '_grid')
    save_png(plot_grid(group, f'{layer}: every head'), os.path.join(out_dir, grid), dpi)
    heads = []
    for amap in group:
      for h in range(amap.weights.shape[0]):
        name = _filename(amap.name, f'_head{h}')
        save_png(plot_attention(amap, h), os.path.join(out_dir, name), dpi)
        heads.append((f'{amap.name} head {h}', name))
    sections.append((layer, grid, heads))
  page = [
      '<!doctype html>', '<html><head><meta charset="utf-8">',
      f'<title>{html.escape(title)}</title>',
      '<style>body{font-family:sans-serif;margin:1.5em} img{max-width:100%;border:1px solid #ddd}'
      ' figure{display:inline-block;margin:0.4em;vertical-align:top}'
      ' figcaption{font-size:0.8em;color:#444}</style>', '</head><body>',
      f'<h1>{html.escape(title)}</h1>'
  ]
  if description:
    page.append('<p>' + '<br>'.join(html.escape(line) for line in description.splitlines()) +
                '</p>')
  for caption, name in extra:
    page.append(f'<figure><img src="{html.escape(name)}" alt="{html.escape(caption)}">'
                f'<figcaption>{html.escape(caption)}</figcaption></figure><br>')
  if sections:
    links = ', '.join(
        f'<a href="#{html.escape(layer)}">{html.escape(layer)}</a>' for layer, _, _ in sections)
    page.append('<p>Rows are queries, columns the keys they attend to; each row sums to 1. '
                f'Each picture is scaled to its own maximum. Layers: {links}.</p>')
  for layer, grid, heads in sections:
    page.append(f'<h2 id="{html.escape(layer)}">{html.escape(layer)}</h2>')
    page.append(f'<figure><img src="{grid}" alt="{html.escape(layer)} grid">'
                f'<figcaption>{html.escape(layer)}: every head</figcaption></figure><br>')
    for caption, name in heads:
      page.append(f'<figure><img src="{name}" alt="{html.escape(caption)}">'
                  f'<figcaption>{html.escape(caption)}</figcaption></figure>')
  page.append('</body></html>')
  path = os.path.join(out_dir, 'index.html')
  write_atomically(path, '\n'.join(page) + '\n')
  return path


# ---------------------------------------------------------------------------------------------
# Position encodings and training curves


def plot_positions(length: int = 100, width: int = 128, base: float = 10000.0):
  """The sinusoidal encoding matrix, a few of its dimensions as waves, and the dot product of
  every pair of positions (high near the diagonal: nearby positions look alike)."""
  from transformer_jax.layers.position import sinusoidal_table
  table = sinusoidal_table(length, width, base)
  figure = _new_figure(16.0, 4.8)
  left, middle, right = figure.subplots(1, 3, width_ratios=[1.25, 1.0, 1.0])
  image = left.imshow(table, cmap='RdBu_r', vmin=-1, vmax=1, aspect='auto', interpolation='nearest')
  left.set_xlabel('encoding dimension (even: sin, odd: cos)')
  left.set_ylabel('position')
  left.set_title(f'sinusoidal position encoding ({length} positions x {width} dims)')
  figure.colorbar(image, ax=left, shrink=0.85)
  dims = sorted({d - d % 2 for d in (0, width // 8, width // 4, width // 2) if d < width})
  for d in dims:
    period = 2 * math.pi * base**(d / width)
    middle.plot(np.arange(length), table[:, d], label=f'dim {d} (period {period:,.0f})')
  middle.set_xlabel('position')
  middle.set_ylabel('value')
  middle.set_title('each dimension pair is a clock of its own frequency')
  middle.legend(fontsize=7, loc='lower left')
  similarity = table @ table.T
  image = right.imshow(similarity, cmap='viridis', aspect='auto', interpolation='nearest')
  right.set_xlabel('position')
  right.set_ylabel('position')
  right.set_title('dot product of position encodings')
  figure.colorbar(image, ax=right, shrink=0.85)
  return figure


def read_metrics(path: str) -> dict[str, tuple[np.ndarray, np.ndarray]]:
  """{metric: (steps, values)} from a workdir's metrics.jsonl (a resumed run's rewritten steps
  keep their last value)."""
  series: dict[str, dict[int, float]] = collections.defaultdict(dict)
  with open(path, encoding='utf-8') as f:
    for number, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        record = json.loads(line)
      except json.JSONDecodeError:
        raise DataError(f'{path}:{number}: not a JSON line') from None
      step = record.get('step')
      for key, value in record.items():
        if key != 'step' and isinstance(value, (int, float)) and step is not None:
          series[key][int(step)] = float(value)
  return {
      k: (np.asarray(sorted(v)), np.asarray([v[s] for s in sorted(v)])) for k, v in series.items()
  }


def plot_curves(metrics: dict[str, tuple[np.ndarray, np.ndarray]], title: str = ''):
  """Loss (train and eval), BLEU (or else accuracy) and the learning rate, against the step."""
  panels = [('loss (nats per token)', ['train/loss', 'eval/loss'], True)]
  if 'eval/bleu' in metrics:
    panels.append(('BLEU', ['eval/bleu'], False))
  elif 'eval/accuracy' in metrics:
    panels.append(('accuracy', ['train/accuracy', 'eval/accuracy'], False))
  if 'train/learning_rate' in metrics:
    panels.append(('learning rate', ['train/learning_rate'], False))
  panels = [p for p in panels if any(k in metrics for k in p[1])]
  if not panels:
    raise DataError('metrics.jsonl has no train/loss, eval/loss or eval metrics to plot')
  figure = _new_figure(5.0 * len(panels), 3.8)
  if title:
    figure.suptitle(title, fontsize=10)
  axes = figure.subplots(1, len(panels), squeeze=False)[0]
  for ax, (label, keys, log_scale) in zip(axes, panels):
    for key in keys:
      if key in metrics:
        steps, values = metrics[key]
        ax.plot(steps, values, marker='o' if len(steps) < 30 else None, markersize=3, label=key)
    values = np.concatenate([metrics[k][1] for k in keys if k in metrics])
    if log_scale and np.all(values > 0) and values.max() > 20 * values.min():
      from matplotlib import ticker
      ax.set_yscale('log')
      ax.yaxis.set_major_locator(ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
      ax.yaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f'{v:g}'))
      ax.yaxis.set_minor_formatter(ticker.NullFormatter())
    ax.set_xlabel('step')
    ax.set_title(label, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
  return figure
