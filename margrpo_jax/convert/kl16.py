"""MAR's KL-16 tokenizer ``kl16.ckpt`` (``{'model': state_dict}``, LDM layout) -> :class:`models.vae.AutoencoderKL`.

Also the layout-independent walk over the VAE tree shared with ``convert/sdvae.py``: a :class:`Names` object
says where each part of the network lives in the source (docs/models.md sections 1.5 / 3.5,
``tests/fixtures/keys/keys_kl16_vae.txt``):

    encoder.conv_in | encoder.down.{i}.block.{j}.{norm1,conv1,norm2,conv2,nin_shortcut}
    encoder.down.{i}.attn.{j}.{norm,q,k,v,proj_out} (1x1 convs) | encoder.down.{i}.downsample.conv
    encoder.mid.{block_1,attn_1,block_2} | encoder.norm_out | encoder.conv_out | quant_conv | post_quant_conv
    decoder.conv_in | decoder.mid.* | decoder.up.{i}.block.{j} | decoder.up.{i}.upsample.conv | decoder.norm_out ...

The architecture (widths, levels, blocks, attention levels) is read from the weights; GroupNorm groups (32) and
the latent scale (0.2325) are KL-16's.

    python -m margrpo_jax.convert --family=kl16 --src=pretrained_models/vae/kl16.ckpt --out=KL16
"""
from __future__ import annotations

import dataclasses
from typing import Callable

from margrpo_jax.convert.core import ConversionError, Converter, abstract_params
from margrpo_jax.models import vae

PREFER = ("model", "state_dict")


@dataclasses.dataclass(frozen=True)
class Names:
  """Source key prefixes of one layout (``level(part, i, n)`` is level ``i`` of ``n`` in our numbering)."""
  level: Callable[[str, int, int], str]  # (part, i, n) -> prefix of level i
  block: str                    # ResBlocks inside a level
  attn: str                     # attention blocks inside a level
  down: str                     # downsampling conv inside an encoder level
  up: str                       # upsampling conv inside a decoder level
  mid: tuple[str, str, str]     # mid ResBlock, attention, ResBlock
  norm_out: str
  shortcut: str
  attn_parts: tuple[str, str, str, str, str]  # norm, q, k, v, proj_out
  attn_conv: bool               # q/k/v/proj_out stored as 1x1 convs (LDM) rather than Linears (diffusers)


LDM = Names(level=lambda part, i, n: f"{part}.{'down' if part == 'encoder' else 'up'}.{i}", block="block",
            attn="attn", down="downsample.conv", up="upsample.conv", mid=("mid.block_1", "mid.attn_1", "mid.block_2"),
            norm_out="norm_out", shortcut="nin_shortcut", attn_parts=("norm", "q", "k", "v", "proj_out"),
            attn_conv=True)


def _count(sd, prefix) -> int:
  """How many of ``prefix(0), prefix(1), ...`` start some key (stops at the first absent one)."""
  i = 0
  while any(k.startswith(prefix(i)) for k in sd):
    i += 1
  return i


