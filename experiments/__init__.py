"""Experiment entry points: thin compositions of library parts, driven by ml_collections configs."""
