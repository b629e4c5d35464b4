"""The converter core: read PyTorch / safetensors weights, fill a Flax parameter tree, prove full key coverage.

A family converter (``margrpo_jax/convert/<family>.py``) builds its model abstractly, then maps every target
leaf from a source tensor with :class:`Converter`:

    conv = Converter(tensors, target=abstract_params, origin=path)
    conv.dense("backbone/z_proj", "z_proj")          # kernel = weight.T, bias = bias
    conv.ignore(r"^lm_head\\.weight$", "tied to the embedding")
    params = conv.result()                          # raises unless every leaf is filled and every key used

Rules (docs/models.md section 4): Linear ``kernel = W.T``; Conv2d ``kernel = W.transpose(2, 3, 1, 0)`` (NHWC);
LayerNorm / GroupNorm ``scale = weight``; Embedding ``embedding = weight``; raw parameters copied as they are.
Every mismatch is one sentence naming the source key and the target path.
"""
from __future__ import annotations

import contextlib
import glob
import os
import re
from typing import Callable, Iterable, Mapping

import numpy as np


class ConversionError(ValueError):
  """A source checkpoint that does not match the target model, in one sentence naming the key."""


def _to_numpy(t) -> np.ndarray:
  if isinstance(t, np.ndarray):
    return t
  # torch tensors (bf16 / fp16 included) -> float32 numpy for floats, as-is otherwise.
  if t.is_floating_point():
    return t.detach().float().cpu().numpy()
  return t.detach().cpu().numpy()


def _flatten(tree, prefix=""):
  """Nested dicts of tensors -> flat ``{'a.b.c': tensor}`` (PyTorch's dotted naming)."""
  out = {}
  for k, v in tree.items():
    name = f"{prefix}{k}"
    if isinstance(v, Mapping):
      out.update(_flatten(v, name + "."))
    elif hasattr(v, "shape"):
      out[name] = v
  return out


def _torch_load(path: str):
  """A PyTorch file read with ``weights_only=True`` (tensors and plain containers; unpickling anything else could
  run code). The one extra type allowed is ``argparse.Namespace``, which released MAR files save beside the
  weights."""
  try:
    import torch
  except ImportError as e:  # torch is only needed to read .pth files
    raise ConversionError(f"reading {path} needs PyTorch (pip install torch); safetensors files do not.") from e
  import argparse
  import pickle
  try:
    with torch.serialization.safe_globals([argparse.Namespace]):
      return torch.load(path, map_location="cpu", weights_only=True)
  except pickle.UnpicklingError as e:
    found = re.search(r"GLOBAL (\S+)", str(e))
    if not found:
      raise ConversionError(f"{path} is not a readable PyTorch checkpoint (truncated, corrupt or another "
                            "format).") from None
    raise ConversionError(
        f"{path} pickles {found.group(1)}, which is not loaded (unpickling can run code): re-save it as a state "
        "dict (torch.save(model.state_dict(), 'weights.pth')) or as safetensors.") from None
  except (RuntimeError, EOFError, OSError, IndexError, KeyError, ValueError) as e:  # empty, truncated, not torch
    detail = type(e).__name__ if isinstance(e, (IndexError, KeyError)) or not str(e) else str(e).splitlines()[0]
    raise ConversionError(f"{path} is not a readable PyTorch checkpoint (empty, truncated or another format: "
                          f"{detail}).") from None


def _safetensors_load(path: str) -> dict:
  from safetensors import safe_open
  out = {}
  try:
    handle = safe_open(path, framework="numpy")
  except Exception as e:  # noqa: BLE001 - SafetensorError for a truncated file or one of another format
    raise ConversionError(f"{path} is not a readable safetensors file ({str(e).splitlines()[0]}).") from None
  with handle as f:
    for k in f.keys():
      try:
        out[k] = f.get_tensor(k)
      except TypeError:  # bf16 has no numpy dtype in safetensors: go through torch
        return _safetensors_torch(path)
  return out


def _safetensors_torch(path: str) -> dict:
  from safetensors.torch import load_file
  return load_file(path)


def read_checkpoint(path: str) -> dict:
  """The raw top-level object of a checkpoint: a ``.pth/.pt/.bin/.ckpt`` file, a ``.safetensors`` file, or a
  folder of shards (``*.safetensors`` or ``pytorch_model*.bin``, merged)."""
  path = os.path.abspath(os.path.expanduser(path))
  if os.path.isdir(path):
    shards = sorted(glob.glob(os.path.join(path, "*.safetensors"))) or sorted(
        glob.glob(os.path.join(path, "*.bin")))
    if not shards:
      raise ConversionError(f"folder {path} has no *.safetensors or *.bin weight files.")
    merged = {}
    for s in shards:
      merged.update(read_checkpoint(s))
    return merged
  if not os.path.isfile(path):
    raise ConversionError(f"checkpoint {path} does not exist.")
  if path.endswith(".safetensors"):
    return _safetensors_load(path)
  return _torch_load(path)


