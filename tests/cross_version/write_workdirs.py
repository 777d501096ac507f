r"""Writes the workdirs that tests/test_cross_version.py reads with other jax versions.

    python tests/cross_version/write_workdirs.py OUT_DIR

Run under the oldest supported stack (Python 3.11, jax 0.10.2): the committed copy under
tests/cross_version/jax_0.10.2/ was written that way. It trains, through the entry points a user
runs, a tiny character GPT and a tiny translation model (the quickstart's, shrunk) with a
checkpoint at their last step, then records what the same entry points answer from them: the
evaluate figures, a greedy continuation, translations, and the versions that wrote them.
Logs, TensorBoard events and the compilation cache are left out: only what resuming, generating,
evaluating and exporting read is kept.
"""

import json
import os
import shutil
import subprocess
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

TRAIN_TEXT = 'the quick brown fox jumps over the lazy dog. ' * 40
EVAL_TEXT = 'the lazy dog jumps over the quick brown fox. the end. the fox. '
LM_STEPS = 40
LM_FLAGS = {
    'model.emb_dim': 32, 'model.num_heads': 2, 'model.mlp_dim': 64, 'model.num_decoder_layers': 2,
    'data.block_size': 16, 'data.batch_size': 8, 'data.eval_batches': 1,
    'optimizer.learning_rate': 1e-2, 'optimizer.end_learning_rate': 1e-3,
    'optimizer.warmup_steps': 5, 'optimizer.decay_steps': 80, 'train.num_steps': LM_STEPS,
    'train.log_every': 10, 'train.eval_every': 0, 'train.checkpoint_every': LM_STEPS,
    'train.eval_max_batches': 0, 'eval.sample_tokens': 0, 'eval.sample_prompt': 'the '
}
TRANSLATE_STEPS = 150
TRANSLATE_FLAGS = {
    'model.emb_dim': 32, 'model.num_heads': 2, 'model.mlp_dim': 64, 'model.num_encoder_layers': 1,
    'model.num_decoder_layers': 1, 'data.max_len': 32, 'data.batch_tokens': 512, 'data.buckets':
        (32,), 'data.max_train_examples': 2000, 'optimizer.learning_rate': 5e-3,
    'optimizer.warmup_steps': 10, 'train.num_steps': TRANSLATE_STEPS, 'train.log_every': 10,
    'train.eval_every': 0, 'train.checkpoint_every': TRANSLATE_STEPS, 'train.eval_max_batches': 2,
    'eval.bleu_sentences': 8, 'eval.decode_rows': 256, 'eval.test_prefix': ''
}
PROMPT = 'the '
SENTENCES = [
    'i have twelve books', 'we saw three hundred four birds',
    'she bought forty-two thousand seven hundred flowers'
]
# What a run writes that neither resuming nor inference reads (the checkpoints, config.json and
# the tokenizer files stay).
DROP = ('metrics.jsonl', 'provenance.jsonl', 'tensorboard')


def environment() -> dict[str, str]:
  env = dict(os.environ, TRANSFORMER_JAX_ALLOCATOR='system', JAX_PLATFORMS='cpu',
             TF_CPP_MIN_LOG_LEVEL='2', TRANSFORMER_JAX_COMPILATION_CACHE='off')
  env['PYTHONPATH'] = os.pathsep.join(filter(None, [REPO_ROOT, env.get('PYTHONPATH')]))
  return env


def run(module: str, *flags: str, stdin: str | None = None) -> str:
  """Runs `python -m module flags` from the repository root; its stdout (fails loudly)."""
  result = subprocess.run([sys.executable, '-m', module, *flags], cwd=REPO_ROOT, env=environment(),
                          input=stdin, capture_output=True, text=True, timeout=900, check=False)
  if result.returncode:
    raise SystemExit(f'{module} {" ".join(flags)} failed:\n{result.stderr[-4000:]}')
  return result.stdout


