"""Compute dtype: float32 master parameters, the transformer's layers computing in bfloat16.

``with_compute(graphdef, params, 'bfloat16')`` returns the graph with ``dtype = bfloat16`` on every Flax layer
(``Linear``, ``Conv``, ``Embed``, the norms, ...) outside the diffusion ``head``: such a layer casts its input and
its float32 parameters to bfloat16 and returns bfloat16 (the norms compute their statistics in float32; attention
takes its softmax in float32). Parameters, gradients (through the casts) and optimizer state stay float32; the
head, and so every log-probability and KL of the RL loss, computes in float32 on the bfloat16 condition. The
dtype is static graph metadata: the same parameters run under either graph, each jitted once.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

DTYPES = {"float32": None, "bfloat16": jnp.bfloat16}
LAYERS = (nnx.Linear, nnx.LinearGeneral, nnx.Einsum, nnx.Conv, nnx.Embed, nnx.LayerNorm, nnx.RMSNorm,
          nnx.GroupNorm)
FLOAT32_COMPONENTS = ("head",)  # the diffusion head: log-probs in float32


def with_compute(graphdef, params: dict, dtype: str, held: str = "float32"):
  """``graphdef`` whose layers outside :data:`FLOAT32_COMPONENTS` compute in ``dtype`` ('float32': unchanged).
  ``held='bfloat16'`` (some parameters stored in bf16, :func:`stored`): every other layer computes in float32
  explicitly, so that a bf16-stored weight is promoted (an ``Embed``'s lookup, whose dtype would otherwise be its
  table's, included)."""
  if DTYPES[dtype] is None and DTYPES[held] is None:
    return graphdef
  model = nnx.merge(graphdef, jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params))
  for path, module in nnx.iter_modules(model):
    if not isinstance(module, LAYERS):
      continue
    if DTYPES[dtype] is not None and path and path[0] not in FLOAT32_COMPONENTS:
      module.dtype = DTYPES[dtype]
    elif DTYPES[held] is not None:
      module.dtype = jnp.float32
  return nnx.split(model)[0]


def stored(tree, dtype: str):
  """``tree`` with its floating leaves held in ``dtype`` (arrays cast, ``ShapeDtypeStruct`` leaves re-typed with
  their sharding; leaves already in it, and integer leaves, returned as they are). How the RL step holds the parts
  no optimizer sees (``rl.frozen_dtype``): a layer whose parameters are bfloat16 and whose input is float32
  computes in float32 (Flax promotes), so only the stored values are rounded."""
  target = jnp.dtype(DTYPES[dtype] or jnp.float32)

  def cast(x):
    if not jnp.issubdtype(x.dtype, jnp.floating) or x.dtype == target:
      return x
    if isinstance(x, jax.ShapeDtypeStruct):
      return jax.ShapeDtypeStruct(x.shape, target, sharding=x.sharding)
    return x.astype(target)
  return jax.tree.map(cast, tree)
