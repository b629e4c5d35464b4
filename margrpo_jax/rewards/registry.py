"""Rewards by name, combined with weights: ``r = sum_f w_f n(r_f(images, metadatas, prompts))``.

Verifier rewards (need shapes-world metadata, or none):

* ``shapes_partial``: the shapes-world verifier's partial score in [0, 1] (the dense RL signal).
* ``shapes_strict``: strict pass in {0, 1} (for reporting, or as a sparse reward).
* ``shapes_dense``: the verifier's dense score in [0, 1]: the mean of the wanted-object and position clauses,
  divided by ``1 + extra objects``; 1 exactly when strict passes, 0 for an empty canvas
  (:mod:`margrpo_jax.rewards.shapes_verifier`, rule 6).
* ``jpeg_compressibility``: ``-(JPEG size in kB)`` at quality 95, as in DDPO (needs no metadata).
* ``brightness``: mean pixel value in [0, 1] (needs no metadata): a reward every token moves, the first rung of
  the learnability ladder (``benchmarks/learnability.py``).

Learned rewards (need a converted checkpoint and a tokenizer vocabulary, under ``config.rewards.<name>``):
``hps``, ``pickscore``, ``clip_score``, ``aesthetic`` (:mod:`margrpo_jax.rewards.clip_rewards`) and
``imagereward`` (:mod:`margrpo_jax.rewards.imagereward`). Each is a builder ``"module:function"`` with
``build(cfg) -> score(images uint8 (B, H, W, 3), prompts: list[str]) -> float32 (B,)``, imported and built on
first use and cached per settings. A learned reward whose weight is 0 is not computed.

Normalisation ``n`` (``normalize``, per batch, per reward, before weighting): ``'none'``, ``'std'``
(``(r - mean) / (std + 1e-8)``) or ``'minmax'`` (``(r - min) / (max - min + 1e-8)``, MAR-GRPO's optional one).

RL: ``config.rl.rewards.<name> = weight``, settings in ``config.rewards.<name>`` (:func:`settings_config`),
``config.rl.reward_norm``. Every reward maps uint8 images (B, H, W, 3) to a float32 array (B,).
"""
from __future__ import annotations

import importlib
import io
import json
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


def brightness(images, metadatas=None):
  return np.asarray(images, np.float32).reshape(len(images), -1).mean(1) / 255.0


REWARDS: dict[str, Callable] = {  # verifier rewards: fn(images, metadatas)
    "shapes_partial": _verifier("partial"),
    "shapes_strict": lambda im, md: _verifier("strict")(im, md).astype(np.float32),
    "shapes_dense": _verifier("dense"),
    "jpeg_compressibility": jpeg_compressibility,
    "brightness": brightness,
}
# the files a learned reward reads from config.rewards.<name>: key -> the model family of the export there (None: a
# plain file such as a tokenizer vocabulary); validate.py opens them before a run starts
FILES: dict[str, dict[str, str | None]] = {
    "hps": {"checkpoint": "clip", "vocab": None}, "pickscore": {"checkpoint": "clip", "vocab": None},
    "clip_score": {"checkpoint": "clip", "vocab": None}, "aesthetic": {"checkpoint": "clip", "head": "aesthetic"},
    "imagereward": {"checkpoint": "imagereward", "vocab": None},
}
NEEDS_SHAPES = ("shapes_partial", "shapes_strict", "shapes_dense")  # verifier rewards defined only on shapes-world metadata

LEARNED: dict[str, str] = {  # learned rewards: "module:builder", build(cfg)(images, prompts)
    "hps": "margrpo_jax.rewards.clip_rewards:hps",
    "pickscore": "margrpo_jax.rewards.clip_rewards:pickscore",
    "clip_score": "margrpo_jax.rewards.clip_rewards:clip_score",
    "aesthetic": "margrpo_jax.rewards.clip_rewards:aesthetic",
    "imagereward": "margrpo_jax.rewards.imagereward:build",
}
NORMALIZE = ("none", "std", "minmax")

_BUILT: dict[tuple[str, str], Callable] = {}


def names() -> list[str]:
  return sorted({*REWARDS, *LEARNED})


# rewards.<learned reward>.<key> -> (low, high, low included, high included); validate.py checks each block
SETTING_RANGES = dict(batch_size=(1, float("inf"), True, False), scale=(-float("inf"), float("inf"), False, False))


