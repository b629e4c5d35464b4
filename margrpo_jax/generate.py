"""Batched generation for a list of prompts (any model family) and shapes-world scoring, shared by every job.

The model class of ``model_cfg.family`` turns prompts into condition ids (``prompt_ids``: shapes-world token
ids, MAR class labels, a text family's tokenizer) and sampled token canvases into uint8 images
(``decode_images``: shapes-world unpatchify, or a VAE export). Prompts are cut into fixed-size batches (the
last one padded) so one compiled sampler serves them all. Batch ``i`` draws from ``fold_in(key(seed), i)``:
the same prompts, seed and batch size give the same images, bit for bit on CPU.
"""
from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from flax import nnx

from margrpo_jax.diffusion import gaussian
from margrpo_jax.models import families
from margrpo_jax.parallel import sharding
from margrpo_jax.rewards import shapes_verifier
from margrpo_jax.sampling import sampler as sampler_lib


def sampler_config(cfg) -> sampler_lib.SamplerConfig:
  """``SamplerConfig`` from a config's ``sampling`` block."""
  return sampler_lib.SamplerConfig(num_steps=cfg.num_steps, cfg_scale=cfg.cfg_scale, cfg_schedule=cfg.cfg_schedule,
                                   temperature=cfg.temperature, clip_denoised=float(cfg.get("clip_denoised", 0.0)))


_TRACED: set[str] = set()


def trace(model_cfg, sampling) -> None:
  """Trace the sampler on one prompt abstractly (``jax.eval_shape``: shapes only, nothing computed), so that a
  model config or sampling setting the model cannot run raises here instead of inside a job. Remembered per
  value of ``(model_cfg, sampling)``."""
  key = families.value_key(model_cfg, sampling)
  if key in _TRACED:
    return
  family = families.get(model_cfg.family)
  graphdef, state = nnx.split(families.abstract(model_cfg))
  ids = jax.ShapeDtypeStruct((1,) if family.condition_ndim == 1 else (1, model_cfg.text.max_len), jnp.int32)
  if family.own_sampler():
    fn = family.make_sample_fn(graphdef, model_cfg, sampling)
  else:
    diff = gaussian.make_diffusion(model_cfg.diffusion.num_train_steps, sampling.diffusion_steps)
    fn = sampler_lib.make_sample_fn(graphdef, diff, sampler_config(sampling), ids_ndim=ids.ndim)
  jax.eval_shape(fn, nnx.to_pure_dict(state), ids, jax.random.key(0))
  _TRACED.add(key)


def generate(graphdef, params, model_cfg, prompts: list[str], sampling, seed: int, batch_size: int,
             progress: bool = False, mesh=None, rules=()) -> np.ndarray:
  """Images (N, H, W, 3) uint8 for ``prompts`` (H, W: whatever the family decodes to), on every process.

  With a ``mesh`` (params placed on it by ``rules``) each batch is split over the batch axes, every process
  feeding its rows (``batch_size`` must divide by data x fsdp); without one (or with a mesh of one device), or
  for a family with its own sampler, the batch runs on this process's devices, params sharded across processes
  gathered first."""
  family = families.get(model_cfg.family)
  own = family.own_sampler()  # a family with its own generation loop (NOVA: flow head, its schedule)
  if mesh is not None and mesh.devices.size == 1:
    mesh = None  # one device: the unsharded program
  if mesh is None or own:
    params = jax.tree.map(lambda x: sharding.to_host(x) if not _addressable(x) else x, params)
  ids = np.asarray(family.prompt_ids(model_cfg, list(prompts)))
  if own:
    fn = family.make_sample_fn(graphdef, model_cfg, sampling)
  else:
    diff = gaussian.make_diffusion(model_cfg.diffusion.num_train_steps, sampling.diffusion_steps)
    fn = sampler_lib.make_sample_fn(graphdef, diff, sampler_config(sampling), mesh=mesh, rules=rules, params=params,
                                    ids_ndim=ids.ndim)
  n = len(prompts)
  nb = -(-n // batch_size)
  ids = np.concatenate([ids, np.zeros((nb * batch_size - n,) + ids.shape[1:], ids.dtype)])
  base, out, t0 = jax.random.key(seed), [], time.time()
  for i in range(nb):
    batch = ids[i * batch_size:(i + 1) * batch_size]
    if mesh is not None and not own:  # each process: its rows of the batch
      batch = sharding.to_global(batch[sharding.host_rows(batch_size)], sharding.batch_sharding(mesh, batch.ndim))
    tokens, _ = fn(params, jnp.asarray(batch), jax.random.fold_in(base, i))
    out.append(np.asarray(family.decode_images(model_cfg, sharding.to_host(tokens))))
    if progress:
      logging.info("generated %d / %d images (%.1f images/s)", min((i + 1) * batch_size, n), n,
                   min((i + 1) * batch_size, n) / (time.time() - t0))
  return np.concatenate(out)[:n]


def _addressable(x) -> bool:
  return not isinstance(x, jax.Array) or x.is_fully_addressable


def score(images: np.ndarray, metadatas: list[dict | None]) -> dict:
  """Per-image verifier results and their means over the images that carry shapes-world metadata."""
  idx = [i for i, md in enumerate(metadatas) if md is not None]
  per = [None] * len(metadatas)
  res = {"strict_pass": None, "partial": None, "noise": None, "num_scored": len(idx)}
  if idx:
    s = shapes_verifier.score_images(images[idx], [metadatas[i] for i in idx])
    for j, i in enumerate(idx):
      per[i] = {k: s["per_image"][j][k] for k in ("strict", "partial", "noise")}
    res.update(strict_pass=float(s["strict_mean"]), partial=float(s["partial_mean"]), noise=float(s["noise_mean"]))
    tags = sorted({metadatas[i]["tag"] for i in idx})
    res["per_task"] = {t: float(np.mean([per[i]["strict"] for i in idx if metadatas[i]["tag"] == t])) for t in tags}
  res["per_image"] = per
  return res


def image_grid(images: np.ndarray, cols: int = 8, pad: int = 2, scale: int = 1) -> np.ndarray:
  """Tile (N, H, W, 3) uint8 images into one grid image with grey separators."""
  n, h, w, c = images.shape
  rows = -(-n // cols)
  grid = np.full((rows * (h + pad) + pad, cols * (w + pad) + pad, c), 96, np.uint8)
  for i, im in enumerate(images):
    r, q = divmod(i, cols)
    grid[pad + r * (h + pad):pad + r * (h + pad) + h, pad + q * (w + pad):pad + q * (w + pad) + w] = im
  return grid.repeat(scale, 0).repeat(scale, 1) if scale > 1 else grid
