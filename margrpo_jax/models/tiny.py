"""The shapes-world text-to-image MAR: text encoder -> MAR backbone -> SimpleMLPAdaLN diffusion head.

Tokens are the 4x4 RGB patches of a 32x32 image (64 tokens x 48 values, no VAE). Widths and depths come
from the model config, so the same classes build MAR-B/L/H-shaped backbones.
"""
from __future__ import annotations

import jax
import ml_collections
import numpy as np
from flax import nnx

from margrpo_jax.data import shapes
from margrpo_jax.models import text
from margrpo_jax.models.diffusion_head import SimpleMLPAdaLN
from margrpo_jax.models.mar import MARBackbone


def tiny_config() -> ml_collections.ConfigDict:
  """Default architecture of the shipped shapes-world model."""
  return ml_collections.ConfigDict(dict(
      family="tiny",
      seq_len=64, token_dim=48,
      text=dict(max_len=12, width=128, depth=2, num_heads=4),
      backbone=dict(width=128, encoder_depth=3, decoder_depth=3, num_heads=4, mlp_ratio=4.0, pos_init="sincos"),
      head=dict(width=128, depth=3),
      diffusion=dict(num_train_steps=1000, sampling_steps="25"),
  ))


class TinyMAR(nnx.Module):
  """Components: ``text_encoder`` (condition), ``backbone`` (AR transformer), ``head`` (diffusion head)."""

  policy_components = ("text_encoder", "backbone")  # what RL trains (plus ``head`` when it is not frozen)
  condition_ndim = 2  # conditions are token ids (B, T)

  def __init__(self, cfg: ml_collections.ConfigDict, *, rngs: nnx.Rngs):
    b = cfg.backbone
    self.text_encoder = text.TextEncoder(vocab_size=len(text.VOCAB), out_dim=b.width, rngs=rngs, **cfg.text)
    self.backbone = MARBackbone(seq_len=cfg.seq_len, token_dim=cfg.token_dim, buffer_size=cfg.text.max_len,
                                rngs=rngs, **b)
    self.head = SimpleMLPAdaLN(token_dim=cfg.token_dim, cond_dim=b.width, rngs=rngs, **cfg.head)

  def condition(self, ids: jax.Array) -> jax.Array:
    """Token ids (B, T) -> buffer tokens (B, T, D)."""
    return self.text_encoder(ids)

  def null_condition(self, batch: int) -> jax.Array:
    return self.text_encoder.null(batch)

  def tokenize(self, prompts):
    return text.tokenize(prompts, self.text_encoder.max_len)

  @staticmethod
  def prompt_ids(model_cfg: ml_collections.ConfigDict, prompts: list[str]) -> np.ndarray:
    """Shapes-world token ids (N, text.max_len) int32."""
    return text.tokenize(prompts, model_cfg.text.max_len)

  @staticmethod
  def decode_images(model_cfg: ml_collections.ConfigDict, tokens: np.ndarray) -> np.ndarray:
    """Token canvases (N, 64, 48) -> (N, 32, 32, 3) uint8 images (the 4 x 4 patches put back in place)."""
    return np.asarray(shapes.unpatchify(tokens))

