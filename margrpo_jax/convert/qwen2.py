"""Hugging Face Qwen2 / Qwen2.5 weights (a safetensors file or folder; keys ``model.*``) ->
:class:`~margrpo_jax.models.qwen2.Qwen2Model`.

    python -m margrpo_jax.convert --family=qwen2 --src=Qwen2.5-0.5B-Instruct/ --out=DIR [--size=0.5b]

The architecture comes from ``config.json`` beside the weights when there is one, else from ``--size``, else from
the weight shapes matched against the Qwen2.5 sizes. ``lm_head.weight`` is not part of the base model (tied to
``embed_tokens`` in the small Qwen2.5 models); the RoPE ``inv_freq`` buffer is not stored (computed).
"""
from __future__ import annotations

import json
import os

from margrpo_jax.convert.core import ConversionError, Converter, abstract_params
from margrpo_jax.models import qwen2

PREFER = ("state_dict", "model_state_dict")


def convert_llm(conv: Converter, prefix: str = "model.", dst: str = "") -> None:
  """Every parameter of a :class:`Qwen2Model` at target ``dst`` from source keys ``{prefix}...``."""
  d = f"{dst}/" if dst else ""
  conv.embed(f"{d}embed_tokens", prefix + "embed_tokens")
  conv.norm(f"{d}norm", prefix + "norm")
  i = 0
  while f"{d}layers/{i}/input_layernorm/scale" in conv.want:
    src, tgt = f"{prefix}layers.{i}", f"{d}layers/{i}"
    for n in ("input_layernorm", "post_attention_layernorm"):
      conv.norm(f"{tgt}/{n}", f"{src}.{n}")
    for n in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
              "mlp.up_proj", "mlp.down_proj"):
      conv.dense(f"{tgt}/{n.replace('.', '/')}", f"{src}.{n}")
    i += 1
  conv.ignore(rf"^{prefix.replace('.', r'[.]')}layers\.\d+\.self_attn\.rotary_emb\.inv_freq$",
              "RoPE frequencies are computed, not stored")


def infer_config(sd, prefix: str = "model.", size: str | None = None, origin: str | None = None):
  """The :func:`qwen2.qwen2_config` of these weights: ``config.json`` beside ``origin``, ``size``, or the shapes."""
  folder = origin if origin and os.path.isdir(origin) else os.path.dirname(origin or "")
  path = os.path.join(folder, "config.json") if folder else ""
  if path and os.path.isfile(path):
    with open(path) as f:
      c = json.load(f)
    rope = c.get("rope_theta", (c.get("rope_parameters") or {}).get("rope_theta", 1e6))
    heads = c["num_attention_heads"]
    return qwen2.qwen2_config(
        vocab_size=c["vocab_size"], hidden_size=c["hidden_size"], num_layers=c["num_hidden_layers"], num_heads=heads,
        num_kv_heads=c.get("num_key_value_heads", heads), head_dim=c.get("head_dim") or c["hidden_size"] // heads,
        intermediate_size=c["intermediate_size"], rope_theta=float(rope), rms_eps=c.get("rms_norm_eps", 1e-6),
        tie_word_embeddings=c.get("tie_word_embeddings", False))
  if size:
    return qwen2.qwen2_config(size)
  key = prefix + "embed_tokens.weight"
  hidden = sd[key].shape[1] if key in sd else None
  for name, spec in qwen2.SIZES.items():
    if spec[0] == hidden:
      return qwen2.qwen2_config(name)
  raise ConversionError(f"cannot tell the Qwen2 architecture of {origin or 'the checkpoint'} (hidden size {hidden}): "
                        f"put its config.json beside the weights or pass --size ({', '.join(qwen2.SIZES)}).")


def convert(sd, origin: str = "checkpoint", size: str | None = None):
  """``(model_cfg, params, report)`` for a flat Hugging Face Qwen2 state dict."""
  cfg = infer_config(sd, "model.", size, origin)
  cfg.family = "qwen2"
  conv = Converter(sd, abstract_params(cfg, lambda c: qwen2.Qwen2Model(c, rngs=_rngs())), origin)
  convert_llm(conv)
  conv.ignore(r"^lm_head\.weight$", "tied to model.embed_tokens (and not part of the base model)"
              if cfg.tie_word_embeddings else "the base model has no LM head")
  return cfg, conv.result(), conv.report()


def _rngs():
  from flax import nnx
  return nnx.Rngs(0)
