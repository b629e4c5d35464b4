"""CLIP-based rewards (docs/rewards.md sections 2.1-2.5): ``build(cfg)(images uint8 (B, H, W, 3), prompts) -> (B,)``.

Scores (``img``, ``txt``: L2-normalised CLIP embeddings; ``cos = <img, txt>``):

* ``hps`` (HPS v2.1, open_clip ViT-H-14): ``scale * cos``; ``scale`` 1 = the raw cosine MAR-GRPO trains on
  (~0.2-0.35), 100 = the benchmark's number (e.g. 30.6).
* ``pickscore`` (HF CLIP ViT-H-14): ``mode='logit'`` (default) ``exp(logit_scale) * cos`` as PickScore reports
  (~18-23), ``mode='cosine'`` the raw cosine; times ``scale`` (default 1; Flow-GRPO uses 1/26).
* ``clip_score``: ``convention='raw'`` cos (MAR-GRPO's ``clip``, T2I-CompBench's OpenAI ViT-B/32),
  ``'torchmetrics'`` ``100 * max(cos, 0)``, ``'clipscore'`` ``2.5 * max(cos, 0)`` (Hessel et al.; pair it with
  ``prefix='A photo depicts '``); ``prefix`` is prepended to every prompt.
* ``aesthetic`` (LAION v1 / v2 head on OpenAI ViT-L/14): ``head(img)``; ``checkpoint`` is the CLIP export and
  ``head`` the head export (its variant must equal ``variant`` when given). Prompts are ignored.

The image and text encoders (preprocessing included) are jitted and run in fixed-size batches on the device mesh;
they are cached per (export, resize, batch size), so rewards sharing a CLIP export compile once. The scalar
formulas above are applied to their outputs in numpy.

Preprocessing (``resize`` option): the shorter side goes to ``S`` (the model's image
size, 224) and the longer to ``int(S * long / short)`` (torchvision's ``Resize(S)``), bicubic with antialiasing:
Keys' cubic with ``a = -0.5``, support widened by the downscale factor, weights renormalised at the borders,
separable (PIL's and torch's ``antialias=True`` kernel); then the centre crop with offsets
``round((H - S) / 2)`` (torchvision ``CenterCrop``), ``/ 255`` and OpenAI CLIP's mean/std.

* ``resize='tensor'`` (default of ``hps``: hpsv2's transform runs ``ToTensor`` first, then ``Resize`` on the float
  tensor): the resize is done in float32 on ``v / 255`` with no rounding -- torchvision's tensor path.
* ``resize='tensor_noaa'``: the same with torchvision < 0.17's default for tensors (``antialias`` off): torch's
  plain bicubic, a = -0.75 at the 4 nearest samples, border indices clamped (no widening when downscaling).
* ``resize='pil'`` (default of the others: open_clip / OpenAI ``clip`` / HF CLIPImageProcessor resize PIL images):
  PIL's uint8 arithmetic, reproduced exactly -- weights in 22-bit fixed point, horizontal pass then vertical pass,
  each rounded and clipped to uint8.
HF's CLIPImageProcessor crops at ``(H - S) // 2``; it differs from ``round`` only for non-square inputs whose
resized long side exceeds ``S`` by an odd number that rounds up.

How to use::

    python -m margrpo_jax.convert --family=clip_openclip --src=HPS_v2.1_compressed.pt --out=ckpt/hps
    cfg = ml_collections.ConfigDict(dict(checkpoint="ckpt/hps", vocab="bpe_simple_vocab_16e6.txt.gz", scale=100.))
    scores = clip_rewards.hps(cfg)(images_uint8, prompts)            # (B,) float32
    # RL: --config.rl.rewards.hps=1.0 --config.rewards.hps.checkpoint=ckpt/hps --config.rewards.hps.vocab=...

Options common to all: ``resize`` ('pil' | 'tensor' | 'tensor_noaa'), ``batch_size`` (images per compiled call,
default 16).
"""
from __future__ import annotations

