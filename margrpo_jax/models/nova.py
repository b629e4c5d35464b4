r"""NOVA text-to-image (baaivision/NOVA ``NOVATransformer3DModel`` + its Phi-2 encoder), docs/models.md section 3.

Components (top-level attributes; RL trains ``backbone`` only, docs/algorithm.md section 9):

- ``text_encoder``: Phi-2 (:mod:`margrpo_jax.models.phi2`), frozen.
- ``null_text`` (512, 2560): NOVA's ``text_embed.weight`` buffer, the "null" text rows (frozen).
- ``backbone`` (D = width): ``text_embed`` Linear(2560 -> D) + LN; ``video_pos_embed`` (2-D sin-cos of the video
  grid + ``LN(MLP(sincos_t(0)))``); ``mask_embed`` (``bos_token``, ``mask_token``); ``video_encoder`` (16
  post-norm blocks); ``image_encoder`` (32 post-norm blocks, MAE split 16 + 16, 2-D sin-cos of the image grid);
  ``motion_embed`` for video variants only (its weights are kept; text-to-video generation is not implemented).
- ``head``: ``DiffusionMLP`` (``image_decoder``), frozen (``fix_head``).

Post-norm block (LN eps 1e-5): ``x <- x + LN1(Attn(x))``, ``x <- x + LN2(MLP(x))`` (exact GELU, fused qkv).
Tokens are 2 x 2 patches of the 4-channel VAE latent laid out ``(ph, pw, c)`` (16 values); a patch-embed conv
with kernel (p, p, c, D) is the Linear ``token @ kernel.reshape(p p c, D)``.

Condition (once per image): Phi-2 states overwrite the first ``len(prompt)`` rows of ``null_text[:256]`` ->
``text_embed`` -> ``video_encoder([text ; BOS grid])`` -> ``c`` = its output at the grid positions (B, Lv, D).
Backbone (every AR step): tokens = patch-embed(canvas), ``mask_token`` where unknown, + 2-D sin-cos; the first 16
blocks see ``[c ; known tokens]`` (a key mask: equivalent to NOVA's gather of ``prev_ids``), the known outputs are
put back into the grid, the last 16 blocks see ``[c ; all]``; output ``LN(x[:, Lv:])`` (B, L, D).
Head ``DiffusionMLP(x, t, z)``: ``cond = Proj_c(z) + Proj_t(sincos_256(t))`` ([cos | sin]); blocks
``(scale, shift, gate) = W(SiLU(cond))``, ``x <- x + gate * LN2(Proj(LN0(x) (1 + scale) + shift))``; final
``(scale, shift)`` AdaLN and Linear W -> 16 (the velocity ``eps - x0`` of the patch).

How to use:
    python -m margrpo_jax.convert --family=nova --src=nova-d48w1024-sdxl1024/transformer --out=NOVA   # + Phi-2
    model_cfg.tokenizer_path = "nova-d48w1024-sdxl1024/tokenizer"; model_cfg.vae_checkpoint = <sdvae export>
    ids = NOVA.prompt_ids(model_cfg, prompts)                # (N, 256) int32, -1 = padding
    fn = NOVA.make_sample_fn(graphdef, model_cfg, config.sampling)   # margrpo_jax/sampling/nova.py
    tokens, _ = fn(params, ids, jax.random.key(0))          # (N, L, 16) scaled-latent tokens
    images = NOVA.decode_images(model_cfg, tokens)           # -> (N, H, W, 3) uint8
"""
from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from margrpo_jax.models import families, phi2, vae
from margrpo_jax.models.diffusion_head import timestep_embedding
from margrpo_jax.models.layers import Attention, linear, Mlp, scan_blocks
from margrpo_jax.sampling import nova as nova_sampling

# variant -> width, heads, (head depth, head width), image token grid, video grid (t, h, w), VAE scale
# (docs/models.md section 3.1)
VARIANTS = {
    "d48w768-sdxl1024": (768, 12, (6, 768), (64, 64), (1, 32, 32), 0.13025),
    "d48w1024-sdxl1024": (1024, 16, (6, 1024), (64, 64), (1, 32, 32), 0.13025),
    "d48w1536-sdxl1024": (1536, 16, (6, 1536), (64, 64), (1, 32, 32), 0.13025),
    "d48w1024-sd512": (1024, 16, (6, 1024), (32, 32), (1, 16, 16), 0.18215),
    "d48w1024-osp480": (1024, 16, (3, 1280), (30, 48), (16, 15, 24), None),  # T2V: OpenSora VAE (not supported)
}


