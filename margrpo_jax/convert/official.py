r"""Fine-tuned weights back out in the official layout: the inverse of the converters, derived from them.

A converter only *moves* weights (copies, transposes, reshapes, splits, stacks); it never computes one. Run on
element ids instead of weights (:func:`core.tracing`: source key ``k`` holds ``offset_k + arange(size_k)``), it
returns for every leaf of the JAX parameter tree the source elements its values came from. Writing the
fine-tuned values to those elements of the official file the base was converted from (the *template*) is then
the exact inverse, for every family at once:

    official[ids(path)] = params[path]   for every parameter path,

and the elements no parameter reads (keys the converter ignores: a tied LM head, the VAE inside a Harmon file)
keep the template's values. Each key keeps the template's dtype. A converter that computed a value would be
refused while tracing, so a written-back file is never approximate.

Layouts written (what the official code loads):

- ``mar``: a ``.pth`` like the template (``checkpoint-last.pth``) with the fine-tuned weights as ``model_ema``
  and ``model``; ``args`` and ``epoch`` kept, the stale ``optimizer`` / ``scaler`` states dropped.
- ``harmon``: a ``.pth`` state dict like the template (flat, or wrapped as the template is).
- ``nova``: a ``transformer/`` folder for the diffusers pipeline: ``diffusion_pytorch_model.safetensors`` and the
  template's ``config.json`` (the frozen Phi-2 text encoder stays in the pipeline's ``text_encoder/``).
"""
from __future__ import annotations

import glob
import os

import jax
import numpy as np

from margrpo_jax import checkpoint, fileio
from margrpo_jax.convert import core, harmon, mar, nova

FAMILIES = ("mar", "harmon", "nova")
DROPPED = ("optimizer", "scaler")  # training state of the template that the fine-tuned weights make stale


