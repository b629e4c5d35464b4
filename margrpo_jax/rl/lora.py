r"""LoRA adapters for RL fine-tuning (``rl.lora.rank > 0``): the base stays frozen, a low-rank update is trained.

Each targeted 2-D kernel ``W`` (in, out) of the trainable components (``rl.lora.targets``: regexes over the
'/'-joined parameter paths, e.g. ``backbone/encoder_blocks/0/attn/qkv/kernel``) is used as

    W' = W + (alpha / r) A B,   A (in, r) ~ N(0, 1/in),   B (r, out) = 0,

so the adapted model starts exactly at the base (``A B = 0``); ``alpha`` defaults to ``r`` (scale 1). The
adapter pytree mirrors the parameter tree down to each targeted kernel, which becomes ``{'lora_a': A,
'lora_b': B}``; its top-level keys are the trained components, so the optimizer's masks, the sharding rules
(``parallel/sharding.py``: A follows the kernel's input axis, B its output axis) and checkpoints treat it like
any policy. The reference policy is the base itself: the empty adapter tree ``{}``, merged, is the base.

With rank 0 (full fine-tuning) nothing here changes what is computed: :func:`assemble` is ``{**frozen,
**policy}``.
"""
from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp

FACTORS = ("lora_a", "lora_b")  # the two factors of an adapted kernel, as named in the adapter tree
# rl.lora.targets' default: the attention (qkv, proj) and MLP (fc1, fc2) kernels of every transformer block of the
# trained components (MAR's encoder / decoder, the shapes-world text encoder, NOVA's transformer); not the
# embeddings, projections or the diffusion head
DEFAULT_TARGETS = r"blocks/\d+/(attn/(qkv|proj)|mlp/fc[12])/kernel$"


@dataclasses.dataclass(frozen=True)
class LoraConfig:
  """``rl.lora`` resolved: ``rank`` 0 = full fine-tuning; ``alpha`` 0 = ``rank``; ``targets`` the regexes."""
  rank: int = 0
  alpha: float = 0.0
  targets: tuple[str, ...] = ()

  @property
  def scale(self) -> float:
    """``alpha / r`` (1 for full fine-tuning and for the default ``alpha = r``)."""
    return (self.alpha or self.rank) / self.rank if self.rank else 1.0


def parse(rank: int, alpha: float, targets: str) -> LoraConfig:
  """``rl.lora.*`` as a :class:`LoraConfig`; a negative rank or alpha, or a regex that does not compile, is a
  ``ValueError`` naming the key (``rl/config.py`` raises it as a ConfigError). The targets are matched against a
  model by :func:`targets`."""
  if rank < 0:
    raise ValueError(f"rl.lora.rank={rank} must be >= 0 (0 = full fine-tuning)")
  if not 0.0 <= alpha < float("inf"):
    raise ValueError(f"rl.lora.alpha={alpha} must be a finite number >= 0 (0 = rl.lora.rank, i.e. scale 1)")
  patterns = tuple(p.strip() for p in str(targets).split(",") if p.strip())
  for p in patterns:
    try:
      re.compile(p)
    except re.error as e:
      raise ValueError(f"rl.lora.targets={targets!r}: {p!r} is not a regular expression ({e})") from None
  return LoraConfig(int(rank), float(alpha), patterns)


def _leaves(params):
  """``(path, keys, leaf)`` of every leaf, ``path`` the '/'-joined keys."""
  for path, leaf in jax.tree_util.tree_leaves_with_path(params):
    keys = tuple(getattr(k, "key", getattr(k, "idx", k)) for k in path)
    yield "/".join(str(k) for k in keys), keys, leaf


def targets(params, patterns) -> tuple[str, ...]:
  """The paths of the 2-D leaves of ``params`` that some regex of ``patterns`` matches (``re.search``); a pattern
  that matches none of them is a ``ValueError`` naming ``rl.lora.targets``."""
  if not patterns:
    raise ValueError("rl.lora.targets='' names no parameter: rl.lora.rank > 0 needs at least one regex")
  paths = [path for path, _, leaf in _leaves(params) if len(leaf.shape) == 2]
  for p in patterns:
    if not any(re.search(p, path) for path in paths):
      raise ValueError(f"rl.lora.targets={','.join(patterns)!r}: {p!r} matches no 2-D parameter of "
                       f"the trained components {', '.join(sorted(params))}")
  return tuple(path for path in paths if any(re.search(p, path) for p in patterns))


def init(params, cfg: LoraConfig, key: jax.Array) -> dict:
  """The adapter tree of ``params`` (the trainable components): for each targeted kernel (in, out) a float32
  ``lora_a`` (in, r) ~ N(0, 1/in) from ``fold_in(key, i)`` (``i`` its place in :func:`targets`' order) and a zero
  ``lora_b`` (r, out). Works on abstract leaves under ``jax.eval_shape``."""
  chosen = {path: i for i, path in enumerate(targets(params, cfg.targets))}
  tree: dict = {}
  for path, keys, w in _leaves(params):
    if path not in chosen:
      continue
    (n_in, n_out), r = w.shape, cfg.rank
    a = jax.random.normal(jax.random.fold_in(key, chosen[path]), (n_in, r), jnp.float32) / jnp.sqrt(n_in)
    node = tree
    for k in keys[:-1]:
      node = node.setdefault(k, {})
    node[keys[-1]] = dict(lora_a=a, lora_b=jnp.zeros((r, n_out), jnp.float32))
  return tree


def _is_adapter(node) -> bool:
  return isinstance(node, dict) and set(node) == set(FACTORS)


def merge(base, adapters, scale: float):
  """``base`` with every adapted kernel replaced by ``W + scale A B`` (in float32 when ``W`` is stored in bfloat16,
  ``rl.frozen_dtype``: the adapters' small update is not rounded away); leaves without an adapter are ``base``'s own
  (not copied). Pure and jittable; ``merge(base, {}, s)`` is ``base``."""
  if _is_adapter(adapters):
    delta = scale * jnp.matmul(adapters["lora_a"], adapters["lora_b"])
    return base.astype(jnp.promote_types(base.dtype, delta.dtype)) + delta
  return {**base, **{k: merge(base[k], v, scale) for k, v in adapters.items()}}


def assemble(frozen: dict, policy: dict, cfg: LoraConfig) -> dict:
  """The model's parameters from the RL step's two halves: ``{**frozen, **policy}`` (rank 0: ``policy`` holds the
  trained components), or, with LoRA, the base ``frozen`` (every parameter) merged with the adapters ``policy``
  (``{}``, the reference, gives the base)."""
  if not cfg.rank:
    return {**frozen, **policy}
  return merge(frozen, policy, cfg.scale)


def split(params: dict, trainable: tuple[str, ...], cfg: LoraConfig, key: jax.Array) -> tuple[dict, dict]:
  """``(policy, frozen)`` of the base ``params``: rank 0: the ``trainable`` components and the rest; LoRA: fresh
  adapters over the trainable components (:func:`init` with ``key``) and every parameter of the base."""
  if not cfg.rank:
    return {k: params[k] for k in trainable}, {k: v for k, v in params.items() if k not in trainable}
  return init({k: params[k] for k in trainable}, cfg, key), params
