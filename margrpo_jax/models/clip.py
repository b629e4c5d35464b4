"""CLIP (OpenAI / open_clip / Hugging Face ``CLIPModel``) in Flax NNX, and the LAION aesthetic heads.

Both towers are pre-LN transformers (LayerNorm eps 1e-5) with blocks ``x += Attn(LN1 x)``, ``x += MLP(LN2 x)``,
fused ``qkv`` laid out ``[q | k | v]`` x ``(heads, head_dim)``, softmax scaled by ``head_dim^-1/2``, MLP
``fc2(act(fc1 x))`` with ``act`` = exact-erf ``gelu`` (open_clip LAION models: HPS v2.1, PickScore) or
``quick_gelu`` ``x * sigmoid(1.702 x)`` (OpenAI models: ViT-L/14 of the aesthetic predictor, ViT-B/32).

* vision (B, S, S, 3) normalised pixels -> conv ``patch x patch`` stride ``patch`` (no bias) -> prepend the class
  embedding -> + positional embedding -> ``ln_pre`` -> blocks -> ``ln_post`` of the class token -> ``@ proj``.
* text (B, L) ids -> token + positional embedding -> blocks with a causal mask -> ``ln_final`` -> the token at
  ``argmax(ids)`` (the first ``<eot>``, the largest id) -> ``@ text_projection``. No padding mask: padding after
  ``<eot>`` cannot reach it through the causal mask.
* the blocks of a tower are stacked (``blocks/<leaf>`` has a leading layer axis) and run with ``lax.scan``.
* ``logit_scale`` is stored as a log: ``logits = exp(logit_scale) * cos``.

Known sizes (``SIZES``; the converters read every other dimension from the weights): ViT-B-32, ViT-B-16,
ViT-L-14 (OpenAI: quick_gelu) and ViT-H-14 (LAION / HPS / PickScore: gelu, vision head width 80).

    model = clip.CLIP(clip.clip_config("ViT-H-14"), rngs=nnx.Rngs(0))
    img, txt = model.encode_image(pixels), model.encode_text(ids)     # L2-normalised (B, embed_dim)
"""
from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from margrpo_jax.models.layers import Attention, linear, normal_param

LN_EPS = 1e-5
ACTS = {"gelu": lambda x: jax.nn.gelu(x, approximate=False), "quick_gelu": lambda x: x * jax.nn.sigmoid(1.702 * x)}
# name -> (embed_dim, patch, vision width, layers, heads, text width, layers, heads, act); image 224, context 77
SIZES = {
    "ViT-B-32": (512, 32, 768, 12, 12, 512, 12, 8, "quick_gelu"),
    "ViT-B-16": (512, 16, 768, 12, 12, 512, 12, 8, "quick_gelu"),
    "ViT-L-14": (768, 14, 1024, 24, 16, 768, 12, 12, "quick_gelu"),
    "ViT-H-14": (1024, 14, 1280, 32, 16, 1024, 24, 16, "gelu"),
}


def tower_config(width: int, layers: int, heads: int, mlp_dim: int | None = None, **kw) -> ml_collections.ConfigDict:
  return ml_collections.ConfigDict(dict(width=width, layers=layers, heads=heads, mlp_dim=mlp_dim or 4 * width, **kw))


def clip_config(size: str | None = None, *, embed_dim: int = 0, act: str = "gelu", vision=None, text=None
                ) -> ml_collections.ConfigDict:
  """A named size of ``SIZES``, or explicit ``vision`` / ``text`` tower configs (see :func:`tower_config`)."""
  if size is not None:
    if size not in SIZES:
      raise ValueError(f"CLIP size {size!r} is not one of {', '.join(SIZES)}.")
    embed_dim, patch, vw, vl, vh, tw, tl, th, act = SIZES[size]
    vision = tower_config(vw, vl, vh, image_size=224, patch_size=patch)
    text = tower_config(tw, tl, th, context_length=77, vocab_size=49408)
  if act not in ACTS:
    raise ValueError(f"CLIP act {act!r} is not one of {', '.join(ACTS)}.")
  return ml_collections.ConfigDict(dict(family="clip", embed_dim=embed_dim, act=act, vision=vision, text=text))


