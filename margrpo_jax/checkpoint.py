"""Orbax checkpoints: resumable train state (async, keeps the last few) and params-only model exports.

A params-only export is a folder ``<dir>/params`` (Orbax) plus ``<dir>/model.json`` (the architecture),
so ``load_model(dir)`` rebuilds the model without any other config.

Nothing non-finite is ever written: :func:`save_state` and :func:`save_model` refuse a tree with a NaN or Inf
(:class:`NonFiniteError`, one sentence), so the newest checkpoint is always the last good one. A newest
checkpoint that cannot be read is reported in one warning, set aside (renamed ``<step>.unreadable``, not
deleted) and :func:`restore_latest` falls back to the newest intact one.
"""
from __future__ import annotations

import json
import os
import shutil

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from flax import nnx

from margrpo_jax import fileio
from margrpo_jax.errors import UserError
from margrpo_jax.models import families
from margrpo_jax.parallel import hosts, sharding


class CheckpointError(UserError, ValueError):
  """A checkpoint path that is missing or unreadable, with a one-sentence message."""


class StorageError(OSError):
  """The disk is full (or a quota is reached) while saving; one sentence, the older checkpoints intact."""


def _disk_full(e: BaseException) -> bool:
  text = str(e)
  return getattr(e, "errno", None) in (28, 122) or "No space left on device" in text or "os_error_code='28'" in text


def check_space(directory: str, tree, what: str) -> None:
  """Refuse (one :class:`StorageError`) a save of ``tree`` whose bytes exceed the free space where ``directory``
  lives: a save that starts and then runs out of space fails inside Orbax's writer threads, loudly."""
  if fileio.is_url(directory):  # a bucket: no free-space figure to check
    return
  need = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree) if hasattr(x, "dtype"))
  folder = os.path.abspath(directory)
  while not os.path.exists(folder):
    folder = os.path.dirname(folder)
  try:
    free = shutil.disk_usage(folder).free
  except OSError:
    return
  if free < need:
    raise StorageError(28, f"the disk holding {directory} has {free / 2**20:.1f} MiB free, less than the "
                       f"{need / 2**20:.1f} MiB {what} needs; nothing was written: free some space and rerun the "
                       "same command to resume")


def guard_storage(mngr: ocp.CheckpointManager, fn, *args, **kwargs):
  """``fn(*args, **kwargs)`` (an Orbax save or wait) with a full disk turned into one :class:`StorageError`."""
  try:
    return fn(*args, **kwargs)
  except Exception as e:  # noqa: BLE001 - Orbax reports ENOSPC as ValueError / RuntimeError from its threads
    if not _disk_full(e):
      raise
    steps = [s for s in mngr.all_steps()]
    newest = max(steps) if steps else None
    raise StorageError(28, f"the disk holding {mngr.directory} is full (no space left while saving a checkpoint); "
                       + (f"the newest complete checkpoint (step {newest}) is intact" if newest is not None else
                          "no checkpoint was complete yet")
                       + ": free some space and rerun the same command to resume") from None


class NonFiniteError(FloatingPointError):
  """Parameters or optimizer state with a NaN or Inf, refused before anything is written (one sentence)."""


ASSETS = os.path.join(os.path.dirname(__file__), "assets")
SHIPPED = ("shapes_base", "shapes_tokenizer")  # exports shipped in the package, referred to by name


def resolve(path: str) -> str:
  """The folder of a shipped export named ``path`` (``'shapes_base'``, ``'shapes_tokenizer'``), else ``path`` made
  absolute (``~`` expanded). Model configs refer to shipped exports by name, so exports carry no machine path."""
  if path in SHIPPED:
    return os.path.join(ASSETS, path)
  return fileio.resolve(path)


def manager(directory: str, keep: int = 3, async_save: bool = True) -> ocp.CheckpointManager:
  return ocp.CheckpointManager(fileio.resolve(directory), options=ocp.CheckpointManagerOptions(
      max_to_keep=keep, enable_async_checkpointing=async_save, create=True))


