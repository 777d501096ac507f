"""A plain PyTorch eager encoder-decoder Transformer, the baseline for benchmarks/train_step.py.

The same model as `transformer_jax.models.encoder_decoder` with the Multi30k config: Post-LN,
sinusoidal positions, ReLU, one embedding shared by source, target and the output logits,
embeddings scaled by sqrt(d_model). Built from `torch.nn.Transformer` (batch_first), which is
what a PyTorch user would reach for; its extra final encoder/decoder LayerNorms cost nothing.
"""

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from transformer_jax.special_tokens import PAD_ID  # the same ids as the JAX model


@dataclass
class TorchTranslationConfig:
  vocab_size: int = 8000
  d_model: int = 256
  n_head: int = 4
  d_ff: int = 1024
  n_encoder_layers: int = 3
  n_decoder_layers: int = 3
  max_len: int = 256
  dropout: float = 0.0


def _sinusoids(length: int, dim: int) -> torch.Tensor:
  position = torch.arange(length, dtype=torch.float32)[:, None]
  rate = torch.exp(torch.arange(0, dim, 2, dtype=torch.float32) * (-math.log(10000.0) / dim))
  table = torch.zeros(length, dim)
  table[:, 0::2], table[:, 1::2] = torch.sin(position * rate), torch.cos(position * rate)
  return table


class TorchTranslation(nn.Module):

  def __init__(self, cfg: TorchTranslationConfig):
    super().__init__()
    self.cfg = cfg
    self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
    nn.init.normal_(self.embed.weight, std=cfg.d_model**-0.5)
    self.register_buffer('positions', _sinusoids(cfg.max_len, cfg.d_model), persistent=False)
    self.transformer = nn.Transformer(d_model=cfg.d_model, nhead=cfg.n_head,
                                      num_encoder_layers=cfg.n_encoder_layers,
                                      num_decoder_layers=cfg.n_decoder_layers,
                                      dim_feedforward=cfg.d_ff, dropout=cfg.dropout,
                                      batch_first=True)

  def _embed(self, tokens):
    x = self.embed(tokens) * math.sqrt(self.cfg.d_model)
    return x + self.positions[:tokens.shape[1]]

  def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    decoder_inputs = F.pad(targets[:, :-1], (1, 0), value=PAD_ID)  # shift right
    source_pad = inputs == PAD_ID
    causal = nn.Transformer.generate_square_subsequent_mask(targets.shape[1])
    y = self.transformer(self._embed(inputs), self._embed(decoder_inputs), tgt_mask=causal,
                         src_key_padding_mask=source_pad, memory_key_padding_mask=source_pad,
                         tgt_is_causal=True)
    return y @ self.embed.weight.T

  def num_params(self) -> int:
    return sum(p.numel() for p in self.parameters())


def train_step(model, optimizer, inputs, targets, label_smoothing: float = 0.1,
               grad_clip_norm: float = 1.0) -> torch.Tensor:
  """Forward, label-smoothed cross-entropy over non-pad targets, backward, clip, AdamW."""
  logits = model(inputs, targets)
  loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                         ignore_index=PAD_ID, label_smoothing=label_smoothing)
  optimizer.zero_grad(set_to_none=True)
  loss.backward()
  torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip_norm, foreach=True)
  optimizer.step()
  return loss.detach()
