"""Orbax checkpoints: resumable train state (async, keeps the last few) and params-only model exports.

A params-only export is a folder ``<dir>/params`` (Orbax) plus ``<dir>/model.json`` (the architecture),
so ``load_model(dir)`` rebuilds the model without any other config.
"""
from __future__ import annotations

import importlib
import json
import os

import jax
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx



class CheckpointError(ValueError):
  """A checkpoint path that is missing or unreadable, with a one-sentence message."""


ASSETS = os.path.join(os.path.dirname(__file__), "assets")
SHIPPED = ("shapes_base", "shapes_tokenizer")  # exports shipped in the package, referred to by name


def resolve(path: str) -> str:
  """The folder of a shipped export named ``path`` (``'shapes_base'``, ``'shapes_tokenizer'``), else ``path`` made
  absolute (``~`` expanded). Model configs refer to shipped exports by name, so exports carry no machine path."""
  if path in SHIPPED:
    return os.path.join(ASSETS, path)
  return os.path.abspath(os.path.expanduser(path))


def manager(directory: str, keep: int = 3, async_save: bool = True) -> ocp.CheckpointManager:
  return ocp.CheckpointManager(os.path.abspath(directory), options=ocp.CheckpointManagerOptions(
      max_to_keep=keep, enable_async_checkpointing=async_save, create=True))


def abstract_like(tree):
  return jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)


def restore_latest(mngr: ocp.CheckpointManager, target):
  """``(step, state)`` of the latest checkpoint restored into ``target``'s structure, or ``(None, target)``."""
  step = mngr.latest_step()
  if step is None:
    return None, target
  return step, mngr.restore(step, args=ocp.args.StandardRestore(abstract_like(target)))


FAMILIES = {  # model.family -> "module:Class" (imported on first use)
    "tiny": "margrpo_jax.models.tiny:TinyMAR",
    "mar": "margrpo_jax.models.class_mar:ClassMAR",
    "qwen2": "margrpo_jax.models.qwen2:Qwen2Model", "harmon": "margrpo_jax.models.harmon:Harmon",
    "clip": "margrpo_jax.models.clip:CLIP", "aesthetic": "margrpo_jax.models.clip:AestheticHead",
    "imagereward": "margrpo_jax.models.blip:ImageReward",
    "phi2": "margrpo_jax.models.phi2:Phi2",
    "nova": "margrpo_jax.models.nova:NOVA",
    "vae": "margrpo_jax.models.vae:AutoencoderKL",
}


def model_class(family: str):
  if family not in FAMILIES:
    raise CheckpointError(f"model.family={family!r} is not one of {', '.join(FAMILIES)}.")
  module, name = FAMILIES[family].split(":")
  return getattr(importlib.import_module(module), name)


def build_model(model_cfg: ml_collections.ConfigDict, seed: int = 0):
  """The model of ``model_cfg.family`` (components are its top-level attributes: backbone, head, ...)."""
  return model_class(model_cfg.family)(model_cfg, rngs=nnx.Rngs(seed))


def save_model(directory: str, params, model_cfg: ml_collections.ConfigDict, dtype=None) -> str:
  """Write a params-only export (optionally cast, e.g. to bfloat16) and its ``model.json``."""
  directory = os.path.abspath(directory)
  os.makedirs(directory, exist_ok=True)
  if dtype is not None:
    params = jax.tree.map(lambda x: x.astype(dtype) if np.issubdtype(x.dtype, np.floating) else x, params)
  with ocp.StandardCheckpointer() as ckptr:
    ckptr.save(os.path.join(directory, "params"), jax.device_get(params), force=True)
  with open(os.path.join(directory, "model.json"), "w") as f:
    f.write(model_cfg.to_json(indent=2, sort_keys=True))
  return directory


def read_model_config(directory: str, what: str = "checkpoint", family: str | None = None):
  """The ``model.json`` of the export at ``directory`` (checked to be of ``family`` when given), or one sentence
  naming ``what`` and the folder."""
  directory = os.path.abspath(os.path.expanduser(directory))
  cfg_path = os.path.join(directory, "model.json")
  if not os.path.isfile(cfg_path) or not os.path.isdir(os.path.join(directory, "params")):
    raise CheckpointError(f"{what} {directory} does not exist or is not a model export "
                          "(expected model.json and params/ inside it).")
  try:
    with open(cfg_path) as f:
      model_cfg = ml_collections.ConfigDict(json.load(f))
    model_cfg.family
  except (ValueError, AttributeError, TypeError):
    raise CheckpointError(f"{cfg_path} is not a model config (JSON with a 'family' key).") from None
  if family is not None and model_cfg.family != family:
    raise CheckpointError(f"{what} {directory} holds a {model_cfg.family!r} model, not a {family!r} one.")
  return model_cfg


def load_model(directory: str):
  """``(model_cfg, graphdef, params)`` of an export written by :func:`save_model`, params as float32."""
  directory = os.path.abspath(os.path.expanduser(directory))
  model_cfg = read_model_config(directory)
  check = getattr(model_class(model_cfg.family), "check_config", None)
  if check is not None:  # e.g. a shapes-world model whose tokenizer does not make its tokens
    check(model_cfg, f"checkpoint {directory}")
  graphdef, state = nnx.split(nnx.eval_shape(lambda: build_model(model_cfg)))
  target = abstract_like(nnx.to_pure_dict(state))
  with ocp.StandardCheckpointer() as ckptr:  # restores (and up-casts a bf16 export) into float32
    params = ckptr.restore(os.path.join(directory, "params"), target)
  return model_cfg, graphdef, params
