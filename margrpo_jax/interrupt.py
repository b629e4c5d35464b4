"""SIGTERM (a preemption notice: spot / preemptible VMs, TPU maintenance) and SIGINT (Ctrl-C) as a clean stop.

Inside a training loop (:func:`polled`) the handler only records the signal: the loop finishes its current step,
saves a checkpoint (:func:`requested` is polled once per step, agreed across processes), prints one line and exits
with 128 + the signal (143 for SIGTERM, 130 for SIGINT); rerunning the same command resumes. Outside a loop
(loading, evaluation, sampling: nothing half-done worth saving; every file is written atomically) the process
prints one line and exits at once. A second signal always exits at once.
"""
from __future__ import annotations

import contextlib
import os
import signal
import sys

_state = dict(received=None, polled=False)
_NAMES = {signal.SIGTERM: "SIGTERM", signal.SIGINT: "SIGINT"}


class Stopped(SystemExit):
  """Raised by :func:`stop` after the loop saved its state: exits with 128 + the signal, no traceback."""


def _handler(signum, frame):  # noqa: ARG001
  if _state["polled"] and _state["received"] is None:
    _state["received"] = signum
    print(f"{_NAMES[signum]} received: finishing the current step, then saving a checkpoint (send it again to "
          "stop at once, losing the progress since the last checkpoint).", file=sys.stderr, flush=True)
    return
  print(f"stopped by {_NAMES[signum]}; files already saved are untouched (rerun the same command to resume).",
        file=sys.stderr, flush=True)
  sys.stdout.flush()
  os._exit(128 + signum)  # no interpreter shutdown: background saves cut short would each print a traceback


def install() -> None:
  """Route SIGTERM and SIGINT through this module (the entry point does this once, main thread only)."""
  for sig in _NAMES:
    signal.signal(sig, _handler)


@contextlib.contextmanager
def polled():
  """The body polls :func:`requested` once per step and calls :func:`stop` when it is true."""
  _state["polled"] = True
  try:
    yield
  finally:
    _state["polled"] = False


def requested() -> bool:
  """Whether a stop was asked for, the same answer on every process (one tiny all-reduce when there are several,
  so that all of them save the same step together)."""
  local = _state["received"] is not None
  import jax
  if jax.process_count() == 1:
    return local
  from jax.experimental import multihost_utils
  import numpy as np
  return bool(np.any(multihost_utils.process_allgather(np.array(local))))


def stop(saved: str) -> None:
  """Print one line naming what was saved and exit with 128 + the signal (SIGTERM when another process got it)."""
  signum = _state["received"] or signal.SIGTERM
  print(f"stopped by {_NAMES[signum]}: {saved}; rerun the same command to resume.", file=sys.stderr, flush=True)
  raise Stopped(128 + signum)
