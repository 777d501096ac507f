r"""Train, evaluate and use an encoder-decoder Transformer for translation.

  python -m experiments.translate --config=experiments/configs/translate_quickstart.py \
      --workdir=/tmp/qs
  python -m experiments.translate --config=experiments/configs/multi30k.py \
      --config.data.dir=../shared/data/multi30k --workdir=/tmp/m30k
  # translate new text with a trained workdir (stdin or a file), one sentence per line:
  echo "A dog runs on the beach." | python -m experiments.translate --workdir=/tmp/m30k \
      --mode=translate
  # BLEU on a test set:
  python -m experiments.translate --workdir=/tmp/m30k --mode=evaluate \
      --config.eval.test_prefix=test_2016_flickr

Rerunning the train command resumes from the latest checkpoint in the workdir.
"""

from transformer_jax import runtime

if __name__ == '__main__':
  runtime.setup_allocator()

# pylint: disable=g-import-not-at-top,wrong-import-position
import os
import sys

from absl import app, flags, logging
from ml_collections import config_flags

from transformer_jax import experiment
from transformer_jax.data import batching, text, tokenizer as tok
from transformer_jax.data.numbers import make_numbers_splits
from transformer_jax.errors import ConfigError
from transformer_jax.model_config import model_config_from_dict

