"""KL autoencoders in Flax NNX: MAR's KL-16 (LDM layout, docs/models.md 1.5) and the SD / SDXL VAE (diffusers
``AutoencoderKL`` layout, docs/models.md 3.5). Both layouts are the same network; only the key names differ, so one
module serves both and the converters (``convert/kl16.py``, ``convert/sdvae.py``) map the names.

Images are NHWC in [-1, 1]. With ``n = len(ch_mult)`` levels of ``ch * ch_mult[i]`` channels:

- encoder: ``conv_in`` 3x3 -> level i = 0..n-1: ``num_res_blocks`` ResBlocks (each followed by attention on the
  levels in ``enc_attn_levels``), then, except on the last level, Downsample = zero pad (bottom 1, right 1) and a
  3x3 stride-2 VALID conv -> ``mid`` (Res, Attn, Res) -> GN -> swish -> ``conv_out`` to 2 * z_channels.
- ``quant_conv`` 1x1 -> posterior ``mean | logvar`` (logvar clipped to [-30, 20]); the latent is the mode (mean).
- decoder: ``post_quant_conv`` 1x1 -> ``conv_in`` -> ``mid`` -> level i = n-1..0: ``num_res_blocks + 1``
  ResBlocks (attention on ``dec_attn_levels``), then, except on level 0, Upsample = nearest x2 and a 3x3 conv
  -> GN -> swish -> ``conv_out`` to 3 channels.
- ResBlock: GN -> swish -> conv3 -> GN -> swish -> conv3, plus a 1x1 ``shortcut`` conv when channels change.
- Attention: one head over the H*W positions: GN, q / k / v / proj_out (LDM 1x1 convs = diffusers Linears),
  softmax(q k^T C^-1/2) v, residual.
- GroupNorm: ``norm_groups`` groups (32), eps 1e-6.

Scaled latents: ``encode(x) = (mean - shift) * scale``; ``decode(z) = decoder(z / scale + shift)``
(KL-16: scale 0.2325; SD 1.x/2.x: 0.18215; SDXL: 0.13025; shift 0 unless the VAE's config.json sets one).

How to use::

    python -m margrpo_jax.convert --family=kl16 --src=kl16.ckpt --out=KL16          # MAR's tokenizer
    python -m margrpo_jax.convert --family=sdvae --src=NOVA/vae --out=SDXL_VAE       # diffusers vae/ folder
    images = vae.decode_latents(vae_dir, latents)   # scaled NHWC latents -> (N, H, W, 3) uint8
    images = vae.decode_tokens(vae_dir, tokens)     # MAR token canvas (N, L, C p p) -> uint8 images
"""
from __future__ import annotations

import functools
import os

import chex
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from margrpo_jax import checkpoint, fileio

# kind -> architecture (docs/models.md sections 1.5, 3.5; 'shapes': docs/tokenizer.md)
KINDS = {
    "kl16": dict(layout="ldm", ch=128, ch_mult=(1, 1, 2, 2, 4), num_res_blocks=2, enc_attn_levels=(4,),
                 dec_attn_levels=(), z_channels=16, embed_dim=16, scale=0.2325, shift=0.0),
    "sd": dict(layout="diffusers", ch=128, ch_mult=(1, 2, 4, 4), num_res_blocks=2, enc_attn_levels=(),
               dec_attn_levels=(), z_channels=4, embed_dim=4, scale=0.18215, shift=0.0),
    "sdxl": dict(layout="diffusers", ch=128, ch_mult=(1, 2, 4, 4), num_res_blocks=2, enc_attn_levels=(),
                 dec_attn_levels=(), z_channels=4, embed_dim=4, scale=0.13025, shift=0.0),
    # the shapes-world tokenizer (trained by configs/shapes_tokenizer.py): 32 x 32 -> 4 x 4 x 8, ~0.4 M params
    "shapes": dict(layout="diffusers", ch=16, ch_mult=(1, 2, 4, 4), num_res_blocks=1, enc_attn_levels=(),
                   dec_attn_levels=(), z_channels=8, embed_dim=8, scale=1.0, shift=0.0, norm_groups=8),
}


LAYOUTS = ("ldm", "diffusers")  # parameter names of the LDM (KL-16) and diffusers (SD / SDXL) checkpoints


