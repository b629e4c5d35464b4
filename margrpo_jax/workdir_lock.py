"""One writer per workdir: ``W/.lock`` holds the host and pid of the run that owns it (process 0 takes it).

A second run on the same workdir is refused in one sentence while the first lives. A lock left by a dead process
on this host is taken over with a warning; one from another host cannot be checked from here, so it is refused
with the command that removes it. Workdirs on gs:// are not locked (no atomic create there): a warning says so.
"""
from __future__ import annotations

import contextlib
import json
import os
import socket

from absl import logging

from margrpo_jax.errors import UserError


class WorkdirInUse(UserError):
  """Another live run owns the workdir (one sentence for the user)."""


def _alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:  # someone else's live process
    return True
  return True


def _take(path: str) -> bool:
  try:
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
  except FileExistsError:
    return False
  with os.fdopen(fd, "w") as f:
    json.dump(dict(host=socket.gethostname(), pid=os.getpid()), f)
  return True


def acquire(workdir: str) -> str | None:
  """Take ``W/.lock`` (creating ``W``) and return its path; None for a gs:// workdir. Raises :class:`WorkdirInUse`."""
  if "://" in workdir:
    logging.warning("%s is not locked (object stores have no atomic create): run one job on it at a time", workdir)
    return None
  os.makedirs(workdir, exist_ok=True)
  path = os.path.join(workdir, ".lock")
  for _ in range(3):  # a stale lock removed by us (or a racing run) is retried
    if _take(path):
      return path
    try:
      with open(path) as f:
        holder = json.load(f)
      host, pid = str(holder["host"]), int(holder["pid"])
    except (OSError, ValueError, KeyError, TypeError):
      host, pid = "?", -1
    if host == socket.gethostname() and not _alive(pid):
      logging.warning("%s was left by process %d, which is gone: taking it over", path, pid)
      with contextlib.suppress(FileNotFoundError):
        os.remove(path)
      continue
    if host == socket.gethostname():
      raise WorkdirInUse(f"the workdir {workdir} is in use by process {pid} on this host ({path}); wait for it to "
                         "finish or pass another --workdir")
    raise WorkdirInUse(f"the workdir {workdir} is locked by process {pid} on host {host} ({path}); if that run is "
                       f"gone, remove the lock (rm {path}) and rerun")
  raise WorkdirInUse(f"the workdir {workdir} could not be locked ({path} keeps changing); is another run starting?")


def release(path: str | None) -> None:
  """Remove the lock if it is still ours."""
  if path is None:
    return
  with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
    with open(path) as f:
      if int(json.load(f)["pid"]) != os.getpid():
        return
    os.remove(path)
