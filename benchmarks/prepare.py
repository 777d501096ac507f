r"""Corpus preparation against nanoGPT's single pass, and a GPT run's start on a large corpus.

  python benchmarks/prepare.py --size_mb=2048 --tokenizers=byte_bpe,sentencepiece --rounds=1
  python benchmarks/prepare.py --size_mb=200 --rounds=3         # interleaved rounds, quicker
  python benchmarks/prepare.py --size_mb=200 --kills=5 --ray    # bytes after kills, Ray's bytes
  python benchmarks/prepare.py --size_mb=2048 --start           # a GPT's start on 10 MB and 2 GB

The corpus is built from the text shipped in ../shared/data (Tiny Shakespeare's speeches,
Multi30k's English, German and French captions four to a document, SST-2's sentences eight to a
document), its documents shuffled and repeated until it is `size_mb` MiB, documents separated by
blank lines; a tokenizer of each kind (8,192 ids) is trained once on its first 64 MiB and used by
both sides:

  nanogpt   one process: documents read in order, `encode_batch` over 10,000 at a time, the ids
            and EOS appended to one uint16 file (nanoGPT's prepare.py; the 100 MB measurement in
            shared/notes/data-at-scale.md). The byte-level BPE's encoder uses both cores by
            itself; SentencePiece's does not.
  prepare   `python -m experiments.prepare` with that tokenizer (`--tokenizer_from`), a worker
            per core, 0.05% of the documents held out.

Each side runs as a fresh command; rounds alternate them (A B A B). Reported per side: wall
seconds, tokens/s, and the peak of the summed RSS of the command's process tree (sampled every
50 ms with psutil). `--start` times `python -m experiments.lm` (GPT-2's shape shrunk to 4 layers
of 256, block 256, batch 8) from process start to the end of its first step, and its peak RSS,
on the 10 MB and the `size_mb` corpus prepared above. `--kills=N` SIGKILLs preparation at N
random moments (rerunning each time) and compares the finished corpus's checksums with an
uninterrupted run's and a one-worker run's; `--ray` adds a run on a local Ray.

Last line of output: one JSON object.
"""

import argparse
import hashlib
import json
import os
import pathlib
import random
import re
import signal
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
  sys.path.insert(0, REPO_ROOT)

import numpy as np  # noqa: E402

from tools import machine  # noqa: E402

SHARED = pathlib.Path(REPO_ROOT).parent / 'shared' / 'data'
VOCAB = 8192

NANOGPT = r'''
import sys
import numpy as np
sys.path.insert(0, {repo!r})
from transformer_jax.corpus import sources, tokenizers
kind, path, out = {kind!r}, {corpus!r}, {out!r}
tokenizer = tokenizers.load(kind, {tokenizer!r})
eos = tokenizers.eos_id(kind, tokenizer)
unit = sources.Unit(0, 'text', path)
batch, total = [], 0
with open(out, 'wb') as f:
  def flush():
    global total
    for ids in tokenizer.encode_batch(batch):
      f.write(np.asarray(list(ids) + [eos], np.uint16).tobytes())
      total += len(ids) + 1
    batch.clear()
  for document in sources.read_documents(unit, sources.ReadOptions(), sources.Invalid('skip')):
    batch.append(document)
    if len(batch) == 10_000:
      flush()
  flush()
print(total)
'''


def build_corpus(path: pathlib.Path, size_mb: int, seed: int = 0):
  """Documents from the shipped text, shuffled and repeated to `size_mb` MiB."""
  import gzip
  if path.exists() and path.stat().st_size >= size_mb << 20:
    return
  documents = [
      d.strip()
      for d in (SHARED / 'tinyshakespeare' / 'input.txt').read_text().split('\n\n')
      if d.strip()
  ]
  for lang in ('en', 'de', 'fr'):
    with gzip.open(SHARED / 'multi30k' / f'train.{lang}.gz', 'rt', encoding='utf-8') as f:
      lines = [line.strip() for line in f if line.strip()]
    documents += ['\n'.join(lines[i:i + 4]) for i in range(0, len(lines), 4)]
  with open(SHARED / 'sst2' / 'train.tsv', encoding='utf-8') as f:
    sentences = [line.split('\t', 1)[1].strip() for line in list(f)[1:] if '\t' in line]
  documents += ['\n'.join(sentences[i:i + 8]) for i in range(0, len(sentences), 8)]
  rng = random.Random(seed)
  written = 0
  with open(path, 'w', encoding='utf-8') as f:
    while written < size_mb << 20:
      rng.shuffle(documents)
      for document in documents:
        f.write(document + '\n\n')
        written += len(document.encode('utf-8')) + 2
        if written >= size_mb << 20:
          break


