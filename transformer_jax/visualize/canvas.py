"""The canvas every picture draws on: matplotlib's object API on the Agg canvas (no pyplot, no
global backend, no display), so it is safe inside a training process. A figure's pixel size is
its size in inches times `dpi` exactly (no tight bounding box), which makes the output
predictable."""

import os

import numpy as np

DPI = 100


def new_figure(width: float, height: float):
  # lazy: matplotlib adds 0.6-0.8 s to start-up (measured); the tasks import this module but
  # draw only when an evaluation asks for pictures
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
