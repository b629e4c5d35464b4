"""MAR as released (LTH14/mar): class-conditional, KL-16 latents (16 channels, 16 x 16 tokens at 256 px).

The class embedding (or, for CFG and label drop, the learned ``fake_latent``) fills all ``buffer_size``
buffer slots of the backbone (docs/models.md section 1.2). ``class_emb`` and ``fake_latent`` live inside the
``backbone`` component, so the two components are exactly the "AR transformer" and "diffusion head" columns
of docs/models.md section 1.7 (MAR-B: 172,174,848 + 35,749,920 parameters).

Prompts are class labels ("207" or "class 207"); sampled tokens are KL-16 latents (x 0.2325, raster order)
decoded by the KL-16 export named by ``model_cfg.vae_checkpoint`` (``python -m margrpo_jax.convert --family=kl16``).
"""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from margrpo_jax.models import families, vae
from margrpo_jax.models.diffusion_head import SimpleMLPAdaLN
from margrpo_jax.models.layers import normal_param
from margrpo_jax.models.mar import MARBackbone

# size -> (width, encoder/decoder depth, heads, head depth, head width), docs/models.md section 1.1
SIZES = {"base": (768, 12, 12, 6, 1024), "large": (1024, 16, 16, 8, 1280), "huge": (1280, 20, 16, 12, 1536)}


def mar_config(size: str = "base") -> ml_collections.ConfigDict:
  if size not in SIZES:
    raise ValueError(f"MAR size {size!r} is not one of {', '.join(SIZES)}")
  width, depth, heads, head_depth, head_width = SIZES[size]
  return ml_collections.ConfigDict(dict(
      family="mar", size=size, num_classes=1000, buffer_size=64, seq_len=256, token_dim=16,
      backbone=dict(width=width, encoder_depth=depth, decoder_depth=depth, num_heads=heads, mlp_ratio=4.0,
                    pos_init="normal"),
      head=dict(width=head_width, depth=head_depth),
      diffusion=dict(num_train_steps=1000, sampling_steps="100"),
      vae_checkpoint="",  # the KL-16 export that decodes the tokens (set at sampling time)
  ))


class ClassConditionedBackbone(MARBackbone):
  """:class:`MARBackbone` plus MAR's ``class_emb`` (num_classes, D) and ``fake_latent`` (1, D)."""

  def __init__(self, *, num_classes: int, rngs: nnx.Rngs, **kw):
    super().__init__(rngs=rngs, **kw)
    self.class_emb = nnx.Embed(num_classes, self.width, embedding_init=nnx.initializers.normal(0.02), rngs=rngs)
    self.fake_latent = normal_param(rngs, (1, self.width))

  def condition(self, labels: jax.Array) -> jax.Array:
    """(B,) int class labels -> buffer tokens (B, buffer, D)."""
    emb = self.class_emb(labels)
    return jnp.broadcast_to(emb[:, None], (labels.shape[0], self.buffer_size, self.width))

  def null(self, batch: int) -> jax.Array:
    return jnp.broadcast_to(self.fake_latent[...][None], (batch, self.buffer_size, self.width))


class ClassMAR(families.Generator):
  """Components: ``backbone`` (AR transformer with the class embedding) and ``head`` (SimpleMLPAdaLN)."""

  policy_components = ("backbone",)
  condition_ndim = 1  # conditions are class labels (B,)

  def __init__(self, cfg: ml_collections.ConfigDict, *, rngs: nnx.Rngs):
    self.backbone = ClassConditionedBackbone(num_classes=cfg.num_classes, seq_len=cfg.seq_len,
                                             token_dim=cfg.token_dim, buffer_size=cfg.buffer_size, rngs=rngs,
                                             **cfg.backbone)
    self.head = SimpleMLPAdaLN(token_dim=cfg.token_dim, cond_dim=cfg.backbone.width, rngs=rngs, **cfg.head)

  def condition(self, labels: jax.Array) -> jax.Array:
    return self.backbone.condition(labels)

  def null_condition(self, batch: int) -> jax.Array:
    return self.backbone.null(batch)

  @staticmethod
  def prompt_ids(model_cfg: ml_collections.ConfigDict, prompts: list[str]) -> np.ndarray:
    """Class labels (N,) int32 from prompts like ``"207"`` or ``"class 207"``."""
    out = []
    for p in prompts:
      m = re.fullmatch(r"\s*(?:class\s*)?(\d+)\s*", p, re.IGNORECASE)
      if not m or int(m.group(1)) >= model_cfg.num_classes:
        raise ValueError(f"MAR prompt {p!r} is not a class label in 0..{model_cfg.num_classes - 1} "
                         "(write '207' or 'class 207').")
      out.append(int(m.group(1)))
    return np.asarray(out, np.int32)

  @staticmethod
  def decode_images(model_cfg: ml_collections.ConfigDict, tokens: np.ndarray) -> np.ndarray:
    """Token canvases (N, seq_len, 16) -> (N, 16 * grid, 16 * grid, 3) uint8 through the KL-16 export."""
    return vae.decode_tokens(model_cfg.get("vae_checkpoint"), tokens)

