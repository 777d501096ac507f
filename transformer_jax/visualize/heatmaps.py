"""Attention maps (`attention_maps.AttentionMap`) drawn as heat maps: one head, a grid of heads by
modules, one overview image per stack and attention type for TensorBoard, and a folder of PNGs
with an index.html."""

import html
import math
import os
import re
from typing import Sequence

import numpy as np

from transformer_jax.files import write_atomically
from transformer_jax.visualize.attention_maps import AttentionMap, group_by_kind, group_by_layer
from transformer_jax.visualize.canvas import DPI, figure_to_array, new_figure, save_png

_CELL_INCHES = 0.26  # one token's row/column in a single-head heat map
_MAX_MAP_INCHES = 14.0  # longer sequences get smaller cells (and every k-th label)
_GRID_PANEL_INCHES = 2.4


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
  figure = new_figure(width, height)
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
  figure = new_figure(width, height)
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
