"""The tiny text side of the shapes world: a word-level tokenizer and a small transformer text encoder.

The encoder's output tokens, projected to the backbone width, fill MAR's buffer slots; a learned null
embedding of the same shape replaces them for classifier-free guidance (and for label drop in training).
"""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from margrpo_jax.models.layers import Block, layer_norm, linear, normal_param

PAD, UNK = 0, 1
VOCAB = ("<pad>", "<unk>", "a", "above", "and", "below", "blue", "circle", "circles", "cyan", "four", "green",
         "left", "of", "purple", "red", "right", "square", "squares", "the", "three", "to", "triangle",
         "triangles", "two", "yellow")
_INDEX = {w: i for i, w in enumerate(VOCAB)}


def num_words(prompt: str) -> int:
  """The number of words :func:`tokenize` reads from ``prompt`` before cutting."""
  return len(re.findall(r"[a-z]+", prompt.lower()))


def tokenize(prompts: list[str], max_len: int) -> np.ndarray:
  """Lower-cased words -> ids (unknown words -> ``<unk>``), truncated / right-padded to ``max_len``."""
  out = np.full((len(prompts), max_len), PAD, np.int32)
  for i, p in enumerate(prompts):
    ids = [_INDEX.get(w, UNK) for w in re.findall(r"[a-z]+", p.lower())][:max_len]
    out[i, :len(ids)] = ids
  return out


class TextEncoder(nnx.Module):
  """Word embeddings + learned positions -> pre-norm transformer (pads masked) -> Linear to ``out_dim``."""

  def __init__(self, *, vocab_size: int, max_len: int, width: int, depth: int, num_heads: int, out_dim: int,
               rngs: nnx.Rngs):
    self.max_len = max_len
    self.embed = nnx.Embed(vocab_size, width, embedding_init=nnx.initializers.normal(0.02), rngs=rngs)
    self.pos_embed = normal_param(rngs, (1, max_len, width))
    self.blocks = nnx.List([Block(width, num_heads, rngs=rngs) for _ in range(depth)])
    self.norm = layer_norm(width, rngs)
    self.proj = linear(width, out_dim, rngs)
    self.null_embed = normal_param(rngs, (1, max_len, out_dim))

  def __call__(self, ids: jax.Array) -> jax.Array:
    """``ids`` (B, max_len) int -> buffer tokens (B, max_len, out_dim)."""
    x = self.embed(ids) + self.pos_embed[...]
    keep = (ids != PAD) | (jnp.arange(ids.shape[1]) == 0)  # never mask every key
    for blk in self.blocks:
      x = blk(x, keep)
    return self.proj(self.norm(x))

  def null(self, batch: int) -> jax.Array:
    """The unconditional (CFG / label-drop) buffer tokens, (batch, max_len, out_dim)."""
    return jnp.broadcast_to(self.null_embed[...], (batch,) + self.null_embed.shape[1:])
