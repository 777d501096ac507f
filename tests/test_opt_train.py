"""experiments/configs/opt_shakespeare.py: an OPT trained from scratch here, exported as an OPT.

The config shrunk (a 320-token byte-level BPE, one layer 32 wide, 40 steps) trains from the
command line on Tiny Shakespeare, and `experiments.export` writes the workdir as an
OPTForCausalLM (its switches are OPT's: convert/families.py picks OPT, not GPT-2). Proven: the
saved model has OPT_ARCHITECTURE's switches; the loss falls; transformers' AutoModelForCausalLM
loads the export as an OPTForCausalLM whose logits equal ours, and AutoTokenizer gives the
workdir tokenizer's ids; the OPT importer reads the export back to the trained params, bit for
bit. Needs the `parity` extra (torch, transformers).
"""

import json
import math
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from conftest import REPO_ROOT, TranslateCli

pytestmark = [pytest.mark.parity, pytest.mark.slow]

VOCAB = 320
STEPS = 40
CONTEXT = 16
TINY = {
    'tokenizer.vocab_size': VOCAB, 'model.emb_dim': 32, 'model.num_heads': 2, 'model.mlp_dim': 64,
    'model.num_decoder_layers': 1, 'data.block_size': CONTEXT, 'data.batch_size': 8,
    'data.eval_batches': 1, 'optimizer.learning_rate': 1e-2, 'optimizer.end_learning_rate': 1e-3,
    'optimizer.warmup_steps': 5, 'optimizer.decay_steps': STEPS, 'train.num_steps': STEPS,
    'train.log_every': 5, 'train.eval_every': 0, 'train.checkpoint_every': 0,
    'train.eval_max_batches': 1, 'eval.sample_tokens': 0
}
TOLERANCE = 1e-4  # max |logit difference|, float32


def _run(module: str, *flags: str) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, '-m', module, *flags], cwd=REPO_ROOT,
                        env=TranslateCli.env(), capture_output=True, text=True, timeout=600,
                        check=False)


def test_opt_shakespeare_trains_from_the_command_line_and_exports_as_opt(
    tmp_path, tiny_shakespeare):
  pytest.importorskip('torch', reason='needs the parity extra: pip install -e ".[parity]"')
  transformers = pytest.importorskip('transformers',
                                     reason='needs the parity extra: pip install -e ".[parity]"')
  import torch
  from transformer_jax.cli.workdir import load_saved_config
  from transformer_jax.convert import families
  from transformer_jax.models.gpt import GPT, OPT_ARCHITECTURE
  from transformer_jax.workflows import lm
  workdir, out = str(tmp_path / 'work'), str(tmp_path / 'hf')
  trained = _run('experiments.lm', '--config=experiments/configs/opt_shakespeare.py',
                 f'--workdir={workdir}', f'--config.data.path={tiny_shakespeare}',
                 *(f'--config.{key}={value}' for key, value in TINY.items()))
  assert trained.returncode == 0, trained.stderr[-3000:]

  config = load_saved_config(workdir)
  restored = lm.restore_for_inference(config, workdir)
  cfg, params, tokenizer = restored.task.cfg, restored.params, restored.tokenizer
  assert {key: getattr(cfg, key) for key in OPT_ARCHITECTURE} == OPT_ARCHITECTURE
  assert (cfg.emb_dim, cfg.max_len, tokenizer.vocab_size) == (32, CONTEXT, VOCAB)
  with open(os.path.join(workdir, 'metrics.jsonl'), encoding='utf-8') as f:
    losses = [r['train/loss'] for r in map(json.loads, f) if 'train/loss' in r]
  assert len(losses) == STEPS // TINY['train.log_every']
  assert losses[0] > 0.9 * math.log(VOCAB), losses  # near-zero initial logits: about ln(V)
  assert losses[-1] < losses[0] - 0.8, losses

  exported = _run('experiments.export', f'--workdir={workdir}', f'--out={out}')
  assert exported.returncode == 0, exported.stderr[-3000:]
  assert exported.stdout == f'{out} opt\n'
  model, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
  assert type(model).__name__ == 'OPTForCausalLM'
  assert not info['missing_keys'] and not info['unexpected_keys'], info

  with open(tiny_shakespeare, encoding='utf-8') as f:
    text = f.read()[:4000]
  passage = text[1000:1200]  # several lines: newlines, punctuation, capitals
  hf_tokenizer = transformers.AutoTokenizer.from_pretrained(out)
  assert hf_tokenizer(passage).input_ids == tokenizer.encode(passage)
  assert hf_tokenizer.eos_token_id == tokenizer.eos_id and len(hf_tokenizer) == VOCAB

  tokens = np.asarray([tokenizer.encode(text[i:])[:CONTEXT] for i in (0, 500, 3000)], np.int32)
  ours = np.asarray(GPT(cfg).apply({'params': params}, jax.numpy.asarray(tokens)))
  with torch.no_grad():
    theirs = model.eval()(torch.from_numpy(tokens).long()).logits.numpy()
  assert np.abs(theirs).max() > 0.5  # not a comparison of near-zero logits
  difference = float(np.abs(ours - theirs).max())
  print(f'trained OPT export: max |logits difference| = {difference:.3g}')
  assert difference <= TOLERANCE

  # The importer reads the export back to the trained params and the saved model's switches.
  imported = families.of_directory(out).load(out)
  assert {key: getattr(imported.config, key) for key in OPT_ARCHITECTURE} == OPT_ARCHITECTURE
  got, want = (
      jax.tree_util.tree_leaves_with_path(jax.device_get(p)) for p in (imported.params, params))
  for (path, value), (want_path, expected) in zip(got, want, strict=True):
    assert path == want_path and np.array_equal(value, expected), jax.tree_util.keystr(path)