def check_config(cfg: ml_collections.ConfigDict, what: str = "config.model") -> None:
  """The option values of an autoencoder config: its kind and layout, attention levels that exist."""
  if cfg.kind not in KINDS:
    raise ValueError(f"{what}.kind={cfg.kind!r} is not one of {', '.join(KINDS)}")
  if cfg.layout not in LAYOUTS:
    raise ValueError(f"{what}.layout={cfg.layout!r} is not one of {', '.join(LAYOUTS)}")
  for key in ("enc_attn_levels", "dec_attn_levels"):
    levels = cfg[key]
    if not isinstance(levels, (tuple, list)) or any(
        isinstance(l, bool) or not isinstance(l, int) or not 0 <= l < len(cfg.ch_mult) for l in levels):
      raise ValueError(f"{what}.{key}={levels!r} must be levels of ch_mult, integers in [0, {len(cfg.ch_mult)})")


def vae_config(kind: str = "kl16", **overrides) -> ml_collections.ConfigDict:
  """The architecture of ``kind`` (``kl16`` | ``sd`` | ``sdxl``), with ``overrides`` (e.g. tiny test widths)."""
  if kind not in KINDS:
    raise ValueError(f"VAE kind {kind!r} is not one of {', '.join(KINDS)}")
  c = dict(family="vae", kind=kind, in_channels=3, out_channels=3, norm_groups=32)
  c.update(KINDS[kind])
  c.update(overrides)
  return ml_collections.ConfigDict(c)


def _conv(cin: int, cout: int, k: int, rngs: nnx.Rngs, stride: int = 1) -> nnx.Conv:
  return nnx.Conv(cin, cout, (k, k), strides=stride, padding="SAME" if stride == 1 else "VALID", rngs=rngs)


def _norm(c: int, groups: int, rngs: nnx.Rngs) -> nnx.GroupNorm:
  return nnx.GroupNorm(c, num_groups=groups, epsilon=1e-6, use_fast_variance=False, rngs=rngs)


class ResBlock(nnx.Module):
  def __init__(self, cin: int, cout: int, groups: int, *, rngs: nnx.Rngs):
    self.norm1 = _norm(cin, groups, rngs)
    self.conv1 = _conv(cin, cout, 3, rngs)
    self.norm2 = _norm(cout, groups, rngs)
    self.conv2 = _conv(cout, cout, 3, rngs)
    self.shortcut = _conv(cin, cout, 1, rngs) if cin != cout else None

  def __call__(self, x):
    h = self.conv1(jax.nn.silu(self.norm1(x)))
    h = self.conv2(jax.nn.silu(self.norm2(h)))
    return (self.shortcut(x) if self.shortcut is not None else x) + h


class AttnBlock(nnx.Module):
  def __init__(self, c: int, groups: int, *, rngs: nnx.Rngs):
    self.norm = _norm(c, groups, rngs)
    self.q, self.k, self.v, self.proj_out = (nnx.Linear(c, c, rngs=rngs) for _ in range(4))

  def __call__(self, x):
    b, h, w, c = x.shape
    y = self.norm(x).reshape(b, h * w, c)
    logits = jnp.einsum("bqc,bkc->bqk", self.q(y), self.k(y)) * c ** -0.5
    out = jnp.einsum("bqk,bkc->bqc", jax.nn.softmax(logits, axis=-1), self.v(y))
    return x + self.proj_out(out).reshape(b, h, w, c)


class Level(nnx.Module):
  """ResBlocks (+ attention after each) and an optional resampling conv (``down`` or ``up``)."""

  def __init__(self, cin: int, cout: int, num_blocks: int, attn: bool, resample: str | None, groups: int, *,
               rngs: nnx.Rngs):
    self.block = nnx.List([ResBlock(cin if j == 0 else cout, cout, groups, rngs=rngs) for j in range(num_blocks)])
    self.attn = nnx.List([AttnBlock(cout, groups, rngs=rngs) for _ in range(num_blocks)] if attn else [])
    self.resample_kind = resample
    self.resample = None if resample is None else _conv(cout, cout, 3, rngs, stride=2 if resample == "down" else 1)

  def __call__(self, x):
    for j, blk in enumerate(self.block):
      x = blk(x)
      if len(self.attn):
        x = self.attn[j](x)
    if self.resample_kind == "down":
      x = self.resample(jnp.pad(x, ((0, 0), (0, 1), (0, 1), (0, 0))))
    elif self.resample_kind == "up":
      x = self.resample(jnp.repeat(jnp.repeat(x, 2, axis=1), 2, axis=2))
    return x