def state_dict(raw, prefer: Iterable[str] = ("model_ema", "ema", "state_dict", "model", "module"),
               origin: str = "checkpoint") -> dict[str, np.ndarray]:
  """The flat ``{name: float32 numpy}`` weights inside ``raw``, taking the first of ``prefer`` that is present
  (EMA first: MAR stores ``model`` and ``model_ema``)."""
  if not isinstance(raw, Mapping):
    raise ConversionError(f"{origin} holds a {type(raw).__name__}, not a state dict.")
  for key in prefer:
    if isinstance(raw.get(key), Mapping):
      raw = raw[key]
      break
  out = {k: _to_numpy(v) for k, v in _flatten(raw).items()}
  if not out:
    raise ConversionError(f"{origin} holds no tensors.")
  return out


def flat_paths(tree, prefix="") -> dict[str, tuple]:
  """``{'a/b/c': leaf}`` for a nested dict of arrays or ShapeDtypeStructs (list indices become strings)."""
  out = {}
  for k, v in tree.items():
    name = f"{prefix}{k}"
    if isinstance(v, Mapping):
      out.update(flat_paths(v, name + "/"))
    else:
      out[name] = v
  return out


def _unflatten_like(target, flat, prefix=""):
  return {k: (_unflatten_like(v, flat, f"{prefix}{k}/") if isinstance(v, Mapping) else flat[f"{prefix}{k}"])
          for k, v in target.items()}


_TRACING = [False]  # inside :func:`tracing`: leaves keep their integer element ids instead of being cast


@contextlib.contextmanager
def tracing():
  """Run a converter on element ids (``int64`` source arrays) instead of weights: every target leaf then holds the
  ids of the source elements it was copied from, which is what writes fine-tuned weights back
  (``convert/official.py``). A mapping that computes values instead of moving them is refused in one sentence."""
  _TRACING[0] = True
  try:
    yield
  finally:
    _TRACING[0] = False


