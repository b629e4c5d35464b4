"""MAR's diffusion head ``SimpleMLPAdaLN`` (docs/models.md section 1.4): an MLP of AdaLN residual blocks.

``y = TimeEmbed(t) + CondEmbed(z)``; each block: ``(shift, scale, gate) = W(SiLU(y))``,
``x <- x + gate * MLP(LN(x) * (1 + scale) + shift)``; final: ``Linear(LN(x) * (1 + scale) + shift)`` with a
non-affine LayerNorm. Output ``[eps_hat | v]`` (2 x token channels). ``t`` is the original 0..999 index.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from margrpo_jax.models.layers import layer_norm, linear

zeros = nnx.initializers.zeros_init()


def timestep_embedding(t: jax.Array, dim: int = 256, max_period: float = 10000.0) -> jax.Array:
  """Sinusoidal embedding laid out ``[cos | sin]`` with ``dim/2`` frequencies ``exp(-ln(P) i / (dim/2))``."""
  half = dim // 2
  freqs = jnp.exp(-math.log(max_period) * jnp.arange(half, dtype=jnp.float32) / half)
  args = t.astype(jnp.float32)[..., None] * freqs
  return jnp.concatenate([jnp.cos(args), jnp.sin(args)], axis=-1)


class TimestepEmbedder(nnx.Module):
  def __init__(self, width: int, freq_dim: int = 256, *, rngs: nnx.Rngs):
    init = nnx.initializers.normal(0.02)
    self.freq_dim = freq_dim
    self.fc1 = linear(freq_dim, width, rngs, kernel_init=init)
    self.fc2 = linear(width, width, rngs, kernel_init=init)

  def __call__(self, t):
    return self.fc2(jax.nn.silu(self.fc1(timestep_embedding(t, self.freq_dim))))


def _modulate(x, shift, scale):
  return x * (1 + scale) + shift


class ResBlock(nnx.Module):
  def __init__(self, width: int, *, rngs: nnx.Rngs):
    self.in_ln = layer_norm(width, rngs)
    self.fc1 = linear(width, width, rngs)
    self.fc2 = linear(width, width, rngs)
    self.ada_ln = linear(width, 3 * width, rngs, kernel_init=zeros)

  def __call__(self, x, y):
    shift, scale, gate = jnp.split(self.ada_ln(jax.nn.silu(y)), 3, axis=-1)
    h = self.fc2(jax.nn.silu(self.fc1(_modulate(self.in_ln(x), shift, scale))))
    return x + gate * h


class FinalLayer(nnx.Module):
  def __init__(self, width: int, out_dim: int, *, rngs: nnx.Rngs):
    self.norm_final = layer_norm(width, rngs, affine=False)
    self.ada_ln = linear(width, 2 * width, rngs, kernel_init=zeros)
    self.linear = linear(width, out_dim, rngs, kernel_init=zeros)

  def __call__(self, x, y):
    shift, scale = jnp.split(self.ada_ln(jax.nn.silu(y)), 2, axis=-1)
    return self.linear(_modulate(self.norm_final(x), shift, scale))


class SimpleMLPAdaLN(nnx.Module):
  def __init__(self, *, token_dim: int, cond_dim: int, width: int, depth: int, rngs: nnx.Rngs):
    self.token_dim = token_dim
    self.time_embed = TimestepEmbedder(width, rngs=rngs)
    self.cond_embed = linear(cond_dim, width, rngs)
    self.input_proj = linear(token_dim, width, rngs)
    self.res_blocks = nnx.List([ResBlock(width, rngs=rngs) for _ in range(depth)])
    self.final_layer = FinalLayer(width, 2 * token_dim, rngs=rngs)

  def __call__(self, x: jax.Array, t: jax.Array, z: jax.Array) -> jax.Array:
    """``x`` (..., C) noisy token, ``t`` (...) original timestep, ``z`` (..., D) AR latent -> (..., 2C)."""
    y = self.time_embed(t) + self.cond_embed(z)
    x = self.input_proj(x)
    for blk in self.res_blocks:
      x = blk(x, y)
    return self.final_layer(x, y)
