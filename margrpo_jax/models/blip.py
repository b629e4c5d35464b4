"""BLIP (ViT + BERT with cross-attention) and ImageReward v1.0 (docs/rewards.md section 2.3).

* ``visual``: timm-style pre-LN ViT (:class:`~margrpo_jax.models.layers.Block`, LayerNorm eps 1e-6, exact GELU):
  ``x = [cls; conv_p(img)] + pos``, blocks, final ``norm``; all ``1 + (S/p)^2`` tokens are returned.
* ``text``: BLIP's ``med.py`` BERT (post-LN, eps 1e-12, no token-type table): ``h = LN(word + pos)``, then per
  layer ``h = LN(h + SelfAttn(h, pad mask))``, ``h = LN(h + CrossAttn(h, image tokens))`` (key/value project
  the vision width to the text width), ``h = LN(h + W2 gelu(W1 h))``.
* ``head``: ImageReward's ``MLP`` (768 -> 1024 -> 128 -> 64 -> 16 -> 1) whose ReLUs are commented out upstream,
  so it is an affine map; reward ``r = (head(h[:, 0]) - mean) / std`` with the package's mean/std.

Input pixels are NHWC, already resized and normalised (see :mod:`margrpo_jax.rewards.imagereward`).
"""
from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from margrpo_jax.models.layers import Block, layer_norm, linear, normal_param

# ImageReward.py: (r - mean) / std over its training set
IMAGEREWARD_MEAN = 0.16717362830052426
IMAGEREWARD_STD = 1.0333394966054072


def imagereward_config(**overrides) -> ml_collections.ConfigDict:
  """ImageReward v1.0 (BLIP ViT-L/16 @ 224 + BERT-base, vocab 30524 = bert-base-uncased + [DEC], [ENC])."""
  cfg = ml_collections.ConfigDict(dict(
      family="imagereward", image_size=224, patch_size=16, max_len=35,
      vision=dict(width=1024, depth=24, num_heads=16, mlp_ratio=4.0),
      text=dict(vocab_size=30524, width=768, depth=12, num_heads=12, intermediate=3072, max_positions=512),
      head_dims=[1024, 128, 64, 16], mean=IMAGEREWARD_MEAN, std=IMAGEREWARD_STD))
  cfg.update_from_flattened_dict(overrides)
  return cfg