class Converter:
  """Fills a Flax parameter tree (``nnx.to_pure_dict`` layout, abstract leaves) from a flat source dict."""

  def __init__(self, source: Mapping[str, np.ndarray], target, origin: str = "checkpoint"):
    self.source, self.target, self.origin = dict(source), target, origin
    self.want = flat_paths(target)
    self.filled: dict[str, np.ndarray] = {}
    self.used: set[str] = set()
    self.ignored: list[tuple[re.Pattern, str]] = []

  # -- primitives -----------------------------------------------------------------------------------------------
  def get(self, key: str) -> np.ndarray:
    if key not in self.source:
      raise ConversionError(f"{self.origin} has no key {key!r}.")
    self.used.add(key)
    return np.asarray(self.source[key])

  def has(self, key: str) -> bool:
    return key in self.source

  def put(self, path: str, value: np.ndarray, key: str = "") -> None:
    """Set target leaf ``path`` (checked against the target's shape; cast to its dtype)."""
    if path not in self.want:
      raise ConversionError(f"target has no parameter {path!r} (mapping {key or 'a value'} of {self.origin}).")
    want = self.want[path]
    value = np.asarray(value)
    if tuple(value.shape) != tuple(want.shape):
      raise ConversionError(f"{self.origin} key {key or path!r} has shape {tuple(value.shape)} after conversion, "
                            f"but target {path!r} expects {tuple(want.shape)}.")
    if path in self.filled:
      raise ConversionError(f"target {path!r} is filled twice (second time from {key!r}).")
    if _TRACING[0] and value.dtype != np.int64:
      raise ConversionError(f"target {path!r} is computed from {key or 'the source'} ({value.dtype}), not copied: it "
                            "cannot be written back to the official layout.")
    if not _TRACING[0]:
      if not np.issubdtype(value.dtype, np.floating):
        raise ConversionError(f"{self.origin} key {key or path!r} holds {value.dtype} values; only floating-point "
                              "weights are converted (dequantise or cast the checkpoint first).")
      if not np.all(np.isfinite(value)):
        raise ConversionError(f"{self.origin} key {key or path!r} holds {int(np.sum(~np.isfinite(value)))} NaN or "
                              "Inf values.")
    self.filled[path] = value if _TRACING[0] else value.astype(want.dtype)

  def copy(self, path: str, key: str, fn: Callable[[np.ndarray], np.ndarray] | None = None) -> None:
    x = self.get(key)
    try:
      y = fn(x) if fn else x
    except (ValueError, IndexError) as e:  # a transpose / reshape of a weight of the wrong rank
      raise ConversionError(f"{self.origin} key {key!r} has shape {tuple(x.shape)}, which does not fit target "
                            f"{path!r} ({str(e).splitlines()[0]}).") from None
    self.put(path, y, key)

  # -- layers ---------------------------------------------------------------------------------------------------
  def dense(self, path: str, key: str) -> None:
    """``nn.Linear`` -> ``nnx.Linear``: kernel = weight.T (bias if the target has one)."""
    self.copy(f"{path}/kernel", f"{key}.weight", lambda w: w.T)
    if f"{path}/bias" in self.want:
      self.copy(f"{path}/bias", f"{key}.bias")

  def norm(self, path: str, key: str) -> None:
    """LayerNorm / GroupNorm / RMSNorm: scale = weight (bias if the target has one)."""
    self.copy(f"{path}/scale", f"{key}.weight")
    if f"{path}/bias" in self.want:
      self.copy(f"{path}/bias", f"{key}.bias")

  def conv(self, path: str, key: str) -> None:
    """``nn.Conv2d`` (out, in, kh, kw) -> NHWC kernel (kh, kw, in, out)."""
    self.copy(f"{path}/kernel", f"{key}.weight", lambda w: w.transpose(2, 3, 1, 0))
    if f"{path}/bias" in self.want:
      self.copy(f"{path}/bias", f"{key}.bias")

  def embed(self, path: str, key: str) -> None:
    self.copy(f"{path}/embedding", f"{key}.weight")

  def ignore(self, pattern: str, why: str) -> None:
    """Source keys matching ``pattern`` are deliberately not used (``why`` is kept for the report)."""
    self.ignored.append((re.compile(pattern), why))

  # -- the result -----------------------------------------------------------------------------------------------
  def unused(self) -> list[str]:
    return sorted(k for k in self.source if k not in self.used and not any(p.search(k) for p, _ in self.ignored))

  def result(self):
    """The filled tree; raises naming the first missing target parameters and unused source keys."""
    missing = sorted(set(self.want) - set(self.filled))
    unused = self.unused()
    if missing or unused:
      parts = []
      if missing:
        parts.append(f"{len(missing)} target parameter(s) not filled ({', '.join(missing[:5])}"
                     f"{', ...' if len(missing) > 5 else ''})")
      if unused:
        parts.append(f"{len(unused)} source key(s) of {self.origin} not used ({', '.join(unused[:5])}"
                     f"{', ...' if len(unused) > 5 else ''})")
      raise ConversionError("; ".join(parts) + ".")
    return _unflatten_like(self.target, self.filled)

  def report(self) -> dict:
    return {"origin": self.origin, "target_parameters": len(self.want), "source_keys": len(self.source),
            "used": len(self.used), "ignored": {why: sum(1 for k in self.source if p.search(k))
                                                 for p, why in self.ignored}}


VIT_NORMS = ("norm1", "norm2")
VIT_DENSES = ("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2")


def blocks(conv: Converter, dst: str, src: str, norms: tuple = VIT_NORMS, denses: tuple = VIT_DENSES) -> None:
  """Blocks ``i = 0, 1, ...`` while the target has ``{dst}/{i}/{norms[0]}/scale``: ``{src}.{i}.{n}`` ->
  ``{dst}/{i}/{n}`` (dots become slashes), ``norms`` by :meth:`Converter.norm`, then ``denses`` by
  :meth:`Converter.dense`. The defaults are timm's ViT ``Block``."""
  i = 0
  while f"{dst}/{i}/{norms[0]}/scale" in conv.want:
    for n in norms:
      conv.norm(f"{dst}/{i}/{n}", f"{src}.{i}.{n}")
    for n in denses:
      conv.dense(f"{dst}/{i}/{n.replace('.', '/')}", f"{src}.{i}.{n}")
    i += 1


def abstract_params(model_cfg, build) -> dict:
  """The ``nnx.to_pure_dict`` tree of ShapeDtypeStructs of ``build(model_cfg)`` (no allocation)."""
  from flax import nnx
  import jax
  state = nnx.state(nnx.eval_shape(lambda: build(model_cfg)))
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), nnx.to_pure_dict(state))
