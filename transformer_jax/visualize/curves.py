"""Training curves from a workdir's metrics.jsonl."""

import collections
import json

import numpy as np

from transformer_jax.errors import DataError
from transformer_jax.visualize.canvas import new_figure


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
  figure = new_figure(5.0 * len(panels), 3.8)
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
      from matplotlib import ticker  # lazy: as canvas.py imports matplotlib (its cost)
      ax.set_yscale('log')
      ax.yaxis.set_major_locator(ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
      ax.yaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f'{v:g}'))
      ax.yaxis.set_minor_formatter(ticker.NullFormatter())
    ax.set_xlabel('step')
    ax.set_title(label, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
  return figure
