"""Files the jobs rewrite, written atomically (a temp file in the same folder, then ``os.replace``).

A job killed mid-write, or a full disk, leaves the previous version of the file intact; readers of files a run
appends to (``metrics.jsonl``) or derives (``base_eval.json``) tolerate a damaged copy with one warning.
"""
from __future__ import annotations

import io
import json
import os
import tempfile

import numpy as np
from absl import logging


_UMASK = os.umask(0o022)
os.umask(_UMASK)


def write_bytes(path: str, data: bytes) -> str:
  """Write ``data`` to ``path`` atomically (mode 0666 less the umask, as ``open`` would); returns ``path``."""
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
  if not os.path.exists(path):
    return None
  try:
    with open(path) as f:
      return json.load(f)
  except (ValueError, UnicodeDecodeError):
    logging.warning("%s is damaged (not valid JSON); it is recomputed.", path)
    return None


def read_jsonl(path: str) -> list[dict]:
  """The rows of ``path`` (none when missing); damaged lines (e.g. a line cut by a kill) are dropped with one
  warning."""
  if not os.path.exists(path):
    return []
  rows, bad = [], 0
  with open(path, errors="replace") as f:
    for line in f:
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
