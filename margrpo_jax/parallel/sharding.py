"""Logical axes of every parameter, their mapping onto the mesh, and the shardings of states and batches.

Each parameter gets logical axes from :data:`PARAM_AXES` (first regex matching its ``component/.../name``
path; a LoRA factor ``.../kernel/lora_a`` (in, r) takes its kernel's input axis, ``lora_b`` (r, out) its output
axis); ``parallel.rules`` maps logical axes to mesh axes (:data:`.mesh.DEFAULT_RULES`: ``embed -> fsdp``,
``mlp -> tensor``). A dimension whose size the mesh axes do not divide stays replicated, so tiny models run
on any mesh. The frozen diffusion head (and anything else outside ``sharded``) is replicated.
Optimizer state is sharded like its parameters (``optax.tree_map_params``); batches are split over
``('data', 'fsdp')`` along their batch dimension.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from margrpo_jax.parallel.mesh import BATCH_AXES
from margrpo_jax.rl import lora

# (regex over "component/.../name", logical axes per dimension); first match wins
PARAM_AXES = (
    (r"/patch_embed/proj/kernel$", (None, None, None, "embed")),  # NOVA's patch-embed conv (p, p, c, D)
    (r"/(qkv|fc1)/kernel$", ("embed", "mlp")),            # column-parallel: (D, 3D) / (D, 4D)
    (r"/(qkv|fc1)/bias$", ("mlp",)),
    (r"/(proj|fc2)/kernel$", ("mlp", "embed")),           # row-parallel: (D, D) / (4D, D)
    (r"/(proj|fc2)/bias$", ("embed",)),
    (r"/(q_proj|k_proj|v_proj|gate_proj|up_proj)/kernel$", ("embed", "mlp")),  # Qwen2 (Harmon's LLM)
    (r"/(q_proj|k_proj|v_proj)/bias$", ("mlp",)),
    (r"/(o_proj|down_proj|dense)/kernel$", ("mlp", "embed")),  # ... and Phi-2's attention output (NOVA)
    (r"/dense/bias$", ("embed",)),
    (r"/(z_proj|decoder_embed)/kernel$", (None, "embed")),
    (r"/(z_proj|decoder_embed)/bias$", ("embed",)),
    (r"/\w*norm\w*/(scale|bias)$|/z_proj_ln/(scale|bias)$", ("norm",)),
    (r"/fake_latent$|/mask_embed/(bos_token|mask_token)$|^null_text$", (None, "embed")),  # (1, D) / (rows, D)
    (r"pos_embed\w*$|/mask_token$|/null_embed$", (None, None, "embed")),   # (1, N, D)
    (r"/(embedding|class_emb/embedding)$", ("vocab", "embed")),
)
REPLICATED_COMPONENTS = ("head",)  # the diffusion head: small, frozen in MAR-GRPO, replicated everywhere


def path_str(path) -> str:
  return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def logical_axes(path: str, ndim: int) -> tuple:
  """The logical axes of parameter ``path``; replicated for :data:`REPLICATED_COMPONENTS`."""
  if path.split("/")[0] in REPLICATED_COMPONENTS:
    return (None,) * ndim
  kernel, _, factor = path.rpartition("/")
  if factor in lora.FACTORS:  # A (in, r) and B (r, out) of an adapted 2-D kernel
    d_in, d_out = logical_axes(kernel, 2)
    return (d_in, None) if factor == lora.FACTORS[0] else (None, d_out)
  for pattern, axes in PARAM_AXES:
    if re.search(pattern, path):
      if len(axes) != ndim:
        raise ValueError(f"sharding rule {pattern!r} gives {len(axes)} axes to parameter {path} of rank {ndim}.")
      return axes
  raise ValueError(f"parameter {path} has no logical-axis rule in margrpo_jax/parallel/sharding.py PARAM_AXES.")


def spec_for(axes: tuple, shape: tuple, rules, mesh: Mesh) -> P:
  """``PartitionSpec`` for ``axes`` under ``rules`` (list of [logical, mesh axes]); indivisible dims replicate."""
  table = {logical: target for logical, target in rules}
  used, out = set(), []
  for logical, size in zip(axes, shape):
    target = table.get(logical) if logical is not None else None
    names = () if target is None else (tuple(target) if isinstance(target, (list, tuple)) else (target,))
    names = tuple(n for n in names if n not in used and mesh.shape[n] > 1)
    if names and size % math.prod(mesh.shape[n] for n in names) == 0:
      used.update(names)
      out.append(names[0] if len(names) == 1 else names)
    else:
      out.append(None)
  return P(*out)


def param_specs(params, rules, mesh: Mesh):
  """A tree of ``PartitionSpec`` over ``params`` (arrays or ``ShapeDtypeStruct``)."""
  return jax.tree_util.tree_map_with_path(
      lambda p, x: spec_for(logical_axes(path_str(p), len(x.shape)), x.shape, rules, mesh), params)


def named(mesh: Mesh, specs):
  return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def param_shardings(mesh: Mesh, params, rules):
  return named(mesh, param_specs(params, rules, mesh))


def opt_shardings(mesh: Mesh, tx: optax.GradientTransformation, params, shardings):
  """Optimizer-state shardings: a leaf whose path ends in a parameter's path and whose shape equals that
  parameter's (Adam moments, masked or not) is sharded like it; counters and the rest are replicated."""
  by_path = {path_str(p): (x.shape, s) for (p, x), s in zip(
      jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(shardings))}
  rep = NamedSharding(mesh, P())

  def pick(path, leaf):
    keys = path_str(path).split("/")
    for i in range(len(keys)):
      hit = by_path.get("/".join(keys[i:]))
      if hit is not None and tuple(hit[0]) == tuple(leaf.shape):
        return hit[1]
    return rep

  return jax.tree_util.tree_map_with_path(pick, jax.eval_shape(tx.init, params))


