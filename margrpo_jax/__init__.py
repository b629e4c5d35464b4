"""margrpo_jax: a JAX/Flax reimplementation of MAR-GRPO (RL fine-tuning of masked-autoregressive image generators)."""

__version__ = "0.1.0"
