r"""Phi-2 as NOVA's frozen text encoder (``PhiModel`` without ``lm_head``), docs/models.md section 3.5.

Parallel pre-norm block with ONE input LayerNorm (eps 1e-5):

    h = LN(x);   x <- x + Dense(Attn(h)) + fc2(gelu_tanh(fc1(h)))

Attention: separate ``q_proj / k_proj / v_proj`` (biased), heads of ``head_dim = width / heads``, causal,
softmax scaled by ``head_dim^-1/2``. Partial rotary: RoPE (NeoX ``rotate_half``, theta 1e4) on the first
``rotary_dim = int(head_dim * 0.4)`` dims of every q / k head (32 of 80 for Phi-2), positions 0..T-1; the
rest passes through. Output: ``final_layernorm`` of the last block (``last_hidden_state``).
Phi-2: width 2560, 32 layers, 32 heads, FFN 10240, vocab 51200 (2,648.56 M parameters without lm_head).

How to use:
    model = Phi2(phi2_config(), rngs=nnx.Rngs(0))   # or checkpoint.load_model(<export of convert --family=phi2>)
    hidden = model(ids)                             # (B, T) int32 -> (B, T, 2560)
Padding needs no attention mask: attention is causal and pads only follow the real tokens.
"""
from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from margrpo_jax.models.layers import linear, scan_blocks


def phi2_config(**overrides) -> ml_collections.ConfigDict:
  """Phi-2 (microsoft/phi-2) hyper-parameters; ``overrides`` for tiny test models."""
  cfg = dict(family="phi2", vocab_size=51200, width=2560, depth=32, num_heads=32, mlp_dim=10240,
             rotary_fraction=0.4, rope_theta=10000.0, eps=1e-5)
  cfg.update(overrides)
  return ml_collections.ConfigDict(cfg)