def config_flags(values: dict) -> list[str]:
  return [f'--config.{key}={value}' for key, value in values.items()]


def lm_train_flags(workdir: str, train_file: str, steps: int = LM_STEPS) -> list[str]:
  values = dict(LM_FLAGS, **{'data.path': train_file, 'train.num_steps': steps})
  return ['--config=experiments/configs/shakespeare_char.py', f'--workdir={workdir}'
         ] + config_flags(values)


def translate_train_flags(workdir: str, steps: int = TRANSLATE_STEPS) -> list[str]:
  values = dict(TRANSLATE_FLAGS, **{'train.num_steps': steps})
  return ['--config=experiments/configs/translate_quickstart.py', f'--workdir={workdir}'
         ] + config_flags(values)


def answers(lm_workdir: str, translate_workdir: str, eval_file: str) -> dict:
  """What the entry points answer from the two workdirs (the test compares these)."""
  evaluate = json.loads(
      run('experiments.lm', '--mode=evaluate', f'--workdir={lm_workdir}', f'--input={eval_file}',
          '--stride=8').strip().splitlines()[-1])
  continuation = run('experiments.generate', f'--workdir={lm_workdir}', f'--prompt={PROMPT}',
                     '--max_new_tokens=24', '--temperature=0', '--stream=false')
  translations = run('experiments.translate', f'--workdir={translate_workdir}', '--mode=translate',
                     '--input=-', stdin='\n'.join(SENTENCES) + '\n')
  evaluate.pop('file')  # an absolute path
  return {
      'lm_evaluate': evaluate, 'lm_greedy': continuation.rstrip('\n'),
      'translations': translations.rstrip('\n').split('\n')
  }


def prune(workdir: str):
  for name in DROP:
    path = os.path.join(workdir, name)
    if os.path.isdir(path):
      shutil.rmtree(path)
    elif os.path.exists(path):
      os.remove(path)


def main(out_dir: str):
  import importlib.metadata as metadata
  import platform
  if os.path.exists(out_dir):
    raise SystemExit(f'{out_dir} exists; remove it first')
  os.makedirs(out_dir)
  train_file = os.path.join(out_dir, 'train.txt')
  eval_file = os.path.join(out_dir, 'eval.txt')
  with open(train_file, 'w') as f:
    f.write(TRAIN_TEXT)
  with open(eval_file, 'w') as f:
    f.write(EVAL_TEXT)
  lm_workdir, translate_workdir = (os.path.join(out_dir, n) for n in ('char_gpt', 'translation'))
  run('experiments.lm', *lm_train_flags(lm_workdir, train_file))
  run('experiments.translate', *translate_train_flags(translate_workdir))
  for workdir in (lm_workdir, translate_workdir):
    prune(workdir)
  # The training text's path as the folder names it, not as this machine did (resuming passes
  # --config.data.path again; inference reads only the tokenizer).
  config_path = os.path.join(lm_workdir, 'config.json')
  with open(config_path) as f:
    saved = json.load(f)
  saved['data']['path'] = 'train.txt'
  with open(config_path, 'w') as f:
    json.dump(saved, f, indent=2)
    f.write('\n')
  expected = answers(lm_workdir, translate_workdir, eval_file)
  expected['written_by'] = {
      'python': platform.python_version(),
      **{name: metadata.version(name) for name in ('jax', 'jaxlib', 'flax', 'orbax-checkpoint')}
  }
  expected['steps'] = {'char_gpt': LM_STEPS, 'translation': TRANSLATE_STEPS}
  with open(os.path.join(out_dir, 'expected.json'), 'w') as f:
    json.dump(expected, f, indent=1)
    f.write('\n')
  print(json.dumps(expected['written_by']))


if __name__ == '__main__':
  if len(sys.argv) != 2:
    raise SystemExit(__doc__)
  main(os.path.abspath(sys.argv[1]))