def measure(command: list[str], env=None, until: str | None = None) -> dict:
  """Runs `command`: wall seconds, peak summed RSS of its process tree, its stdout; with
  `until`, also the seconds until a stderr line matching it."""
  import psutil
  start = time.perf_counter()
  process = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
  peak, seen_at, lines = 0, None, []
  root = psutil.Process(process.pid)
  import selectors
  selector = selectors.DefaultSelector()
  selector.register(process.stderr, selectors.EVENT_READ)
  while process.poll() is None:
    try:
      tree = [root] + root.children(recursive=True)
      peak = max(peak, sum(p.memory_info().rss for p in tree if p.is_running()))
    except (psutil.NoSuchProcess, psutil.AccessDenied):
      pass
    for _ in selector.select(timeout=0.05):
      line = process.stderr.readline()
      lines.append(line)
      if until and seen_at is None and re.search(until, line):
        seen_at = time.perf_counter() - start
  stdout, rest = process.communicate()
  lines += rest.splitlines(True)
  if until and seen_at is None:
    for line in lines:
      if re.search(until, line):
        seen_at = time.perf_counter() - start
  if process.returncode:
    raise SystemExit(f'{command[:4]} failed ({process.returncode}):\n{"".join(lines[-20:])}')
  return {
      'seconds': time.perf_counter() - start, 'peak_rss_mb': peak / 2**20, 'stdout': stdout,
      'until_seconds': seen_at
  }


def train_tokenizer(kind: str, corpus: pathlib.Path, folder: pathlib.Path) -> str:
  from transformer_jax.corpus import sources, tokenizers
  path = folder / tokenizers.FILE_NAMES[kind]
  if not path.exists():
    units = sources.plan([str(corpus)], unit_bytes=64 << 20)[:1]
    sample = sources.sample_text(units, sources.ReadOptions(), 64 << 20)
    tokenizers.train(kind, sample, VOCAB, str(path))
  return str(path)


def prepare_command(corpus, output, kind, tokenizer, workers: int = 0, engine='local'):
  return [
      sys.executable, '-m', 'experiments.prepare', f'--sources={corpus}', f'--output={output}',
      f'--tokenizer={kind}', f'--tokenizer_from={tokenizer}', '--valid_fraction=0.0005',
      f'--workers={workers}', f'--engine={engine}'
  ]


def checksums(root: str) -> str:
  digest = hashlib.sha256()
  for path in sorted(pathlib.Path(root).rglob('*')):
    if path.is_file() and path.name != 'plan.json':
      digest.update(str(path.relative_to(root)).encode() + path.read_bytes())
  return digest.hexdigest()


def compare(work: pathlib.Path, corpus: pathlib.Path, kind: str, tokenizer: str,
            rounds: int) -> dict:
  results = {'nanogpt': [], 'prepare': []}
  for r in range(rounds):
    out = work / f'nanogpt_{kind}.bin'
    script = NANOGPT.format(repo=REPO_ROOT, kind=kind, corpus=str(corpus), out=str(out),
                            tokenizer=tokenizer)
    run = measure([sys.executable, '-c', script])
    tokens = int(run['stdout'].strip().splitlines()[-1])
    results['nanogpt'].append(
        dict(seconds=run['seconds'], peak_rss_mb=run['peak_rss_mb'], tokens=tokens,
             tokens_per_s=tokens / run['seconds']))
    out.unlink(missing_ok=True)
    output = work / f'prepared_{kind}_{r}'
    # A corpus left by an earlier invocation (the last round's is kept for --start) would be
    # found finished and timed at a fraction of a second.
    shutil.rmtree(output, ignore_errors=True)
    run = measure(prepare_command(corpus, output, kind, tokenizer))
    summary = json.loads(run['stdout'].strip().splitlines()[-1])
    tokens = summary['train_tokens'] + summary['valid_tokens']
    results['prepare'].append(
        dict(seconds=run['seconds'], peak_rss_mb=run['peak_rss_mb'], tokens=tokens,
             tokens_per_s=tokens / run['seconds']))
    print(
        f'round {r + 1}/{rounds} {kind}: nanogpt {results["nanogpt"][-1]["tokens_per_s"]:,.0f} '
        f'tokens/s, {results["nanogpt"][-1]["peak_rss_mb"]:,.0f} MB; prepare '
        f'{results["prepare"][-1]["tokens_per_s"]:,.0f} tokens/s, '
        f'{results["prepare"][-1]["peak_rss_mb"]:,.0f} MB', flush=True)
    if r < rounds - 1:
      shutil.rmtree(output)
  ratios = [
      b['tokens_per_s'] / a['tokens_per_s'] for a, b in zip(results['nanogpt'], results['prepare'])
  ]
  return dict(results, prepare_over_nanogpt_tokens_per_s=statistics.median(ratios),
              per_round=ratios)


