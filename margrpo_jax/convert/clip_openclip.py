"""open_clip / OpenAI CLIP state dicts -> :class:`~margrpo_jax.models.clip.CLIP` (HPS v2/v2.1, LAION, OpenAI).

    python -m margrpo_jax.convert --family=clip_openclip --src=HPS_v2.1_compressed.pt --out=DIR   # ViT-H-14
    python -m margrpo_jax.convert --family=clip_openclip --src=open_clip_pytorch_model.bin --out=DIR --size=ViT-L-14

Layout (docs/rewards.md 2.1; OpenAI's ``ViT-*.pt`` weights use the same names): ``visual.conv1.weight`` (no bias),
``visual.{class_embedding, positional_embedding, ln_pre, ln_post}``, ``visual.proj`` (W, E) used as ``x @ proj``,
``{visual.,}transformer.resblocks.{i}.{ln_1, ln_2, attn.in_proj_weight (3W, W) = [q; k; v], attn.in_proj_bias,
attn.out_proj, mlp.c_fc, mlp.c_proj}``, ``token_embedding.weight``, ``positional_embedding``, ``ln_final``,
``text_projection`` (W, E) used as ``x @ W``, ``logit_scale`` (a log). HPS files hold ``{'state_dict': ...}``
(fp16; read as float32). OpenAI's metadata keys ``input_resolution / context_length / vocab_size`` are ignored.
OpenAI's TorchScript archives must first be saved as a plain state dict (``torch.jit.load(p).state_dict()``).

Widths, depths, patch, image size, context and vocabulary come from the weights; heads and activation do not,
so they come from ``--size``: a name of ``models.clip.SIZES`` (matched from the weights when omitted), optionally
followed by overrides, e.g. ``--size=ViT-L-14,act=gelu`` (open_clip's LAION ViT-L-14) or
``--size=vision_heads=2,text_heads=2,act=quick_gelu``.
"""
from __future__ import annotations

import numpy as np

from margrpo_jax.convert.core import ConversionError, Converter, abstract_params
from margrpo_jax.models import clip

PREFER = ("state_dict",)
# Where each dimension is read from, per layout: (key, axis); ``{i}`` is a block index.
PROBES = {
    "openclip": dict(patch="visual.conv1.weight", vpos="visual.positional_embedding", vproj=("visual.proj", 1),
                     tok="token_embedding.weight", tpos="positional_embedding",
                     vblock="visual.transformer.resblocks.{i}.", tblock="transformer.resblocks.{i}.",
                     fc1="mlp.c_fc.weight"),
    "hf": dict(patch="vision_model.embeddings.patch_embedding.weight",
               vpos="vision_model.embeddings.position_embedding.weight", vproj=("visual_projection.weight", 0),
               tok="text_model.embeddings.token_embedding.weight",
               tpos="text_model.embeddings.position_embedding.weight",
               vblock="vision_model.encoder.layers.{i}.", tblock="text_model.encoder.layers.{i}.",
               fc1="mlp.fc1.weight"),
}


def _depth(sd, block: str, fc1: str, origin: str) -> tuple[int, int]:
  n = 0
  while block.format(i=n) + fc1 in sd:
    n += 1
  if not n:
    raise ConversionError(f"{origin} has no key {block.format(i=0) + fc1!r}: not a CLIP of this layout.")
  return n, sd[block.format(i=0) + fc1].shape[0]


def parse_size(size: str | None) -> tuple[str | None, dict]:
  """``'ViT-L-14,act=gelu'`` -> ``('ViT-L-14', {'act': 'gelu'})``; ints for ``vision_heads`` / ``text_heads``."""
  name, over = None, {}
  for item in filter(None, (size or "").split(",")):
    if "=" not in item:
      name = item
      continue
    k, v = item.split("=", 1)
    if k not in ("vision_heads", "text_heads", "act"):
      raise ConversionError(f"--size option {k!r} is not one of vision_heads, text_heads, act.")
    over[k] = v if k == "act" else int(v)
  return name, over


def infer_config(sd, layout: str, size: str | None = None, origin: str = "the checkpoint"):
  """The CLIP config of a state dict: every dimension from the weights, heads and act from ``size``."""
  p = PROBES[layout]
  for k in (p["patch"], p["vpos"], p["vproj"][0], p["tok"], p["tpos"]):
    if k not in sd:
      raise ConversionError(f"{origin} has no key {k!r}: not a CLIP in the {layout} layout.")
  vw, _, _, patch = sd[p["patch"]].shape
  grid = int(round(np.sqrt(sd[p["vpos"]].shape[0] - 1)))
  vl, vmlp = _depth(sd, p["vblock"], p["fc1"], origin)
  tl, tmlp = _depth(sd, p["tblock"], p["fc1"], origin)
  (ctx, tw), vocab = sd[p["tpos"]].shape, sd[p["tok"]].shape[0]
  name, over = parse_size(size)
  if name is None:  # match a known size on the weights
    name = next((n for n, s in clip.SIZES.items() if (s[1], s[2], s[3], s[5], s[6]) == (patch, vw, vl, tw, tl)), None)
  if name is not None:
    if name not in clip.SIZES:
      raise ConversionError(f"--size={name!r} is not one of {', '.join(clip.SIZES)}.")
    s = clip.SIZES[name]
    over = {"vision_heads": s[4], "text_heads": s[7], "act": s[8], **over}
  missing = [k for k in ("vision_heads", "text_heads", "act") if k not in over]
  if missing:
    raise ConversionError(f"the weights of {origin} (vision width {vw}, patch {patch}, {vl} layers; text width "
                          f"{tw}, {tl} layers) are not a known size and --size does not give {', '.join(missing)}; "
                          f"pass --size=NAME ({', '.join(clip.SIZES)}) or --size=vision_heads=H,text_heads=H,act=gelu.")
  return clip.clip_config(
      embed_dim=int(sd[p["vproj"][0]].shape[p["vproj"][1]]), act=over["act"],
      vision=clip.tower_config(vw, vl, over["vision_heads"], vmlp, image_size=grid * patch, patch_size=patch),
      text=clip.tower_config(tw, tl, over["text_heads"], tmlp, context_length=ctx, vocab_size=vocab))


