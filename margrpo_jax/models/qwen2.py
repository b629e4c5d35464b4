"""Qwen2 / Qwen2.5 decoder-only language model (the base ``Qwen2Model``, no LM head), named like Hugging Face's
modules so that converters map keys 1:1 (``embed_tokens``, ``layers.{i}.self_attn.{q,k,v,o}_proj``,
``layers.{i}.mlp.{gate,up,down}_proj``, ``input_layernorm``, ``post_attention_layernorm``, ``norm``).

Layer ``i``: ``x <- x + o(Attn(RMSNorm(x)))``, ``x <- x + down(SiLU(gate(h)) * up(h))`` with ``h = RMSNorm(x)``;
the output is ``RMSNorm(x_N)``. RMSNorm: ``x / sqrt(mean(x^2) + eps) * scale`` (eps 1e-6, float32).
Attention: grouped-query (``num_heads`` query heads share ``num_kv_heads`` key/value heads in contiguous groups),
q/k/v with biases, o without; RoPE with ``theta`` (1e6) in the rotate-half layout: for frequencies
``f_k = theta^(-2k/head_dim)`` and angle ``a = pos * f_k`` the pair ``(x_k, x_{k+head_dim/2})`` is rotated by ``a``.
Mask: causal AND key-valid (``valid`` (B, S), False at padding); positions default to ``cumsum(valid) - 1``
(so tokens after right padding continue from the last valid one, as Harmon does), clamped at 0.
Scores are scaled by ``head_dim^-1/2`` and soft-maxed in float32.

How to use::

    cfg = qwen2.qwen2_config("0.5b")               # Qwen2.5-0.5B-Instruct shapes (or a tiny ConfigDict)
    lm = qwen2.Qwen2Model(cfg, rngs=nnx.Rngs(0))
    h = lm(lm.embed(ids), valid)                   # (B, S, hidden), the final-norm output
    h, per_layer = lm(emb, valid, output_hidden_states=True)   # + (embeddings, layer 1..N-1 outputs, h)

Weights: ``python -m margrpo_jax.convert --family=qwen2 --src=HF_FOLDER --out=DIR`` (margrpo_jax/convert/qwen2.py).
"""
from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from margrpo_jax.models.layers import scan_blocks

# Qwen2.5-{0.5B,1.5B}-Instruct (docs/models.md section 2.1): hidden, layers, q heads, kv heads, head dim, FFN
SIZES = {"0.5b": (896, 24, 14, 2, 64, 4864), "1.5b": (1536, 28, 12, 2, 128, 8960)}
VOCAB = 151936


def qwen2_config(size: str = "0.5b", **overrides) -> ml_collections.ConfigDict:
  if size not in SIZES:
    raise ValueError(f"Qwen2.5 size {size!r} is not one of {', '.join(SIZES)}")
  hidden, layers, heads, kv_heads, head_dim, ffn = SIZES[size]
  cfg = dict(vocab_size=VOCAB, hidden_size=hidden, num_layers=layers, num_heads=heads, num_kv_heads=kv_heads,
             head_dim=head_dim, intermediate_size=ffn, rope_theta=1e6, rms_eps=1e-6, tie_word_embeddings=True)
  cfg.update(overrides)
  return ml_collections.ConfigDict(cfg)


_init = nnx.initializers.normal(0.02)


def _dense(din, dout, rngs, bias):
  return nnx.Linear(din, dout, use_bias=bias, kernel_init=_init, rngs=rngs)


def rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
  """Rotate-half RoPE of ``x`` (B, S, H, hd) at integer ``positions`` (B, S)."""
  hd = x.shape[-1]
  inv = 1.0 / theta ** (jnp.arange(0, hd, 2, dtype=jnp.float32) / hd)
  ang = positions.astype(jnp.float32)[..., None] * inv                     # (B, S, hd/2)
  cos, sin = (jnp.concatenate([f(ang)] * 2, -1)[:, :, None].astype(x.dtype) for f in (jnp.cos, jnp.sin))
  x1, x2 = jnp.split(x, 2, axis=-1)
  return x * cos + jnp.concatenate([-x2, x1], axis=-1) * sin