def rope_tables(seq_len: int, rotary_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
  """``cos, sin`` (T, rotary_dim): angle ``p * theta^(-2i/rotary_dim)`` repeated over both halves (NeoX)."""
  inv = theta ** (-jnp.arange(0, rotary_dim, 2, dtype=jnp.float32) / rotary_dim)
  ang = jnp.arange(seq_len, dtype=jnp.float32)[:, None] * inv[None]
  ang = jnp.concatenate([ang, ang], axis=-1)
  return jnp.cos(ang), jnp.sin(ang)


def apply_partial_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
  """``x`` (B, T, H, hd): rotate the first ``cos.shape[-1]`` dims with ``x cos + rotate_half(x) sin``."""
  r = cos.shape[-1]
  rot, rest = x[..., :r], x[..., r:]
  x1, x2 = rot[..., :r // 2], rot[..., r // 2:]
  half = jnp.concatenate([-x2, x1], axis=-1)
  rot = rot * cos[:, None] + half * sin[:, None]
  return jnp.concatenate([rot, rest], axis=-1)


class PhiAttention(nnx.Module):
  def __init__(self, width: int, num_heads: int, rotary_dim: int, theta: float, *, rngs: nnx.Rngs):
    self.num_heads, self.rotary_dim, self.theta = num_heads, rotary_dim, theta
    self.q_proj = linear(width, width, rngs)
    self.k_proj = linear(width, width, rngs)
    self.v_proj = linear(width, width, rngs)
    self.dense = linear(width, width, rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    b, t, d = x.shape
    h = self.num_heads
    split = lambda y: y.reshape(b, t, h, d // h)
    cos, sin = rope_tables(t, self.rotary_dim, self.theta)
    q = apply_partial_rope(split(self.q_proj(x)), cos, sin)
    k = apply_partial_rope(split(self.k_proj(x)), cos, sin)
    v = split(self.v_proj(x))
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) * (d // h) ** -0.5
    causal = jnp.tril(jnp.ones((t, t), bool))
    logits = jnp.where(causal, logits, jnp.finfo(logits.dtype).min)
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1).astype(v.dtype)
    return self.dense(jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, t, d))


class PhiMlp(nnx.Module):
  def __init__(self, width: int, hidden: int, *, rngs: nnx.Rngs):
    self.fc1 = linear(width, hidden, rngs)
    self.fc2 = linear(hidden, width, rngs)

  def __call__(self, x):
    return self.fc2(jax.nn.gelu(self.fc1(x), approximate=True))


class PhiLayer(nnx.Module):
  def __init__(self, cfg, *, rngs: nnx.Rngs):
    rotary_dim = int(cfg.width // cfg.num_heads * cfg.rotary_fraction)
    self.input_layernorm = nnx.LayerNorm(cfg.width, epsilon=cfg.eps, rngs=rngs)
    self.self_attn = PhiAttention(cfg.width, cfg.num_heads, rotary_dim, cfg.rope_theta, rngs=rngs)
    self.mlp = PhiMlp(cfg.width, cfg.mlp_dim, rngs=rngs)

  def __call__(self, x):
    h = self.input_layernorm(x)
    return x + self.self_attn(h) + self.mlp(h)


class Phi2(nnx.Module):
  """``embed_tokens -> layers -> final_layernorm`` (names as ``PhiModel.model``)."""

  policy_components = ()  # a frozen encoder: nothing of it is trained
  condition_ndim = 2

  def __init__(self, cfg: ml_collections.ConfigDict, *, rngs: nnx.Rngs):
    if cfg.width % cfg.num_heads:
      raise ValueError(f"Phi width {cfg.width} is not divisible by num_heads {cfg.num_heads}")
    self.width = cfg.width
    self.embed_tokens = nnx.Embed(cfg.vocab_size, cfg.width, embedding_init=nnx.initializers.normal(0.02),
                                  rngs=rngs)
    self.layers = nnx.List([PhiLayer(cfg, rngs=rngs) for _ in range(cfg.depth)])
    self.final_layernorm = nnx.LayerNorm(cfg.width, epsilon=cfg.eps, rngs=rngs)

  def __call__(self, ids: jax.Array) -> jax.Array:
    """Token ids (B, T) -> last hidden states (B, T, width)."""
    chex.assert_rank(ids, 2)
    x = self.embed_tokens(ids)
    out = self.final_layernorm(scan_blocks(self.layers, x))  # a sharded run gathers one layer at a time
    chex.assert_shape(out, ids.shape + (self.width,))
    return out


PAD_ID = 50256  # <|endoftext|>, Phi-2's pad token


class TokenizerError(FileNotFoundError):
  """Phi-2's tokenizer files are missing, in one sentence."""


_TOKENIZERS: dict = {}


def load_tokenizer(path: str | None):
  """The HF ``tokenizers`` tokenizer of ``path`` (a ``tokenizer.json`` or a folder holding one), cached."""
  import os
  if not path:
    raise TokenizerError("model.tokenizer_path is not set: point it at Phi-2's tokenizer.json (or its folder, "
                         "e.g. <nova pipeline>/tokenizer).")
  path = os.path.abspath(os.path.expanduser(path))
  file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
  if not os.path.isfile(file):
    raise TokenizerError(f"Phi-2 tokenizer {file} does not exist (model.tokenizer_path={path}).")
  if file not in _TOKENIZERS:
    from tokenizers import Tokenizer  # lazily: only text-to-image families need it
    _TOKENIZERS[file] = Tokenizer.from_file(file)
  return _TOKENIZERS[file]


def tokenize(prompts: list[str], path: str | None, max_len: int = 256, pad: int = -1):
  """(N, max_len) int32 ids of ``prompts``, truncated, right-padded with ``pad`` (-1: marks the padding)."""
  import numpy as np
  tok = load_tokenizer(path)
  out = np.full((len(prompts), max_len), pad, np.int32)
  for i, enc in enumerate(tok.encode_batch(list(prompts), add_special_tokens=False)):
    ids = enc.ids[:max_len]
    out[i, :len(ids)] = ids
  return out