def _ln(dim: int, rngs: nnx.Rngs) -> nnx.LayerNorm:
  return nnx.LayerNorm(dim, epsilon=LN_EPS, rngs=rngs)


class Mlp(nnx.Module):
  def __init__(self, dim: int, hidden: int, act: str, *, rngs: nnx.Rngs):
    self.act = act
    self.fc1 = linear(dim, hidden, rngs)
    self.fc2 = linear(hidden, dim, rngs)

  def __call__(self, x):
    return self.fc2(ACTS[self.act](self.fc1(x)))


class Block(nnx.Module):
  """open_clip ``ResidualAttentionBlock`` / HF ``CLIPEncoderLayer`` (timm names, LayerNorm eps 1e-5)."""

  def __init__(self, c: ml_collections.ConfigDict, act: str, *, rngs: nnx.Rngs):
    self.norm1 = _ln(c.width, rngs)
    self.attn = Attention(c.width, c.heads, rngs=rngs)
    self.norm2 = _ln(c.width, rngs)
    self.mlp = Mlp(c.width, c.mlp_dim, act, rngs=rngs)

  def __call__(self, x, mask=None):
    x = x + self.attn(self.norm1(x), mask=mask)
    return x + self.mlp(self.norm2(x))


def _blocks(c, act, rngs) -> Block:
  """``c.layers`` blocks with stacked parameters (leading axis = layer), built in one vmapped call."""
  @nnx.split_rngs(splits=c.layers)
  @nnx.vmap(in_axes=(0,), out_axes=0, axis_size=c.layers)
  def make(r):
    return Block(c, act, rngs=r)
  return make(rngs)


def run_blocks(blocks: Block, x: jax.Array, mask: jax.Array | None = None) -> jax.Array:
  """Apply stacked blocks in order with ``lax.scan`` (one compiled block body for all layers)."""
  graphdef, state = nnx.split(blocks)
  return jax.lax.scan(lambda h, s: (nnx.merge(graphdef, s)(h, mask), None), x, state)[0]


