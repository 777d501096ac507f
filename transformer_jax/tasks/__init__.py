"""Tasks: what a model family trains on (loss) and how it is evaluated beyond the loss."""