_CONFIG = config_flags.DEFINE_config_file('config', None, 'Experiment config file (Python).',
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string('workdir', None, 'Directory for checkpoints, tokenizer, logs.')
_MODE = flags.DEFINE_enum('mode', 'train', ['train', 'evaluate', 'translate'],
                          'train (and evaluate), evaluate a test set, or translate text.')
_INPUT = flags.DEFINE_string('input', '-', 'translate mode: file of sentences, - for stdin.')
_OUTPUT = flags.DEFINE_string('output', '-', 'translate mode: output file, - for stdout.')


# -- data ---------------------------------------------------------------------------------------

def load_split(config, prefix: str) -> tuple[list[str], list[str]]:
  """Source/target sentences of one split, from the configured source."""
  data = config.data
  if data.source == 'numbers':
    splits = make_numbers_splits(seed=config.seed)
    names = {data.train_prefix: 'train', data.valid_prefix: 'valid', 'test': 'test'}
    if prefix not in names:
      raise ConfigError(f'the numbers corpus has splits {sorted(names)}, not {prefix!r}')
    return splits[names[prefix]]
  if data.source == 'files':
    if not data.dir:
      raise ConfigError('data.dir is empty: pass --config.data.dir=DIR holding '
                        f'{prefix}.{data.src_lang}[.gz] and {prefix}.{data.tgt_lang}[.gz]')
    src_path, tgt_path = text.find_parallel_files(data.dir, prefix, data.src_lang, data.tgt_lang)
    return text.read_parallel(src_path, tgt_path, skip_invalid_utf8=data.skip_invalid_utf8)
  if data.source == 'tfds':
    from transformer_jax.data.tfds_text import load_tfds_parallel
    return load_tfds_parallel(data.tfds_name, prefix, data.src_lang, data.tgt_lang,
                              data_dir=data.tfds_data_dir or None)
  raise ConfigError(f"data.source must be 'files', 'tfds' or 'numbers', got {data.source!r}")


def load_tokenizers(config, workdir: str, train_pairs=None):
  """(source, target) SentencePiece tokenizers, trained on the training text on first run."""
  t = config.tokenizer

  def texts(*sides):
    if train_pairs is None:
      raise ConfigError(f'no tokenizer model in {workdir}: train first (--mode=train)')
    return lambda: (s for side in sides for s in train_pairs[side])
  kwargs = dict(vocab_size=t.vocab_size, model_type=t.model_type, max_sentences=t.max_sentences)
  if t.joint:
    shared = tok.load_or_train_tokenizer(os.path.join(workdir, 'spm.model'), texts(0, 1), **kwargs)
    return shared, shared
  return (tok.load_or_train_tokenizer(os.path.join(workdir, 'spm.src.model'), texts(0), **kwargs),
          tok.load_or_train_tokenizer(os.path.join(workdir, 'spm.tgt.model'), texts(1), **kwargs))


# -- composition --------------------------------------------------------------------------------

def build(config, workdir: str, train_pairs=None, valid_pairs=((), ())):
  """Tokenizers, task and trainer for `config` (the model sized to the tokenizers)."""
  from transformer_jax.tasks.translation import TranslationTask
  from transformer_jax.trainer import Trainer
  src_tok, tgt_tok = load_tokenizers(config, workdir, train_pairs)
  model_cfg = model_config_from_dict(
      config.model, vocab_size=tgt_tok.vocab_size, max_len=config.data.max_len,
      source_vocab_size=None if config.tokenizer.joint else src_tok.vocab_size,
      share_embeddings=bool(config.model.share_embeddings and config.tokenizer.joint))
  bleu_n = config.eval.bleu_sentences or len(valid_pairs[0])
  task = TranslationTask(
      model_cfg, label_smoothing=config.loss.label_smoothing, beam_size=config.eval.beam_size,
      alpha=config.eval.alpha, decode_rows=config.eval.decode_rows, src_tokenizer=src_tok,
      tgt_tokenizer=tgt_tok, eval_sources=valid_pairs[0][:bleu_n],
      eval_references=valid_pairs[1][:bleu_n])
  return task, Trainer(config, task, workdir), (src_tok, tgt_tok)


def make_batcher(config, trainer, src_tok, tgt_tok, pairs, *, train: bool):
  import jax
  data = config.data
  src_ids, tgt_ids, _ = batching.encode_pairs(src_tok, tgt_tok, pairs[0], pairs[1], data.max_len,
                                              data.overflow)
  from transformer_jax.sharding import data_parallel_size
  return batching.BucketedBatcher(
      src_ids, tgt_ids, batch_tokens=data.batch_tokens,
      buckets=batching.default_buckets(data.max_len), seed=config.seed, shuffle=train,
      multiple_of=data_parallel_size(trainer.mesh), process_index=jax.process_index(),
      process_count=jax.process_count())


def evaluate_test_set(config, workdir, task, trainer, params) -> dict:
  import sacrebleu
  prefix = config.eval.test_prefix
  sources, references = load_split(config, prefix)
  hypotheses = task.translate(params, sources, trainer.mesh)
  bleu = sacrebleu.corpus_bleu(hypotheses, [references])
  out_path = os.path.join(workdir, f'{prefix}.{config.data.tgt_lang}.hyp')
  with open(out_path + '.tmp', 'w', encoding='utf-8') as f:
    f.write('\n'.join(hypotheses) + '\n')
  os.replace(out_path + '.tmp', out_path)
  logging.info('%s: %s (translations in %s)', prefix, bleu, out_path)
  return {'bleu': bleu.score, 'hypotheses_path': out_path}


# -- modes --------------------------------------------------------------------------------------

def train_and_evaluate(config, workdir: str) -> dict:
  experiment.require_keys(config, 'train', ('num_steps', 'eval_every', 'checkpoint_every',
                                            'log_every'))
  train_pairs = load_split(config, config.data.train_prefix)
  if config.data.max_train_examples:
    train_pairs = tuple(side[:config.data.max_train_examples] for side in train_pairs)
  valid_pairs = load_split(config, config.data.valid_prefix)
  task, trainer, (src_tok, tgt_tok) = build(config, workdir, train_pairs, valid_pairs)
  experiment.save_config(config, workdir)
  train_data = make_batcher(config, trainer, src_tok, tgt_tok, train_pairs, train=True)
  valid_data = make_batcher(config, trainer, src_tok, tgt_tok, valid_pairs, train=False)
  logging.info('train: %d pairs in %d batches/epoch; valid: %d pairs', train_data.num_examples,
               train_data.num_batches_per_epoch, valid_data.num_examples)
  results = trainer.fit(train_data, lambda: iter(valid_data))
  if config.eval.test_prefix and not results.get('interrupted'):
    test = evaluate_test_set(config, workdir, task, trainer, trainer.state.params)
    results[f'test_bleu'] = test['bleu']
  trainer.close()
  return results


def restore_for_inference(config, workdir: str):
  task, trainer, _ = build(config, workdir)
  restored = trainer.checkpointer.restore(trainer.abstract_state)
  if restored is None:
    raise ConfigError(f'no checkpoint in {workdir}/checkpoints: train first')
  logging.info('loaded checkpoint at step %d', restored[2])
  return task, trainer, restored[0].params


def translate_text(config, workdir: str):
  task, trainer, params = restore_for_inference(config, workdir)
  source = sys.stdin if _INPUT.value == '-' else open(_INPUT.value, encoding='utf-8')
  with source:
    lines = [line.rstrip('\n') for line in source]
  outputs = task.translate(params, lines, trainer.mesh)
  if _OUTPUT.value == '-':
    sys.stdout.write(''.join(o + '\n' for o in outputs))
  else:
    with open(_OUTPUT.value, 'w', encoding='utf-8') as f:
      f.write(''.join(o + '\n' for o in outputs))


def main(argv):
  if len(argv) > 1:
    raise ConfigError(f'unexpected arguments {argv[1:]}; options are --flag=value')
  logging.info('allocator: %s', runtime.allocator_description())
  workdir = experiment.prepare_workdir(_WORKDIR.value)
  config = _CONFIG.value
  if config is None:  # inference modes may rely on the workdir's saved config
    if _MODE.value == 'train':
      raise ConfigError('--config is required for training, e.g. '
                        '--config=experiments/configs/translate_quickstart.py')
    config = experiment.load_saved_config(workdir)
  if _MODE.value == 'train':
    results = train_and_evaluate(config, workdir)
    logging.info('done: %s', {k: round(v, 4) if isinstance(v, float) else v
                              for k, v in results.items()})
  elif _MODE.value == 'evaluate':
    if not config.eval.test_prefix:
      raise ConfigError('--mode=evaluate needs --config.eval.test_prefix=PREFIX (e.g. '
                        'test_2016_flickr)')
    task, trainer, params = restore_for_inference(config, workdir)
    evaluate_test_set(config, workdir, task, trainer, params)
  else:
    translate_text(config, workdir)


if __name__ == '__main__':
  app.run(lambda argv: experiment.run(main, argv))
