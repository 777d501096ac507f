"""Small random Hugging Face encoders of the families whose tokenizers are not WordPiece (RoBERTa,
ALBERT), saved by `transformers` with their tokenizers, the way a user downloads one.

transformers is imported when a function is called, so a test module can import this one and
still run its BERT cases (written by our own exporter, tests/test_bert_predict.py) without the
`parity` extra; the RoBERTa and ALBERT cases are marked parity and call `need_transformers()`.
"""

import pytest


def need_transformers():
  """transformers (with torch), or the test is skipped like the other parity tests."""
  pytest.importorskip('torch', reason='needs the parity extra: pip install -e ".[parity]"')
  return pytest.importorskip('transformers',
                             reason='needs the parity extra: pip install -e ".[parity]"')


def albert_tokenizer(words):
  """ALBERT's unigram SentencePiece over `words` (plus letters, so any word encodes)."""
  transformers = need_transformers()
  special = ['<pad>', '<unk>', '[CLS]', '[SEP]', '[MASK]']
  vocab = ([(t, 0.0) for t in special] + [('▁' + w, -1.0 - 0.1 * i) for i, w in enumerate(words)] +
           [('▁', -5.0)] + [(c, -8.0) for c in 'abcdefghijklmnopqrstuvwxyz'])
  return transformers.AlbertTokenizer(vocab=vocab)


def perturbed(model, scale: float, seed: int = 1):
  """`model` in eval mode with noise added to every weight: transformers initialises biases to 0
  and norms to 1, which would hide a mis-mapped one."""
  import torch
  torch.manual_seed(seed)
  with torch.no_grad():
    for p in model.parameters():
      p.add_(scale * torch.randn_like(p))
  return model.eval()


def save_encoder(family: str, directory, words, *, width: int = 32, layers: int = 2,
                 max_len: int = 32, scale: float = 0.3, seed: int = 0):
  """(folder, model, tokenizer): a random `family` encoder (`transformers`' RobertaModel or
  AlbertModel, no heads) with positions for `max_len` tokens and a tokenizer learnt from (RoBERTa's
  byte-level BPE) or spelling (ALBERT's unigram) `words`, saved in directory / family. `scale`:
  the noise added to transformers' initial weights (`perturbed`); `seed` makes both repeatable."""
  transformers = need_transformers()
  import torch
  torch.manual_seed(seed)  # transformers initialises the model from torch's global generator
  size = dict(hidden_size=width, num_hidden_layers=layers, num_attention_heads=2,
              intermediate_size=2 * width, hidden_dropout_prob=0.0,
              attention_probs_dropout_prob=0.0)
  if family == 'roberta':
    from test_hf_roberta_parity import roberta_tokenizer
    scratch = directory / 'bpe_files'
    scratch.mkdir(parents=True)
    tokenizer = roberta_tokenizer([' '.join(words)] * 20, 300, scratch)
    # Positions start after the pad id (1): max_len + 2 rows.
    config = transformers.RobertaConfig(**size, vocab_size=len(tokenizer), type_vocab_size=1,
                                        max_position_embeddings=max_len + 2, pad_token_id=1,
                                        layer_norm_eps=1e-5)
    model = transformers.RobertaModel(config)
  elif family == 'albert':
    tokenizer = albert_tokenizer(words)
    config = transformers.AlbertConfig(**size, vocab_size=len(tokenizer), embedding_size=16,
                                       max_position_embeddings=max_len)
    model = transformers.AlbertModel(config)
  else:
    raise ValueError(f'no {family!r} encoder here: roberta or albert')
  folder = directory / family
  perturbed(model, scale, seed + 1).save_pretrained(str(folder), safe_serialization=True)
  tokenizer.save_pretrained(str(folder))
  return str(folder), model, tokenizer


def assert_encoder_matches(model, cfg, params, ids, hf_ids, segments=None):
  """Our `Bert` (`cfg`, `params`: an import of `model`'s folder) computes on our `ids` the
  hidden states transformers' `model` computes on its `hf_ids` (RoBERTa's differ from ours by a
  swap of 0 and the pad id; data/roberta_tokenizer.py), to 1e-4; one row, token types
  `segments` (default 0)."""
  import numpy as np
  import torch
  from transformer_jax.models.bert import Bert, bert_heads
  segments = [0] * len(ids) if segments is None else list(segments)
  encoder = Bert(cfg.replace(dropout_rate=0.0, attention_dropout_rate=0.0), **bert_heads(params))
  hidden = encoder.apply({'params': params}, np.asarray([ids]), np.asarray([segments]))['hidden']
  with torch.no_grad():
    expected = model(input_ids=torch.tensor([list(hf_ids)]),
                     token_type_ids=torch.tensor([segments])).last_hidden_state.numpy()
  np.testing.assert_allclose(np.asarray(hidden), expected, atol=1e-4)
