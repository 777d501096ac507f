r"""Pictures of a trained model: attention heat maps, position encodings, training curves.

  # every layer and head of a translation model (the target is the model's own translation
  # unless --target is given), written with index.html to WORKDIR/pictures:
  python -m experiments.visualize --workdir=/tmp/qs --text="she bought forty-two flowers"
  python -m experiments.visualize --workdir=/tmp/qs --text="she bought five flowers" \
      --target="sie kaufte fünf blumen" --out=/tmp/pictures
  # a GPT reading a text:
  python -m experiments.visualize --workdir=/tmp/sc --text="ROMEO: But soft, what light"
  # loss, BLEU/accuracy and learning rate from the workdir's metrics.jsonl:
  python -m experiments.visualize --workdir=/tmp/qs --curves
  # the sinusoidal position encoding and the similarity of positions (no model needed):
  python -m experiments.visualize --positions --length=100 --width=128 --out=/tmp/pictures

Open OUT/index.html in a browser. Weights are the model's own (sown by its attention layers).
"""

import os
import sys

from absl import app, flags, logging

from transformer_jax.cli import entrypoint
from transformer_jax.cli.workdir import load_saved_config
from transformer_jax.errors import ConfigError

_WORKDIR = flags.DEFINE_string(
    'workdir', None, 'A workdir trained by experiments.translate, '
    'experiments.lm or experiments.bert.')
_TEXT = flags.DEFINE_string('text', None, 'Source sentence (translation) or text (GPT, BERT).')
_TARGET = flags.DEFINE_string(
    'target', None, 'Translation only: the target sentence to '
    'teacher-force; default: the model\'s own translation.')
_OUT = flags.DEFINE_string('out', None, 'Output directory; default WORKDIR/pictures.')
_POSITIONS = flags.DEFINE_bool('positions', False, 'Draw the sinusoidal position encoding.')
_LENGTH = flags.DEFINE_integer('length', 100, '--positions: number of positions.')
_WIDTH = flags.DEFINE_integer('width', 128, '--positions: encoding width (even).')
_CURVES = flags.DEFINE_bool('curves', False, 'Plot WORKDIR/metrics.jsonl.')
_TITLE = flags.DEFINE_string(
    'title', None, 'Title of the curves and the index page; default: '
    'the workdir\'s name.')


def bert_attention(config, workdir: str, text: str):
  """A BERT workdir (pretrained or fine-tuned) reading [CLS] text [SEP]."""
  from transformer_jax.models.bert import Bert
  from transformer_jax.visualize import attention_maps
  from transformer_jax.workflows import bert
  if config.mode == 'pretrain':
    cfg, params, tokenizer = bert.restore_pretrained(workdir)
  else:  # fine-tuned: the pretrained model's config and tokenizer, this workdir's params
    from transformer_jax.tasks.bert import BertClassificationTask
    from transformer_jax.training import trained_model
    cfg, _, tokenizer, type_vocab_size = bert.load_init(config)
    from transformer_jax.workflows.bert_sections import FineTuning
    num_labels = FineTuning.of(config).data.num_labels
    task = BertClassificationTask(cfg, num_labels, type_vocab_size=type_vocab_size)
    params = trained_model.restore(config, task, workdir).params
  ids, segments = tokenizer.encode_pair(text, None, cfg.max_len)
  model = Bert(cfg, type_vocab_size=params['segment_embedding'].shape[0], mlm=False,
               sentence_classes=0)
  import jax.numpy as jnp
  maps = attention_maps.encoder_attention(model, params, tokenizer, ids,
                                          jnp.asarray([segments], jnp.int32), method='encode')
  return maps, f'BERT self-attention ({config.mode})', f'text: {text}'


