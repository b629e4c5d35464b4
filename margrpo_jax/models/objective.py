r"""MAR's masked diffusion objective: pretraining's loss and, per image, RL's image log-likelihood surrogate.

Per image: a random order, a mask ratio ``r``, the first ``ceil(L r)`` tokens of the order masked. ``r`` is
MAR's ``TruncNormal(mean 1, std 0.25, [0.7, 1])`` (``mask_ratio='truncnorm'``) or MaskGIT's
``r = cos(pi/2 u), u ~ U(0, 1)`` (``'cosine'``: the masked fractions the cosine sampler visits). The condition
is dropped to the null embedding with probability ``label_drop`` (CFG). ``z = backbone(tokens, mask, cond)``;
each token's ``(z, x_0)`` pair is repeated ``diffusion_batch_mul`` times with independent ``t ~ U{0..T-1}`` and
noise, and ``l(token) = MSE(eps) + VLB`` (``gaussian.training_loss``) on the masked tokens.

Averaged over the orders, masks and noise levels, ``-l`` is (up to constants and level weights) an evidence lower
bound of ``log p(x | prompt)`` under the MAR, which RL's forward-process estimators score (``rl/estimators/``: image_elbo, awm, nft).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from margrpo_jax import rng
from margrpo_jax.diffusion import gaussian


MASK_RATIOS = ("cosine", "truncnorm")  # the one list of mask-ratio laws (validate.py reads it)


@dataclasses.dataclass(frozen=True)
class MaskedObjective:
  mask_ratio: str = "cosine"    # 'cosine' (MaskGIT, the sampler's fractions) | 'truncnorm' (MAR)
  mask_ratio_min: float = 0.7   # truncnorm's lower bound
  mask_ratio_std: float = 0.25
  diffusion_batch_mul: int = 4  # noise levels per token
  label_drop: float = 0.1       # probability of the null condition

  @classmethod
  def from_config(cls, c) -> "MaskedObjective":
    return cls(**{f.name: c[f.name] for f in dataclasses.fields(cls) if f.name in c})


def validate(obj: MaskedObjective, prefix: str = "mar.") -> None:
  """``ValueError`` naming ``prefix + field`` for a law not in :data:`MASK_RATIOS` or a value out of its range
  (the one check of these keys: validate.py calls it on ``mar``, rl/config.py on ``rl.mar_objective``)."""
  if obj.mask_ratio not in MASK_RATIOS:
    raise ValueError(f"{prefix}mask_ratio={obj.mask_ratio!r} is not one of {', '.join(MASK_RATIOS)}")
  for name, ok, span in (("mask_ratio_min", 0.0 <= obj.mask_ratio_min <= 1.0, "a number in [0, 1]"),
                         ("mask_ratio_std", 0.0 <= obj.mask_ratio_std < float("inf"), "a finite number >= 0"),
                         ("diffusion_batch_mul", obj.diffusion_batch_mul >= 1, "at least 1"),
                         ("label_drop", 0.0 <= obj.label_drop < 1.0, "a number in [0, 1) (1: never conditioned)")):
    if not ok:
      raise ValueError(f"{prefix}{name}={getattr(obj, name)} must be {span}")


def sample_mask(obj: MaskedObjective, b: int, seq_len: int, key: jax.Array) -> jax.Array:
  """(B, L) bool: the masked (predicted) tokens of each image."""
  order = jax.vmap(lambda k: jax.random.permutation(k, seq_len))(jax.random.split(rng.stream(key, "order"), b))
  if obj.mask_ratio == "cosine":
    ratio = jnp.cos(jnp.pi / 2 * jax.random.uniform(rng.stream(key, "ratio"), (b,)))
  elif obj.mask_ratio == "truncnorm":
    lower = (obj.mask_ratio_min - 1.0) / obj.mask_ratio_std
    ratio = 1.0 + obj.mask_ratio_std * jax.random.truncated_normal(rng.stream(key, "ratio"), lower, 0.0, (b,))
  else:
    raise ValueError(f"mar.mask_ratio={obj.mask_ratio!r} is not one of {', '.join(MASK_RATIOS)}")
  num_masked = jnp.clip(jnp.ceil(seq_len * ratio), 1, seq_len)
  return jnp.argsort(order, axis=1) < num_masked[:, None]  # place in the order < number masked


def per_token(model, diff: gaussian.Diffusion, obj: MaskedObjective, ids, x0, key, ref_model=None):
  """``(loss, mask, kl)``: ``loss`` (m, B, L) per token and noise level, ``mask`` (B, L) the masked tokens, and,
  with a ``ref_model``, ``kl`` (m, B, L) = ``1/2 mean_c (eps_hat - eps_hat_ref)^2`` at the same draws (the two
  denoisers' distance, gradient through the model only), else None."""
  b, seq_len, _ = x0.shape
  mask = sample_mask(obj, b, seq_len, key)
  drop = jax.random.bernoulli(rng.stream(key, "label_drop"), obj.label_drop, (b,))
  m = obj.diffusion_batch_mul
  t = jax.random.randint(rng.stream(key, "timestep"), (m, b, seq_len), 0, diff.num_steps)
  noise = jax.random.normal(rng.stream(key, "noise"), (m,) + x0.shape)
  x_t = gaussian.q_sample(diff, x0, t, noise)

  def head(mod):
    cond = jnp.where(drop[:, None, None], mod.null_condition(b), mod.condition(ids))
    z = mod.backbone(x0, mask, cond)
    return mod.head(x_t, t, jnp.broadcast_to(z, (m,) + z.shape))

  out = head(model)
  kl = None
  if ref_model is not None:
    ref_eps = jax.lax.stop_gradient(gaussian.split_output(head(ref_model))[0])
    kl = 0.5 * jnp.mean((gaussian.split_output(out)[0] - ref_eps) ** 2, axis=-1)
  return gaussian.training_loss(diff, out, x0, x_t, t, noise), mask, kl


def mar_loss(model, diff: gaussian.Diffusion, obj: MaskedObjective, batch: dict, key: jax.Array):
  """Pretraining's loss on ``{'ids': (B, T), 'tokens': (B, L, C)}``: the mean over every masked token."""
  loss, mask, _ = per_token(model, diff, obj, batch["ids"], batch["tokens"], key)
  w = jnp.broadcast_to(mask, loss.shape).astype(jnp.float32)
  return jnp.sum(loss * w) / jnp.maximum(w.sum(), 1.0)


def per_image(values, mask):
  """(m, B, L) per-token values -> (B,) means over each image's masked tokens and noise levels."""
  w = jnp.broadcast_to(mask, values.shape).astype(jnp.float32)
  return jnp.sum(values * w, axis=(0, 2)) / jnp.maximum(w.sum(axis=(0, 2)), 1.0)
