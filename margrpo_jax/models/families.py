"""Model families: the registry (``model.family`` -> class) and the protocol every image generator follows.

An export's ``model.json`` names its family; :func:`build` makes the model from it. Generators (the families RL
fine-tunes and the jobs sample) subclass :class:`Generator`, which states what the jobs rely on:

- ``policy_components``: the top-level components RL trains (the diffusion ``head`` is frozen unless
  ``rl.train_head``); every other component is held static.
- ``condition_ndim``: 1 for class labels ``(B,)``, 2 for token ids ``(B, T)``.
- ``prompt_ids(model_cfg, prompts)`` / ``decode_images(model_cfg, tokens)``: prompts -> conditions, sampled token
  canvases -> uint8 images.
- ``encode_images(model_cfg, images)``: images -> token canvases (the tokenizer's latents), or None when the
  family has no image encoder here.
- ``make_sample_fn(graphdef, model_cfg, sampling, record)``: the family's own sampler (NOVA: flow head and its
  mask schedule), or None for the MAR sampler with the Gaussian head (``sampling/sampler.py``).
- ``check_config(model_cfg, what)``: raises one sentence when a model config cannot work (default: accepts).

The other registered families (text encoders, reward models, autoencoders) are plain modules.
"""
from __future__ import annotations

import importlib
import json

import ml_collections
from flax import nnx

from margrpo_jax.errors import UserError


class Generator(nnx.Module):
  """Base class of the image-generator families (module docstring); subclasses set the class attributes."""

  policy_components: tuple[str, ...] = ()
  head_kind: str = "gaussian"  # the diffusion head's process (model.diffusion.kind): 'gaussian' or 'flow'
  fixed_sampling: dict = {}  # sampling keys a family's own sampler does not read -> the one value it runs with
  condition_ndim: int = 2
  encode_images = None
  make_sample_fn = None

  @staticmethod
  def check_config(model_cfg: ml_collections.ConfigDict, what: str) -> None:
    del model_cfg, what

  @classmethod
  def own_sampler(cls) -> bool:
    """Whether the family samples with its own loop (:attr:`make_sample_fn`) instead of the MAR sampler."""
    return cls.make_sample_fn is not None

  @classmethod
  def can_encode(cls) -> bool:
    return cls.encode_images is not None


REGISTRY = {  # model.family -> "module:Class" (imported on first use)
    "tiny": "margrpo_jax.models.tiny:TinyMAR",
    "mar": "margrpo_jax.models.class_mar:ClassMAR",
    "harmon": "margrpo_jax.models.harmon:Harmon",
    "nova": "margrpo_jax.models.nova:NOVA",
    "qwen2": "margrpo_jax.models.qwen2:Qwen2Model",
    "clip": "margrpo_jax.models.clip:CLIP", "aesthetic": "margrpo_jax.models.clip:AestheticHead",
    "imagereward": "margrpo_jax.models.blip:ImageReward",
    "phi2": "margrpo_jax.models.phi2:Phi2",
    "vae": "margrpo_jax.models.vae:AutoencoderKL",
}
GENERATORS = ("tiny", "mar", "harmon", "nova")


class UnknownFamily(UserError, ValueError):
  """A ``model.family`` the registry does not have (one sentence)."""


def get(family: str):
  """The class of ``family``."""
  if family not in REGISTRY:
    raise UnknownFamily(f"model.family={family!r} is not one of {', '.join(REGISTRY)}.")
  module, name = REGISTRY[family].split(":")
  return getattr(importlib.import_module(module), name)


def generator(family: str, what: str = "the model"):
  """The class of ``family``, which must be an image generator (:class:`Generator`)."""
  cls = get(family)
  if not issubclass(cls, Generator):
    raise UnknownFamily(f"{what} is a {family!r} model, not an image generator (one of {', '.join(GENERATORS)}).")
  return cls


def build(model_cfg: ml_collections.ConfigDict, seed: int = 0):
  """The model of ``model_cfg.family`` (components are its top-level attributes: backbone, head, ...)."""
  return get(model_cfg.family)(model_cfg, rngs=nnx.Rngs(seed))


_ABSTRACT: dict[str, nnx.Module] = {}


def value_key(*configs) -> str:
  """A string that is equal for configs (ConfigDicts or dicts) of equal value: the key of the caches below."""
  return json.dumps([c.to_dict() if hasattr(c, "to_dict") else dict(c) for c in configs], sort_keys=True,
                    default=repr)


def abstract(model_cfg: ml_collections.ConfigDict):
  """The model of ``model_cfg`` built abstractly (``nnx.eval_shape``: shapes and dtypes, nothing allocated).

  Cached by the config's value: tracing a build costs about a second even for the shapes-world model, and
  validation, the export check and the plan all ask for the same one. Callers must not modify the result."""
  key = value_key(model_cfg)
  if key not in _ABSTRACT:
    if len(_ABSTRACT) >= 16:
      _ABSTRACT.pop(next(iter(_ABSTRACT)))
    _ABSTRACT[key] = nnx.eval_shape(lambda: build(model_cfg))
  return _ABSTRACT[key]
