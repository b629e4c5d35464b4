"""PyTorch / safetensors -> Flax converters with full key coverage (``python -m margrpo_jax.convert``)."""
