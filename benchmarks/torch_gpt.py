"""A plain PyTorch (eager) GPT-2-style model and train step: the baseline for train_step.py.

Written the way a PyTorch user would write it, not tuned: token + learned position embeddings,
Pre-LN blocks with one fused q|k|v Linear, causal attention through
`F.scaled_dot_product_attention`, a tanh-GELU MLP, a final LayerNorm and an output head tied to
the token embedding. It computes the same function as `transformer_jax.models.GPT` under
`gpt2_config` (same widths, biases, epsilons), so the two train steps do the same work.
"""

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn


@dataclasses.dataclass(frozen=True)
class TorchGPTConfig:
  vocab_size: int = 65
  block_size: int = 64
  n_layer: int = 4
  n_head: int = 4
  n_embd: int = 128
  mlp_ratio: int = 4
  dropout: float = 0.0
  layer_norm_epsilon: float = 1e-5


class CausalSelfAttention(nn.Module):

  def __init__(self, cfg: TorchGPTConfig):
    super().__init__()
    self.n_head = cfg.n_head
    self.dropout = cfg.dropout
    self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
    self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
    self.resid_dropout = nn.Dropout(cfg.dropout)

  def forward(self, x: torch.Tensor) -> torch.Tensor:
    b, t, c = x.shape
    # [B, T, 3C] -> three [B, H, T, D]: heads become a batch axis for the attention kernel.
    q, k, v = self.qkv(x).view(b, t, 3, self.n_head, c // self.n_head).permute(2, 0, 3, 1, 4)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                       dropout_p=self.dropout if self.training else 0.0)
    y = y.transpose(1, 2).reshape(b, t, c)
    return self.resid_dropout(self.proj(y))


class MLP(nn.Module):

  def __init__(self, cfg: TorchGPTConfig):
    super().__init__()
    self.fc = nn.Linear(cfg.n_embd, cfg.mlp_ratio * cfg.n_embd)
    self.proj = nn.Linear(cfg.mlp_ratio * cfg.n_embd, cfg.n_embd)
    self.dropout = nn.Dropout(cfg.dropout)

  def forward(self, x: torch.Tensor) -> torch.Tensor:
    return self.dropout(self.proj(F.gelu(self.fc(x), approximate='tanh')))


class Block(nn.Module):

  def __init__(self, cfg: TorchGPTConfig):
    super().__init__()
    self.ln_1 = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)
    self.attn = CausalSelfAttention(cfg)
    self.ln_2 = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)
    self.mlp = MLP(cfg)

  def forward(self, x: torch.Tensor) -> torch.Tensor:
    x = x + self.attn(self.ln_1(x))
    return x + self.mlp(self.ln_2(x))


class TorchGPT(nn.Module):
  """tokens [B, T] (int64) -> logits [B, T, V]."""

  def __init__(self, cfg: TorchGPTConfig):
    super().__init__()
    self.cfg = cfg
    self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
    self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
    self.drop = nn.Dropout(cfg.dropout)
    self.blocks = nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)])
    self.ln_f = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)
    self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
    self.lm_head.weight = self.wte.weight  # tied, as in GPT-2
    self.apply(self._init_weights)
    # GPT-2 scales the residual output projections down by depth.
    for name, p in self.named_parameters():
      if name.endswith('proj.weight'):
        nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

  @staticmethod
  def _init_weights(module: nn.Module):
    if isinstance(module, nn.Linear):
      nn.init.normal_(module.weight, mean=0.0, std=0.02)
      if module.bias is not None:
        nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
      nn.init.normal_(module.weight, mean=0.0, std=0.02)

  def forward(self, tokens: torch.Tensor) -> torch.Tensor:
    positions = torch.arange(tokens.shape[1], device=tokens.device)
    x = self.drop(self.wte(tokens) + self.wpe(positions))
    for block in self.blocks:
      x = block(x)
    return self.lm_head(self.ln_f(x))

  def num_params(self, non_embedding: bool = True) -> int:
    """Parameter count; the tied head is counted once, with the embedding."""
    total = sum(p.numel() for p in self.parameters())
    if non_embedding:
      total -= self.wte.weight.numel() + self.wpe.weight.numel()
    return total


def make_optimizer(model: nn.Module, lr: float = 3e-4,
                   weight_decay: float = 0.1) -> torch.optim.Optimizer:
  """AdamW, decaying matrices only (as transformer_jax.training.optimizer does); multi-tensor
  on CPU too."""
  decay = [p for p in model.parameters() if p.dim() >= 2]
  no_decay = [p for p in model.parameters() if p.dim() < 2]
  return torch.optim.AdamW(
      [{'params': decay, 'weight_decay': weight_decay}, {'params': no_decay, 'weight_decay': 0.0}],
      lr=lr, betas=(0.9, 0.95), eps=1e-8, foreach=True)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, inputs: torch.Tensor,
               targets: torch.Tensor, grad_clip_norm: float = 1.0) -> torch.Tensor:
  """One update: forward, mean next-token cross-entropy, backward, clip, AdamW step."""
  logits = model(inputs)
  loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))
  optimizer.zero_grad(set_to_none=True)
  loss.backward()
  if grad_clip_norm:
    torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip_norm, foreach=True)
  optimizer.step()
  return loss.detach()
