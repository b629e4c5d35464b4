"""``python -m margrpo_jax.main`` with every file this process opens for writing (or renames, or makes a folder
of) under ``$AUDIT_ROOT`` recorded, one path a line, in ``$AUDIT_OUT`` at exit. Python-level writes only: Orbax's
array data and TFDS's records are written by C++ (tensorstore, tf.io.gfile) and are not seen.

    AUDIT_ROOT=W AUDIT_OUT=F python tests/audited_main.py --config=... --workdir=W
"""
import atexit
import os
import runpy
import sys

ROOT = os.path.realpath(os.environ["AUDIT_ROOT"])
SEEN: list[str] = []
WRITE = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC


def _record(path) -> None:
  if isinstance(path, (str, bytes, os.PathLike)):
    p = os.path.realpath(os.fsdecode(path))
    if p == ROOT or p.startswith(ROOT + os.sep):
      SEEN.append(os.path.relpath(p, ROOT))


def _hook(event: str, args) -> None:
  if event == "open":
    path, mode, flags = args
    if (isinstance(mode, str) and any(c in mode for c in "wax+")) or (mode is None and flags & WRITE):
      _record(path)
  elif event in ("os.rename", "os.replace"):
    _record(args[1])
  elif event == "os.mkdir":
    _record(args[0])


def _dump() -> None:
  with open(os.environ["AUDIT_OUT"], "w") as f:
    f.write("".join(p + "\n" for p in SEEN))


if __name__ == "__main__":
  atexit.register(_dump)
  sys.addaudithook(_hook)
  sys.argv[0] = "margrpo_jax.main"
  runpy.run_module("margrpo_jax.main", run_name="__main__")
