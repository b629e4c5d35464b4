"""Harmon ``harmon_{0.5b,1.5b}.pth`` (a flat bf16 state dict: ``llm.*``, ``mar.*``, ``proj_in.*``, ``proj_out.*``;
no VAE, no EMA) -> :class:`~margrpo_jax.models.harmon.Harmon` in float32.

    python -m margrpo_jax.convert --family=harmon --src=harmon_0.5b.pth --out=DIR

Keys: docs/models.md section 2.6 (full lists: ``tests/fixtures/keys/keys_Harmon-{0.5B,1.5B}.txt``); the size is
read from the LLM width.
``mar.*`` maps exactly like MAR's checkpoint (convert/mar.py), the diffusion head ``mar.diffloss.net.*`` to the
``head`` component, ``llm.model.*`` like a Qwen2 checkpoint (convert/qwen2.py). ``llm.lm_head.weight`` is tied to
the embedding and unused by text-to-image; ``vae.*`` (HF ports) belongs to the KL-16 export (family ``kl16``).
The position tables stay at their learned 16 x 16 size (resized in the forward pass). When a ``tokenizer.json``
lies beside the weights, the null prompt's token ids are written into the model config (``text.null_ids``).
"""
from __future__ import annotations

import os

from margrpo_jax.convert import mar as convert_mar, qwen2 as convert_qwen2
from margrpo_jax.convert.core import ConversionError, Converter, abstract_params
from margrpo_jax.models import harmon, qwen2, qwen_tokenizer

PREFER = ("state_dict", "model", "module")  # the released files are flat; accept a wrapped dict too


def infer_size(sd) -> str:
  key = "llm.model.embed_tokens.weight"
  hidden = sd[key].shape[1] if key in sd else None
  for size, (llm_size, _) in harmon.SIZES.items():
    if qwen2.SIZES[llm_size][0] == hidden:
      return size
  raise ConversionError(f"cannot tell the Harmon size from {key} (hidden size {hidden}); known: "
                        + ", ".join(f"{s}={qwen2.SIZES[l][0]}" for s, (l, _) in harmon.SIZES.items()) + ".")


def null_ids(tokenizer_path: str, max_len: int) -> list[int]:
  tok = qwen_tokenizer.load(tokenizer_path)
  return [int(i) for i in qwen_tokenizer.encode(tok, [qwen_tokenizer.null_prompt()], max_len)[0] if i >= 0]


def fill(conv: Converter) -> None:
  """Map every Harmon key onto a :class:`Harmon` target (used by :func:`convert`; tests pass shape-only ones)."""
  convert_mar.convert_backbone(conv, "mar.", "mar")
  conv.embed("mar/class_emb", "mar.class_emb")
  conv.copy("mar/fake_latent", "mar.fake_latent")
  convert_mar.convert_head(conv, "mar.diffloss.net.", "head")
  convert_qwen2.convert_llm(conv, "llm.model.", "llm")
  for name in ("proj_in", "proj_out"):
    conv.dense(f"{name}/fc1", f"{name}.0")
    conv.dense(f"{name}/fc2", f"{name}.2")
  conv.ignore(r"^llm\.lm_head\.weight$", "tied to llm.model.embed_tokens; text-to-image uses no LM head")
  conv.ignore(r"^vae\.", "the KL-16 VAE is converted on its own (family kl16)")


def convert(sd, origin: str = "checkpoint", size: str | None = None, model_cfg=None, tokenizer_path: str | None = None):
  """``(model_cfg, params, report)`` for a flat Harmon state dict (``model_cfg``: a non-default architecture)."""
  cfg = model_cfg or harmon.harmon_config(size or infer_size(sd))
  beside = os.path.join(os.path.dirname(os.path.abspath(origin)), "tokenizer.json")
  tokenizer_path = tokenizer_path or (beside if os.path.isfile(beside) else None)
  if tokenizer_path:
    cfg.text.null_ids = null_ids(tokenizer_path, cfg.text.max_len)
  conv = Converter(sd, abstract_params(cfg, lambda c: harmon.Harmon(c, rngs=_rngs())), origin)
  fill(conv)
  return cfg, conv.result(), conv.report()


def _rngs():
  from flax import nnx
  return nnx.Rngs(0)
