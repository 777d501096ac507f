r"""Multi30k English->German under a wall-clock budget on this machine; prints BLEU.

  python benchmarks/translate_multi30k.py --data_dir=../shared/data/multi30k --budget_minutes=40

Trains experiments/configs/multi30k.py for `budget_minutes` of wall time (compilation and the
periodic checkpoints included), picks the last checkpoint or the average of the last few by
validation BLEU (and, with `--alphas=0.6,1.0`, the length penalty by validation BLEU),
translates test_2016_flickr with beam search and scores it two ways:
  sacrebleu:   detokenised, cased output against the raw references (sacreBLEU's default);
  bleu_lc_tok: output lowercased, punctuation-normalised and Moses-tokenised (sacremoses),
               against the official *.lc.norm.tok.* references with tokenize='none': the
               number published Multi30k results report.
With --lowercase_tokenized the model is trained, validated and tested on those official
lowercased, tokenised files themselves (as published systems are), its output is scored as it
is, and there is no cased sacreBLEU.
Packing (several pairs per row, one batch shape) instead of length buckets: --set=data.pack=True.
Last line: one JSON object, with the padding share of an epoch's batches ('padding_fraction',
the plan of the training batches' first epoch), whether they were packed ('pack') and the peak
resident memory of this process ('peak_rss_gb', training, checkpoints and test decoding).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from transformer_jax.cli import process

if __name__ == '__main__':
  process.setup_allocator()

import gzip
import json
import resource
import tempfile
import time

from absl import app, flags, logging

_DATA_DIR = flags.DEFINE_string('data_dir', '../shared/data/multi30k', 'Multi30k directory.')
_BUDGET = flags.DEFINE_float('budget_minutes', 40.0, 'Wall-clock training budget.')
_WORKDIR = flags.DEFINE_string('workdir', None, 'Work directory (default: a fresh temp dir).')
_SRC = flags.DEFINE_string('src_lang', 'en', 'Source language.')
_TGT = flags.DEFINE_string('tgt_lang', 'de', 'Target language.')
_OVERRIDES = flags.DEFINE_multi_string('set', [], 'Config overrides, e.g. --set=model.emb_dim=128')
_LC_TOK = flags.DEFINE_bool(
    'lowercase_tokenized', False, 'Train, validate and test on the official lowercased, '
    'normalised, Moses-tokenised files (train.lc.norm.tok.*, ...), as published Multi30k results '
    'do; the output is then scored as it is (bleu_lc_tok) and there is no cased sacreBLEU.')
_ALPHAS = flags.DEFINE_list(
    'alphas', [], 'Length penalties to choose from by validation BLEU '
    '(default: only eval.alpha); the test set is decoded with the best.')


def moses_lc_tok(lines: list[str], lang: str) -> list[str]:
  """The official Multi30k preprocessing: normalise punctuation, tokenise, lowercase."""
  from sacremoses import MosesPunctNormalizer, MosesTokenizer
  normalizer, tokenizer = MosesPunctNormalizer(lang=lang), MosesTokenizer(lang=lang)
  return [tokenizer.tokenize(normalizer.normalize(line), return_str=True).lower() for line in lines]


def apply_override(config, assignment: str):
  key, _, value = assignment.partition('=')
  node = config
  *parents, leaf = key.split('.')
  for p in parents:
    node = node[p]
  node[leaf] = type(node[leaf])(value) if not isinstance(node[leaf], bool) else value == 'True'


def train_padding_fraction(config, trainer, src_tok, tgt_tok) -> float:
  """The padding share of the first epoch of the training batches, as the run built them."""
  from transformer_jax.workflows import translation as translate
  pairs = translate.load_split(config, config.data.train_prefix)
  if config.data.max_train_examples:
    pairs = tuple(side[:config.data.max_train_examples] for side in pairs)
  batcher = translate.make_batcher(config, trainer, src_tok, tgt_tok, pairs, train=True)
  return translate.padding_fraction(config, batcher)


def main(argv):
  del argv
  import sacrebleu
  from transformer_jax.workflows import translation as translate
  from experiments.configs import multi30k
  from transformer_jax.cli.workdir import prepare_workdir

  config = multi30k.get_config()
  config.data.dir = _DATA_DIR.value
  config.data.src_lang, config.data.tgt_lang = _SRC.value, _TGT.value
  config.train.max_minutes = _BUDGET.value
  config.train.num_steps = 1_000_000  # the budget decides
  config.train.eval_every = 0  # all the time goes to training; evaluate at the end
  config.eval.test_prefix = ''  # scored below, with both metrics
  if _LC_TOK.value:
    config.data.train_prefix, config.data.valid_prefix = 'train.lc.norm.tok', 'val.lc.norm.tok'
  for assignment in _OVERRIDES.value:
    apply_override(config, assignment)
  workdir = prepare_workdir(_WORKDIR.value or tempfile.mkdtemp(prefix='m30k_'))
  logging.info('workdir %s, config:\n%s', workdir, config)

  start = time.time()
  results = translate.train_and_evaluate(config, workdir)
  if results.get('interrupted'):
    logging.warning('interrupted: rerun the same command with --workdir=%s to continue', workdir)
    sys.exit(1)
  train_minutes = results['minutes']
  task, trainer, (src_tok, tgt_tok) = translate.build(config, workdir)
  params = trainer.restore_params()
  padding = train_padding_fraction(config, trainer, src_tok, tgt_tok)
  if results.get('averaged'):
    from transformer_jax.training.checkpointing import average_params
    steps = trainer.checkpointer.all_steps()[-config.eval.average_last:]
    params = average_params(trainer.checkpointer, trainer.abstract_state, steps)

  valid_by_alpha = {}
  if len(_ALPHAS.value) > 1:  # chosen on the validation set only
    valid_sources, valid_references = translate.load_split(config, config.data.valid_prefix)
    for alpha in map(float, _ALPHAS.value):
      valid_by_alpha[alpha] = sacrebleu.corpus_bleu(
          task.translate(params, valid_sources, trainer.mesh, alpha=alpha),
          [valid_references]).score
      logging.info('validation BLEU with alpha %.2f: %.2f', alpha, valid_by_alpha[alpha])
    config.eval.alpha = max(valid_by_alpha, key=valid_by_alpha.get)

  prefix = 'test_2016_flickr'
  config.eval.test_prefix = prefix
  if _LC_TOK.value:  # sources and references already lowercased and tokenised
    sources, tok_refs = translate.load_split(config, f'{prefix}.lc.norm.tok')
    hypotheses = task.translate(params, sources, trainer.mesh, alpha=config.eval.alpha)
    references, cased = tok_refs, None
    lc_tok = sacrebleu.corpus_bleu(hypotheses, [tok_refs], tokenize='none')
  else:
    sources, references = translate.load_split(config, prefix)
    hypotheses = task.translate(params, sources, trainer.mesh, alpha=config.eval.alpha)
    cased = sacrebleu.corpus_bleu(hypotheses, [references])
    tok_ref_path = os.path.join(config.data.dir, f'{prefix}.lc.norm.tok.{config.data.tgt_lang}.gz')
    with gzip.open(tok_ref_path, 'rt', encoding='utf-8') as f:
      tok_refs = [line.rstrip('\n') for line in f]
    lc_tok = sacrebleu.corpus_bleu(moses_lc_tok(hypotheses, config.data.tgt_lang), [tok_refs],
                                   tokenize='none')
  logging.info('test sacreBLEU %s | lc.tok %s', cased, lc_tok)
  for i in range(3):
    logging.info('SRC: %s\nREF: %s\nOUT: %s', sources[i], references[i], hypotheses[i])
  out = {
      'benchmark': 'translate_multi30k',
      'direction': f'{_SRC.value}-{_TGT.value}',
      'sacrebleu': None if cased is None else round(cased.score, 2),
      'bleu_lc_tok': round(lc_tok.score, 2),
      'lowercase_tokenized_data': _LC_TOK.value,
      'valid_bleu_last': round(results.get('valid_bleu_last', results.get('eval_bleu', 0.0)), 2),
      'valid_bleu_averaged': round(results.get('valid_bleu_averaged', 0.0), 2),
      'averaged_checkpoints': bool(results.get('averaged')),
      'beam_size': config.eval.beam_size,
      'alpha': config.eval.alpha,
      'valid_bleu_by_alpha': {str(a): round(b, 2) for a, b in valid_by_alpha.items()},
      'train_tokens_per_s': round(results['tokens_per_s']),
      'params': trainer.num_params(),
      'steps': results['step'],
      'minutes': round(train_minutes, 2),
      'total_minutes': round((time.time() - start) / 60, 2),
      'pack': bool(config.data.pack),
      'padding_fraction': round(padding, 4),
      # ru_maxrss: the high-water mark of the resident set, in KiB on Linux.
      'peak_rss_gb': round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9, 2),
      'allocator': process.allocator_description().split(' ')[0],
      'workdir': workdir,
  }
  trainer.close()
  print(json.dumps(out))


if __name__ == '__main__':
  from transformer_jax.cli import entrypoint
  app.run(lambda argv: entrypoint.run(main, argv))
