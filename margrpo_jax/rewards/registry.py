"""Rewards by name, combined with weights: ``r = sum_f w_f r_f(images, metadatas)``.

* ``shapes_partial``: the shapes-world verifier's partial score in [0, 1] (the dense RL signal).
* ``shapes_strict``: strict pass in {0, 1} (for reporting, or as a sparse reward).
* ``jpeg_compressibility``: ``-(JPEG size in kB)`` at quality 95, as in DDPO (needs no metadata).

Every reward maps uint8 images (B, H, W, 3) and their metadata to a float32 array (B,).
"""
from __future__ import annotations

import io
from typing import Callable

import numpy as np
from PIL import Image

from margrpo_jax.rewards import shapes_verifier


def _verifier(key: str) -> Callable:
  def fn(images, metadatas):
    s = shapes_verifier.score_images(images, metadatas)
    return np.array([p[key] for p in s["per_image"]], np.float32)
  return fn


def jpeg_compressibility(images, metadatas=None):
  out = []
  for im in np.asarray(images):
    buf = io.BytesIO()
    Image.fromarray(im).save(buf, format="JPEG", quality=95)
    out.append(-buf.tell() / 1000.0)
  return np.array(out, np.float32)


REWARDS: dict[str, Callable] = {
    "shapes_partial": _verifier("partial"),
    "shapes_strict": lambda im, md: _verifier("strict")(im, md).astype(np.float32),
    "jpeg_compressibility": jpeg_compressibility,
}


def compute(weights: dict[str, float], images, metadatas) -> tuple[np.ndarray, dict[str, np.ndarray]]:
  """``(total (B,), {name: (B,)})`` for the weighted rewards; unknown names raise one clear ValueError."""
  unknown = sorted(set(weights) - set(REWARDS))
  if unknown:
    raise ValueError(f"reward(s) {', '.join(unknown)} not in the registry (known: {', '.join(sorted(REWARDS))})")
  parts = {name: REWARDS[name](images, metadatas) for name in weights}
  total = sum(float(w) * parts[n] for n, w in weights.items() if w)
  return np.asarray(total, np.float32), parts
