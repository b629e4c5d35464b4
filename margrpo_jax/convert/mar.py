"""MAR (LTH14/mar) ``checkpoint-last.pth`` -> :class:`~margrpo_jax.models.class_mar.ClassMAR` (EMA weights).

Keys: docs/models.md section 1.6 (full lists: ``tests/fixtures/keys/keys_mar_{base,large,huge}.txt``); the size is
read from the weights.
"""
from __future__ import annotations

from margrpo_jax.convert.core import ConversionError, Converter, abstract_params, blocks
from margrpo_jax.models import class_mar

PREFER = ("model_ema", "model")  # docs/models.md section 1.6: use model_ema for inference


def infer_size(sd) -> str:
  width = sd["z_proj.weight"].shape[0] if "z_proj.weight" in sd else None
  for size, (w, *_rest) in class_mar.SIZES.items():
    if w == width:
      return size
  raise ConversionError(f"cannot tell the MAR size from z_proj.weight (width {width}); "
                        f"known widths: {', '.join(f'{s}={v[0]}' for s, v in class_mar.SIZES.items())}.")


def convert_backbone(conv: Converter, prefix: str = "", dst: str = "backbone") -> None:
  """The MAE encoder / decoder and position tables shared by MAR and Harmon's ``mar.*``."""
  for name in ("encoder_pos_embed_learned", "decoder_pos_embed_learned", "mask_token"):
    conv.copy(f"{dst}/{name}", prefix + name)
  conv.copy(f"{dst}/diffusion_pos_embed_learned", prefix + "diffusion_pos_embed_learned")
  conv.dense(f"{dst}/z_proj", prefix + "z_proj")
  conv.norm(f"{dst}/z_proj_ln", prefix + "z_proj_ln")
  conv.dense(f"{dst}/decoder_embed", prefix + "decoder_embed")
  for part in ("encoder", "decoder"):
    conv.norm(f"{dst}/{part}_norm", f"{prefix}{part}_norm")
    blocks(conv, f"{dst}/{part}_blocks", f"{prefix}{part}_blocks")


def convert_head(conv: Converter, prefix: str = "diffloss.net.", dst: str = "head") -> None:
  """SimpleMLPAdaLN (docs/models.md section 1.4): ``mlp.0 / mlp.2`` -> fc1 / fc2, ``adaLN_modulation.1`` -> ada_ln."""
  conv.dense(f"{dst}/time_embed/fc1", prefix + "time_embed.mlp.0")
  conv.dense(f"{dst}/time_embed/fc2", prefix + "time_embed.mlp.2")
  conv.dense(f"{dst}/cond_embed", prefix + "cond_embed")
  conv.dense(f"{dst}/input_proj", prefix + "input_proj")
  i = 0
  while f"{dst}/res_blocks/{i}/fc1/kernel" in conv.want:
    src, tgt = f"{prefix}res_blocks.{i}", f"{dst}/res_blocks/{i}"
    conv.norm(f"{tgt}/in_ln", f"{src}.in_ln")
    conv.dense(f"{tgt}/fc1", f"{src}.mlp.0")
    conv.dense(f"{tgt}/fc2", f"{src}.mlp.2")
    conv.dense(f"{tgt}/ada_ln", f"{src}.adaLN_modulation.1")
    i += 1
  conv.dense(f"{dst}/final_layer/linear", prefix + "final_layer.linear")
  conv.dense(f"{dst}/final_layer/ada_ln", prefix + "final_layer.adaLN_modulation.1")


def convert(sd, origin: str = "checkpoint", size: str | None = None, model_cfg=None):
  """``(model_cfg, params, report)`` for a flat MAR state dict (``model_cfg``: a non-default architecture)."""
  cfg = model_cfg or class_mar.mar_config(size or infer_size(sd))
  conv = Converter(sd, abstract_params(cfg, lambda c: class_mar.ClassMAR(c, rngs=_rngs())), origin)
  convert_backbone(conv)
  conv.embed("backbone/class_emb", "class_emb")
  conv.copy("backbone/fake_latent", "fake_latent")
  convert_head(conv)
  return cfg, conv.result(), conv.report()


def _rngs():
  from flax import nnx
  return nnx.Rngs(0)