class Mid(nnx.Module):
  def __init__(self, c: int, groups: int, *, rngs: nnx.Rngs):
    self.block_1 = ResBlock(c, c, groups, rngs=rngs)
    self.attn_1 = AttnBlock(c, groups, rngs=rngs)
    self.block_2 = ResBlock(c, c, groups, rngs=rngs)

  def __call__(self, x):
    return self.block_2(self.attn_1(self.block_1(x)))


class Encoder(nnx.Module):
  def __init__(self, cfg, *, rngs: nnx.Rngs):
    chans, g, n = [cfg.ch * m for m in cfg.ch_mult], cfg.norm_groups, len(cfg.ch_mult)
    self.conv_in = _conv(cfg.in_channels, cfg.ch, 3, rngs)
    self.down = nnx.List([Level(([cfg.ch] + chans)[i], chans[i], cfg.num_res_blocks, i in cfg.enc_attn_levels,
                                "down" if i < n - 1 else None, g, rngs=rngs) for i in range(n)])
    self.mid = Mid(chans[-1], g, rngs=rngs)
    self.norm_out = _norm(chans[-1], g, rngs)
    self.conv_out = _conv(chans[-1], 2 * cfg.z_channels, 3, rngs)

  def __call__(self, x):
    x = self.conv_in(x)
    for level in self.down:
      x = level(x)
    return self.conv_out(jax.nn.silu(self.norm_out(self.mid(x))))


class Decoder(nnx.Module):
  def __init__(self, cfg, *, rngs: nnx.Rngs):
    chans, g, n = [cfg.ch * m for m in cfg.ch_mult], cfg.norm_groups, len(cfg.ch_mult)
    self.conv_in = _conv(cfg.z_channels, chans[-1], 3, rngs)
    self.mid = Mid(chans[-1], g, rngs=rngs)
    self.up = nnx.List([Level((chans + [chans[-1]])[i + 1], chans[i], cfg.num_res_blocks + 1,
                              i in cfg.dec_attn_levels, "up" if i > 0 else None, g, rngs=rngs) for i in range(n)])
    self.norm_out = _norm(chans[0], g, rngs)
    self.conv_out = _conv(chans[0], cfg.out_channels, 3, rngs)

  def __call__(self, z):
    x = self.mid(self.conv_in(z))
    for level in reversed(self.up):
      x = level(x)
    return self.conv_out(jax.nn.silu(self.norm_out(x)))


