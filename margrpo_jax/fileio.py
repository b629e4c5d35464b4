"""The one file-system layer of the jobs: local paths and ``gs://`` URLs, written atomically, by process 0.

Every file a job writes or reads in its workdir (config, metrics, reports, images, arrays, ``model.json``),
prompt files and exports go through here. Local paths use the OS (a write goes to a temp file in the same
folder, then ``os.replace``); URLs use ``etils.epath`` (on ``gs://`` that is ``tf.io.gfile``; an object store
writes each object whole, so a killed write leaves the previous version). Orbax checkpoints and exports take the
same path string as is (tensorstore writes ``gs://`` natively; Orbax's own folder bookkeeping is ``epath`` too)
and TFDS its data dir. The tests run the jobs on a fake bucket (``tests/fake_gcs.py``) through these same calls.

With several processes (multi-host) only process 0 writes (``parallel/hosts.py``): on the others every write
here is skipped and returns the path, so a job calls these on every process alike. A job killed mid-write, or a
full disk, leaves the previous version of the file intact; readers of files a run appends to
(``metrics.jsonl``) or derives (``base_eval.json``) tolerate a damaged copy with one warning.
"""
from __future__ import annotations

import io
import json
import os
import re
import tempfile

import numpy as np
from absl import logging

from margrpo_jax.errors import UserError
from margrpo_jax.parallel import hosts

SCHEMES = ("gs://",)  # URL schemes the jobs accept (Orbax / tensorstore write gs:// and local paths only)
_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


class UnsupportedPath(UserError, ValueError):
  """A URL of a scheme the jobs cannot write through (one sentence)."""


def is_url(path: str) -> bool:
  return bool(_URL.match(os.fspath(path)))


def check_scheme(path: str, what: str = "path") -> None:
  """Refuse a URL of a scheme outside :data:`SCHEMES` in one sentence (:class:`UnsupportedPath`)."""
  m = _URL.match(os.fspath(path))
  if m and not path.startswith(SCHEMES):
    raise UnsupportedPath(f"{what} {path}: the {m.group(1)}:// scheme is not supported (use a local folder or "
                          f"one of {', '.join(SCHEMES)})")


def resolve(path: str) -> str:
  """A local path made absolute (``~`` expanded); a URL as is."""
  path = os.fspath(path)
  return path if is_url(path) else os.path.abspath(os.path.expanduser(path))


def _url(path: str):
  from etils import epath
  return epath.Path(path)


def exists(path: str) -> bool:
  return _url(path).exists() if is_url(path) else os.path.exists(path)


def isdir(path: str) -> bool:
  return _url(path).is_dir() if is_url(path) else os.path.isdir(path)


def isfile(path: str) -> bool:
  return exists(path) and not isdir(path)


def listdir(path: str) -> list[str]:
  return [p.name for p in _url(path).iterdir()] if is_url(path) else os.listdir(path)


def makedirs(path: str) -> str:
  """Make the folder ``path`` (and its parents) on process 0; returns ``path``."""
  if hosts.is_main():
    _url(path).mkdir(parents=True, exist_ok=True) if is_url(path) else os.makedirs(path, exist_ok=True)
  return path


def rename(src: str, dst: str) -> None:
  """Move ``src`` (a file or folder) to ``dst`` on process 0."""
  if hosts.is_main():
    _url(src).rename(dst) if is_url(src) else os.replace(src, dst)


def read_bytes(path: str) -> bytes:
  if is_url(path):
    return _url(path).read_bytes()
  with open(path, "rb") as f:
    return f.read()


def read_text(path: str) -> str:
  return read_bytes(path).decode("utf-8")


def load_npy(path: str) -> np.ndarray:
  return np.load(io.BytesIO(read_bytes(path)))


_UMASK = os.umask(0o022)
os.umask(_UMASK)


def write_bytes(path: str, data: bytes) -> str:
  """Write ``data`` to ``path`` atomically (mode 0666 less the umask, as ``open`` would); returns ``path``.
  Nothing is written on a process other than 0."""
  if not hosts.is_main():
    return path
  if is_url(path):
    _url(path).write_bytes(data)  # one object, whole (GCS has no folders to make first)
    return path
  folder = os.path.dirname(os.path.abspath(path))
  os.makedirs(folder, exist_ok=True)
  fd, tmp = tempfile.mkstemp(dir=folder, prefix="." + os.path.basename(path) + ".", suffix=".tmp")
  try:
    with os.fdopen(fd, "wb") as f:
      f.write(data)
    os.chmod(tmp, 0o666 & ~_UMASK)
    os.replace(tmp, path)
  except BaseException:
    if os.path.exists(tmp):
      os.remove(tmp)
    raise
  return path


def write_text(path: str, text: str) -> str:
  return write_bytes(path, text.encode("utf-8"))


def write_json(path: str, obj, indent: int | None = 1) -> str:
  return write_text(path, json.dumps(obj, indent=indent) + "\n")


def write_jsonl(path: str, rows: list[dict]) -> str:
  return write_text(path, "".join(json.dumps(r) + "\n" for r in rows))


def save_npy(path: str, array: np.ndarray) -> str:
  buf = io.BytesIO()
  np.save(buf, np.asarray(array))
  return write_bytes(path, buf.getvalue())


def save_image(path: str, image) -> str:
  """A PIL image as PNG, atomically."""
  buf = io.BytesIO()
  image.save(buf, format="PNG")
  return write_bytes(path, buf.getvalue())


def save_figure(path: str, fig, dpi: int = 120) -> str:
  """A matplotlib figure as PNG, atomically."""
  buf = io.BytesIO()
  fig.savefig(buf, format="png", dpi=dpi)
  return write_bytes(path, buf.getvalue())


def read_json(path: str):
  """The JSON at ``path``, or None (with one warning) when it is missing or damaged (a derived file the caller
  recomputes)."""
  if not exists(path):
    return None
  try:
    return json.loads(read_text(path))
  except (ValueError, UnicodeDecodeError):
    logging.warning("%s is damaged (not valid JSON); it is recomputed.", path)
    return None


def read_jsonl(path: str) -> list[dict]:
  """The rows of ``path`` (none when missing); damaged lines (e.g. a line cut by a kill) are dropped with one
  warning."""
  if not exists(path):
    return []
  rows, bad = [], 0
  for line in read_bytes(path).decode("utf-8", errors="replace").splitlines():
    if not line.strip():
      continue
    try:
      row = json.loads(line)
    except ValueError:
      bad += 1
      continue
    if isinstance(row, dict):
      rows.append(row)
    else:
      bad += 1
  if bad:
    logging.warning("%s: %d damaged line(s) dropped.", path, bad)
  return rows