def model_attention(config, workdir: str, text: str, target: str | None):
  """(maps, title, description) for the workdir's model reading `text`."""
  from transformer_jax.visualize import attention_maps
  from transformer_jax.workflows import experiment_kinds
  kind = experiment_kinds.of_config(config).name
  if kind == experiment_kinds.TRANSLATION:
    from transformer_jax.workflows import translation
    model = translation.restore_for_inference(config, workdir)
    task, params = model.task, model.params
    if target is None:
      target = task.translate(params, [text], model.mesh)[0]
      logging.info('model translation: %s', target)
    maps = attention_maps.translation_attention(task.model, params, task.src_tokenizer,
                                                task.tgt_tokenizer, text, target)
    return maps, 'Translation attention', f'source: {text}\ntarget: {target}'
  if target is not None:
    raise ConfigError(f'--target is for translation workdirs, not this {kind} one: pass '
                      'only --text')
  if kind == experiment_kinds.LM:
    from transformer_jax.workflows import lm
    model = lm.restore_for_inference(config, workdir)
    return (attention_maps.lm_attention(model.task.model, model.params, model.tokenizer,
                                        text), 'GPT self-attention', f'text: {text}')
  return bert_attention(config, workdir, text)


def main(argv):
  if len(argv) > 1:
    raise ConfigError(f'unexpected arguments {argv[1:]}; options are --flag=value')
  workdir = None
  if _WORKDIR.value:
    workdir = os.path.abspath(os.path.expanduser(_WORKDIR.value))
    if not os.path.isdir(workdir):
      raise ConfigError(f'--workdir {workdir} does not exist: train a model there first')
  wants_model = _TEXT.value is not None or _TARGET.value is not None
  if not (wants_model or _CURVES.value or _POSITIONS.value):
    raise ConfigError('nothing to draw: pass --workdir=DIR --text="..." (attention), '
                      '--workdir=DIR --curves (training curves) or --positions')
  if (wants_model or _CURVES.value) and workdir is None:
    raise ConfigError('--workdir is required for --text and --curves')
  if _TARGET.value is not None and _TEXT.value is None:
    raise ConfigError('--target needs --text (the source sentence)')
  if wants_model and not _TEXT.value.strip():
    raise ConfigError('--text is empty')
  if _POSITIONS.value and (_LENGTH.value < 1 or _WIDTH.value < 2 or _WIDTH.value % 2):
    raise ConfigError('--positions needs --length >= 1 and an even --width >= 2')
  if _OUT.value:
    out = os.path.abspath(os.path.expanduser(_OUT.value))
  elif workdir:
    out = os.path.join(workdir, 'pictures')
  else:
    raise ConfigError('--out=DIR is required without --workdir')
  config = load_saved_config(workdir) if wants_model else None
  # jax and matplotlib: only once the flags are good
  from transformer_jax.visualize import canvas, curves, heatmaps, positions
  try:
    os.makedirs(out, exist_ok=True)
  except OSError as error:
    raise ConfigError(f'cannot create --out {out}: {error.strerror}') from None

  extra = []
  if _POSITIONS.value:
    canvas.save_png(positions.plot_positions(_LENGTH.value, _WIDTH.value),
                    os.path.join(out, 'positions.png'))
    extra.append((f'sinusoidal position encoding, {_LENGTH.value} positions x {_WIDTH.value} '
                  'dimensions', 'positions.png'))
  if _CURVES.value:
    path = os.path.join(workdir, 'metrics.jsonl')
    if not os.path.exists(path):
      raise ConfigError(f'{path} does not exist: train a model in {workdir} first')
    figure = curves.plot_curves(curves.read_metrics(path), _TITLE.value or
                                os.path.basename(workdir))
    canvas.save_png(figure, os.path.join(out, 'curves.png'))
    extra.append(('training curves', 'curves.png'))
  maps, title, description = [], 'Pictures', ''
  if wants_model:
    maps, title, description = model_attention(config, workdir, _TEXT.value, _TARGET.value)
  if _TITLE.value:
    title = _TITLE.value
  elif workdir:
    title = f'{title}: {os.path.basename(workdir)}'
  index = heatmaps.write_attention_report(out, maps, title=title, description=description,
                                          extra=extra)
  count = len([n for n in os.listdir(out) if n.endswith('.png')])
  sys.stdout.write(f'{count} pictures in {out}; open {index}\n')


if __name__ == '__main__':
  app.run(lambda argv: entrypoint.run(main, argv), flags_parser=entrypoint.parse_flags)
