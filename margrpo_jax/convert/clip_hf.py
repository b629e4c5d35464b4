"""Hugging Face ``CLIPModel`` weights -> :class:`~margrpo_jax.models.clip.CLIP` (PickScore v1, openai/clip-vit-*).

    python -m margrpo_jax.convert --family=clip_hf --src=PickScore_v1/model.safetensors --out=DIR      # ViT-H-14
    python -m margrpo_jax.convert --family=clip_hf --src=clip-vit-large-patch14/ --out=DIR            # ViT-L-14

Layout (docs/rewards.md section 2.2): ``vision_model.embeddings.{patch_embedding.weight (no bias), class_embedding,
position_embedding.weight}``, ``vision_model.{pre_layrnorm, post_layernorm}``, ``{vision,text}_model.encoder.layers.
{i}.{layer_norm1, layer_norm2, self_attn.{q,k,v,out}_proj, mlp.fc1, mlp.fc2}`` (q, k, v concatenated into the fused
projection), ``text_model.embeddings.{token,position}_embedding.weight``, ``text_model.final_layer_norm``,
``visual_projection.weight`` / ``text_projection.weight`` (``nn.Linear`` without bias: used transposed),
``logit_scale``. ``*.position_ids`` buffers (in files saved by older transformers) are ignored.
Heads and activation: as for ``clip_openclip`` (``--size``; PickScore matches ViT-H-14 = gelu, OpenAI's
ViT-L/14 matches ViT-L-14 = quick_gelu).
"""
from __future__ import annotations

import numpy as np

from margrpo_jax.convert import clip_openclip
from margrpo_jax.convert.core import Converter

PREFER = ("state_dict",)
HF_BLOCK = dict(norm1="layer_norm1", norm2="layer_norm2", proj="self_attn.out_proj", fc1="mlp.fc1", fc2="mlp.fc2")


def _split_qkv(conv: Converter, prefix: str):
  keys = [f"{prefix}self_attn.{n}_proj" for n in "qkv"]
  return (np.concatenate([conv.get(k + ".weight") for k in keys]).T,
          np.concatenate([conv.get(k + ".bias") for k in keys]))


def fill(conv: Converter) -> None:
  """Map every target leaf of :class:`CLIP` from the HF layout."""
  v, t = "vision_model.", "text_model."
  conv.conv("vision/patch_embed", v + "embeddings.patch_embedding")
  conv.copy("vision/class_embedding", v + "embeddings.class_embedding")
  conv.copy("vision/positional_embedding", v + "embeddings.position_embedding.weight")
  conv.norm("vision/ln_pre", v + "pre_layrnorm")
  conv.norm("vision/ln_post", v + "post_layernorm")
  conv.copy("vision/proj", "visual_projection.weight", lambda w: w.T)
  clip_openclip.convert_blocks(conv, "vision", v + "encoder.layers.{i}.", HF_BLOCK, _split_qkv)
  conv.embed("text/token_embedding", t + "embeddings.token_embedding")
  conv.copy("text/positional_embedding", t + "embeddings.position_embedding.weight")
  conv.norm("text/ln_final", t + "final_layer_norm")
  conv.copy("text/text_projection", "text_projection.weight", lambda w: w.T)
  clip_openclip.convert_blocks(conv, "text", t + "encoder.layers.{i}.", HF_BLOCK, _split_qkv)
  conv.copy("logit_scale", "logit_scale")
  conv.ignore(r"\.position_ids$", "index buffer (0..N-1), not a weight")


def convert(sd, origin: str = "checkpoint", size: str | None = None):
  """``(model_cfg, params, report)`` for a flat HF ``CLIPModel`` state dict."""
  cfg = clip_openclip.infer_config(sd, "hf", size, origin)
  conv = Converter(sd, clip_openclip.target(cfg), origin)
  fill(conv)
  return cfg, conv.result(), conv.report()
