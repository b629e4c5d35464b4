"""NOVA (diffusers pipeline folder, docs/models.md section 3.6) -> :class:`~margrpo_jax.models.nova.NOVA`.

``--src`` is the ``transformer/`` folder (``diffusion_pytorch_model.safetensors``, keys
``tests/fixtures/keys/keys_nova-<variant>.txt``); Phi-2 is read from the sibling ``text_encoder/`` folder (keys
``tests/fixtures/keys/keys_phi2_text_encoder.txt``, ``lm_head`` ignored). The variant comes from ``--size`` (a name
of ``models.nova.VARIANTS``), else from the shapes (width, head depth / width, motion_embed), with
``transformer/config.json``'s ``image_size`` telling d48w1024-sdxl1024 from d48w1024-sd512.

    python -m margrpo_jax.convert --family=nova --src=nova-d48w1024-sdxl1024/transformer --out=NOVA_W1024

Mapping: ``text_embed.{proj,norm}`` -> ``backbone/text_embed``; the ``text_embed.weight`` buffer -> ``null_text``;
``video_pos_embed.time_proj.{0,2}`` -> ``time_proj/{fc1,fc2}``; ``mask_embed.*``, ``{video,image}_encoder.*`` and
``motion_embed.{flow,fps}_proj.{0,2}`` -> ``backbone/...``; ``image_decoder.*`` -> ``head/...``.
"""
from __future__ import annotations

import json
import os

from margrpo_jax.convert import phi2 as phi2_convert
from margrpo_jax.convert.core import ConversionError, Converter, abstract_params, blocks, read_checkpoint, state_dict
from margrpo_jax.models import nova

PREFER = ()
TEXT = "text_encoder."  # prefix of the Phi-2 keys inside the merged source dict


def infer_variant(sd, origin: str = "") -> str:
  """The released variant whose shapes match ``sd`` (config.json beside it breaks the w1024 tie)."""
  try:
    width = sd["text_embed.proj.weight"].shape[0]
    head = (sum(1 for k in sd if k.startswith("image_decoder.blocks.") and k.endswith(".norm2.weight")),
            sd["image_decoder.head.weight"].shape[1])
  except KeyError as e:
    raise ConversionError(f"{origin} has no key {e.args[0]!r}: not a NOVA transformer.") from None
  video = any(k.startswith("motion_embed.") for k in sd)
  found = [v for v, (w, _, hd, _, vg, _) in nova.VARIANTS.items() if w == width and hd == head and (vg[0] > 1) == video]
  cfg_file = os.path.join(origin, "config.json")
  if len(found) > 1 and os.path.isfile(cfg_file):
    with open(cfg_file) as f:
      size = json.load(f).get("image_size")
    size = size[0] if isinstance(size, (list, tuple)) else size
    found = [v for v in found if v.endswith(str(size))]
  if len(found) != 1:
    raise ConversionError(f"cannot tell the NOVA variant of {origin} (width {width}, head {head}): "
                          f"{'candidates ' + ', '.join(found) if found else 'no match'}; pass --size=<variant>.")
  return found[0]


def text_encoder_dict(origin: str) -> dict:
  """Phi-2 weights of the pipeline: ``<origin>/../text_encoder``."""
  folder = os.path.join(os.path.dirname(os.path.abspath(origin).rstrip("/")), "text_encoder")
  if not os.path.isdir(folder):
    raise ConversionError(f"Phi-2 weights not found: expected the pipeline's text_encoder/ folder at {folder} "
                          "(pass the transformer/ folder of a NOVA pipeline as --src).")
  return state_dict(read_checkpoint(folder), origin=folder)


def _vit(conv: Converter, src: str, dst: str) -> None:
  conv.conv(f"{dst}/patch_embed/proj", f"{src}.patch_embed.proj")
  blocks(conv, f"{dst}/blocks", f"{src}.blocks")
  conv.norm(f"{dst}/norm", f"{src}.norm")


