"""The ImageReward v1.0 reward (docs/rewards.md section 2.3): ``build(cfg)(images uint8 (B, H, W, 3), prompts) ->
(B,)``.

Preprocessing, as the package's ``Resize(224, BICUBIC) -> CenterCrop(224) -> ToTensor -> Normalize``: the shorter
side is resized to ``S`` (PIL's bicubic: Keys a=-0.5, kernel widened by the downscale factor, weights renormalised
at the borders; horizontal then vertical pass, each rounded and clipped to uint8 as PIL stores them), the centre
``S x S`` crop is taken, and
``x = (v / 255 - mean) / std`` with OpenAI CLIP's mean/std. Text: WordPiece ``[CLS] ... [SEP]`` padded to 35.
Score: ``(head(BERT(ids, mask, ViT(x))[:, 0]) - 0.16717362830052426) / 1.0333394966054072``.

How to use::

    python -m margrpo_jax.convert --family=imagereward --src=ImageReward.pt --out=ckpt/imagereward
    # RL: --config.rl.rewards.imagereward=1.0 with config.rewards.imagereward = {checkpoint, vocab}
    # eval: --config.rewards.imagereward.checkpoint=ckpt/imagereward --config.rewards.imagereward.vocab=vocab.txt

``vocab`` is bert-base-uncased's ``vocab.txt`` (30522 lines; ``[DEC]`` and ``[ENC]`` are appended as BLIP does).
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from margrpo_jax import checkpoint, fileio
from margrpo_jax.rewards import registry, wordpiece

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def resize_shorter(images: jax.Array, size: int) -> jax.Array:
  """uint8-valued (B, H, W, C) -> float (B, h, w, C) with the shorter side ``size`` (torchvision's
  ``Resize(int)`` sizes), bicubic with antialiasing, per pass rounded and clipped to [0, 255] like PIL."""
  _, h, w, _ = images.shape
  short, long = (h, w) if h <= w else (w, h)
  new_long = int(size * long / short)
  hw = (size, new_long) if h <= w else (new_long, size)
  x = images.astype(jnp.float32)
  for axis in (2, 1):  # PIL: a horizontal pass, then a vertical one, each stored as uint8
    if x.shape[axis] != hw[axis - 1]:
      shape = list(x.shape)
      shape[axis] = hw[axis - 1]
      x = jnp.clip(jnp.round(jax.image.resize(x, shape, "bicubic", antialias=True)), 0, 255)
  return x


def center_crop(images: jax.Array, size: int) -> jax.Array:
  """torchvision ``CenterCrop``: top/left offsets ``round((H - size) / 2)``."""
  _, h, w, _ = images.shape
  top, left = int(round((h - size) / 2.0)), int(round((w - size) / 2.0))
  return images[:, top:top + size, left:left + size]


def preprocess(images: jax.Array, size: int, mean=CLIP_MEAN, std=CLIP_STD) -> jax.Array:
  """uint8 (B, H, W, 3) -> normalised float32 (B, size, size, 3)."""
  x = center_crop(resize_shorter(images, size), size) / 255.0
  return (x - jnp.asarray(mean, jnp.float32)) / jnp.asarray(std, jnp.float32)


def _need(cfg, key: str) -> str:
  path = str(cfg.get(key, "") or "")
  path = fileio.resolve(path) if path else path
  if not path or not fileio.exists(path):
    raise FileNotFoundError(f"rewards.imagereward.{key}={path!r} does not exist; "
                            + ("convert ImageReward.pt with python -m margrpo_jax.convert --family=imagereward."
                               if key == "checkpoint" else "give bert-base-uncased's vocab.txt."))
  return path


def build(cfg) -> Callable[[np.ndarray, list[str]], np.ndarray]:
  """The jitted ImageReward scorer of ``cfg.checkpoint`` (an ``imagereward`` export) with ``cfg.vocab``;
  ``cfg.batch_size`` (default 16) images per compiled call, on the device mesh (params replicated)."""
  ckpt, vocab = _need(cfg, "checkpoint"), _need(cfg, "vocab")
  model_cfg, graphdef, params = checkpoint.load_model(ckpt)
  if model_cfg.family != "imagereward":
    raise ValueError(f"rewards.imagereward.checkpoint={ckpt} holds a {model_cfg.family!r} model, not imagereward.")
  tok = wordpiece.WordPiece.from_file(vocab, extra=("[DEC]", "[ENC]"))

  def apply(p, images, ids, mask):
    return nnx.merge(graphdef, p)(preprocess(images, model_cfg.image_size), ids, mask)

  run = registry.batched_on_mesh(apply, params, int(cfg.get("batch_size", 16) or 16))

  def score(images, prompts):
    ids, mask = tok.encode(list(prompts), model_cfg.max_len)
    return run(np.asarray(images, np.uint8), ids, mask)
  return score

