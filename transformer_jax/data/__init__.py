"""Data: reading corpora, tokenizers, and batch iterators whose position can be saved."""