def _seq_mlp(conv: Converter, src: str, dst: str) -> None:
  """``nn.Sequential(Linear, SiLU, Linear)`` -> Projector ``fc1 / fc2``."""
  conv.dense(f"{dst}/fc1", f"{src}.0")
  conv.dense(f"{dst}/fc2", f"{src}.2")


def convert_transformer(conv: Converter) -> None:
  b = "backbone"
  conv.dense(f"{b}/text_embed/proj", "text_embed.proj")
  conv.norm(f"{b}/text_embed/norm", "text_embed.norm")
  conv.copy("null_text", "text_embed.weight")
  _seq_mlp(conv, "video_pos_embed.time_proj", f"{b}/video_pos_embed/time_proj")
  conv.norm(f"{b}/video_pos_embed/norm", "video_pos_embed.norm")
  for n in ("bos_token", "mask_token"):
    conv.copy(f"{b}/mask_embed/{n}", f"mask_embed.{n}")
  _vit(conv, "video_encoder", f"{b}/video_encoder")
  _vit(conv, "image_encoder", f"{b}/image_encoder")
  if f"{b}/motion_embed/flow_proj/fc1/kernel" in conv.want:
    for n in ("flow_proj", "fps_proj"):
      _seq_mlp(conv, f"motion_embed.{n}", f"{b}/motion_embed/{n}")
  h, s = "head", "image_decoder"
  conv.conv(f"{h}/patch_embed/proj", f"{s}.patch_embed.proj")
  for n in ("timestep_proj", "condition_proj"):
    for fc in ("fc1", "fc2"):
      conv.dense(f"{h}/time_cond_embed/{n}/{fc}", f"{s}.time_cond_embed.{n}.{fc}")
  i = 0
  while f"{h}/blocks/{i}/norm2/scale" in conv.want:
    conv.dense(f"{h}/blocks/{i}/norm1/proj", f"{s}.blocks.{i}.norm1.proj")
    conv.dense(f"{h}/blocks/{i}/proj/fc1", f"{s}.blocks.{i}.proj.fc1")
    conv.dense(f"{h}/blocks/{i}/proj/fc2", f"{s}.blocks.{i}.proj.fc2")
    conv.norm(f"{h}/blocks/{i}/norm2", f"{s}.blocks.{i}.norm2")
    i += 1
  conv.dense(f"{h}/norm/proj", f"{s}.norm.proj")
  conv.dense(f"{h}/head", f"{s}.head")


def converter(sd, text_sd, model_cfg, origin: str = "checkpoint", target=None) -> Converter:
  """A :class:`Converter` with every NOVA + Phi-2 mapping applied (``target``: abstract params of ``model_cfg``)."""
  source = dict(sd)
  source.update({TEXT + k: v for k, v in text_sd.items()})
  target = target if target is not None else abstract_params(model_cfg, lambda c: nova.NOVA(c, rngs=_rngs()))
  conv = Converter(source, target, origin)
  conv.ignore(r"^text_encoder\.lm_head\.", phi2_convert.LM_HEAD[1])
  convert_transformer(conv)
  phi2_convert.convert_into(conv, prefix=TEXT + "model.", dst="text_encoder/")
  return conv


def convert(sd, origin: str = "checkpoint", size: str | None = None, text_sd=None, model_cfg=None):
  """``(model_cfg, params, report)`` for NOVA's transformer state dict ``sd`` and Phi-2's ``text_sd`` (read from
  the sibling ``text_encoder/`` folder of ``origin`` when not given)."""
  if model_cfg is None:
    model_cfg = nova.nova_config(size or infer_variant(sd, origin))
  if text_sd is None:
    text_sd = text_encoder_dict(origin)
  tcfg = phi2_convert.infer_config(text_sd)
  for k in ("vocab_size", "width", "depth", "mlp_dim"):
    if tcfg[k] != model_cfg.text_encoder[k]:
      raise ConversionError(f"the Phi text encoder of {origin} has {k}={tcfg[k]}, the model expects "
                            f"{model_cfg.text_encoder[k]}.")
  conv = converter(sd, text_sd, model_cfg, origin)
  return model_cfg, conv.result(), conv.report()


def _rngs():
  from flax import nnx
  return nnx.Rngs(0)