import functools
import os
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from margrpo_jax import checkpoint, fileio
from margrpo_jax.rewards import registry
from margrpo_jax.rewards.clip_tokenizer import ClipTokenizer

OPENAI_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_STD = (0.26862954, 0.26130258, 0.27577711)
PIL_BITS = 22  # PIL's PRECISION_BITS for 8-bit images
CONVENTIONS = ("raw", "torchmetrics", "clipscore")
RESIZE = ("pil", "tensor", "tensor_noaa")
PICKSCORE_MODES = ("logit", "cosine")
# config.rewards.<name>.<option> -> its choices ('' = the builder's default); validate.py checks them up front
CHOICES = {"resize": RESIZE, "mode": PICKSCORE_MODES, "convention": CONVENTIONS}


# -- preprocessing ----------------------------------------------------------------------------------------------
def _cubic(x: np.ndarray, a: float = -0.5) -> np.ndarray:
  x = np.abs(x)
  near = ((a + 2) * x - (a + 3)) * x * x + 1
  far = (((x - 5) * x + 8) * x - 4) * a
  return np.where(x < 1, near, np.where(x < 2, far, 0.0))


@functools.lru_cache(maxsize=64)
def resize_weights(n_in: int, n_out: int, antialias: bool = True) -> np.ndarray:
  """(n_out, n_in) float64 bicubic interpolation matrix. ``antialias``: PIL's ``precompute_coeffs`` / torch's AA
  kernel (a = -0.5, support widened by the downscale factor, renormalised); else torch's plain bicubic
  (``antialias=False``: a = -0.75 at the 4 nearest samples, indices clamped to the border)."""
  scale = n_in / n_out
  w = np.zeros((n_out, n_in))
  for o in range(n_out):
    if not antialias:
      src = (o + 0.5) * scale - 0.5
      i0 = int(np.floor(src))
      for k in range(4):
        w[o, min(max(i0 - 1 + k, 0), n_in - 1)] += _cubic(np.float64(src - i0 + 1 - k), a=-0.75)
      continue
    center, filterscale = (o + 0.5) * scale, max(scale, 1.0)
    lo, hi = max(int(center - 2 * filterscale + 0.5), 0), min(int(center + 2 * filterscale + 0.5), n_in)
    k = _cubic((np.arange(lo, hi) - center + 0.5) / filterscale)
    w[o, lo:hi] = k / k.sum() if k.sum() != 0 else k
  return w


def resized_size(h: int, w: int, size: int) -> tuple[int, int]:
  """torchvision ``Resize(size)``: the shorter side becomes ``size``, the longer ``int(size * long / short)``."""
  if h <= w:
    return size, int(size * w / h)
  return int(size * h / w), size


def _pil_pass(x: jax.Array, n_out: int, axis: int) -> jax.Array:
  """One PIL resampling pass of int32 uint8-valued ``x`` along ``axis``: fixed-point weights, round, clip."""
  if x.shape[axis] == n_out:
    return x
  w = resize_weights(x.shape[axis], n_out) * (1 << PIL_BITS)
  kk = jnp.asarray(np.where(w < 0, w - 0.5, w + 0.5).astype(np.int64).astype(np.int32))  # C's (int) truncation
  acc = jnp.moveaxis(jnp.tensordot(jnp.moveaxis(x, axis, -1), kk.T, axes=1), -1, axis)
  return jnp.clip(jnp.right_shift(acc + (1 << (PIL_BITS - 1)), PIL_BITS), 0, 255)


def _float_pass(x: jax.Array, n_out: int, axis: int, antialias: bool = True) -> jax.Array:
  if x.shape[axis] == n_out:
    return x
  w = jnp.asarray(resize_weights(x.shape[axis], n_out, antialias), jnp.float32)
  return jnp.moveaxis(jnp.tensordot(jnp.moveaxis(x, axis, -1), w.T, axes=1, precision="highest"), -1, axis)


