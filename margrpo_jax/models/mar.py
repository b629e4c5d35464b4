"""The MAR backbone: an MAE-style bidirectional encoder over [buffer + visible tokens] and a decoder over
all positions, producing one latent ``z`` per image token for the diffusion head (docs/models.md section 1.2).

Dropping masked tokens (MAR's encoder) is implemented with a key mask over all positions (:meth:`encode`: the
outputs at visible and buffer positions are identical to running the encoder on the gathered visible set, shapes
static inside ``lax`` loops), or, at the official code's cost, on the gathered known tokens padded to a static
count (:meth:`encode_known`: the sampler's steps, and ``sampling.sampler.latents`` for the RL update's recorded
canvases). The conditioning arrives as ``buffer_size`` ready-made buffer tokens
(class embedding broadcast for MAR, text-encoder output for the text-to-image models).
"""
from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
from flax import nnx

from margrpo_jax.models.layers import Block, layer_norm, linear, normal_param, scan_blocks


def sincos_2d(grid: int, dim: int) -> jax.Array:
  """MAE's fixed 2D sin-cos table (grid^2, dim): half the channels encode the row, half the column."""
  def one_d(pos, d):
    omega = 1.0 / 10000 ** (jnp.arange(d // 2, dtype=jnp.float32) / (d / 2))
    out = pos[:, None] * omega[None]
    return jnp.concatenate([jnp.sin(out), jnp.cos(out)], axis=1)
  rows, cols = jnp.meshgrid(jnp.arange(grid, dtype=jnp.float32), jnp.arange(grid, dtype=jnp.float32), indexing="ij")
  return jnp.concatenate([one_d(rows.reshape(-1), dim // 2), one_d(cols.reshape(-1), dim // 2)], axis=1)


def _pos_param(rngs, buffer_size, seq_len, width, init):
  """Learned position table (1, buffer + L, D): MAR's N(0, 0.02) init, or (``'sincos'``) image positions
  started from the 2D sin-cos table so that positions are distinguishable from step 0 (training from
  scratch: MAR's tiny init leaves visible tokens' positions drowned by their content after the LayerNorm)."""
  p = normal_param(rngs, (1, buffer_size + seq_len, width))
  if init == "sincos":
    grid = int(round(seq_len ** 0.5))
    p = nnx.Param(p[...].at[0, buffer_size:].set(sincos_2d(grid, width)))
  elif init != "normal":
    raise ValueError(f"pos_init={init!r} is not one of 'normal', 'sincos'")
  return p


class MARBackbone(nnx.Module):
  def __init__(self, *, seq_len: int, token_dim: int, buffer_size: int, width: int, encoder_depth: int,
               decoder_depth: int, num_heads: int, mlp_ratio: float = 4.0, pos_init: str = "normal",
               pos_seq_len: int | None = None, rngs: nnx.Rngs):
    self.seq_len, self.token_dim, self.buffer_size, self.width = seq_len, token_dim, buffer_size, width
    self.pos_seq_len = pos_seq_len = pos_seq_len or seq_len  # learned tables' image length (resized if != seq_len)
    self.z_proj = linear(token_dim, width, rngs)
    self.z_proj_ln = layer_norm(width, rngs)
    self.encoder_pos_embed_learned = _pos_param(rngs, buffer_size, pos_seq_len, width, pos_init)
    self.encoder_blocks = nnx.List([Block(width, num_heads, mlp_ratio, rngs=rngs) for _ in range(encoder_depth)])
    self.encoder_norm = layer_norm(width, rngs)
    self.decoder_embed = linear(width, width, rngs)
    self.mask_token = normal_param(rngs, (1, 1, width))
    self.decoder_pos_embed_learned = _pos_param(rngs, buffer_size, pos_seq_len, width, pos_init)
    self.decoder_blocks = nnx.List([Block(width, num_heads, mlp_ratio, rngs=rngs) for _ in range(decoder_depth)])
    self.decoder_norm = layer_norm(width, rngs)
    self.diffusion_pos_embed_learned = nnx.Param(_pos_param(rngs, 0, pos_seq_len, width, pos_init)[...])

  def pos_table(self, table: nnx.Param, buffer: int) -> jax.Array:
    """``table`` (1, buffer + pos_seq_len, D) for ``seq_len`` image tokens: the buffer rows as they are, the
    image rows bilinearly resized (half-pixel, edge-clamped: PyTorch ``F.interpolate(align_corners=False)``
    when upsampling) from the learned square grid to the run-time one (Harmon at 512 px: 16^2 -> 32^2)."""
    t = table[...]
    if self.pos_seq_len == self.seq_len:
      return t
    g0, g1 = (int(round(n ** 0.5)) for n in (self.pos_seq_len, self.seq_len))
    img = t[0, buffer:].reshape(g0, g0, -1)
    img = jax.image.resize(img, (g1, g1, img.shape[-1]), "linear", antialias=False).reshape(1, g1 * g1, -1)
    return jnp.concatenate([t[:, :buffer], img.astype(t.dtype)], axis=1)

  def encode(self, tokens: jax.Array, mask: jax.Array, cond: jax.Array) -> tuple[jax.Array, jax.Array]:
    """MAE encoder: ``(x (B, buffer + L, D) after encoder_norm, visible (B, buffer + L) bool)``; rows at masked
    positions are computed but never seen by visible ones (key mask) and are replaced in :meth:`decode`."""
    b = tokens.shape[0]
    chex.assert_shape(tokens, (b, self.seq_len, self.token_dim))
    chex.assert_shape(mask, (b, self.seq_len))
    chex.assert_shape(cond, (b, self.buffer_size, self.width))
    visible = jnp.concatenate([jnp.ones((b, self.buffer_size), bool), ~mask.astype(bool)], axis=1)
    x = jnp.concatenate([cond.astype(tokens.dtype), self.z_proj(tokens)], axis=1)
    x = self.z_proj_ln(x + self.pos_table(self.encoder_pos_embed_learned, self.buffer_size))
    x = scan_blocks(self.encoder_blocks, x, visible)
    return self.encoder_norm(x), visible

  def encode_known(self, tokens: jax.Array, known: jax.Array, n_known, cond: jax.Array
                   ) -> tuple[jax.Array, jax.Array]:
    """MAR's encoder as the official code runs it, on the buffer and the known tokens only: ``known`` (B, K) are
    positions of which the first ``n_known`` (a traced int, or (B, 1) per row) are known, the rest key-masked padding. Returns
    ``(x, visible)`` over all ``buffer + L`` positions (zeros and False where not known), for :meth:`decode`;
    equal to :meth:`encode` with the mask that ``known`` [: n_known] leaves, at a cost of ``buffer + K`` tokens."""
    b, k = known.shape
    chex.assert_shape(tokens, (b, self.seq_len, self.token_dim))
    chex.assert_shape(cond, (b, self.buffer_size, self.width))
    rows, buf = jnp.arange(b)[:, None], self.buffer_size
    pos = self.pos_table(self.encoder_pos_embed_learned, buf)
    x = jnp.concatenate([cond.astype(tokens.dtype), self.z_proj(tokens[rows, known])], axis=1)
    x = self.z_proj_ln(x + jnp.concatenate([jnp.broadcast_to(pos[:, :buf], (b, buf, pos.shape[2])),
                                            pos[0, buf:][known]], axis=1))
    visible = jnp.concatenate([jnp.ones((b, buf), bool), jnp.broadcast_to(jnp.arange(k) < n_known, (b, k))], axis=1)
    x = scan_blocks(self.encoder_blocks, x, visible)
    x = self.encoder_norm(x)
    full = jnp.zeros((b, buf + self.seq_len, x.shape[-1]), x.dtype).at[:, :buf].set(x[:, :buf])
    full = full.at[rows, buf + known].set(x[:, buf:])
    seen = jnp.zeros((b, buf + self.seq_len), bool).at[:, :buf].set(True).at[rows, buf + known].set(visible[:, buf:])
    return full, seen

  def decode(self, x: jax.Array, visible: jax.Array) -> jax.Array:
    """MAE decoder over all positions (mask token where not ``visible``) -> z (B, L, D) for the head."""
    x = self.decoder_embed(x)
    x = jnp.where(visible[..., None], x, self.mask_token[...].astype(x.dtype))
    x = x + self.pos_table(self.decoder_pos_embed_learned, self.buffer_size)
    x = scan_blocks(self.decoder_blocks, x)
    x = self.decoder_norm(x)
    return x[:, self.buffer_size:] + self.pos_table(self.diffusion_pos_embed_learned, 0)

  def __call__(self, tokens: jax.Array, mask: jax.Array, cond: jax.Array) -> jax.Array:
    """``tokens`` (B, L, C) canvas, ``mask`` (B, L) with 1/True = unknown, ``cond`` (B, buffer, D) -> z (B, L, D)."""
    return self.decode(*self.encode(tokens, mask, cond))
