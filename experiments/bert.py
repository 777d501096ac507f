r"""Pretrain BERT (masked LM + NSP/SOP), fine-tune one on sentence (pair) classification, and use
what was trained.

  # MLM + NSP pretraining of a small BERT on local text (WordPiece trained on it)
  python -m experiments.bert --config=experiments/configs/bert_pretrain_small.py --workdir=/tmp/bp
  # fine-tune the imported MiniLM-L6 checkpoint on SST-2
  python -m experiments.bert --config=experiments/configs/sst2_minilm.py --workdir=/tmp/sst2 \
      --config.data.dir=../shared/data/sst2
  # fine-tune our own pretrained workdir instead
  python -m experiments.bert --config=experiments/configs/sst2_minilm.py --workdir=/tmp/ft \
      --config.init.hf_dir= --config.init.bert_workdir=/tmp/bp
  # sentence pairs (GLUE RTE from TSVs; MRPC, MNLI or TFDS glue/* in glue_pairs.py)
  python -m experiments.bert --config=experiments/configs/glue_pairs.py --workdir=/tmp/rte \
      --config.data.dir=../shared/data/rte

  # classify sentences (one per line; a pair model reads 'first<TAB>second'), stdin or a file
  echo "a gripping, beautiful film" | python -m experiments.bert --mode=predict --workdir=/tmp/sst2
  python -m experiments.bert --mode=predict --workdir=/tmp/sst2 --input=s.txt --format=jsonl
  # accuracy (F1, Matthews correlation for two classes) on a labelled TSV; predictions are
  # written to WORKDIR/predictions.tsv, the scores printed as one JSON line
  python -m experiments.bert --mode=evaluate --workdir=/tmp/sst2 --input=../shared/data/sst2/dev.tsv
  python -m experiments.bert --mode=evaluate --workdir=/tmp/sst2 \
      --config=experiments/configs/sst2_minilm.py --config.data.test=../shared/data/sst2/dev.tsv
  # the top-k tokens for each [MASK], from a pretraining workdir or an HF encoder folder
  echo "the cat sat on the [MASK]." | python -m experiments.bert --mode=fill_mask --workdir=/tmp/bp
  echo "paris is the [MASK] of france." | python -m experiments.bert --mode=fill_mask \
      --hf_dir=/path/to/bert-base-uncased --top_k=5

Training modes come from the config (config.mode) unless --mode overrides it; rerunning the same
command resumes from the latest checkpoint in the workdir. predict, evaluate and fill_mask read
the workdir's saved config, tokenizer and latest checkpoint; --config is optional there (only
its data.test is read, by evaluate).
"""

from transformer_jax.cli import process

if __name__ == '__main__':
  process.setup_allocator()

import json
import sys

from absl import app, flags, logging
from ml_collections import config_flags

from transformer_jax.cli import entrypoint
from transformer_jax.cli.workdir import prepare_workdir
from transformer_jax.convert import families
from transformer_jax.errors import ConfigError
from transformer_jax.files import write_atomically
from transformer_jax.workflows import bert
from transformer_jax.workflows import bert_sections
from transformer_jax.workflows import bert_use
from transformer_jax.workflows import token_classification

