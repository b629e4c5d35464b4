"""The SD / SDXL VAE (diffusers ``AutoencoderKL`` layout, as NOVA ships it) -> :class:`models.vae.AutoencoderKL`.

Source: a ``vae/`` folder (``diffusion_pytorch_model.safetensors`` + ``config.json``) or one weights file; keys
(docs/models.md section 3.5; full list ``tests/fixtures/keys/keys_sd_sdxl_vae_diffusers.txt``; a leading ``vae.`` is
dropped when every key has it):

    encoder.down_blocks.{i}.resnets.{j}.{norm1,conv1,norm2,conv2,conv_shortcut} | .downsamplers.0.conv
    {encoder,decoder}.mid_block.{resnets.0, attentions.0.{group_norm,to_q,to_k,to_v,to_out.0}, resnets.1}
    decoder.up_blocks.{k}.resnets.{j} | .upsamplers.0.conv   (up block k is our level n-1-k: lowest resolution first)
    {encoder,decoder}.{conv_in,conv_norm_out,conv_out} | quant_conv | post_quant_conv

The architecture is read from the weights; ``norm_num_groups``, ``scaling_factor`` and ``shift_factor`` from the
``config.json`` beside the weights (docs/models.md section 6: not verified for NOVA, so read, not assumed).
Without a config.json, ``--size=sd`` (0.18215) or ``--size=sdxl`` (0.13025) chooses the scale.

    python -m margrpo_jax.convert --family=sdvae --src=BAAI/nova-d48w1024-sdxl1024/vae --out=SDXL_VAE
"""
from __future__ import annotations

import json
import os

from margrpo_jax.convert.core import ConversionError
from margrpo_jax.convert.kl16 import Names, convert_vae, infer_architecture
from margrpo_jax.models import vae

PREFER = ("state_dict",)

DIFFUSERS = Names(
    level=lambda part, i, n: f"encoder.down_blocks.{i}" if part == "encoder" else f"decoder.up_blocks.{n - 1 - i}",
    block="resnets", attn="attentions", down="downsamplers.0.conv", up="upsamplers.0.conv",
    mid=("mid_block.resnets.0", "mid_block.attentions.0", "mid_block.resnets.1"), norm_out="conv_norm_out",
    shortcut="conv_shortcut", attn_parts=("group_norm", "to_q", "to_k", "to_v", "to_out.0"), attn_conv=False)


def read_config(origin: str) -> dict:
  """The diffusers ``config.json`` in the folder ``origin`` or beside the file ``origin`` ({} when absent)."""
  folder = origin if os.path.isdir(origin) else os.path.dirname(os.path.abspath(origin))
  path = os.path.join(folder, "config.json")
  if not os.path.isfile(path):
    return {}
  with open(path) as f:
    return json.load(f)


def convert(sd, origin: str = "checkpoint", size: str | None = None):
  """``(vae_cfg, params, report)``; ``size`` (``sd`` | ``sdxl``) picks the default latent scale."""
  if sd and all(k.startswith("vae.") for k in sd):
    sd = {k[4:]: v for k, v in sd.items()}
  hf = read_config(origin)
  if size is not None and size not in ("sd", "sdxl"):
    raise ConversionError(f"--size={size!r} is not sd or sdxl.")
  if "scaling_factor" not in hf and size is None:
    raise ConversionError(f"no config.json with scaling_factor beside {origin}; pass --size=sd (0.18215) or "
                          "--size=sdxl (0.13025).")
  arch = infer_architecture(sd, DIFFUSERS)
  scale = float(hf.get("scaling_factor") or vae.KINDS[size]["scale"])
  kind = size or ("sd" if abs(scale - vae.KINDS["sd"]["scale"]) < 1e-6 else "sdxl")
  cfg = vae.vae_config(kind, **arch, scale=scale, shift=float(hf.get("shift_factor") or 0.0),
                       norm_groups=int(hf.get("norm_num_groups", 32)))
  return convert_vae(sd, DIFFUSERS, cfg, origin)