def stack_layers(arrays: list[np.ndarray]) -> np.ndarray:
  return np.stack(arrays)


def convert_blocks(conv: Converter, dst: str, src: str, names: dict, qkv) -> None:
  """The stacked blocks ``dst/blocks/*`` (leading layer axis) from ``src.format(i=i)`` for every layer i:
  ``names`` maps norm1/norm2/proj/fc1/fc2 to source sub-keys; ``qkv(conv, prefix) -> (kernel, bias)`` returns the
  fused ``[q | k | v]`` projection."""
  layers = []
  for i in range(conv.want[f"{dst}/blocks/norm1/scale"].shape[0]):
    s, out = src.format(i=i), {}
    for n in ("norm1", "norm2"):
      out[f"{n}/scale"], out[f"{n}/bias"] = conv.get(s + names[n] + ".weight"), conv.get(s + names[n] + ".bias")
    for t, n in (("attn/proj", "proj"), ("mlp/fc1", "fc1"), ("mlp/fc2", "fc2")):
      out[f"{t}/kernel"], out[f"{t}/bias"] = conv.get(s + names[n] + ".weight").T, conv.get(s + names[n] + ".bias")
    out["attn/qkv/kernel"], out["attn/qkv/bias"] = qkv(conv, s)
    layers.append(out)
  for k in layers[0]:
    for i, layer in enumerate(layers):
      if layer[k].shape != layers[0][k].shape:
        raise ConversionError(f"{conv.origin} layer {src.format(i=i)} gives {dst}/blocks/{k} the shape "
                              f"{layer[k].shape}, but layer 0 gives {layers[0][k].shape}.")
    conv.put(f"{dst}/blocks/{k}", stack_layers([layer[k] for layer in layers]), src.format(i="*") + k)


def _fused_qkv(conv: Converter, prefix: str):
  return conv.get(prefix + "attn.in_proj_weight").T, conv.get(prefix + "attn.in_proj_bias")


OPENCLIP_BLOCK = dict(norm1="ln_1", norm2="ln_2", proj="attn.out_proj", fc1="mlp.c_fc", fc2="mlp.c_proj")


def strip_module_prefix(sd: dict) -> dict:
  """DDP checkpoints prefix every key with ``module.``."""
  if sd and all(k.startswith("module.") for k in sd):
    return {k[len("module."):]: v for k, v in sd.items()}
  return sd


def target(cfg) -> dict:
  return abstract_params(cfg, lambda c: clip.CLIP(c, rngs=_rngs()))


def fill(conv: Converter) -> None:
  """Map every target leaf of :class:`CLIP` from the open_clip layout."""
  conv.conv("vision/patch_embed", "visual.conv1")
  for n in ("class_embedding", "positional_embedding", "proj"):
    conv.copy(f"vision/{n}", f"visual.{n}")
  for n in ("ln_pre", "ln_post"):
    conv.norm(f"vision/{n}", f"visual.{n}")
  convert_blocks(conv, "vision", "visual.transformer.resblocks.{i}.", OPENCLIP_BLOCK, _fused_qkv)
  conv.embed("text/token_embedding", "token_embedding")
  conv.copy("text/positional_embedding", "positional_embedding")
  conv.copy("text/text_projection", "text_projection")
  conv.norm("text/ln_final", "ln_final")
  convert_blocks(conv, "text", "transformer.resblocks.{i}.", OPENCLIP_BLOCK, _fused_qkv)
  conv.copy("logit_scale", "logit_scale")
  conv.ignore(r"^(input_resolution|context_length|vocab_size)$", "OpenAI metadata (read from the weights instead)")
  conv.ignore(r"(^|\.)attn_mask$", "the causal mask is built in the model")


def convert(sd, origin: str = "checkpoint", size: str | None = None):
  """``(model_cfg, params, report)`` for a flat open_clip / OpenAI CLIP state dict."""
  sd = strip_module_prefix(sd)
  cfg = infer_config(sd, "openclip", size, origin)
  conv = Converter(sd, target(cfg), origin)
  fill(conv)
  return cfg, conv.result(), conv.report()


def _rngs():
  from flax import nnx
  return nnx.Rngs(0)