_CONFIG = config_flags.DEFINE_config_file('config', None, 'Experiment config file (Python).',
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string('workdir', None, 'Directory for checkpoints, vocabulary, logs.')
_MODE = flags.DEFINE_enum('mode', None, list(bert.MODES), 'Overrides config.mode.')
_INPUT = flags.DEFINE_string(
    'input', '-', 'predict/fill_mask: text file, one input per line (- for stdin); evaluate: the '
    'labelled TSV when --config.data.test is not given.')
_OUTPUT = flags.DEFINE_string('output', '-', 'predict/fill_mask: output file, - for stdout.')
_FORMAT = flags.DEFINE_enum('format', 'text', ['text', 'jsonl'],
                            'predict/fill_mask output: text, or JSON lines with every score.')
_HF_DIR = flags.DEFINE_string(
    'hf_dir', '', 'fill_mask: a Hugging Face masked-LM folder (model_type '
    f'{" / ".join(families.names(families.ENCODER))}) instead of a workdir.')
_TOP_K = flags.DEFINE_integer('top_k', 5, 'fill_mask: tokens listed per [MASK].')
_BATCH = flags.DEFINE_integer('batch_size', 32, 'predict/evaluate/fill_mask: rows per batch.')


def _read_lines() -> list[str]:
  if _INPUT.value == '-':
    return [line.rstrip('\n') for line in sys.stdin]
  from transformer_jax.errors import DataError
  try:
    with open(_INPUT.value, encoding='utf-8') as f:
      return [line.rstrip('\n') for line in f]
  except OSError as e:
    raise DataError(f'cannot read --input={_INPUT.value} ({e.strerror})') from None


def _write(lines: list[str]) -> None:
  """All lines at once (to stdout, or atomically to --output) after every input succeeded."""
  text = ''.join(line + '\n' for line in lines)
  if _OUTPUT.value == '-':
    sys.stdout.write(text)
    sys.stdout.flush()
  else:
    write_atomically(_OUTPUT.value, text)


def predict(workdir: str) -> None:
  saved, task, params, tokenizer = bert_use.restore_classifier(workdir)
  names = saved.data.class_names()
  lines = _read_lines()
  texts = bert_use.parse_lines(lines, bert.is_pair_task(saved))
  probs = bert_use.classify(task, params, tokenizer, texts, batch_size=_BATCH.value)
  out = []
  for p in probs:
    best = int(p.argmax())
    if _FORMAT.value == 'jsonl':
      out.append(
          json.dumps({
              'label': names[best], 'probability': float(p[best]),
              'probabilities': {n: float(x) for n, x in zip(names, p)}
          }))
    else:
      out.append(f'{names[best]}\t{p[best]:.4f}')
  _write(out)


def fill_mask(workdir: str) -> None:
  if _TOP_K.value < 1:
    raise ConfigError(f'--top_k must be at least 1, got {_TOP_K.value}')
  model, params, tokenizer = bert_use.restore_mlm(workdir, _HF_DIR.value)
  lines = _read_lines()
  results = bert_use.fill_mask(model, params, tokenizer, lines, top_k=_TOP_K.value,
                               batch_size=_BATCH.value)
  token = getattr(tokenizer, 'id_to_token', None) or (lambda i: tokenizer.decode([i]))
  # Ids are printed in the tokenizer files' own numbering (RoBERTa's differs from the model's:
  # data/roberta_tokenizer.py), the ids transformers gives for the same folder.
  to_hf = getattr(tokenizer, 'to_hf', None) or (lambda ids: ids)
  out = []
  for line, masks in zip(lines, results):
    if _FORMAT.value == 'jsonl':
      out.append(
          json.dumps({
              'text':
                  line, 'masks': [[{'token': token(i), 'id': int(to_hf([i])[0]), 'probability': p}
                                   for i, p in mask]
                                  for mask in masks]
          }))
    else:
      out.append(' | '.join(' '.join(f'{token(i)}:{p:.4f}' for i, p in mask) for mask in masks))
  _write(out)


def _evaluation_file() -> str:
  """--mode=evaluate's labelled TSV: a fine-tuning --config's data.test, else --input."""
  config = _CONFIG.value
  if config is not None and bert_sections.mode_of(config) != 'pretrain':
    test = bert_sections.FineTuning.of(config).data.test
    if test:
      return test
  return '' if _INPUT.value == '-' else _INPUT.value


def train(config, workdir: str, mode: str) -> dict:
  """Pretraining or sentence-classification fine-tuning (workflows/bert.py), or for a tagging
  config (data.task='token_classification') fine-tuning one label per word
  (workflows/token_classification.py, which builds on workflows/bert.py: the choice is made
  here, above both)."""
  if bert.train_mode(config, mode) == 'pretrain':
    return bert.pretrain(config, workdir)
  run = bert_sections.FineTuning.of(config)  # read once; data.task picks the workflow
  if run.tagging:
    return token_classification.finetune(run, workdir)
  return bert.finetune(run, workdir)


def main(argv):
  if len(argv) > 1:
    raise ConfigError(f'unexpected arguments {argv[1:]}; options are --flag=value')
  logging.info('allocator: %s', process.allocator_description())
  mode = _MODE.value or (bert_sections.mode_of(_CONFIG.value) or ''
                         if _CONFIG.value is not None else '')
  if _BATCH.value < 1:
    raise ConfigError(f'--batch_size must be at least 1, got {_BATCH.value}')
  if mode == 'fill_mask' and _HF_DIR.value:
    if _WORKDIR.value:
      raise ConfigError('fill_mask reads one model: --workdir or --hf_dir, not both')
    fill_mask('')
    return
  if mode in ('predict', 'evaluate', 'fill_mask'):
    if not _WORKDIR.value:
      raise ConfigError(f'--mode={mode} needs --workdir=DIR (a trained workdir)')
    workdir = _WORKDIR.value
    if mode == 'predict':
      predict(workdir)
    elif mode == 'fill_mask':
      fill_mask(workdir)
    else:
      results = bert_use.evaluate_file(workdir, _evaluation_file(), batch_size=_BATCH.value)
      print(json.dumps(results), flush=True)
    return
  if _CONFIG.value is None:
    raise ConfigError('--config is required, e.g. --config=experiments/configs/sst2_minilm.py')
  workdir = prepare_workdir(_WORKDIR.value)
  results = train(_CONFIG.value, workdir, mode)
  logging.info('done: %s',
               {k: round(v, 4) if isinstance(v, float) else v for k, v in results.items()})


if __name__ == '__main__':
  app.run(lambda argv: entrypoint.run(main, argv), flags_parser=entrypoint.parse_flags)
