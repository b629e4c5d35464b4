"""Transformer building blocks, named like timm's ViT ``Block`` so that converters map keys 1:1.

Pre-norm block: ``x <- x + Attn(LN1(x))``, ``x <- x + MLP(LN2(x))``; LayerNorm eps 1e-6; fused ``qkv``
projection laid out ``[q | k | v]`` x ``(heads, head_dim)``; softmax attention scaled by ``head_dim^-1/2``
with an optional key mask and/or (query, key) mask; exact (erf) GELU MLP. No dropout: rollouts and RL forwards
are deterministic.
"""
from __future__ import annotations

import contextlib
import contextvars

import jax
import jax.numpy as jnp
from flax import nnx

from margrpo_jax.parallel import sharding

xavier = nnx.initializers.xavier_uniform()


def linear(din: int, dout: int, rngs: nnx.Rngs, **kw) -> nnx.Linear:
  """``nnx.Linear`` with MAR's init (xavier-uniform kernel, zero bias) unless overridden."""
  kw.setdefault("kernel_init", xavier)
  return nnx.Linear(din, dout, rngs=rngs, **kw)


def layer_norm(dim: int, rngs: nnx.Rngs, affine: bool = True) -> nnx.LayerNorm:
  return nnx.LayerNorm(dim, epsilon=1e-6, use_bias=affine, use_scale=affine, rngs=rngs)


def normal_param(rngs: nnx.Rngs, shape, std: float = 0.02) -> nnx.Param:
  return nnx.Param(std * jax.random.normal(rngs.params(), shape))


class Attention(nnx.Module):
  def __init__(self, dim: int, num_heads: int, *, rngs: nnx.Rngs):
    if dim % num_heads:
      raise ValueError(f"width {dim} is not divisible by num_heads {num_heads}")
    self.num_heads = num_heads
    self.qkv = linear(dim, 3 * dim, rngs)
    self.proj = linear(dim, dim, rngs)

  def __call__(self, x: jax.Array, key_mask: jax.Array | None = None, *, mask: jax.Array | None = None) -> jax.Array:
    """``x``: (B, N, D); ``key_mask``: (B, N) bool, True where a key may be attended to; ``mask``: (N, N) bool
    (or broadcastable to (B, heads, N, N)), True where query i may attend to key j."""
    b, n, d = x.shape
    h = self.num_heads
    q, k, v = jnp.moveaxis(self.qkv(x).reshape(b, n, 3, h, d // h), 2, 0)
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) * (d // h) ** -0.5
    if key_mask is not None:
      logits = jnp.where(key_mask[:, None, None, :], logits, jnp.finfo(logits.dtype).min)
    if mask is not None:
      logits = jnp.where(mask, logits, jnp.finfo(logits.dtype).min)
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1).astype(v.dtype)
    return self.proj(jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, n, d))


class Mlp(nnx.Module):
  def __init__(self, dim: int, hidden: int, *, rngs: nnx.Rngs):
    self.fc1 = linear(dim, hidden, rngs)
    self.fc2 = linear(hidden, dim, rngs)

  def __call__(self, x):
    return self.fc2(jax.nn.gelu(self.fc1(x), approximate=False))


class Block(nnx.Module):
  """timm ``Block``: pre-norm self-attention and MLP with residuals."""

  def __init__(self, dim: int, num_heads: int, mlp_ratio: float = 4.0, *, rngs: nnx.Rngs):
    self.norm1 = layer_norm(dim, rngs)
    self.attn = Attention(dim, num_heads, rngs=rngs)
    self.norm2 = layer_norm(dim, rngs)
    self.mlp = Mlp(dim, int(dim * mlp_ratio), rngs=rngs)

  def __call__(self, x, key_mask=None):
    x = x + self.attn(self.norm1(x), key_mask)
    return x + self.mlp(self.norm2(x))


_REMAT = contextvars.ContextVar("remat_blocks", default=False)


@contextlib.contextmanager
def remat_blocks(on: bool = True):
  """While tracing inside this context, :func:`scan_blocks` recomputes each block in the backward pass."""
  token = _REMAT.set(on)
  try:
    yield
  finally:
    _REMAT.reset(token)


def scan_blocks(blocks, x: jax.Array, *args) -> jax.Array:
  """``x <- block(x, *args)`` for each of the identical ``blocks`` in turn, as one ``lax.scan`` over their stacked
  parameters: the compiled program holds one block, not ``len(blocks)`` (compile time; every AR-step shape of the
  sampler is its own program). The carry ``x`` (B, N, D) stays split over the batch axes
  (:func:`sharding.constrain_batch`); inside :func:`remat_blocks` the backward pass keeps only each block's input
  (B, N, D) and recomputes the rest (attention probabilities, MLP hiddens: (B, heads, N, N) and (B, N, 4D) per
  block otherwise)."""
  if len(blocks) == 0:
    return x
  graphdef = nnx.split(blocks[0])[0]
  stacked = jax.tree.map(lambda *a: jnp.stack(a), *[nnx.split(b)[1] for b in blocks])

  def body(h, state):
    return sharding.constrain_batch(nnx.merge(graphdef, state)(h, *args)), None

  if _REMAT.get():
    body = jax.checkpoint(body, prevent_cse=False)
  return jax.lax.scan(body, sharding.constrain_batch(x), stacked)[0]