def batch_sharding(mesh: Mesh, ndim: int, axis: int = 0) -> NamedSharding:
  """Split dimension ``axis`` of a rank-``ndim`` array over the batch axes ``('data', 'fsdp')``."""
  spec = [None] * ndim
  spec[axis] = BATCH_AXES
  return NamedSharding(mesh, P(*spec))


_TRACED_ON = contextvars.ContextVar("traced_on", default=(None, ()))


@contextlib.contextmanager
def activations_on(mesh: Mesh | None, rules=()):
  """While tracing inside this context, :func:`constrain_batch` pins activations to ``mesh``'s batch axes and
  :func:`constrain_params` parameters computed inside the program to their ``rules``' shardings."""
  token = _TRACED_ON.set((mesh, rules))
  try:
    yield
  finally:
    _TRACED_ON.reset(token)


def traced_on(fn, mesh: Mesh | None, rules=()):
  """``fn`` traced inside :func:`activations_on` ``(mesh, rules)`` (wrap a function before ``jax.jit``)."""
  @functools.wraps(fn)
  def wrapped(*args, **kwargs):
    with activations_on(mesh, rules):
      return fn(*args, **kwargs)
  wrapped.__name__ = getattr(getattr(fn, "func", fn), "__name__", "fn")  # a partial's function (jit's name)
  return wrapped


def constrain_batch(x, axis: int = 0):
  """``x`` with dimension ``axis`` split over the batch axes of the mesh being traced on (:func:`traced_on`), or
  ``x`` unchanged (no mesh, one batch shard, or a size they do not divide). Without it the partitioner may
  follow the FSDP parameters' ``embed`` split and hold every image's activations on every device."""
  mesh = _TRACED_ON.get()[0]
  if mesh is None:
    return x
  shards = math.prod(mesh.shape[a] for a in BATCH_AXES)
  if shards == 1 or x.shape[axis] % shards:
    return x
  return jax.lax.with_sharding_constraint(x, batch_sharding(mesh, x.ndim, axis))


def constrain_params(params):
  """``params`` computed inside a program (LoRA's merged kernels) pinned to their own shardings under the rules
  being traced with (:func:`traced_on`), or unchanged without a mesh. Without it the partitioner may hold every
  merged kernel whole on every device."""
  mesh, rules = _TRACED_ON.get()
  if mesh is None:
    return params
  return jax.lax.with_sharding_constraint(params, param_shardings(mesh, params, rules))


def microbatch(x, c, n: int, axis: int = 0):
  """Microbatch ``c`` of ``n`` along the batch ``axis``: rows ``c, c + n, c + 2n, ...`` (``c`` may be traced). A
  batch sharded in contiguous blocks gives every device the same share of each microbatch, so accumulating
  over microbatches moves no rows between devices."""
  shape = x.shape[:axis] + (x.shape[axis] // n, n) + x.shape[axis + 1:]
  return jax.lax.dynamic_index_in_dim(x.reshape(shape), c, axis + 1, keepdims=False)


def to_global(tree, shardings):
  """Place host data as global arrays: ``device_put`` on one process; on several, each host's rows (its
  share of the batch) become its shards via ``make_array_from_process_local_data``."""
  if jax.process_count() == 1:
    return jax.device_put(tree, shardings)
  return jax.tree.map(lambda x, s: jax.make_array_from_process_local_data(s, np.asarray(x)), tree, shardings)


def to_host(x) -> np.ndarray:
  """A global array as numpy on every host (all-gathered across processes when there are several)."""
  if jax.process_count() == 1:
    return np.asarray(x)
  from jax.experimental import multihost_utils
  return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def host_rows(n: int) -> slice:
  """This process's contiguous share of ``n`` batch rows (all of them on a single process)."""
  per = n // jax.process_count()
  return slice(jax.process_index() * per, (jax.process_index() + 1) * per)


def signature(tree):
  """A hashable description (structure, shapes, dtypes) of ``tree``, for caching compiled steps."""
  leaves, treedef = jax.tree.flatten(tree)
  return treedef, tuple((tuple(x.shape), str(x.dtype)) for x in leaves)


def abstract(sig):
  """The tree of ``ShapeDtypeStruct`` that :func:`signature` describes."""
  treedef, leaves = sig
  return jax.tree.unflatten(treedef, [jax.ShapeDtypeStruct(s, jnp.dtype(d)) for s, d in leaves])


def hashable_rules(rules) -> tuple:
  """``parallel.rules`` (lists from a config) as nested tuples."""
  return tuple((a, tuple(b) if isinstance(b, (list, tuple)) else b) for a, b in rules)
