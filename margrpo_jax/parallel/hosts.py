"""Several processes (multi-host): process 0 writes, the others wait for it where they read what it wrote.

Every job runs the same program on every process. Files (config, metrics, reports, images, prepared TFDS data,
the random-weight base) are written by process 0 only (:func:`is_main`; ``fileio`` skips its writes elsewhere);
Orbax checkpoints and exports are written by all processes together (each its own shards). Where every process
then reads a file process 0 made, :func:`main_first` runs the maker on process 0, a barrier, then on the others
(which find it made). On one process all of this is a no-op.
"""
from __future__ import annotations

import jax


def is_main() -> bool:
  """Whether this process writes the run's files (process 0)."""
  return jax.process_index() == 0


def barrier(name: str) -> None:
  """Wait until every process reaches the barrier ``name`` (nothing on a single process)."""
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils
    multihost_utils.sync_global_devices(name)


def main_first(fn, name: str):
  """``fn()`` on process 0, then (after barrier ``name``) on the others, which find what it made."""
  if jax.process_count() == 1:
    return fn()
  if is_main():
    out = fn()
    barrier(name)
    return out
  barrier(name)
  return fn()