def infer_architecture(sd, names: Names) -> dict:
  """Widths, levels, blocks per level, attention levels and latent sizes read from the weight shapes."""
  try:
    n = _count(sd, lambda i: names.level("encoder", i, 0) + ".")
    lvl = [names.level("encoder", i, n) for i in range(n)]
    ch = sd["encoder.conv_in.weight"].shape[0]
    attn = lambda part: tuple(i for i in range(n) if any(  # noqa: E731
        k.startswith(f"{names.level(part, i, n)}.{names.attn}.") for k in sd))
    return dict(ch=ch, ch_mult=tuple(sd[f"{p}.{names.block}.0.conv1.weight"].shape[0] // ch for p in lvl),
                num_res_blocks=_count(sd, lambda j: f"{lvl[0]}.{names.block}.{j}."),
                enc_attn_levels=attn("encoder"), dec_attn_levels=attn("decoder"),
                in_channels=sd["encoder.conv_in.weight"].shape[1], out_channels=sd["decoder.conv_out.weight"].shape[0],
                z_channels=sd["encoder.conv_out.weight"].shape[0] // 2, embed_dim=sd["post_quant_conv.weight"].shape[1])
  except (KeyError, IndexError, ZeroDivisionError) as e:
    raise ConversionError(f"cannot read the VAE architecture from the weights (missing {e}).") from e


def _res(conv: Converter, dst: str, src: str, names: Names) -> None:
  for n in ("norm1", "norm2"):
    conv.norm(f"{dst}/{n}", f"{src}.{n}")
  for n in ("conv1", "conv2"):
    conv.conv(f"{dst}/{n}", f"{src}.{n}")
  if f"{dst}/shortcut/kernel" in conv.want:
    conv.conv(f"{dst}/shortcut", f"{src}.{names.shortcut}")


def _attn(conv: Converter, dst: str, src: str, names: Names) -> None:
  norm, *proj = names.attn_parts
  conv.norm(f"{dst}/norm", f"{src}.{norm}")
  for ours, theirs in zip(("q", "k", "v", "proj_out"), proj):
    if names.attn_conv:  # 1x1 conv (out, in, 1, 1) == Linear (out, in)
      conv.copy(f"{dst}/{ours}/kernel", f"{src}.{theirs}.weight", lambda w: w[:, :, 0, 0].T)
      conv.copy(f"{dst}/{ours}/bias", f"{src}.{theirs}.bias")
    else:
      conv.dense(f"{dst}/{ours}", f"{src}.{theirs}")


def fill(conv: Converter, names: Names, prefix: str = "") -> None:
  """Map every parameter of an :class:`AutoencoderKL` target from ``prefix``-ed source keys named by ``names``."""
  for part, levels, resample in (("encoder", "down", names.down), ("decoder", "up", names.up)):
    conv.conv(f"{part}/conv_in", f"{prefix}{part}.conv_in")
    conv.conv(f"{part}/conv_out", f"{prefix}{part}.conv_out")
    conv.norm(f"{part}/norm_out", f"{prefix}{part}.{names.norm_out}")
    _res(conv, f"{part}/mid/block_1", f"{prefix}{part}.{names.mid[0]}", names)
    _attn(conv, f"{part}/mid/attn_1", f"{prefix}{part}.{names.mid[1]}", names)
    _res(conv, f"{part}/mid/block_2", f"{prefix}{part}.{names.mid[2]}", names)
    n = len({p.split("/")[2] for p in conv.want if p.startswith(f"{part}/{levels}/")})
    for i in range(n):
      dst, src = f"{part}/{levels}/{i}", prefix + names.level(part, i, n)
      j = 0
      while f"{dst}/block/{j}/conv1/kernel" in conv.want:
        _res(conv, f"{dst}/block/{j}", f"{src}.{names.block}.{j}", names)
        if f"{dst}/attn/{j}/norm/scale" in conv.want:
          _attn(conv, f"{dst}/attn/{j}", f"{src}.{names.attn}.{j}", names)
        j += 1
      if f"{dst}/resample/kernel" in conv.want:
        conv.conv(f"{dst}/resample", f"{src}.{resample}")
  conv.conv("quant_conv", f"{prefix}quant_conv")
  conv.conv("post_quant_conv", f"{prefix}post_quant_conv")


def convert_vae(sd, names: Names, cfg, origin: str):
  """``(cfg, params, report)``: fill an abstract :class:`AutoencoderKL` of ``cfg`` from ``sd``."""
  conv = Converter(sd, abstract_params(cfg, lambda c: vae.AutoencoderKL(c, rngs=_rngs())), origin)
  fill(conv, names)
  return cfg, conv.result(), conv.report()


def convert(sd, origin: str = "checkpoint", size: str | None = None):
  """``(vae_cfg, params, report)`` for the flat state dict of ``kl16.ckpt`` (``size`` is unused)."""
  del size
  cfg = vae.vae_config("kl16", **infer_architecture(sd, LDM))
  return convert_vae(sd, LDM, cfg, origin)


def _rngs():
  from flax import nnx
  return nnx.Rngs(0)
