"""The device mesh from config: axes ``('data', 'fsdp', 'tensor')``, sizes multiplying to the device count.

``config.parallel`` (see :func:`config`)::

  mesh = {data: -1, fsdp: 1, tensor: 1}   # -1: the devices left over by the other axes
  rules = [[logical, mesh axis | [axes] | None], ...]   # logical parameter axes -> mesh axes (maxtext-style)
  distributed = False                     # call jax.distributed.initialize() first (multi-host pods)
  init_timeout_s = 300                    # how long a process waits for the coordinator (then one sentence)

Data parallelism shards the batch over ``data`` and ``fsdp``; FSDP additionally shards each parameter's
``embed`` dimension over ``fsdp`` (gathered per layer by XLA); tensor parallelism shards the ``mlp`` (and
fused-qkv) dimension over ``tensor``.
"""
from __future__ import annotations

import math
import os
import socket
import time

import jax
import ml_collections
import numpy as np
from jax.sharding import AxisType, Mesh

AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")  # the batch dimension is split over both

# logical axis -> mesh axis (None: replicated). Dimensions that do not divide evenly stay replicated.
DEFAULT_RULES = (
    ("embed", "fsdp"),
    ("mlp", "tensor"),
    ("vocab", "tensor"),
    ("norm", None),
)


def config() -> ml_collections.ConfigDict:
  """The ``config.parallel`` block every job config carries (single process, all devices on ``data``)."""
  return ml_collections.ConfigDict(dict(
      mesh=dict(data=-1, fsdp=1, tensor=1),
      rules=[list(r) for r in DEFAULT_RULES],
      distributed=False,
      init_timeout_s=300,
  ))


class CoordinatorError(RuntimeError):
  """The multi-host coordinator did not answer in time (a user-facing sentence)."""


def wait_for_coordinator(address: str, timeout_s: float) -> None:
  """Return once a TCP connection to ``host:port`` succeeds; raise :class:`CoordinatorError` after
  ``timeout_s`` seconds (JAX itself aborts the process when its own wait runs out)."""
  host, _, port = address.rpartition(":")
  deadline = time.monotonic() + timeout_s
  while True:
    try:
      socket.create_connection((host.strip("[]") or "localhost", int(port)), timeout=2.0).close()
      return
    except (OSError, ValueError):
      if time.monotonic() >= deadline:
        raise CoordinatorError(f"the coordinator JAX_COORDINATOR_ADDRESS={address} did not answer within "
                               f"{timeout_s:g} s (parallel.init_timeout_s): is process 0 running and reachable?"
                               ) from None
      time.sleep(0.5)


def resolve_shape(mesh_cfg, num_devices: int) -> tuple[int, ...]:
  """Axis sizes for ``num_devices``: at most one ``-1`` takes what the others leave."""
  sizes = [int(mesh_cfg[a]) for a in AXES]
  if sum(s == -1 for s in sizes) > 1 or any(s == 0 or s < -1 for s in sizes):
    raise ValueError(f"parallel.mesh={dict(zip(AXES, sizes))} must hold positive sizes and at most one -1.")
  known = math.prod(s for s in sizes if s != -1)
  if -1 in sizes:
    if num_devices % known:
      raise ValueError(f"parallel.mesh={dict(zip(AXES, sizes))}: {num_devices} devices are not divisible by "
                       f"{known}.")
    sizes[sizes.index(-1)] = num_devices // known
  if math.prod(sizes) != num_devices:
    raise ValueError(f"parallel.mesh={dict(zip(AXES, sizes))} multiplies to {math.prod(sizes)}, but there are "
                     f"{num_devices} devices.")
  return tuple(sizes)


def make_mesh(mesh_cfg, devices=None) -> Mesh:
  """A ``Mesh`` over ``devices`` (default: all, across hosts) shaped by ``mesh_cfg``."""
  devices = jax.devices() if devices is None else list(devices)
  shape = resolve_shape(mesh_cfg, len(devices))
  auto = (AxisType.Auto,) * len(AXES)  # GSPMD propagation from the steps' explicit in/out shardings
  if len(devices) == len(jax.devices()):
    return jax.make_mesh(shape, AXES, auto, devices=devices)
  return Mesh(np.asarray(devices).reshape(shape), AXES, axis_types=auto)


def initialize(parallel_cfg) -> None:
  """``jax.distributed.initialize()`` when ``parallel.distributed``: TPU pods and SLURM are auto-detected;
  elsewhere ``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID`` are passed on, and a
  non-zero process first waits at most ``parallel.init_timeout_s`` for the coordinator to answer."""
  if not parallel_cfg.distributed:
    return
  env = os.environ
  timeout = int(parallel_cfg.init_timeout_s)
  kw = dict(initialization_timeout=timeout)
  if "JAX_NUM_PROCESSES" in env and "JAX_PROCESS_ID" in env:
    kw.update(num_processes=int(env["JAX_NUM_PROCESSES"]), process_id=int(env["JAX_PROCESS_ID"]))
    if kw["process_id"] and env.get("JAX_COORDINATOR_ADDRESS"):  # a bounded wait with a sentence, not an abort
      wait_for_coordinator(env["JAX_COORDINATOR_ADDRESS"], timeout)
  jax.distributed.initialize(**kw)
