"""One experiment per model family, from a config: data -> tokenizer -> task -> trainer ->
evaluation modes. `experiments/*.py` and `benchmarks/*.py` are thin callers."""
