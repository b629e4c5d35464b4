"""Data: the offline shapes world (prompts, metadata, renderer, splits, patch tokens)."""