def nova_config(variant: str = "d48w1024-sdxl1024", **overrides) -> ml_collections.ConfigDict:
  """The model config of a released NOVA variant (``overrides`` update top-level keys, e.g. for tiny tests)."""
  if variant not in VARIANTS:
    raise ValueError(f"NOVA variant {variant!r} is not one of {', '.join(VARIANTS)}")
  width, heads, (hd, hw), image, video, scale = VARIANTS[variant]
  cfg = ml_collections.ConfigDict(dict(
      family="nova", variant=variant, width=width, num_heads=heads, mlp_ratio=4.0, video_depth=16, image_depth=32,
      encoder_depth=16, patch_size=2, latent_channels=4, image_base_size=list(image), video_base_size=list(video),
      seq_len=image[0] * image[1], token_dim=16,
      text=dict(max_len=256, token_dim=2560, null_rows=512, pad_id=phi2.PAD_ID),
      head=dict(width=hw, depth=hd),
      text_encoder=phi2.phi2_config().to_dict(),
      diffusion=dict(kind="flow", num_train_steps=1000, shift=1.0, sampling_steps=25),
      vae_scale=scale, tokenizer_path="", vae_checkpoint="",
  ))
  cfg.update(overrides)
  return cfg


def sincos_2d(h: int, w: int, dim: int) -> np.ndarray:
  """(h w, dim) fixed embedding ``[sin(j f), cos(j f), sin(i f), cos(i f)]``, f_k = 1e4^(-k/(dim/4)), row-major."""
  f = 1.0 / 10000 ** (np.arange(dim // 4, dtype=np.float64) / (dim // 4))
  i, j = np.meshgrid(np.arange(h, dtype=np.float64), np.arange(w, dtype=np.float64), indexing="ij")
  fi, fj = i.reshape(-1, 1) * f, j.reshape(-1, 1) * f
  return np.concatenate([np.sin(fj), np.cos(fj), np.sin(fi), np.cos(fi)], axis=-1).astype(np.float32)


def sincos_time(t: jax.Array, dim: int = 256) -> jax.Array:
  """NOVA's time / motion embedding ``[sin | cos]`` with ``dim/2`` freqs ``1e4^(-i/(dim/2))``."""
  f = 1.0 / 10000 ** (jnp.arange(dim // 2, dtype=jnp.float32) / (dim // 2))
  a = jnp.asarray(t, jnp.float32)[..., None] * f
  return jnp.concatenate([jnp.sin(a), jnp.cos(a)], axis=-1)


def _ln(dim: int, rngs: nnx.Rngs, eps: float = 1e-5, affine: bool = True) -> nnx.LayerNorm:
  return nnx.LayerNorm(dim, epsilon=eps, use_bias=affine, use_scale=affine, rngs=rngs)


class PatchEmbed(nnx.Module):
  """``Conv2d(c -> D, k = s = p)`` (converter: ``proj``), applied to (ph, pw, c)-ordered patch tokens."""

  def __init__(self, channels: int, dim: int, patch: int, *, rngs: nnx.Rngs):
    self.proj = nnx.Conv(channels, dim, (patch, patch), strides=patch, padding="VALID", rngs=rngs)

  def __call__(self, tokens: jax.Array) -> jax.Array:
    k = self.proj.kernel[...]
    return tokens @ k.reshape(-1, k.shape[-1]) + self.proj.bias[...]


class Projector(nnx.Module):
  """``fc2(SiLU(fc1(x)))`` (NOVA's ``Projector`` and the ``Linear, SiLU, Linear`` time MLPs)."""

  def __init__(self, din: int, dim: int, *, rngs: nnx.Rngs):
    self.fc1 = linear(din, dim, rngs)
    self.fc2 = linear(dim, dim, rngs)

  def __call__(self, x):
    return self.fc2(jax.nn.silu(self.fc1(x)))


class PostNormBlock(nnx.Module):
  """NOVA's ViT block: ``x + LN1(Attn(x))``, then ``x + LN2(MLP(x))`` (LN eps 1e-5)."""

  def __init__(self, dim: int, num_heads: int, mlp_ratio: float = 4.0, *, rngs: nnx.Rngs):
    self.norm1 = _ln(dim, rngs)
    self.attn = Attention(dim, num_heads, rngs=rngs)
    self.norm2 = _ln(dim, rngs)
    self.mlp = Mlp(dim, int(dim * mlp_ratio), rngs=rngs)

  def __call__(self, x, key_mask=None):
    x = x + self.norm1(self.attn(x, key_mask))
    return x + self.norm2(self.mlp(x))


class VisionTransformer(nnx.Module):
  """``patch_embed``, ``blocks``, ``norm``; a prefix ``c`` and, optionally, the MAE split at ``encoder_depth``."""

  def __init__(self, dim: int, depth: int, num_heads: int, patch: int, channels: int, encoder_depth: int,
               mlp_ratio: float = 4.0, *, rngs: nnx.Rngs):
    self.encoder_depth = encoder_depth
    self.patch_embed = PatchEmbed(channels, dim, patch, rngs=rngs)
    self.blocks = nnx.List([PostNormBlock(dim, num_heads, mlp_ratio, rngs=rngs) for _ in range(depth)])
    self.norm = _ln(dim, rngs)

  def __call__(self, x: jax.Array, c: jax.Array, known: jax.Array | None = None) -> jax.Array:
    """``x`` (B, L, D) embedded tokens, ``c`` (B, P, D) prefix, ``known`` (B, L) bool -> (B, L, D)."""
    p = c.shape[1]
    h = jnp.concatenate([c, x], axis=1)
    blocks = list(self.blocks)
    if known is not None:
      key_mask = jnp.concatenate([jnp.ones(c.shape[:2], bool), known], axis=1)
      h = scan_blocks(blocks[:self.encoder_depth], h, key_mask)
      h = jnp.concatenate([h[:, :p], jnp.where(known[..., None], h[:, p:], x)], axis=1)
      blocks = blocks[self.encoder_depth:]
    h = scan_blocks(blocks, h)  # one lax.scan per group: a sharded run gathers one block's weights at a time
    return self.norm(h[:, p:])


class TextEmbed(nnx.Module):
  def __init__(self, token_dim: int, dim: int, *, rngs: nnx.Rngs):
    self.proj = linear(token_dim, dim, rngs)
    self.norm = _ln(dim, rngs)

  def __call__(self, x):
    return self.norm(self.proj(x))


class VideoPosEmbed(nnx.Module):
  """``time_proj`` (Linear 256 -> D, SiLU, Linear) + ``norm``; the 2-D sin-cos part has no parameters."""

  def __init__(self, dim: int, *, rngs: nnx.Rngs):
    self.time_proj = Projector(256, dim, rngs=rngs)
    self.norm = _ln(dim, rngs)

  def time(self, t) -> jax.Array:
    return self.norm(self.time_proj(sincos_time(t)))


class MaskEmbed(nnx.Module):
  def __init__(self, dim: int, *, rngs: nnx.Rngs):
    init = nnx.initializers.normal(0.02)
    self.bos_token = nnx.Param(init(rngs.params(), (1, dim)))
    self.mask_token = nnx.Param(init(rngs.params(), (1, dim)))


class MotionEmbed(nnx.Module):
  """Video variants only: ``flow_proj`` / ``fps_proj`` (Linear 256 -> D, SiLU, Linear)."""

  def __init__(self, dim: int, *, rngs: nnx.Rngs):
    self.flow_proj = Projector(256, dim, rngs=rngs)
    self.fps_proj = Projector(256, dim, rngs=rngs)


class NOVABackbone(nnx.Module):
  """Everything of the transformer but the diffusion MLP (what RL trains)."""

  def __init__(self, cfg: ml_collections.ConfigDict, *, rngs: nnx.Rngs):
    d, c, p = cfg.width, cfg.latent_channels, cfg.patch_size
    self.width, self.seq_len, self.token_dim = d, cfg.seq_len, cfg.token_dim
    self.image_grid, self.video_grid = tuple(cfg.image_base_size), tuple(cfg.video_base_size[1:])
    self.text_embed = TextEmbed(cfg.text.token_dim, d, rngs=rngs)
    self.video_pos_embed = VideoPosEmbed(d, rngs=rngs)
    self.mask_embed = MaskEmbed(d, rngs=rngs)
    self.video_encoder = VisionTransformer(d, cfg.video_depth, cfg.num_heads, 2 * p, c, 0, cfg.mlp_ratio, rngs=rngs)
    self.image_encoder = VisionTransformer(d, cfg.image_depth, cfg.num_heads, p, c, cfg.encoder_depth,
                                           cfg.mlp_ratio, rngs=rngs)
    if cfg.video_base_size[0] > 1:
      self.motion_embed = MotionEmbed(d, rngs=rngs)

  def encode_text(self, text: jax.Array) -> jax.Array:
    """Text features (B, T, 2560) -> the video encoder's condition ``c`` (B, Lv, D) for the first frame."""
    b = text.shape[0]
    grid = self.mask_embed.bos_token[...] + self.video_pos_embed.time(0.0) + sincos_2d(*self.video_grid, self.width)
    c = self.video_encoder(jnp.broadcast_to(grid, (b,) + grid.shape), self.text_embed(text))
    chex.assert_shape(c, (b, self.video_grid[0] * self.video_grid[1], self.width))
    return c

  def __call__(self, canvas: jax.Array, mask: jax.Array, cond: jax.Array) -> jax.Array:
    """Canvas (B, L, 16), ``mask`` (B, L) True = unknown, ``cond`` (B, Lv, D) -> AR latents z (B, L, D)."""
    b = canvas.shape[0]
    chex.assert_shape(canvas, (b, self.seq_len, self.token_dim))
    chex.assert_shape(mask, (b, self.seq_len))
    x = self.image_encoder.patch_embed(canvas)
    x = jnp.where(mask[..., None], self.mask_embed.mask_token[...], x) + sincos_2d(*self.image_grid, self.width)
    return self.image_encoder(x, cond, ~mask)


class AdaLN(nnx.Module):
  """``proj(SiLU(cond))`` split into ``num`` stats; ``LN0(x) (1 + scale) + shift`` (eps 1e-6), rest returned."""

  def __init__(self, dim: int, num: int, *, rngs: nnx.Rngs):
    self.num = num
    self.proj = linear(dim, num * dim, rngs)
    self.norm = _ln(dim, rngs, eps=1e-6, affine=False)

  def __call__(self, x, cond):
    stats = jnp.split(self.proj(jax.nn.silu(cond)), self.num, axis=-1)
    return self.norm(x) * (1 + stats[0]) + stats[1], stats[2:]


class TimeCondEmbed(nnx.Module):
  def __init__(self, cond_dim: int, dim: int, *, rngs: nnx.Rngs):
    self.timestep_proj = Projector(256, dim, rngs=rngs)
    self.condition_proj = Projector(cond_dim, dim, rngs=rngs)

  def __call__(self, t, z):
    return self.condition_proj(z) + self.timestep_proj(timestep_embedding(t, 256))


class DiffusionBlock(nnx.Module):
  def __init__(self, dim: int, *, rngs: nnx.Rngs):
    self.norm1 = AdaLN(dim, 3, rngs=rngs)
    self.proj = Projector(dim, dim, rngs=rngs)
    self.norm2 = _ln(dim, rngs)

  def __call__(self, x, cond):
    h, (gate,) = self.norm1(x, cond)
    return x + gate * self.norm2(self.proj(h))


class DiffusionMLP(nnx.Module):
  """NOVA's ``image_decoder``: ``head(x, t, z)`` -> velocity (..., 16) for tokens ``x`` (..., 16)."""

  def __init__(self, width: int, depth: int, cond_dim: int, patch: int = 2, channels: int = 4, *, rngs: nnx.Rngs):
    self.token_dim = patch * patch * channels
    self.patch_embed = PatchEmbed(channels, width, patch, rngs=rngs)
    self.time_cond_embed = TimeCondEmbed(cond_dim, width, rngs=rngs)
    self.blocks = nnx.List([DiffusionBlock(width, rngs=rngs) for _ in range(depth)])
    self.norm = AdaLN(width, 2, rngs=rngs)
    self.head = linear(width, self.token_dim, rngs)

  def __call__(self, x: jax.Array, t: jax.Array, z: jax.Array) -> jax.Array:
    """``x`` (..., 16), ``t`` float timesteps broadcastable to ``x.shape[:-1]`` (1000 sigma), ``z`` (..., D)."""
    chex.assert_equal(x.shape[-1], self.token_dim)
    cond = self.time_cond_embed(jnp.asarray(t, jnp.float32), z)
    h = self.patch_embed(x)
    for blk in self.blocks:
      h = blk(h, cond)
    return self.head(self.norm(h, cond)[0])


class NOVA(families.Generator):
  """Components: ``text_encoder`` (Phi-2), ``null_text``, ``backbone``, ``head`` (DiffusionMLP)."""

  policy_components = ("backbone",)  # official NOVA RL: the transformer without its head (fix_head=True)
  condition_ndim = 2  # conditions are Phi-2 token ids (B, 256), -1 = padding
  head_kind = "flow"
  fixed_sampling = {"temperature": 1.0, "cfg_schedule": "constant", "mask_schedule": "cos_round"}  # NOVA's loop

  def __init__(self, cfg: ml_collections.ConfigDict, *, rngs: nnx.Rngs):
    self.max_len, self.pad_id = cfg.text.max_len, cfg.text.pad_id
    self.text_encoder = phi2.Phi2(ml_collections.ConfigDict(cfg.text_encoder), rngs=rngs)
    self.null_text = nnx.Param(0.02 * jax.random.normal(rngs.params(), (cfg.text.null_rows, cfg.text.token_dim)))
    self.backbone = NOVABackbone(cfg, rngs=rngs)
    self.head = DiffusionMLP(cfg.head.width, cfg.head.depth, cfg.width, cfg.patch_size, cfg.latent_channels,
                             rngs=rngs)

  def text_features(self, ids: jax.Array) -> jax.Array:
    """(B, T) ids (-1 = padding) -> (B, T, 2560): Phi-2 states at the prompt's tokens, null rows elsewhere."""
    chex.assert_rank(ids, 2)
    valid = ids >= 0
    hidden = self.text_encoder(jnp.where(valid, ids, self.pad_id))  # causal: pads never reach the prompt
    return jnp.where(valid[..., None], hidden, self.null_text[...][:ids.shape[1]].astype(hidden.dtype))

  def condition(self, ids: jax.Array) -> jax.Array:
    return self.backbone.encode_text(self.text_features(ids))

  def null_condition(self, batch: int) -> jax.Array:
    null = self.null_text[...][:self.max_len]
    return self.backbone.encode_text(jnp.broadcast_to(null, (batch,) + null.shape))

  @staticmethod
  def prompt_ids(model_cfg: ml_collections.ConfigDict, prompts: list[str]) -> np.ndarray:
    """Phi-2 token ids (N, text.max_len) int32 from ``model_cfg.tokenizer_path``; -1 marks the padding."""
    return phi2.tokenize(prompts, model_cfg.get("tokenizer_path"), model_cfg.text.max_len)

  @staticmethod
  def make_sample_fn(graphdef, model_cfg: ml_collections.ConfigDict, sampling, record: bool = False):
    """NOVA's own jitted sampler ``fn(state, ids, key) -> (tokens, record)`` (flow head, NOVA mask schedule)."""
    if model_cfg.video_base_size[0] > 1:
      raise ValueError(f"NOVA {model_cfg.variant} is a text-to-video model; only text-to-image is implemented.")
    return nova_sampling.make_sample_fn(graphdef, nova_sampling.sampler_config(sampling), record)

  @staticmethod
  def decode_images(model_cfg: ml_collections.ConfigDict, tokens: np.ndarray) -> np.ndarray:
    """Token canvases (N, L, 16) of scaled latents -> (N, H, W, 3) uint8 through ``model_cfg.vae_checkpoint``."""
    return vae.decode_latents(model_cfg.get("vae_checkpoint"), unpatchify(model_cfg, tokens))


def unpatchify(model_cfg, tokens) -> np.ndarray:
  """(N, gh gw, p p c) tokens laid out (ph, pw, c) -> NHWC latents (N, gh p, gw p, c)."""
  (gh, gw), p, c = model_cfg.image_base_size, model_cfg.patch_size, model_cfg.latent_channels
  x = np.asarray(tokens).reshape(-1, gh, gw, p, p, c).transpose(0, 1, 3, 2, 4, 5)
  return x.reshape(-1, gh * p, gw * p, c)


def patchify(model_cfg, latents) -> np.ndarray:
  """NHWC latents -> (N, gh gw, p p c) tokens (the inverse of :func:`unpatchify`)."""
  (gh, gw), p, c = model_cfg.image_base_size, model_cfg.patch_size, model_cfg.latent_channels
  x = np.asarray(latents).reshape(-1, gh, p, gw, p, c).transpose(0, 1, 3, 2, 4, 5)
  return x.reshape(-1, gh * gw, p * p * c)