def preprocess(images: jax.Array, size: int = 224, resize: str = "pil", mean=OPENAI_MEAN, std=OPENAI_STD
               ) -> jax.Array:
  """uint8 (B, H, W, 3) -> normalised float32 (B, size, size, 3) (see the module docstring)."""
  _, h, w, _ = images.shape
  nh, nw = resized_size(h, w, size)
  if resize == "pil":  # horizontal pass first, as PIL does
    x = _pil_pass(_pil_pass(images.astype(jnp.int32), nw, 2), nh, 1).astype(jnp.float32) / 255.0
  elif resize in RESIZE:
    aa = resize == "tensor"
    x = _float_pass(_float_pass(images.astype(jnp.float32) / 255.0, nw, 2, aa), nh, 1, aa)
  else:
    raise ValueError(f"resize={resize!r} is not one of {', '.join(RESIZE)}.")
  top, left = int(round((nh - size) / 2.0)), int(round((nw - size) / 2.0))
  x = x[:, top:top + size, left:left + size]
  return (x - jnp.asarray(mean, jnp.float32)) / jnp.asarray(std, jnp.float32)


# -- loading ----------------------------------------------------------------------------------------------------
def _path(cfg, name: str, key: str, hint: str) -> str:
  path = str(cfg.get(key, "") or "")
  path = fileio.resolve(path) if path else path
  if not path or not fileio.exists(path):
    raise FileNotFoundError(f"rewards.{name}.{key}={path!r} does not exist; {hint}")
  return path


def _load(cfg, name: str, key: str, family: str, hint: str):
  path = _path(cfg, name, key, hint)
  model_cfg, graphdef, params = checkpoint.load_model(path)
  if model_cfg.family != family:
    raise ValueError(f"rewards.{name}.{key}={path} holds a {model_cfg.family!r} model, not {family!r}.")
  return model_cfg, graphdef, params


_CONVERT = "convert it with python -m margrpo_jax.convert --family=clip_openclip (or clip_hf)."
_VOCAB = "give the path of CLIP's bpe_simple_vocab_16e6.txt.gz."


class Encoders:
  """Jitted, batched CLIP encoders of one export: ``images(uint8 (B, H, W, 3))`` and ``texts(ids (B, L))`` give
  L2-normalised embeddings (B, E) as numpy; preprocessing is inside the compiled image function."""

  def __init__(self, path: str, resize: str, batch_size: int):
    self.cfg, graphdef, params = checkpoint.load_model(path)
    self.path, size = path, self.cfg.vision.image_size
    if self.cfg.family != "clip":
      raise ValueError(f"{path} holds a {self.cfg.family!r} model, not 'clip'.")
    self.logit_scale = float(np.exp(np.asarray(params["logit_scale"])))
    self.images = registry.batched_on_mesh(
        lambda p, x: nnx.merge(graphdef, p).encode_image(preprocess(x, size, resize)), params, batch_size)
    self.texts = registry.batched_on_mesh(lambda p, t: nnx.merge(graphdef, p).encode_text(t), params, batch_size)


@functools.lru_cache(maxsize=8)
def _encoders(path: str, resize: str, batch_size: int) -> Encoders:
  return Encoders(path, resize, batch_size)


def encoders(cfg, name: str, default_resize: str, key: str = "checkpoint") -> Encoders:
  """The (cached, shared by every reward with the same export, resize and batch size) encoders of ``cfg.<key>``."""
  path = os.path.abspath(_path(cfg, name, key, _CONVERT))
  resize = cfg.get("resize", default_resize) or default_resize
  if resize not in RESIZE:
    raise ValueError(f"rewards.{name}.resize={resize!r} is not one of {', '.join(RESIZE)}.")
  try:
    return _encoders(path, resize, int(cfg.get("batch_size", 16) or 16))
  except ValueError as e:
    raise ValueError(f"rewards.{name}.{key}: {e}") from e


def _images(name: str, images) -> np.ndarray:
  images = np.asarray(images)
  if images.ndim != 4 or images.shape[-1] != 3 or images.dtype != np.uint8:
    raise ValueError(f"rewards.{name} takes uint8 images (B, H, W, 3); got {images.dtype} {images.shape}.")
  return images