def attend(q: jax.Array, k: jax.Array, v: jax.Array, num_heads: int, key_mask: jax.Array | None = None):
  """Multi-head softmax attention: q (B, N, D), k/v (B, M, D), key_mask (B, M) bool -> (B, N, D)."""
  b, n, d = q.shape
  split = lambda x: x.reshape(x.shape[0], x.shape[1], num_heads, d // num_heads)
  logits = jnp.einsum("bqhd,bkhd->bhqk", split(q), split(k)) * (d // num_heads) ** -0.5
  if key_mask is not None:
    logits = jnp.where(key_mask[:, None, None, :], logits, jnp.finfo(logits.dtype).min)
  probs = jax.nn.softmax(logits, axis=-1)
  return jnp.einsum("bhqk,bkhd->bqhd", probs, split(v)).reshape(b, n, d)


def bert_norm(dim: int, rngs: nnx.Rngs) -> nnx.LayerNorm:
  return nnx.LayerNorm(dim, epsilon=1e-12, rngs=rngs)


class VisionTransformer(nnx.Module):
  """BLIP's ``visual_encoder`` (timm ``VisionTransformer`` names: patch_embed, cls_token, pos_embed, blocks, norm)."""

  def __init__(self, image_size: int, patch_size: int, width: int, depth: int, num_heads: int, mlp_ratio: float,
               *, rngs: nnx.Rngs):
    self.patch_size, self.width = patch_size, width
    self.num_tokens = 1 + (image_size // patch_size) ** 2
    self.patch_embed = nnx.Conv(3, width, (patch_size, patch_size), strides=(patch_size, patch_size),
                                padding="VALID", rngs=rngs)
    self.cls_token = normal_param(rngs, (1, 1, width))
    self.pos_embed = normal_param(rngs, (1, self.num_tokens, width))
    self.blocks = nnx.List([Block(width, num_heads, mlp_ratio, rngs=rngs) for _ in range(depth)])
    self.norm = layer_norm(width, rngs)

  def __call__(self, pixels: jax.Array) -> jax.Array:
    """(B, S, S, 3) normalised pixels -> (B, 1 + (S/p)^2, width) tokens."""
    b = pixels.shape[0]
    x = self.patch_embed(pixels)
    x = x.reshape(b, -1, self.width)  # row-major patches, as torch's flatten(2).transpose(1, 2)
    x = jnp.concatenate([jnp.broadcast_to(self.cls_token[...], (b, 1, self.width)), x], axis=1)
    chex.assert_shape(x, (b, self.num_tokens, self.width))
    x = x + self.pos_embed[...]
    for blk in self.blocks:
      x = blk(x)
    return self.norm(x)


class BertAttention(nnx.Module):
  """``query/key/value`` -> attention -> ``dense`` -> ``norm(dense + x)`` (BertSelfAttention + BertSelfOutput)."""

  def __init__(self, width: int, kv_width: int, num_heads: int, *, rngs: nnx.Rngs):
    self.num_heads = num_heads
    self.query = linear(width, width, rngs)
    self.key = linear(kv_width, width, rngs)
    self.value = linear(kv_width, width, rngs)
    self.dense = linear(width, width, rngs)
    self.norm = bert_norm(width, rngs)

  def __call__(self, x: jax.Array, kv: jax.Array, key_mask: jax.Array | None = None) -> jax.Array:
    ctx = attend(self.query(x), self.key(kv), self.value(kv), self.num_heads, key_mask)
    return self.norm(self.dense(ctx) + x)


class BertLayer(nnx.Module):
  def __init__(self, width: int, encoder_width: int, num_heads: int, intermediate: int, *, rngs: nnx.Rngs):
    self.attention = BertAttention(width, width, num_heads, rngs=rngs)
    self.crossattention = BertAttention(width, encoder_width, num_heads, rngs=rngs)
    self.intermediate = linear(width, intermediate, rngs)
    self.output = linear(intermediate, width, rngs)
    self.output_norm = bert_norm(width, rngs)

  def __call__(self, h, mask, image_tokens):
    h = self.attention(h, h, mask)
    h = self.crossattention(h, image_tokens)  # every image token is attended to (BLIP's image_atts = 1)
    return self.output_norm(self.output(jax.nn.gelu(self.intermediate(h), approximate=False)) + h)


class BertText(nnx.Module):
  """BLIP's ``text_encoder`` (med.py ``BertModel``, no pooler) with cross-attention in every layer."""

  def __init__(self, vocab_size: int, width: int, depth: int, num_heads: int, intermediate: int,
               max_positions: int, encoder_width: int, *, rngs: nnx.Rngs):
    self.width = width
    init = nnx.initializers.normal(0.02)
    self.word_embeddings = nnx.Embed(vocab_size, width, embedding_init=init, rngs=rngs)
    self.position_embeddings = nnx.Embed(max_positions, width, embedding_init=init, rngs=rngs)
    self.norm = bert_norm(width, rngs)
    self.layers = nnx.List([BertLayer(width, encoder_width, num_heads, intermediate, rngs=rngs)
                            for _ in range(depth)])

  def __call__(self, ids: jax.Array, mask: jax.Array, image_tokens: jax.Array) -> jax.Array:
    """ids, mask (B, L) -> hidden states (B, L, width)."""
    chex.assert_equal_shape([ids, mask])
    chex.assert_rank(image_tokens, 3)
    h = self.norm(self.word_embeddings(ids) + self.position_embeddings(jnp.arange(ids.shape[1]))[None])
    for layer in self.layers:
      h = layer(h, mask.astype(bool), image_tokens)
    return h


class ImageReward(nnx.Module):
  """BLIP ViT + cross-attention BERT + affine head; ``__call__`` is the normalised ImageReward score (B,)."""

  def __init__(self, cfg: ml_collections.ConfigDict, *, rngs: nnx.Rngs):
    v, t = cfg.vision, cfg.text
    self.mean, self.std = float(cfg.mean), float(cfg.std)
    self.visual = VisionTransformer(cfg.image_size, cfg.patch_size, v.width, v.depth, v.num_heads, v.mlp_ratio,
                                    rngs=rngs)
    self.text = BertText(t.vocab_size, t.width, t.depth, t.num_heads, t.intermediate, t.max_positions, v.width,
                         rngs=rngs)
    dims = [t.width, *cfg.head_dims, 1]
    self.head = nnx.List([linear(a, b, rngs) for a, b in zip(dims[:-1], dims[1:])])

  def raw(self, pixels: jax.Array, ids: jax.Array, mask: jax.Array) -> jax.Array:
    """The head's output before normalisation, (B,)."""
    b = pixels.shape[0]
    chex.assert_shape(ids, (b, None))
    x = self.text(ids, mask, self.visual(pixels))[:, 0]
    for lin in self.head:  # no activations: the upstream ReLUs are commented out
      x = lin(x)
    return x[:, 0]

  def __call__(self, pixels: jax.Array, ids: jax.Array, mask: jax.Array) -> jax.Array:
    return (self.raw(pixels, ids, mask) - self.mean) / self.std
