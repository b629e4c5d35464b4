r"""Which tokens get which gradient estimate: MTE uncertainty top-k and consistency-aware selection.

Uncertainty (MTE, docs/algorithm.md section 6): from ``S`` final samples of the frozen head drawn from the same AR
latent, ``u[b, l] = mean_c std_s(x0^{(s)}[b, l, c])`` (population std). ``U = topk_mask(u, frac)`` marks the
``floor(frac * L)`` most uncertain tokens of each image (``jax.lax.top_k``: among equal values the lower
position wins, so exactly ``floor(frac * L)`` tokens are selected, ties included): the official rule, known
tokens included. :func:`topk_in_region` takes the top fraction of the loss region's tokens instead.
Per latent pixel (official NOVA, A3): a token of ``C = p^2 c`` values laid out ``(ph, pw, c)`` holds ``p^2`` pixels;
``u[b, l, x] = mean_c std_s(x0^{(s)}[b, l, x, c])`` ranks the ``L p^2`` pixels instead, and
:func:`add_random` adds the official one uniformly drawn pixel (C3).

Consistency (docs/algorithm.md section 7): a still-undecoded token at AR step ``i > 1`` is kept only if its tentative
prediction moved toward the final image between steps ``i - 1`` and ``i``:
``H = cos(xhat_i, x_fin) - cos(xhat_{i-1}, x_fin) > thresh`` (cosine over channels).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp


def pixel_uncertainty(samples: jax.Array, channels: int) -> jax.Array:
  """``samples`` (S, B, L, C) -> uncertainty (B, L, C // channels) of each token's pixels of ``channels`` values
  (channel fastest: the ``(ph, pw, c)`` patch layout)."""
  s = samples.reshape(samples.shape[:-1] + (samples.shape[-1] // channels, channels))
  return jnp.std(s, axis=0).mean(axis=-1)


def uncertainty(samples: jax.Array) -> jax.Array:
  """``samples`` (S, B, L, C) -> per-token uncertainty (B, L)."""
  return pixel_uncertainty(samples, samples.shape[-1])[..., 0]


def topk_count(num_tokens: int, fraction: float) -> int:
  """``floor(fraction * L)``, the official ``int(0.3 * 1024) = 307`` rule."""
  return int(math.floor(fraction * num_tokens + 1e-9))


def topk_indices(u: jax.Array, fraction: float) -> jax.Array:
  """(B, K) int32 positions of the ``K = topk_count(L, fraction)`` largest ``u`` of each row (``lax.top_k``)."""
  k = topk_count(u.shape[-1], fraction)
  if k == 0:
    return jnp.zeros(u.shape[:-1] + (0,), jnp.int32)
  return jax.lax.top_k(u, k)[1].astype(jnp.int32)


def topk_in_region(u: jax.Array, region: jax.Array, fraction: float) -> tuple[jax.Array, jax.Array]:
  """The ``floor(fraction * |region|)`` most uncertain tokens of each row's ``region`` (B, L): their positions
  padded to the static ``K = topk_count(L, fraction)`` (B, K), and the mask U (B, L) of the selected ones."""
  idx = topk_indices(jnp.where(region, u, -jnp.inf), fraction)
  want = jnp.floor(fraction * region.sum(-1) + 1e-6).astype(jnp.int32)  # per row
  valid = jnp.arange(idx.shape[-1]) < want[:, None]
  mask = jnp.zeros(region.shape, bool).at[jnp.arange(idx.shape[0])[:, None], idx].max(valid)
  return idx, mask


def add_random(mask: jax.Array, eligible: jax.Array, key: jax.Array, count: int) -> jax.Array:
  """``mask`` (B, N) plus ``count`` entries per row drawn uniformly among ``eligible & ~mask`` (fewer where fewer
  are left): official NOVA's extra random pixel, ``max(1, int(0.0 N)) = 1`` (C3)."""
  score = jnp.where(eligible & ~mask, jax.random.uniform(key, mask.shape), -1.0)
  val, idx = jax.lax.top_k(score, count)
  return mask.at[jnp.arange(mask.shape[0])[:, None], idx].max(val >= 0)


def indices_to_mask(idx: jax.Array, length: int) -> jax.Array:
  """(B, K) positions -> (B, L) bool."""
  return jnp.zeros((idx.shape[0], length), bool).at[jnp.arange(idx.shape[0])[:, None], idx].set(True)


def topk_mask(u: jax.Array, fraction: float) -> jax.Array:
  """(B, L) bool with exactly ``topk_count(L, fraction)`` True per row, at the largest ``u``."""
  return indices_to_mask(topk_indices(u, fraction), u.shape[-1])


def cosine(a: jax.Array, b: jax.Array, eps: float = 1e-8) -> jax.Array:
  """Cosine similarity over the last axis."""
  num = jnp.sum(a * b, axis=-1)
  return num / jnp.maximum(jnp.linalg.norm(a, axis=-1) * jnp.linalg.norm(b, axis=-1), eps)


def moved_closer(pred: jax.Array, prev_pred: jax.Array, final: jax.Array, thresh: float = 0.0) -> jax.Array:
  """``H`` (B, L): the tentative prediction at step i is closer (cosine) to the final token than at i - 1."""
  return cosine(pred, final) - cosine(prev_pred, final) > thresh


def consistency_filter(region: jax.Array, decoded: jax.Array, moved: jax.Array, step: int | jax.Array):
  """``M' = M * clip(H * M + P, 0, 1)`` for ``step > 1`` (else ``M``): tokens decoded at the step are always
  kept, still-undecoded ones only where ``H``. All (B, L) bool."""
  kept = region & (moved | decoded)
  return jnp.where(jnp.asarray(step) > 1, kept, region)
