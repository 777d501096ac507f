"""The sinusoidal position encoding as pictures."""

import math

import numpy as np

from transformer_jax.layers.position import sinusoidal_table
from transformer_jax.visualize.canvas import new_figure


def plot_positions(length: int = 100, width: int = 128, base: float = 10000.0):
  """The sinusoidal encoding matrix, a few of its dimensions as waves, and the dot product of
  every pair of positions (high near the diagonal: nearby positions look alike)."""
  table = sinusoidal_table(length, width, base)
  figure = new_figure(16.0, 4.8)
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
