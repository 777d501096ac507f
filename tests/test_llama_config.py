"""experiments/configs/llama_shakespeare.py: its model is LLaMA's, and it trains (shrunk)."""

import json
import math
import os

import numpy as np
import pytest

from experiments.configs import llama_shakespeare
from transformer_jax.models.gpt import LLAMA_ARCHITECTURE

TINY = {
    'model.emb_dim': 32,
    'model.num_heads': 4,
    'model.num_kv_heads': 2,
    'model.mlp_dim': 64,
    'model.num_decoder_layers': 2,
    'data.block_size': 32,
    'data.batch_size': 8,
    'data.eval_batches': 2,
    'optimizer.learning_rate': 1e-2,
    'optimizer.end_learning_rate': 1e-3,
    'optimizer.warmup_steps': 10,
    'optimizer.decay_steps': 80,
    'train.num_steps': 80,
    'train.log_every': 10,
    'train.eval_every': 0,
    'train.checkpoint_every': 0,
    'train.eval_max_batches': 0,
    'eval.sample_tokens': 20,
    'eval.sample_prompt': 'ROMEO:',
}


def _set(config, dotted_key: str, value):
  *parents, leaf = dotted_key.split('.')
  node = config
  for part in parents:
    node = node[part]
  if leaf not in node:
    raise KeyError(dotted_key)
  node[leaf] = value


def test_model_section_is_llama():
  from transformer_jax.workflows import lm
  config = llama_shakespeare.get_config()
  assert config.data.path.endswith(os.path.join('tinyshakespeare', 'input.txt'))
  assert config.tokenizer.type == 'char'
  cfg = lm.model_config(config, vocab_size=65)
  for key, value in LLAMA_ARCHITECTURE.items():
    assert getattr(cfg, key) == value, key
  assert cfg.num_kv_heads < cfg.num_heads  # grouped-query attention
  assert cfg.max_len == config.data.block_size and cfg.num_encoder_layers == 0


@pytest.mark.slow
def test_shrunk_config_trains_on_tiny_shakespeare(tiny_shakespeare, tmp_path):
  from transformer_jax.workflows import lm
  config = llama_shakespeare.get_config()
  config.data.path = tiny_shakespeare
  for key, value in TINY.items():
    _set(config, key, value)
  workdir = str(tmp_path)
  results = lm.train_and_evaluate(config, workdir)
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    losses = [r['train/loss'] for r in map(json.loads, f) if 'train/loss' in r]
  vocab = 65  # Tiny Shakespeare's characters
  # Starts near ln(V) (near-zero initial logits), then learns character statistics.
  assert losses[0] > 0.8 * math.log(vocab), losses
  assert losses[-1] < 0.75 * losses[0], losses
  assert results['eval_loss'] < 0.8 * math.log(vocab)
  assert results['step'] == 80 and np.isfinite(results['eval_loss'])
  # Decoding with the KV cache and rotary positions: the sample continues the prompt.
  model = lm.restore_for_inference(config, workdir)
  assert model.task.cfg.position == 'rotary' and 'lm_head' in model.params
  assert len(model.task.sample_text(model.params, 20)) == len('ROMEO:') + 20