def abstract_like(tree):
  return jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)


@jax.jit
def _all_finite(tree) -> jax.Array:
  leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)
            if jnp.issubdtype(x.dtype, jnp.inexact)]
  return jnp.all(jnp.stack(leaves)) if leaves else jnp.bool_(True)


def all_finite(tree) -> bool:
  """Whether every floating-point leaf of ``tree`` is finite (one fused reduction, one host read)."""
  return bool(_all_finite(tree))


def save_state(mngr: ocp.CheckpointManager, step: int, state, what: str = "the train state") -> None:
  """``mngr.save(step, state)`` unless ``state`` holds a NaN / Inf (then :class:`NonFiniteError`, nothing
  written, the newest checkpoint untouched)."""
  if not all_finite(state):
    newest = mngr.latest_step()
    raise NonFiniteError(f"{what} at step {step} holds NaN or Inf values and was not saved; the newest checkpoint "
                         + (f"(step {newest} in {mngr.directory}) is the last good one." if newest is not None
                            else f"in {mngr.directory}: none was written."))
  check_space(os.fspath(mngr.directory), state, f"the checkpoint of step {step}")
  guard_storage(mngr, mngr.save, step, args=ocp.args.StandardSave(state))


def wait(mngr: ocp.CheckpointManager) -> None:
  """Wait for the async saves to finish (a full disk in one sentence)."""
  guard_storage(mngr, mngr.wait_until_finished)


def restore_latest(mngr: ocp.CheckpointManager, target):
  """``(step, state)`` of the newest readable checkpoint restored into ``target``'s structure, or
  ``(None, target)`` when there is none.

  A checkpoint whose stored keys or shapes are not ``target``'s (another model or config) is refused in one
  sentence and nothing is touched. A newer one whose files cannot be read is set aside (renamed
  ``<step>.unreadable``) with one warning once an older one has restored; when none can be read, that is one
  sentence and all of them stay as they are."""
  abstract = abstract_like(target)
  failed = []
  for step in sorted(mngr.all_steps(), reverse=True):
    stored = _stored_state(mngr, step)
    if stored is not None:
      differ = _differences(stored, abstract)
      if differ:
        raise CheckpointError(f"checkpoint step {step} in {mngr.directory} does not hold this run's train state "
                              f"({differ}; another model or config): use a new workdir.")
    try:
      state = mngr.restore(step, args=ocp.args.StandardRestore(abstract))
    except Exception as e:  # noqa: BLE001 - Orbax raises many types for damaged files
      failed.append((step, (str(e).strip().splitlines() or [type(e).__name__])[0].split(". See full")[0][:160]))
      continue
    for bad, detail in failed:
      _set_aside(mngr, bad, detail)
    return step, state
  if failed:
    raise CheckpointError(f"no checkpoint in {mngr.directory} can be read (newest: step {failed[0][0]}: "
                          f"{failed[0][1]}); they are left as they are: move them aside to start afresh.")
  return None, target


def _set_aside(mngr: ocp.CheckpointManager, step: int, detail: str) -> None:
  """Rename checkpoint ``step`` to ``<step>.unreadable`` (kept for inspection) and forget it."""
  path = os.path.join(os.fspath(mngr.directory), str(step))
  aside = path + ".unreadable"
  if fileio.isdir(path):
    n = 0
    while fileio.exists(aside):
      n += 1
      aside = f"{path}.unreadable{n}"
    fileio.rename(path, aside)
  hosts.barrier(f"set_aside:{step}")  # the others reload once process 0 has renamed it
  mngr.reload()
  logging.warning("checkpoint step %d in %s cannot be read (%s); set aside as %s, resumed from an older one.",
                  step, mngr.directory, detail, os.path.basename(aside))


