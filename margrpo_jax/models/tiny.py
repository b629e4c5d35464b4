"""The shapes-world text-to-image MAR: text encoder -> MAR backbone -> SimpleMLPAdaLN diffusion head.

Tokens are either the latents of the shapes-world tokenizer (``model.vae_checkpoint``: a KL autoencoder export,
32 x 32 x 3 -> 4 x 4 x 8, so 16 tokens of 8 values; MAR's own design with KL-16) or, with no tokenizer, the raw
4 x 4 RGB patches of the image (64 tokens of 48 values). Widths and depths come from the model config, so the same
classes build MAR-B/L/H-shaped backbones.
"""
from __future__ import annotations

import jax
import ml_collections
import numpy as np
from absl import logging
from flax import nnx

from margrpo_jax import checkpoint
from margrpo_jax.data import shapes
from margrpo_jax.models import families, text, vae
from margrpo_jax.models.diffusion_head import SimpleMLPAdaLN
from margrpo_jax.models.mar import MARBackbone


def tiny_config(vae_checkpoint: str = "") -> ml_collections.ConfigDict:
  """Architecture of the shapes-world model: on the latents of ``vae_checkpoint`` (a shipped asset name such as
  ``'shapes_tokenizer'`` or a VAE export folder), or on raw patches when it is empty."""
  seq_len, token_dim = (shapes.NUM_TOKENS, shapes.TOKEN_DIM) if not vae_checkpoint else token_layout(vae_checkpoint)
  return ml_collections.ConfigDict(dict(
      family="tiny", vae_checkpoint=vae_checkpoint,
      seq_len=seq_len, token_dim=token_dim,
      text=dict(max_len=12, width=128, depth=2, num_heads=4),
      backbone=dict(width=128, encoder_depth=3, decoder_depth=3, num_heads=4, mlp_ratio=4.0, pos_init="sincos"),
      head=dict(width=128, depth=3),
      diffusion=dict(num_train_steps=1000, sampling_steps="25"),
  ))


def token_layout(vae_checkpoint: str) -> tuple[int, int]:
  """``(seq_len, token_dim)`` of the tokens the tokenizer export ``vae_checkpoint`` makes from a 32 x 32 image."""
  cfg = checkpoint.read_model_config(checkpoint.resolve(vae_checkpoint), "model.vae_checkpoint", family="vae")
  grid = shapes.IMAGE_SIZE // 2 ** (len(cfg.ch_mult) - 1)
  return grid * grid, int(cfg.embed_dim)


def check_tokenizer(model_cfg: ml_collections.ConfigDict, what: str = "model") -> None:
  """Raise :class:`checkpoint.CheckpointError` in one sentence when ``model_cfg``'s token layout is not the one its
  tokenizer (or the raw patches) produces."""
  path = model_cfg.get("vae_checkpoint", "")
  want = token_layout(path) if path else (shapes.NUM_TOKENS, shapes.TOKEN_DIM)
  got = (model_cfg.seq_len, model_cfg.token_dim)
  if got != want:
    src = f"the tokenizer {path!r}" if path else "raw 4 x 4 patches (no vae_checkpoint)"
    raise checkpoint.CheckpointError(f"{what}: seq_len={got[0]}, token_dim={got[1]} do not match {src}, which "
                                     f"makes {want[0]} tokens of {want[1]} values.")


class TinyMAR(families.Generator):
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

  check_config = staticmethod(check_tokenizer)

  def tokenize(self, prompts):
    return text.tokenize(prompts, self.text_encoder.max_len)

  @staticmethod
  def prompt_ids(model_cfg: ml_collections.ConfigDict, prompts: list[str]) -> np.ndarray:
    """Shapes-world token ids (N, text.max_len) int32; prompts longer than that are cut, with one warning."""
    longest = max((text.num_words(p) for p in prompts), default=0)
    if longest > model_cfg.text.max_len:
      over = sum(text.num_words(p) > model_cfg.text.max_len for p in prompts)
      logging.warning("%d prompt(s) have more than the %d words the model reads (the longest: %d); each is cut to "
                      "its first %d words.", over, model_cfg.text.max_len, longest, model_cfg.text.max_len)
    return text.tokenize(prompts, model_cfg.text.max_len)

  @staticmethod
  def decode_images(model_cfg: ml_collections.ConfigDict, tokens: np.ndarray) -> np.ndarray:
    """Token canvases (N, L, C) -> (N, 32, 32, 3) uint8 images: through the tokenizer's decoder, or the 4 x 4
    patches put back in place."""
    if model_cfg.get("vae_checkpoint"):
      return vae.decode_tokens(checkpoint.resolve(model_cfg.vae_checkpoint), tokens)
    return np.asarray(shapes.unpatchify(tokens))

  @staticmethod
  def encode_images(model_cfg: ml_collections.ConfigDict, images: np.ndarray) -> np.ndarray:
    """uint8 images (N, 32, 32, 3) -> token canvases (N, L, C) (tokenizer mode latents, or raw patches)."""
    if model_cfg.get("vae_checkpoint"):
      return vae.encode_tokens(checkpoint.resolve(model_cfg.vae_checkpoint), images)
    return np.asarray(shapes.patchify(images))

