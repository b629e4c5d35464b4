"""LAION aesthetic heads (``.pth``) -> :class:`~margrpo_jax.models.clip.AestheticHead` (docs/rewards.md section 2.4).

    python -m margrpo_jax.convert --family=aesthetic --src=sac+logos+ava1-l14-linearMSE.pth --out=DIR   # v2
    python -m margrpo_jax.convert --family=aesthetic --src=sa_0_4_vit_l_14_linear.pth --out=DIR         # v1

v2 (improved-aesthetic-predictor ``MLP``): ``layers.{0,2,4,6,7}.{weight,bias}`` = Linear 768->1024->128->64->16->1
(``layers.{1,3,5}`` are parameter-free Dropouts); v1: ``weight (1, D)``, ``bias (1,)`` of ``Linear(D, 1)`` (D = 768
for ViT-L/14, 512 for ViT-B). The variant and D are read from the weights. The backbone (OpenAI ViT-L/14) is
converted separately with ``--family=clip_openclip`` or ``--family=clip_hf``.
"""
from __future__ import annotations

from margrpo_jax.convert.core import ConversionError, Converter, abstract_params
from margrpo_jax.models import clip

PREFER = ("state_dict",)
V2_LAYERS = (0, 2, 4, 6, 7)  # indices of the Linears in the official nn.Sequential


def convert(sd, origin: str = "checkpoint", size: str | None = None):
  """``(model_cfg, params, report)`` for an aesthetic head state dict (``size`` is unused)."""
  del size
  if "layers.0.weight" in sd:
    variant, sources = "v2", [f"layers.{i}" for i in V2_LAYERS]
  elif "weight" in sd:
    variant, sources = "v1", [""]
  else:
    raise ConversionError(f"{origin} has neither 'layers.0.weight' (v2 MLP) nor 'weight' (v1 linear head).")
  first = sources[0] + ".weight" if sources[0] else "weight"
  cfg = clip.aesthetic_config(variant, int(sd[first].shape[1]))
  from flax import nnx
  conv = Converter(sd, abstract_params(cfg, lambda c: clip.AestheticHead(c, rngs=nnx.Rngs(0))), origin)
  for i, src in enumerate(sources):
    conv.copy(f"layers/{i}/kernel", f"{src}.weight" if src else "weight", lambda w: w.T)
    conv.copy(f"layers/{i}/bias", f"{src}.bias" if src else "bias")
  return cfg, conv.result(), conv.report()