class AutoencoderKL(nnx.Module):
  """``posterior`` / ``encode`` (scaled mode) / ``decode`` (scaled latents -> images in [-1, 1])."""

  def __init__(self, cfg: ml_collections.ConfigDict, *, rngs: nnx.Rngs):
    self.scale, self.shift = float(cfg.scale), float(cfg.shift)
    self.stride = 2 ** (len(cfg.ch_mult) - 1)
    self.embed_dim = cfg.embed_dim
    self.encoder = Encoder(cfg, rngs=rngs)
    self.decoder = Decoder(cfg, rngs=rngs)
    self.quant_conv = _conv(2 * cfg.z_channels, 2 * cfg.embed_dim, 1, rngs)
    self.post_quant_conv = _conv(cfg.embed_dim, cfg.z_channels, 1, rngs)

  def posterior(self, images: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(B, H, W, 3) in [-1, 1] -> unscaled (mean, logvar), each (B, H / stride, W / stride, embed_dim)."""
    b, h, w, _ = images.shape
    chex.assert_equal(h % self.stride + w % self.stride, 0)
    mean, logvar = jnp.split(self.quant_conv(self.encoder(images)), 2, axis=-1)
    chex.assert_shape(mean, (b, h // self.stride, w // self.stride, self.embed_dim))
    return mean, jnp.clip(logvar, -30.0, 20.0)

  def encode(self, images: jax.Array) -> jax.Array:
    """Scaled latents ``(mode - shift) * scale``."""
    return (self.posterior(images)[0] - self.shift) * self.scale

  def decode(self, latents: jax.Array) -> jax.Array:
    """Scaled latents (B, h, w, embed_dim) -> images (B, h * stride, w * stride, 3), roughly in [-1, 1]."""
    b, h, w, _ = latents.shape
    chex.assert_shape(latents, (b, h, w, self.embed_dim))
    return self.decode_unscaled(latents / self.scale + self.shift)

  def decode_unscaled(self, z: jax.Array) -> jax.Array:
    """Unscaled latents (a posterior sample or mode) -> images."""
    return self.decoder(self.post_quant_conv(z))


def to_uint8(images) -> np.ndarray:
  """[-1, 1] images -> uint8 (clip, round((x + 1) / 2 * 255))."""
  x = np.clip(np.asarray(images, np.float32), -1.0, 1.0)
  return np.round((x + 1.0) / 2.0 * 255.0).astype(np.uint8)


@functools.lru_cache(maxsize=4)
def _load(path: str):
  cfg, graphdef, params = checkpoint.load_model(path)
  if cfg.family != "vae":
    raise checkpoint.CheckpointError(f"{path} holds a {cfg.family!r} model, not a VAE export "
                                     "(convert one with --family=kl16 or --family=sdvae).")
  decode = jax.jit(lambda p, z: nnx.merge(graphdef, p).decode(z))
  return cfg, graphdef, params, decode


@functools.lru_cache(maxsize=4)
def _encoder(path: str):
  _, graphdef, params, _ = _load(path)
  return params, jax.jit(lambda p, x: nnx.merge(graphdef, p).encode(x))


def load(path: str | None, what: str = "model.vae_checkpoint"):
  """``(vae_cfg, graphdef, params, jitted decode(params, latents))`` of a VAE export, loaded once per path."""
  if not path:
    raise checkpoint.CheckpointError(f"{what} is not set: convert the VAE with `python -m margrpo_jax.convert "
                          "--family=kl16` (or sdvae) and pass the output folder.")
  path = fileio.resolve(path)
  if not fileio.isfile(os.path.join(path, "model.json")):
    raise checkpoint.CheckpointError(f"{what}={path} is not a converted VAE export (no model.json inside).")
  return _load(path)


def unpatchify_latents(tokens: np.ndarray, channels: int) -> np.ndarray:
  """Raster-order tokens (N, g * g, channels * p * p), each laid out ``(c, ph, pw)``, -> latents
  (N, g * p, g * p, channels) NHWC."""
  n, length, dim = tokens.shape
  g, p = int(round(length ** 0.5)), int(round((dim // channels) ** 0.5))
  if g * g != length or channels * p * p != dim:
    raise ValueError(f"tokens of shape {tokens.shape} are not a square grid of {channels}-channel p x p patches.")
  x = np.asarray(tokens).reshape(n, g, g, channels, p, p).transpose(0, 1, 4, 2, 5, 3)
  return x.reshape(n, g * p, g * p, channels)


def decode_latents(path: str | None, latents: np.ndarray, what: str = "model.vae_checkpoint") -> np.ndarray:
  """Scaled NHWC latents -> (N, H, W, 3) uint8 through the VAE export at ``path``."""
  _, _, params, decode = load(path, what)
  return to_uint8(decode(params, jnp.asarray(latents, jnp.float32)))


def decode_tokens(path: str | None, tokens: np.ndarray, what: str = "model.vae_checkpoint") -> np.ndarray:
  """A MAR token canvas (N, L, C * p * p) of scaled latents -> (N, H, W, 3) uint8 (the family hook's body)."""
  cfg = load(path, what)[0]
  return decode_latents(path, unpatchify_latents(np.asarray(tokens, np.float32), cfg.embed_dim), what)


def encode_tokens(path: str | None, images: np.ndarray, what: str = "model.vae_checkpoint") -> np.ndarray:
  """uint8 images (N, H, W, 3) -> a token canvas (N, h * w, embed_dim) of scaled latents (posterior modes, raster
  order; one latent pixel per token)."""
  load(path, what)
  params, encode = _encoder(os.path.abspath(os.path.expanduser(path)))
  z = np.asarray(encode(params, jnp.asarray(images, jnp.float32) / 127.5 - 1.0))
  return z.reshape(z.shape[0], -1, z.shape[-1])
