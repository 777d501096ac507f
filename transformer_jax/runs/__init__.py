"""Experiments as library functions: config in, trained workdir and results out."""