class Attention(nnx.Module):
  def __init__(self, cfg, *, rngs: nnx.Rngs):
    h, d = cfg.hidden_size, cfg.head_dim
    if cfg.num_heads % cfg.num_kv_heads:
      raise ValueError(f"num_heads {cfg.num_heads} is not a multiple of num_kv_heads {cfg.num_kv_heads}")
    self.num_heads, self.num_kv_heads, self.head_dim, self.theta = cfg.num_heads, cfg.num_kv_heads, d, cfg.rope_theta
    self.q_proj = _dense(h, cfg.num_heads * d, rngs, True)
    self.k_proj = _dense(h, cfg.num_kv_heads * d, rngs, True)
    self.v_proj = _dense(h, cfg.num_kv_heads * d, rngs, True)
    self.o_proj = _dense(cfg.num_heads * d, h, rngs, False)

  def __call__(self, x, positions, allowed):
    """``allowed`` (B, S, S) bool: query i may attend to key j."""
    b, s, _ = x.shape
    g = self.num_heads // self.num_kv_heads
    q = rope(self.q_proj(x).reshape(b, s, self.num_heads, self.head_dim), positions, self.theta)
    k = rope(self.k_proj(x).reshape(b, s, self.num_kv_heads, self.head_dim), positions, self.theta)
    v = self.v_proj(x).reshape(b, s, self.num_kv_heads, self.head_dim)
    q = q.reshape(b, s, self.num_kv_heads, g, self.head_dim)  # query head n = kv head n // g
    logits = jnp.einsum("bqkgd,bskd->bkgqs", q, k) * self.head_dim ** -0.5
    logits = jnp.where(allowed[:, None, None], logits.astype(jnp.float32), jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgqs,bskd->bqkgd", probs, v).reshape(b, s, self.num_heads * self.head_dim)
    return self.o_proj(out)


class Mlp(nnx.Module):
  def __init__(self, cfg, *, rngs: nnx.Rngs):
    self.gate_proj = _dense(cfg.hidden_size, cfg.intermediate_size, rngs, False)
    self.up_proj = _dense(cfg.hidden_size, cfg.intermediate_size, rngs, False)
    self.down_proj = _dense(cfg.intermediate_size, cfg.hidden_size, rngs, False)

  def __call__(self, x):
    return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


def rms_norm(cfg, rngs) -> nnx.RMSNorm:
  return nnx.RMSNorm(cfg.hidden_size, epsilon=cfg.rms_eps, rngs=rngs)


class DecoderLayer(nnx.Module):
  def __init__(self, cfg, *, rngs: nnx.Rngs):
    self.input_layernorm = rms_norm(cfg, rngs)
    self.self_attn = Attention(cfg, rngs=rngs)
    self.post_attention_layernorm = rms_norm(cfg, rngs)
    self.mlp = Mlp(cfg, rngs=rngs)

  def __call__(self, x, positions, allowed):
    x = x + self.self_attn(self.input_layernorm(x), positions, allowed)
    return x + self.mlp(self.post_attention_layernorm(x))


class Qwen2Model(nnx.Module):
  """The Qwen2 decoder stack; ``cfg`` as :func:`qwen2_config` (extra keys such as ``family`` are ignored)."""

  def __init__(self, cfg: ml_collections.ConfigDict, *, rngs: nnx.Rngs):
    self.hidden_size = cfg.hidden_size
    self.embed_tokens = nnx.Embed(cfg.vocab_size, cfg.hidden_size, embedding_init=_init, rngs=rngs)
    self.layers = nnx.List([DecoderLayer(cfg, rngs=rngs) for _ in range(cfg.num_layers)])
    self.norm = rms_norm(cfg, rngs)

  def embed(self, ids: jax.Array) -> jax.Array:
    return self.embed_tokens(ids)

  def __call__(self, inputs_embeds: jax.Array, valid: jax.Array | None = None, positions: jax.Array | None = None,
               output_hidden_states: bool = False):
    """``inputs_embeds`` (B, S, hidden); ``valid`` (B, S) bool key mask (default all True) -> (B, S, hidden)."""
    b, s, _ = inputs_embeds.shape
    chex.assert_shape(inputs_embeds, (b, s, self.hidden_size))
    valid = jnp.ones((b, s), bool) if valid is None else valid.astype(bool)
    chex.assert_shape(valid, (b, s))
    if positions is None:
      positions = jnp.maximum(jnp.cumsum(valid, axis=1) - 1, 0)
    allowed = jnp.tril(jnp.ones((s, s), bool))[None] & valid[:, None, :]
    if not output_hidden_states:  # one lax.scan: a sharded run gathers one layer's weights at a time
      return self.norm(scan_blocks(self.layers, inputs_embeds, positions, allowed))
    x, hidden = inputs_embeds, []
    for layer in self.layers:
      hidden.append(x)
      x = layer(x, positions, allowed)
    x = self.norm(x)
    return (x, tuple(hidden) + (x,)) if output_hidden_states else x
