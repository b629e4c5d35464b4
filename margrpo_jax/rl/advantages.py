r"""Group-relative advantages over ``G`` images per prompt (rewards laid out prompt-major, ``(P * G,)``).

* ``grpo``:   ``A = (r - mean_g r) / (std_g r + eps)`` with the unbiased std (ddof 1) and eps = 1e-4, as the
  official trainers compute it.
* ``drgrpo``: ``A = r - mean_g r`` (Dr. GRPO: no std normalisation).
* ``rloo``:   ``A = r - (sum_g r - r) / (G - 1)`` (leave-one-out baseline).
* ``sign``:   ``A = sign(r - mean_g r)``: every image better than its group's mean weighs the same (with
  ``rl.positive_only``, RAFT's uniform weights on the filtered images), where ``grpo`` gives a group's lone passing
  image sqrt(G - 1) times the weight of each image of a half-passing group.

Constant rewards within a group give exactly zero advantages (never NaN).

:func:`with_distinctness` (``rl.diversity_bonus = lam``) adds to each reward, in proportion to it, how much its
image differs from the other images of its prompt: ``r_i + lam r_i (d_i / mean_g d - 1)``, ``d_i`` the mean
distance of image ``i``'s latents to the group's others.

:func:`informative_groups` (``rl.rollout_prompts > rl.prompts_per_iter``, DAPO's dynamic sampling by
over-drawing): of the ``P'`` groups of a rollout, the ``P`` whose rewards vary most, so that fewer of the update's
groups are all-pass or all-fail (zero advantages, no signal).
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

KINDS = ("grpo", "drgrpo", "rloo", "sign")


def group_advantages(rewards, group_size: int, kind: str = "grpo", eps: float = 1e-4):
  if kind not in KINDS:
    raise ValueError(f"advantage kind {kind!r} is not one of {', '.join(KINDS)}")
  if group_size < 2:
    raise ValueError(f"group_size={group_size}: group-relative advantages need at least 2 images per prompt")
  r = jnp.asarray(rewards, jnp.float32).reshape(-1, group_size)
  mean = r.mean(axis=1, keepdims=True)
  if kind == "grpo":
    adv = (r - mean) / (jnp.std(r, axis=1, ddof=1, keepdims=True) + eps)
  elif kind == "drgrpo":
    adv = r - mean
  elif kind == "sign":
    adv = jnp.sign(r - mean)
  else:
    adv = r - (r.sum(axis=1, keepdims=True) - r) / (group_size - 1)
  return adv.reshape(-1)


def shuffle_in_groups(adv, group_size: int, seed) -> np.ndarray:
  """The control: ``adv`` permuted inside each group (same values, no link to the images that earned them)."""
  r = np.random.default_rng(seed)
  return np.concatenate([r.permutation(g) for g in np.asarray(adv).reshape(-1, group_size)])


def shape_weights(adv, positive_only: bool = False, clip: float = 0.0) -> np.ndarray:
  """The update's per-image weights from the advantages: clipped at 0 (``positive_only``: only the images better
  than their group's mean are trained on) and / or to ``[-clip, clip]`` (``clip > 0``, AWM's bound)."""
  adv = np.asarray(adv, np.float32)
  if positive_only:
    adv = np.maximum(adv, 0.0)
  if clip > 0:
    adv = np.clip(adv, -clip, clip)
  return adv


def with_distinctness(rewards, latents, group_size: int, weight: float) -> np.ndarray:
  """``r_i + weight r_i (d_i / mean_g d - 1)``: ``d_i`` the mean Euclidean distance of image ``i``'s ``latents``
  (B, ...) to the other images of its group. The bonus sums to 0 over a group of equal rewards; it ranks the
  images of an all-pass group by how much each differs from the rest (against mode-seeking filters)."""
  r = np.asarray(rewards, np.float64).reshape(-1, group_size)
  z = np.asarray(latents, np.float64).reshape(r.shape + (-1,))
  d = np.sqrt(((z[:, :, None] - z[:, None, :]) ** 2).sum(-1)).sum(-1) / (group_size - 1)  # (P, G)
  rel = d / np.maximum(d.mean(axis=1, keepdims=True), 1e-12) - 1.0
  return (r + weight * r * rel).reshape(-1).astype(np.asarray(rewards).dtype)


def informative_groups(rewards, group_size: int, keep: int) -> np.ndarray:
  """The rows (prompt-major, sorted) of the ``keep`` groups of ``rewards`` (``(P' * G,)``) with the largest reward
  std; ties (e.g. every all-pass or all-fail group, std 0) keep the draw order."""
  r = np.asarray(rewards, np.float64).reshape(-1, group_size)
  if not 1 <= keep <= len(r):
    raise ValueError(f"keep={keep} groups of {len(r)}")
  groups = np.sort(np.argsort(-r.std(axis=1), kind="stable")[:keep])
  return (groups[:, None] * group_size + np.arange(group_size)).reshape(-1)