class VisionTower(nnx.Module):
  def __init__(self, c: ml_collections.ConfigDict, embed_dim: int, act: str, *, rngs: nnx.Rngs):
    self.image_size, self.patch_size, w = c.image_size, c.patch_size, c.width
    n = (c.image_size // c.patch_size) ** 2
    self.patch_embed = nnx.Conv(3, w, (c.patch_size,) * 2, strides=(c.patch_size,) * 2, padding="VALID",
                                use_bias=False, rngs=rngs)
    self.class_embedding = normal_param(rngs, (w,))
    self.positional_embedding = normal_param(rngs, (n + 1, w))
    self.ln_pre = _ln(w, rngs)
    self.blocks = _blocks(c, act, rngs)
    self.ln_post = _ln(w, rngs)
    self.proj = normal_param(rngs, (w, embed_dim), std=w ** -0.5)

  def __call__(self, pixels: jax.Array) -> jax.Array:
    """(B, S, S, 3) normalised pixels -> (B, embed_dim) unnormalised image features."""
    chex.assert_shape(pixels, (None, self.image_size, self.image_size, 3))
    x = self.patch_embed(pixels)
    b, w = x.shape[0], x.shape[-1]
    x = jnp.concatenate([jnp.broadcast_to(self.class_embedding[...], (b, 1, w)), x.reshape(b, -1, w)], axis=1)
    x = self.ln_pre(x + self.positional_embedding[...])
    x = run_blocks(self.blocks, x)
    return self.ln_post(x[:, 0]) @ self.proj[...]


class TextTower(nnx.Module):
  def __init__(self, c: ml_collections.ConfigDict, embed_dim: int, act: str, *, rngs: nnx.Rngs):
    self.context_length = c.context_length
    self.token_embedding = nnx.Embed(c.vocab_size, c.width, rngs=rngs)
    self.positional_embedding = normal_param(rngs, (c.context_length, c.width), std=0.01)
    self.blocks = _blocks(c, act, rngs)
    self.ln_final = _ln(c.width, rngs)
    self.text_projection = normal_param(rngs, (c.width, embed_dim), std=c.width ** -0.5)

  def __call__(self, ids: jax.Array) -> jax.Array:
    """(B, L <= context) int ids -> (B, embed_dim) unnormalised text features, pooled at ``argmax(ids)``."""
    chex.assert_rank(ids, 2)
    n = ids.shape[1]
    if n > self.context_length:
      raise ValueError(f"text length {n} exceeds the context length {self.context_length}")
    x = self.token_embedding(ids) + self.positional_embedding[:n]
    causal = jnp.tril(jnp.ones((n, n), bool))
    x = self.ln_final(run_blocks(self.blocks, x, causal))
    return x[jnp.arange(x.shape[0]), jnp.argmax(ids, axis=-1)] @ self.text_projection[...]


def l2_normalize(x: jax.Array) -> jax.Array:
  return x / jnp.maximum(jnp.linalg.norm(x, axis=-1, keepdims=True), 1e-12)


class CLIP(nnx.Module):
  """Image and text towers plus ``logit_scale`` (a log); see the module docstring."""

  def __init__(self, cfg: ml_collections.ConfigDict, *, rngs: nnx.Rngs):
    self.vision = VisionTower(cfg.vision, cfg.embed_dim, cfg.act, rngs=rngs)
    self.text = TextTower(cfg.text, cfg.embed_dim, cfg.act, rngs=rngs)
    self.logit_scale = nnx.Param(jnp.asarray(np.log(1 / 0.07), jnp.float32))

  def encode_image(self, pixels: jax.Array, normalize: bool = True) -> jax.Array:
    f = self.vision(pixels)
    return l2_normalize(f) if normalize else f

  def encode_text(self, ids: jax.Array, normalize: bool = True) -> jax.Array:
    f = self.text(ids)
    return l2_normalize(f) if normalize else f

  def __call__(self, pixels: jax.Array, ids: jax.Array):
    """``(image_emb, text_emb, logits_per_image)``: normalised embeddings and ``exp(logit_scale) img @ txt.T``."""
    img, txt = self.encode_image(pixels), self.encode_text(ids)
    return img, txt, jnp.exp(self.logit_scale[...]) * img @ txt.T


def aesthetic_config(variant: str = "v2", dim: int = 768) -> ml_collections.ConfigDict:
  """LAION aesthetic head: v1 ``Linear(dim, 1)``; v2 ``dim -> 1024 -> 128 -> 64 -> 16 -> 1`` (no activations)."""
  dims = {"v1": [dim, 1], "v2": [dim, 1024, 128, 64, 16, 1]}
  if variant not in dims:
    raise ValueError(f"aesthetic variant {variant!r} is not one of v1, v2.")
  return ml_collections.ConfigDict(dict(family="aesthetic", variant=variant, dims=dims[variant]))


class AestheticHead(nnx.Module):
  """The aesthetic score of an L2-normalised CLIP image embedding (B, dim) -> (B,): a chain of Linears."""

  def __init__(self, cfg: ml_collections.ConfigDict, *, rngs: nnx.Rngs):
    dims = list(cfg.dims)
    self.dim = dims[0]
    self.layers = nnx.List([linear(a, b, rngs) for a, b in zip(dims[:-1], dims[1:])])

  def __call__(self, emb: jax.Array) -> jax.Array:
    chex.assert_shape(emb, (None, self.dim))
    for layer in self.layers:  # the official v2 MLP has dropouts but no nonlinearity between its Linears
      emb = layer(emb)
    return emb[:, 0]