def _stored_state(mngr: ocp.CheckpointManager, step: int) -> dict | None:
  """The stored tree's metadata (shapes) of checkpoint ``step``, or None when it cannot be read."""
  try:
    with ocp.StandardCheckpointer() as ckptr:
      meta = ckptr.metadata(os.path.join(os.fspath(mngr.directory), str(step), "default"))
    meta = getattr(meta, "item_metadata", meta)
    return dict(getattr(meta, "tree", meta))
  except Exception:  # noqa: BLE001 - damaged metadata: the restore decides
    return None


def _key_name(k) -> str:
  for attr in ("key", "idx", "name"):  # DictKey, SequenceKey, GetAttrKey (optax states are named tuples)
    if hasattr(k, attr):
      return str(getattr(k, attr))
  return str(k)


def _flat(tree) -> dict:
  return {"/".join(_key_name(k) for k in p): v for p, v in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _differences(stored: dict, target: dict) -> str | None:
  """The first key or shape in which ``stored`` (metadata) and ``target`` differ, in words; None if none."""
  have, want = _flat(stored), _flat(target)
  missing, extra = sorted(set(want) - set(have)), sorted(set(have) - set(want))
  if missing or extra:
    return (f"missing {missing[0]}" if missing else f"unexpected {extra[0]}") + \
        f", {len(missing) + len(extra)} key(s) differ"
  for k, v in want.items():
    shape = tuple(getattr(have[k], "shape", ()) or ())
    if shape != tuple(v.shape):
      return f"{k} has shape {shape}, not {tuple(v.shape)}"
  return None


def model_class(family: str):
  """The class of ``family`` (``models/families.py``), a missing family in one sentence."""
  try:
    return families.get(family)
  except families.UnknownFamily as e:
    raise CheckpointError(str(e)) from None


SOURCE = "source.json"  # {"official": the official file / folder an export's weights were converted from}


def save_model(directory: str, params, model_cfg: ml_collections.ConfigDict, dtype=None,
               source: str | None = None) -> str:
  """Write a params-only export (optionally cast, e.g. to bfloat16) and its ``model.json``; ``source``: the
  official checkpoint the weights come from (converted, or fine-tuned from such a conversion), recorded in
  ``source.json`` for ``export_official``. Every process calls it: arrays sharded across processes are gathered
  (``sharding.to_host``), so the export holds plain arrays that load on any number of devices."""
  directory = fileio.resolve(directory)
  if not all_finite(params):
    raise NonFiniteError(f"the parameters to export to {directory} hold NaN or Inf values; nothing was written.")
  if dtype is not None:
    params = jax.tree.map(lambda x: x.astype(dtype) if np.issubdtype(x.dtype, np.floating) else x, params)
  check_space(directory, params, "the export")
  fileio.makedirs(directory)
  try:
    with ocp.StandardCheckpointer() as ckptr:
      ckptr.save(os.path.join(directory, "params"), jax.tree.map(sharding.to_host, params), force=True)
  except Exception as e:  # noqa: BLE001 - a full disk, reported by Orbax as ValueError
    if _disk_full(e):
      raise StorageError(28, f"the disk holding {directory} is full (no space left while exporting); the train "
                         "checkpoints are intact: free some space and rerun the same command") from None
    raise
  fileio.write_text(os.path.join(directory, "model.json"), model_cfg.to_json(indent=2, sort_keys=True))
  if source:
    fileio.write_json(os.path.join(directory, SOURCE), {"official": source})
  return directory


def official_source(directory: str) -> str | None:
  """The official checkpoint the export at ``directory`` descends from (its ``source.json``), if recorded."""
  meta = fileio.read_json(os.path.join(fileio.resolve(directory), SOURCE))
  return meta.get("official") if isinstance(meta, dict) else None


def read_model_config(directory: str, what: str = "checkpoint", family: str | None = None):
  """The ``model.json`` of the export at ``directory`` (checked to be of ``family`` when given), or one sentence
  naming ``what`` and the folder."""
  directory = fileio.resolve(directory)
  cfg_path = os.path.join(directory, "model.json")
  if not fileio.isfile(cfg_path) or not fileio.isdir(os.path.join(directory, "params")):
    raise CheckpointError(f"{what} {directory} does not exist or is not a model export "
                          "(expected model.json and params/ inside it).")
  try:
    model_cfg = ml_collections.ConfigDict(json.loads(fileio.read_text(cfg_path)))
    model_cfg.family
  except (ValueError, AttributeError, TypeError, UnicodeDecodeError):
    raise CheckpointError(f"{cfg_path} is not a model config (JSON with a 'family' key).") from None
  if not isinstance(model_cfg.family, str) or model_cfg.family not in families.REGISTRY:
    raise CheckpointError(f"{cfg_path} names model family {model_cfg.family!r}, not one of "
                          f"{', '.join(families.REGISTRY)}.")
  if family is not None and model_cfg.family != family:
    raise CheckpointError(f"{what} {directory} holds a model of family {model_cfg.family!r}, not {family!r}.")
  return model_cfg


def _abstract_params(model_cfg, directory: str):
  """``(graphdef, abstract params)`` of the model ``model.json`` describes, or one sentence."""
  cls = model_class(model_cfg.family)
  try:
    if issubclass(cls, families.Generator):  # e.g. a shapes-world model whose tokenizer does not make its tokens
      cls.check_config(model_cfg, f"checkpoint {directory}")
    graphdef, state = nnx.split(families.abstract(model_cfg))
  except CheckpointError:
    raise
  except Exception as e:  # noqa: BLE001 - a model.json whose values cannot build the model
    raise CheckpointError(f"{directory}/model.json does not describe a buildable {model_cfg.family} model "
                          f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}).") from None
  return graphdef, abstract_like(nnx.to_pure_dict(state))


