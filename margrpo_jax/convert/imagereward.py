"""ImageReward v1.0 ``ImageReward.pt`` (a plain state dict) -> :class:`~margrpo_jax.models.blip.ImageReward`.

Keys (docs/rewards.md section 2.3): ``blip.visual_encoder.*`` (timm ViT names), ``blip.text_encoder.*`` (BLIP med.py
BERT: ``embeddings.{word,position}_embeddings``, ``embeddings.LayerNorm``, ``encoder.layer.{i}.{attention,
crossattention}.{self.{query,key,value}, output.{dense,LayerNorm}}``, ``intermediate.dense``,
``output.{dense,LayerNorm}``), ``mlp.layers.{0,2,4,6,7}`` (the head; 1, 3, 5 are dropouts). Ignored:
``blip.vision_proj`` / ``blip.text_proj`` (ITC projections, unused by the score) and the ``position_ids`` buffer.
Sizes are read from the weights; heads = width / 64 (ViT-L/16: 16, BERT-base: 12).

    python -m margrpo_jax.convert --family=imagereward --src=ImageReward.pt --out=ckpt/imagereward
"""
from __future__ import annotations

from margrpo_jax.convert.core import ConversionError, Converter, abstract_params, blocks
from margrpo_jax.models import blip

PREFER = ("state_dict", "model")
HEAD_LAYERS = (0, 2, 4, 6, 7)
HEAD_DIM = 64
VIS, TXT = "blip.visual_encoder.", "blip.text_encoder."


def _count(sd, fmt: str) -> int:
  n = 0
  while fmt.format(n) in sd:
    n += 1
  return n


def infer_config(sd, origin: str = "checkpoint"):
  """The model config whose shapes match the state dict."""
  try:
    width = sd[VIS + "cls_token"].shape[-1]
    patch = sd[VIS + "patch_embed.proj.weight"].shape[-1]
    grid = int(round((sd[VIS + "pos_embed"].shape[1] - 1) ** 0.5))
    words, t_width = sd[TXT + "embeddings.word_embeddings.weight"].shape
    layer0 = TXT + "encoder.layer.0."
    cfg = blip.imagereward_config(**{
        "image_size": grid * patch, "patch_size": patch,
        "vision.width": width, "vision.depth": _count(sd, VIS + "blocks.{}.norm1.weight"),
        "vision.num_heads": max(1, width // HEAD_DIM),
        "vision.mlp_ratio": sd[VIS + "blocks.0.mlp.fc1.weight"].shape[0] / width,
        "text.vocab_size": words, "text.width": t_width,
        "text.depth": _count(sd, TXT + "encoder.layer.{}.attention.self.query.weight"),
        "text.num_heads": max(1, t_width // HEAD_DIM),
        "text.intermediate": sd[layer0 + "intermediate.dense.weight"].shape[0],
        "text.max_positions": sd[TXT + "embeddings.position_embeddings.weight"].shape[0]})
    cfg.head_dims = [int(sd[f"mlp.layers.{i}.weight"].shape[0]) for i in HEAD_LAYERS[:-1]]
  except KeyError as e:
    raise ConversionError(f"{origin} has no key {e.args[0]!r}; it is not an ImageReward state dict.") from None
  return cfg


def convert_vit(conv: Converter, prefix: str = VIS, dst: str = "visual") -> None:
  conv.conv(f"{dst}/patch_embed", prefix + "patch_embed.proj")
  conv.copy(f"{dst}/cls_token", prefix + "cls_token")
  conv.copy(f"{dst}/pos_embed", prefix + "pos_embed")
  conv.norm(f"{dst}/norm", prefix + "norm")
  blocks(conv, f"{dst}/blocks", prefix + "blocks")


def convert_bert(conv: Converter, prefix: str = TXT, dst: str = "text") -> None:
  conv.embed(f"{dst}/word_embeddings", prefix + "embeddings.word_embeddings")
  conv.embed(f"{dst}/position_embeddings", prefix + "embeddings.position_embeddings")
  conv.norm(f"{dst}/norm", prefix + "embeddings.LayerNorm")
  conv.ignore(r"embeddings\.position_ids$", "the position-index buffer (positions are 0..L-1)")
  i = 0
  while f"{dst}/layers/{i}/output/kernel" in conv.want:
    src, tgt = f"{prefix}encoder.layer.{i}.", f"{dst}/layers/{i}"
    for att in ("attention", "crossattention"):
      for n in ("query", "key", "value"):
        conv.dense(f"{tgt}/{att}/{n}", f"{src}{att}.self.{n}")
      conv.dense(f"{tgt}/{att}/dense", f"{src}{att}.output.dense")
      conv.norm(f"{tgt}/{att}/norm", f"{src}{att}.output.LayerNorm")
    conv.dense(f"{tgt}/intermediate", src + "intermediate.dense")
    conv.dense(f"{tgt}/output", src + "output.dense")
    conv.norm(f"{tgt}/output_norm", src + "output.LayerNorm")
    i += 1


def convert(sd, origin: str = "checkpoint", size: str | None = None):
  """``(model_cfg, params, report)`` for a flat ImageReward state dict (``size`` is unused: read from weights)."""
  del size
  cfg = infer_config(sd, origin)
  conv = Converter(sd, abstract_params(cfg, lambda c: blip.ImageReward(c, rngs=_rngs())), origin)
  convert_vit(conv)
  convert_bert(conv)
  for j, i in enumerate(HEAD_LAYERS):
    conv.dense(f"head/{j}", f"mlp.layers.{i}")
  conv.ignore(r"^blip\.(vision_proj|text_proj)\.", "BLIP's contrastive projections (not used by the score)")
  return cfg, conv.result(), conv.report()


def _rngs():
  from flax import nnx
  return nnx.Rngs(0)
