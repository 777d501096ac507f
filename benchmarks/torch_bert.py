"""The PyTorch eager BERT baseline for benchmarks/train_step.py: Hugging Face transformers'
`BertForSequenceClassification` (SDPA attention), the model people actually fine-tune, at the
same size as our `models.bert.Bert` classification task."""

import torch
import transformers


def make_model(vocab_size: int, hidden: int, heads: int, intermediate: int, layers: int,
               max_len: int = 512, num_labels: int = 2) -> torch.nn.Module:
  config = transformers.BertConfig(vocab_size=vocab_size, hidden_size=hidden,
                                   num_attention_heads=heads, intermediate_size=intermediate,
                                   num_hidden_layers=layers, max_position_embeddings=max_len,
                                   hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                   num_labels=num_labels, hidden_act='gelu')
  return transformers.BertForSequenceClassification(config)


def train_step(model, optimizer, inputs, segments, labels, grad_clip_norm: float = 1.0):
  """Forward, classification cross-entropy, backward, clip, AdamW step."""
  out = model(input_ids=inputs, token_type_ids=segments, attention_mask=(inputs != 0).long(),
              labels=labels)
  optimizer.zero_grad(set_to_none=True)
  out.loss.backward()
  torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip_norm, foreach=True)
  optimizer.step()
  return out.loss.detach()