def _stored_tree(ckptr, path: str, directory: str) -> dict:
  try:
    meta = ckptr.metadata(path)
  except Exception as e:  # noqa: BLE001 - damaged or foreign params
    detail = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
    raise CheckpointError(f"{path} cannot be read as the parameters of {directory}/model.json ({detail}).") from None
  meta = getattr(meta, "item_metadata", meta)
  return dict(getattr(meta, "tree", meta))


def check_export(directory: str, what: str = "checkpoint", family: str | None = None):
  """The ``model.json`` of the export at ``directory`` after checking that its stored parameters are the ones it
  builds (keys and shapes, from the Orbax metadata: nothing is restored)."""
  directory = fileio.resolve(directory)
  model_cfg = read_model_config(directory, what, family)
  _, target = _abstract_params(model_cfg, directory)
  with ocp.StandardCheckpointer() as ckptr:
    _check_fits(_stored_tree(ckptr, os.path.join(directory, "params"), directory), target, directory)
  return model_cfg


def load_model(directory: str):
  """``(model_cfg, graphdef, params)`` of an export written by :func:`save_model`, params as float32; params that
  do not fit ``model.json`` (another model, another width) raise one sentence naming the first mismatch."""
  directory = fileio.resolve(directory)
  model_cfg = read_model_config(directory)
  graphdef, target = _abstract_params(model_cfg, directory)
  path = os.path.join(directory, "params")
  with ocp.StandardCheckpointer() as ckptr:  # restores (and up-casts a bf16 export) into float32
    _check_fits(_stored_tree(ckptr, path, directory), target, directory)
    try:
      params = ckptr.restore(path, target)
    except Exception as e:  # noqa: BLE001 - damaged params
      detail = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
      raise CheckpointError(f"{path} cannot be read as the parameters of its model.json ({detail}).") from None
  return model_cfg, graphdef, params


def _check_fits(stored: dict, target: dict, directory: str) -> None:
  """The stored params' keys and shapes must be those ``model.json`` builds."""
  differ = _differences(stored, target)
  if differ:
    raise CheckpointError(f"{directory} holds parameters that its model.json does not build ({differ}): the "
                          "export is damaged or mixed up.")