def start_time(prepared: str, label: str) -> dict:
  """experiments.lm on a prepared corpus: seconds to the end of step 1, peak RSS."""
  workdir = tempfile.mkdtemp(prefix=f'start_{label}_')
  command = [
      sys.executable, '-m', 'experiments.lm',
      '--config=experiments/configs/gpt2_shakespeare_bpe.py', '--config.data.source=prepared',
      f'--config.data.prepared={prepared}', f'--workdir={workdir}', '--config.train.num_steps=1',
      '--config.train.log_every=1', '--config.train.eval_every=0',
      '--config.train.checkpoint_every=0', '--config.eval.sample_tokens=0',
      '--config.data.eval_batches=1', '--config.model.num_decoder_layers=4',
      '--config.model.emb_dim=256', '--config.model.num_heads=4', '--config.model.mlp_dim=1024',
      '--config.data.block_size=256', '--config.data.batch_size=8',
      f'--config.tokenizer.vocab_size={VOCAB}'
  ]
  env = dict(os.environ, TRANSFORMER_JAX_COMPILATION_CACHE='off')
  run = measure(command, env=env, until=r'step 1/1 \|')
  return {'seconds_to_first_step': run['until_seconds'], 'peak_rss_mb': run['peak_rss_mb']}


def kills(work: pathlib.Path, corpus: pathlib.Path, kind: str, tokenizer: str, count: int,
          ray: bool) -> dict:
  reference = work / 'kills_reference'
  run = measure(prepare_command(corpus, reference, kind, tokenizer))
  expected = checksums(reference)
  killed = work / 'kills_killed'
  rng = random.Random(1)
  points = []
  for _ in range(count):
    process = subprocess.Popen(prepare_command(corpus, killed, kind,
                                               tokenizer), cwd=REPO_ROOT, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, start_new_session=True)
    at = rng.uniform(0.05, 0.95) * run['seconds']
    time.sleep(at)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    points.append(round(at, 1))
  measure(prepare_command(corpus, killed, kind, tokenizer))
  one = work / 'kills_one_worker'
  measure(prepare_command(corpus, one, kind, tokenizer, workers=1))
  result = {
      'kill_seconds': points, 'killed_equals_reference': checksums(killed) == expected,
      'one_worker_equals_reference': checksums(one) == expected
  }
  if ray:
    on_ray = work / 'kills_ray'
    measure(prepare_command(corpus, on_ray, kind, tokenizer, engine='ray'))
    result['ray_equals_reference'] = checksums(on_ray) == expected
  return result


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument('--size_mb', type=int, default=200)
  parser.add_argument('--tokenizers', default='byte_bpe,sentencepiece')
  parser.add_argument('--rounds', type=int, default=1)
  parser.add_argument('--start', action='store_true')
  parser.add_argument('--kills', type=int, default=0)
  parser.add_argument('--ray', action='store_true')
  parser.add_argument('--work', default=os.path.join(tempfile.gettempdir(), 'prepare_benchmark'))
  args = parser.parse_args()
  work = pathlib.Path(args.work)
  work.mkdir(parents=True, exist_ok=True)
  corpus = work / f'corpus_{args.size_mb}MB.txt'
  build_corpus(corpus, args.size_mb)
  out = {'benchmark': 'prepare', **machine.description(), 'size_mb': args.size_mb}
  for kind in args.tokenizers.split(','):
    tokenizer = train_tokenizer(kind, corpus, work / f'tokenizer_{kind}')
    if args.rounds:
      out[kind] = compare(work, corpus, kind, tokenizer, args.rounds)
    if args.kills:
      out[f'{kind}_kills'] = kills(work, corpus, kind, tokenizer, args.kills, args.ray)
  if args.start:
    small = work / 'corpus_10MB.txt'
    build_corpus(small, 10)
    tokenizer = train_tokenizer('byte_bpe', corpus, work / 'tokenizer_byte_bpe')
    prepared = {}
    for label, path in (('10MB', small), (f'{args.size_mb}MB', corpus)):
      target = work / f'start_{label}'
      compared = work / f'prepared_byte_bpe_{args.rounds - 1}'  # the comparison's last corpus
      if path == corpus and args.rounds and (compared / 'manifest.json').exists():
        target = compared
      if not (target / 'manifest.json').exists():
        measure(prepare_command(path, target, 'byte_bpe', tokenizer))
      prepared[label] = str(target)
    out['start'] = {}
    for _ in range(2):  # interleaved: small, large, small, large
      for label, path in prepared.items():
        out['start'].setdefault(label, []).append(start_time(path, label))
        print(f'start {label}: {out["start"][label][-1]}', flush=True)
  print(json.dumps(out, default=lambda x: float(x) if isinstance(x, np.floating) else str(x)))


if __name__ == '__main__':
  main()
