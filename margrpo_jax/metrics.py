r"""What a fine-tuned shapes-world generator is measured by, over several sampling seeds.

* **Strict pass per task** (:func:`sample_and_verify`): every prompt sampled once per sampling seed with the
  sample job's settings (``generate.generate``: batch ``i`` draws from ``fold_in(key(seed), i)``), verified, and
  the rate per task and overall (the mean over images; the splits hold the tasks in equal numbers). Two models
  sampled with the same prompts and seed see the same noise, so their difference is *paired*; one seed on 400
  prompts carries about 0.03 of paired noise, hence several seeds.
* **Diversity** (:func:`diversity`): ``G`` images of each of a set of prompts; per prompt the mean pairwise
  Euclidean distance of the images' tokenizer latents (the re-encoding, ``(L C,)`` vectors), averaged over
  prompts. A mode-seeking update shrinks it.
* **Drift** (:func:`drift`): the relative parameter distance ``|theta - theta_0| / |theta_0|`` of the trained
  components from the base, as full weights (``Setup.trained_policy``: LoRA adapters merged) against
  ``Setup.base_policy``.

:func:`summary` reduces per-seed figures to mean and standard error (over seeds), and paired differences.
"""
from __future__ import annotations

import jax
import numpy as np

from margrpo_jax import generate
from margrpo_jax.data import shapes
from margrpo_jax.models import families


def sample_and_verify(graphdef, params, model_cfg, records: list[dict], sampling, seed: int,
                      batch_size: int = 64) -> dict:
  """``{'strict': (N,) bool, 'partial': (N,) float, 'tags': (N,) str}`` of ``records`` (shapes-world metadata)
  sampled once with ``seed``."""
  images = generate.generate(graphdef, params, model_cfg, [r["prompt"] for r in records], sampling, seed=seed,
                             batch_size=batch_size)
  per = generate.score(images, records)["per_image"]
  return dict(strict=np.array([p["strict"] for p in per], bool), partial=np.array([p["partial"] for p in per]),
              tags=np.array([r["tag"] for r in records]))


def rates(result: dict) -> dict:
  """Strict pass overall and per task, and the mean partial score, of one :func:`sample_and_verify` result."""
  strict, tags = result["strict"].astype(float), result["tags"]
  return dict(strict=float(strict.mean()), partial=float(np.mean(result["partial"])),
              **{t: float(strict[tags == t].mean()) for t in shapes.TASKS if (tags == t).any()})


def diversity(graphdef, params, model_cfg, prompts: list[str], images_per_prompt: int, sampling, seed: int,
              batch_size: int = 64) -> float:
  """Mean over ``prompts`` of the mean pairwise latent distance of ``images_per_prompt`` images each."""
  g = images_per_prompt
  images = generate.generate(graphdef, params, model_cfg, [p for p in prompts for _ in range(g)], sampling,
                             seed=seed, batch_size=batch_size)
  z = np.asarray(families.get(model_cfg.family).encode_images(model_cfg, images), np.float64)
  return latent_spread(z.reshape(len(prompts), g, -1))


def latent_spread(z: np.ndarray) -> float:
  """``z`` (P, G, ...) latents of G images per prompt -> the mean over prompts of their mean pairwise distance."""
  z = np.asarray(z, np.float64).reshape(z.shape[0], z.shape[1], -1)
  g = z.shape[1]
  d = np.sqrt(((z[:, :, None] - z[:, None, :]) ** 2).sum(-1))  # (P, G, G)
  return float(d.sum((1, 2)).mean() / (g * (g - 1)))


def drift(params, base) -> float:
  """``|theta - theta_0| / |theta_0|`` over the leaves of ``params`` (the trained components' full weights) and
  ``base`` (the same tree)."""
  flat = lambda t: np.concatenate([np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(t)])
  a, b = flat(params), flat(base)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-12))


def mean_se(values) -> tuple[float, float]:
  """Mean and standard error (sample std / sqrt(n); 0 for one value)."""
  v = np.asarray(values, float)
  return float(v.mean()), float(v.std(ddof=1) / np.sqrt(len(v))) if len(v) > 1 else 0.0


def summary(per_seed: list[dict], base_per_seed: list[dict] | None = None) -> dict:
  """Per-seed :func:`rates` -> ``{key: (mean, se)}``; with the base's rates on the same seeds also
  ``gain_<key>`` (paired differences)."""
  out = {k: mean_se([r[k] for r in per_seed]) for k in per_seed[0]}
  if base_per_seed is not None:
    out.update({f"gain_{k}": mean_se([r[k] - b[k] for r, b in zip(per_seed, base_per_seed)]) for k in per_seed[0]})
  return out