def _cosine_scorer(cfg, name: str, default_resize: str, finish: Callable, prefix: str = ""):
  """``score(images, prompts) = finish(cos, exp(logit_scale))`` with the CLIP export ``cfg.checkpoint``."""
  enc = encoders(cfg, name, default_resize)
  tok = ClipTokenizer(_path(cfg, name, "vocab", _VOCAB), enc.cfg.text.context_length)

  def score(images, prompts):
    images = _images(name, images)
    if len(prompts) != len(images):
      raise ValueError(f"rewards.{name} got {len(images)} images but {len(prompts)} prompts.")
    cos = np.sum(enc.images(images) * enc.texts(tok([prefix + p for p in prompts])), axis=-1)
    return np.asarray(finish(cos, enc.logit_scale), np.float32)
  return score


# -- the rewards ------------------------------------------------------------------------------------------------
def hps(cfg) -> Callable:
  """HPS v2.1: ``scale * cos`` (``scale`` default 1: the raw cosine MAR-GRPO trains on; 100 for the benchmark)."""
  scale = float(cfg.get("scale", 1.0))
  return _cosine_scorer(cfg, "hps", "tensor", lambda cos, _: scale * cos)


def pickscore(cfg) -> Callable:
  """PickScore v1: ``scale * exp(logit_scale) * cos`` (``mode='logit'``, default) or ``scale * cos`` (``'cosine'``)."""
  mode, scale = cfg.get("mode", "logit") or "logit", float(cfg.get("scale", 1.0))
  if mode not in PICKSCORE_MODES:
    raise ValueError(f"rewards.pickscore.mode={mode!r} is not one of {', '.join(PICKSCORE_MODES)}.")
  return _cosine_scorer(cfg, "pickscore", "pil",
                        lambda cos, ls: scale * (ls * cos if mode == "logit" else cos))


def clip_score(cfg) -> Callable:
  """CLIP score by ``convention``: raw cos, torchmetrics ``100 max(cos, 0)``, CLIPScore ``2.5 max(cos, 0)``."""
  conv = cfg.get("convention", "raw") or "raw"
  if conv not in CONVENTIONS:
    raise ValueError(f"rewards.clip_score.convention={conv!r} is not one of {', '.join(CONVENTIONS)}.")
  factor = {"torchmetrics": 100.0, "clipscore": 2.5}.get(conv)
  finish = (lambda cos, _: cos) if factor is None else (lambda cos, _: factor * np.maximum(cos, 0.0))
  return _cosine_scorer(cfg, "clip_score", "pil", finish, prefix=str(cfg.get("prefix", "") or ""))


def aesthetic(cfg) -> Callable:
  """LAION aesthetic: ``head(normalised image embedding)`` of the CLIP export ``checkpoint`` and head ``head``."""
  enc = encoders(cfg, "aesthetic", "pil")
  hint = "convert the head .pth with python -m margrpo_jax.convert --family=aesthetic."
  head_cfg, head_def, head_params = _load(cfg, "aesthetic", "head", "aesthetic", hint)
  variant = cfg.get("variant", "") or head_cfg.variant
  if variant != head_cfg.variant:
    raise ValueError(f"rewards.aesthetic.variant={variant!r} but rewards.aesthetic.head holds a {head_cfg.variant} "
                     "head.")
  if head_cfg.dims[0] != enc.cfg.embed_dim:
    raise ValueError(f"the aesthetic head takes {head_cfg.dims[0]}-d embeddings but the CLIP checkpoint gives "
                     f"{enc.cfg.embed_dim}-d ones.")
  head = registry.batched_on_mesh(lambda p, e: nnx.merge(head_def, p)(e), head_params,
                                  int(cfg.get("batch_size", 16) or 16))

  def score(images, prompts=None):
    del prompts
    return head(enc.images(_images("aesthetic", images))).astype(np.float32)
  return score
