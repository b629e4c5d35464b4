"""Phi-2 (``PhiForCausalLM`` safetensors shards, e.g. NOVA's ``text_encoder/``) -> :class:`models.phi2.Phi2`.

Keys (docs/models.md section 3.5; full list ``tests/fixtures/keys/keys_phi2_text_encoder.txt``):
``model.embed_tokens``, ``model.layers.{i}.{self_attn.{q,k,v}_proj, self_attn.dense, mlp.fc1, mlp.fc2,
input_layernorm}``, ``model.final_layernorm``; ``lm_head`` is ignored.
The size is read from the weights (width, depth, FFN, vocab); heads follow Phi-2's head_dim 80.

    python -m margrpo_jax.convert --family=phi2 --src=nova-d48w1024-sdxl1024/text_encoder --out=DIR
"""
from __future__ import annotations

from margrpo_jax.convert.core import ConversionError, Converter, abstract_params
from margrpo_jax.models import phi2

PREFER = ()
LM_HEAD = (r"^lm_head\.", "next-token head, unused by a text encoder (NOVA reads last_hidden_state)")


def infer_config(sd, prefix: str = "model.", head_dim: int = 80, **overrides):
  """Phi config from the shapes of ``sd`` (keys under ``prefix``)."""
  key = prefix + "embed_tokens.weight"
  if key not in sd:
    raise ConversionError(f"no key {key!r}: not a Phi checkpoint.")
  vocab, width = sd[key].shape
  depth = 0
  while f"{prefix}layers.{depth}.input_layernorm.weight" in sd:
    depth += 1
  mlp_dim = sd[f"{prefix}layers.0.mlp.fc1.weight"].shape[0] if depth else 4 * width
  cfg = dict(vocab_size=int(vocab), width=int(width), depth=depth, mlp_dim=int(mlp_dim),
             num_heads=max(1, int(width) // head_dim))
  cfg.update(overrides)
  return phi2.phi2_config(**cfg)


def convert_into(conv: Converter, prefix: str = "model.", dst: str = "") -> None:
  """Map a Phi ``PhiModel`` state dict (keys under ``prefix``) onto the Phi2 module at ``dst``."""
  conv.embed(f"{dst}embed_tokens", prefix + "embed_tokens")
  i = 0
  while f"{dst}layers/{i}/input_layernorm/scale" in conv.want:
    src, tgt = f"{prefix}layers.{i}", f"{dst}layers/{i}"
    conv.norm(f"{tgt}/input_layernorm", f"{src}.input_layernorm")
    for n in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.dense", "mlp.fc1", "mlp.fc2"):
      conv.dense(f"{tgt}/{n.replace('.', '/')}", f"{src}.{n}")
    i += 1
  conv.norm(f"{dst}final_layernorm", prefix + "final_layernorm")


def convert(sd, origin: str = "checkpoint", size: str | None = None, **overrides):
  """``(model_cfg, params, report)`` for a flat Phi state dict (``size`` is unused: read from the weights)."""
  del size
  cfg = infer_config(sd, **overrides)
  conv = Converter(sd, abstract_params(cfg, lambda c: phi2.Phi2(c, rngs=_rngs())), origin)
  conv.ignore(*LM_HEAD)
  convert_into(conv)
  return cfg, conv.result(), conv.report()


def _rngs():
  from flax import nnx
  return nnx.Rngs(0)