def settings_config():
  """``config.rewards``: per learned reward its ``checkpoint`` and ``vocab`` ('' = not configured), ``batch_size``
  and the builder's options ('' = the builder's default; see clip_rewards / imagereward), so that every one can be
  set from the command line on a locked config."""
  import ml_collections
  clip = dict(resize="")
  extra = {"hps": dict(clip, scale=1.0), "pickscore": dict(clip, scale=1.0, mode=""),
           "clip_score": dict(clip, convention="", prefix=""), "aesthetic": dict(clip, head="", variant="")}
  return ml_collections.ConfigDict({n: dict(checkpoint="", vocab="", batch_size=16, **extra.get(n, {}))
                                    for n in LEARNED})


def configured(settings) -> list[str]:
  """The learned rewards whose checkpoint is set in ``settings`` (``config.rewards``)."""
  return [n for n in LEARNED if settings is not None and n in settings and settings[n].get("checkpoint")]


def learned(name: str, cfg) -> Callable:
  """The (cached) scorer of learned reward ``name`` built from ``cfg`` (its ``config.rewards.<name>``)."""
  if cfg is None:
    raise ValueError(f"reward {name!r} needs config.rewards.{name} with its checkpoint and vocab.")
  plain = cfg.to_dict() if hasattr(cfg, "to_dict") else dict(cfg)
  key = (name, json.dumps(plain, sort_keys=True, default=str))
  if key not in _BUILT:
    module, fn = LEARNED[name].split(":")
    _BUILT[key] = getattr(importlib.import_module(module), fn)(cfg)
  return _BUILT[key]


def reward(name: str, images, metadatas, prompts=None, settings=None) -> np.ndarray:
  """One reward (B,) float32; ``prompts`` default to ``metadata['prompt']``."""
  if name in REWARDS:
    return np.asarray(REWARDS[name](images, metadatas), np.float32)
  if name not in LEARNED:
    raise ValueError(f"reward {name!r} is not in the registry (known: {', '.join(names())})")
  if prompts is None:
    prompts = [(md or {}).get("prompt", "") for md in metadatas]
  cfg = settings[name] if settings is not None and name in settings else None
  return np.asarray(learned(name, cfg)(images, list(prompts)), np.float32)


def normalize(r: np.ndarray, how: str) -> np.ndarray:
  if how in ("none", "", None, False):
    return r
  if how == "std":
    return (r - r.mean()) / (r.std() + 1e-8)
  if how == "minmax":
    return (r - r.min()) / (r.max() - r.min() + 1e-8)
  raise ValueError(f"reward normalisation {how!r} is not one of {', '.join(NORMALIZE)}")


def compute(weights: dict[str, float], images, metadatas, prompts=None, settings=None,
            normalize_each: str = "none") -> tuple[np.ndarray, dict[str, np.ndarray]]:
  """``(total (B,), {name: raw (B,)})`` for the weighted rewards; unknown names raise one clear ValueError.

  Verifier rewards are computed (and returned) even with weight 0; learned ones only with a non-zero weight.
  ``normalize_each`` normalises each weighted reward over the batch before the weighted sum."""
  unknown = sorted(set(weights) - set(REWARDS) - set(LEARNED))
  if unknown:
    raise ValueError(f"reward(s) {', '.join(unknown)} not in the registry (known: {', '.join(names())})")
  parts = {name: reward(name, images, metadatas, prompts, settings) for name, w in weights.items()
           if name in REWARDS or w}
  total = np.zeros(len(images), np.float32)
  for n, w in weights.items():
    if w:
      total = total + float(w) * normalize(parts[n], normalize_each)
  return total.astype(np.float32), parts


def batched_on_mesh(apply: Callable, params, batch_size: int, devices=None) -> Callable:
  """``run(*arrays) -> np.ndarray (N,)`` calling ``jit(apply)(params, *chunk)`` on fixed ``batch_size`` chunks
  (the last one padded by repeating row 0, so one compilation serves every call). Params are replicated over a
  1-D ``data`` mesh of ``devices`` (default: all local ones) and each chunk is sharded over it; ``batch_size``
  is rounded up to a multiple of the device count."""
  import jax
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  devices = list(devices or jax.local_devices())
  mesh = Mesh(np.asarray(devices), ("data",))
  batch_size = -(-batch_size // len(devices)) * len(devices)
  params = jax.device_put(params, NamedSharding(mesh, P()))
  fn = jax.jit(apply)

  def run(*arrays):
    n = len(arrays[0])
    out = []
    for s in range(0, n, batch_size):
      chunk = [a[s:s + batch_size] for a in arrays]
      pad = batch_size - len(chunk[0])
      chunk = [np.concatenate([c, np.repeat(c[:1], pad, 0)]) if pad else c for c in chunk]
      chunk = [jax.device_put(c, NamedSharding(mesh, P("data", *([None] * (c.ndim - 1))))) for c in chunk]
      out.append(np.asarray(fn(params, *chunk))[:batch_size - pad])
    return np.concatenate(out) if out else np.zeros((0,), np.float32)
  return run
