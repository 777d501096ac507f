"""Autoregressive search over a model's KV cache: greedy, beam search and sampling."""