def element_ids(sd: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """``{key: offset + arange(size)}`` int64 in the keys' shapes (ids unique over the whole state dict)."""
  out, offset = {}, 0
  for k, v in sd.items():
    out[k] = np.arange(offset, offset + v.size, dtype=np.int64).reshape(v.shape)
    offset += v.size
  return out


def trace(family: str, sd: dict, model_cfg, origin: str, text_sd: dict | None = None) -> dict:
  """The converter of ``family`` run on element ids: the parameter tree of source-element ids."""
  with core.tracing():
    if family == "mar":
      _, ids, _ = mar.convert(element_ids(sd), origin, model_cfg=model_cfg)
    elif family == "harmon":
      _, ids, _ = harmon.convert(element_ids(sd), origin, model_cfg=model_cfg)
    else:
      merged = element_ids({**sd, **{nova.TEXT + k: v for k, v in text_sd.items()}})
      ids = nova.converter({k: merged[k] for k in sd}, {k: merged[nova.TEXT + k] for k in text_sd}, model_cfg,
                           origin).result()
  return ids


def write_back(sd: dict[str, np.ndarray], ids, params) -> dict[str, np.ndarray]:
  """``sd`` (float32, the template) with every element a parameter was read from replaced by that parameter's
  value (module docstring); ``ids`` is :func:`trace`'s tree. Keys of ``sd`` after the traced ones (e.g. the text
  encoder's, appended by :func:`trace`) are not returned."""
  flat_ids, flat_params = core.flat_paths(ids), core.flat_paths(params)
  if set(flat_ids) != set(flat_params):
    extra = sorted(set(flat_params) ^ set(flat_ids))
    raise core.ConversionError(f"the export's parameters are not the ones the converter builds ({extra[0]}, "
                               f"{len(extra)} differ): is it the family and size of the template?")
  sizes = [v.size for v in sd.values()]
  buf = np.concatenate([np.asarray(v, np.float32).ravel() for v in sd.values()] + [np.zeros(0, np.float32)])
  total = sum(sizes)
  for path, idx in flat_ids.items():
    value = np.asarray(flat_params[path], np.float32)
    if value.shape != idx.shape:
      raise core.ConversionError(f"parameter {path} has shape {value.shape}, the template's layout {idx.shape}: "
                                 "the export and the template are not the same model.")
    idx = idx.ravel()
    keep = idx < total  # ids past the template's keys belong to sources written elsewhere (NOVA's Phi-2)
    buf[idx[keep]] = value.ravel()[keep]
  out, offset = {}, 0
  for (k, v), n in zip(sd.items(), sizes):
    out[k] = buf[offset:offset + n].reshape(v.shape)
    offset += n
  return out


def _torch_tensors(sd: dict[str, np.ndarray], dtypes: dict):
  """Torch tensors of ``sd`` in the template's dtypes (torch or numpy dtypes; float32 where unknown)."""
  import torch
  as_torch = lambda d: d if isinstance(d, torch.dtype) else torch.from_numpy(np.zeros(0, d)).dtype
  return {k: torch.from_numpy(np.ascontiguousarray(v)).to(as_torch(dtypes.get(k, np.float32)))
          for k, v in sd.items()}


def _dtypes(tree) -> dict:
  return {k: v.dtype for k, v in core._flatten(tree).items() if hasattr(v, "dtype")}


def template_of(src: str, template: str | None) -> str:
  """``template``, else the official checkpoint ``src`` records it descends from (``source.json``: written by
  the converter, carried by the RL and export jobs), or one sentence."""
  if template:
    return template
  recorded = checkpoint.official_source(src)
  if recorded is None:
    raise core.ConversionError(f"{src} records no official checkpoint it descends from (no source.json): pass "
                               "--template=<the official file or transformer/ folder its base was converted from>.")
  if not fileio.exists(recorded):
    raise core.ConversionError(f"{recorded}, the official checkpoint {src}/source.json names, is gone: pass "
                               "--template=<where it is now>.")
  return recorded


def export(family: str, src: str, template: str | None, out: str) -> dict:
  """Write the export at ``src`` (a fine-tuned ``model.json`` + ``params/``) in the official layout of
  ``template`` (the official file or folder its base was converted from; ``None``: the one ``src`` records,
  :func:`template_of`) to ``out``; returns a small report."""
  if family not in FAMILIES:
    raise core.ConversionError(f"--family={family!r} is not one of {', '.join(FAMILIES)}.")
  model_cfg, _, params = checkpoint.load_model(src)
  if model_cfg.family != family:
    raise core.ConversionError(f"{src} holds a model of family {model_cfg.family!r}, not {family!r}.")
  template = template_of(src, template)
  params = jax.tree.map(np.asarray, params)
  if family == "nova":
    return _export_nova(src, template, out, model_cfg, params)
  module = mar if family == "mar" else harmon
  raw = core.read_checkpoint(template)
  used = next((k for k in module.PREFER if isinstance(raw, dict) and isinstance(raw.get(k), dict)), None)
  sd = core.state_dict(raw, prefer=module.PREFER, origin=template)
  new = write_back(sd, trace(family, sd, model_cfg, template), params)
  weights = _torch_tensors(new, _dtypes(raw[used] if used else raw))
  if used is None:
    result = weights
  else:
    result = {k: v for k, v in raw.items() if k not in DROPPED}
    for k in (module.PREFER if family == "mar" else (used,)):
      if k in raw:
        result[k] = weights
  import io

  import torch
  buf = io.BytesIO()
  torch.save(result, buf)
  fileio.write_bytes(out, buf.getvalue())
  return dict(family=family, src=src, template=template, out=out, keys=len(new),
              changed=int(sum(not np.array_equal(new[k], sd[k]) for k in sd)), dropped=[k for k in DROPPED if
                                                                                     used and k in raw])


def _export_nova(src: str, template: str, out: str, model_cfg, params) -> dict:
  from safetensors.torch import save

  folder = os.path.abspath(template.rstrip("/"))
  if not os.path.isdir(folder) or not glob.glob(os.path.join(folder, "*.safetensors")):
    raise core.ConversionError(f"--template={template} is not the transformer/ folder of a NOVA pipeline (its "
                               "*.safetensors and config.json).")
  raws = [core.read_checkpoint(f) for f in sorted(glob.glob(os.path.join(folder, "*.safetensors")))]
  sd = {k: v for r in raws for k, v in core.state_dict(r, origin=folder).items()}
  text_sd = nova.text_encoder_dict(folder)
  ids = trace("nova", sd, model_cfg, folder, text_sd)
  new = write_back(sd, ids, params)
  text_now = write_back({**sd, **{nova.TEXT + k: v for k, v in text_sd.items()}}, ids, params)
  if any(not np.array_equal(text_now[nova.TEXT + k], v) for k, v in text_sd.items()):
    from absl import logging
    logging.warning("the export's Phi-2 text encoder differs from the pipeline's; only transformer/ is written.")
  dtypes = {k: v.dtype for r in raws for k, v in core._flatten(r).items() if hasattr(v, "dtype")}
  fileio.write_bytes(os.path.join(out, "diffusion_pytorch_model.safetensors"), save(_torch_tensors(new, dtypes)))
  if os.path.isfile(os.path.join(folder, "config.json")):
    fileio.write_bytes(os.path.join(out, "config.json"), fileio.read_bytes(os.path.join(folder, "config.json")))
  return dict(family="nova", src=src, template=template, out=out, keys=len(new),
              changed=int(sum(not np.array_equal(new[k], sd[k]) for k in sd)))
