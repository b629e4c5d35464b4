r"""Reward-preserving augmentation of the images an update trains on (``rl.augment``; estimators that re-encode).

``'shift'``: every image is rolled by a random integer offset ``(dy, dx)`` drawn uniformly from those that keep all
of its content in the frame: with ``r0, r1, c0, c1`` the bounding box of the pixels the shapes verifier does not
classify as background, ``dy in [-r0, H - 1 - r1]`` and ``dx in [-c0, W - 1 - c1]``. No object is cut or wrapped,
so the verifier finds the same objects (colour, shape, area) with every centroid moved by ``(dy, dx)``: counts and
relations, and so the reward, are unchanged (a test checks it on rendered scenes).

Why: the filtered ELBO fits each group's passing images where the policy drew them, and the self-training loop
compounds their placement: objects collapse onto a few positions (the spread of a first object's centroid over a
prompt's images falls from 5.4 to 2.0 pixels on two-object prompts), which is most of the diversity the main job
loses (docs/estimators.md). Trained on the same images at random offsets, the update carries what made them pass
(which objects, how many, how far apart) and not where they were drawn.
"""
from __future__ import annotations

import numpy as np

from margrpo_jax.rewards import shapes_verifier

KINDS = ("none", "shift")


def offsets(content: np.ndarray, rng: np.random.Generator) -> np.ndarray:
  """``(B, 2)`` offsets ``(dy, dx)``, each uniform over those that keep the image's ``content`` (B, H, W) bool
  inside the frame; 0 for an image without content."""
  b, h, w = content.shape
  out = np.zeros((b, 2), np.int64)
  for i, c in enumerate(content):
    rows, cols = np.flatnonzero(c.any(1)), np.flatnonzero(c.any(0))
    if rows.size:
      out[i] = (rng.integers(-rows[0], h - rows[-1]), rng.integers(-cols[0], w - cols[-1]))
  return out


def shift_within_frame(images: np.ndarray, rng: np.random.Generator) -> np.ndarray:
  """``images`` (B, H, W, 3) uint8, each rolled by its :func:`offsets` (content = not the verifier's background)."""
  content = np.stack([shapes_verifier.classify_pixels(im) != 0 for im in images])
  return np.stack([np.roll(im, tuple(o), axis=(0, 1)) for im, o in zip(images, offsets(content, rng))])


def apply(kind: str, images: np.ndarray, rng: np.random.Generator) -> np.ndarray:
  """The images an update trains on under ``rl.augment = kind``."""
  return shift_within_frame(images, rng) if kind == "shift" else images
