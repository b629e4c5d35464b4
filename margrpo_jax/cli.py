"""What every command-line entry shares (``main``, ``convert``, ``export_official``): a mistake ends in one sentence
on stderr (``error: ...``) and exit code 2, never a traceback; flag errors are reported the same way."""
from __future__ import annotations

import os
import sys

from absl import flags


def sentence(e) -> str:
  """``e`` (an exception or a message) as one sentence: whitespace folded, quotes stripped, a final full stop."""
  msg = " ".join(str(e).split()).strip("'\"")
  return msg if msg.endswith((".", "?", "!")) else msg + "."


def fail(msg: str, code: int = 2, hard: bool = False):
  """Print the one sentence and exit; ``hard``: without interpreter shutdown, whose clean-up would report every
  background save that the failure cut short (hundreds of tracebacks)."""
  print(f"error: {msg}", file=sys.stderr)
  if hard:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
  sys.exit(code)


def flag_error(e: flags.Error) -> str:
  """absl's report of a flag mistake (unknown flag, bad value) as one sentence."""
  if isinstance(e, flags.IllegalFlagValueError):
    lines = [l.strip() for l in str(e).replace("flag --", "--").splitlines() if l.strip()]
    return sentence(lines[0] if len(lines) == 1 else f"{lines[0]} {lines[-1]}")
  return str(e).split("\n")[0].rstrip(".") + "."


def parse_flags(argv: list[str]) -> list[str]:
  """absl flag parsing with every flag mistake as one sentence and exit code 2 (``app.run(flags_parser=)``)."""
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:
    fail(flag_error(e))


def check_args(argv: list[str], required: dict) -> None:
  """No stray positional arguments; every flag of ``required`` (name -> FlagHolder) given and non-empty."""
  if len(argv) > 1:
    fail(f"unexpected arguments: {' '.join(argv[1:])} (every option is a --flag=value).")
  for name, holder in required.items():
    if not (holder.value or "").strip():
      fail(f"--{name} is required and must not be empty.")


def check_new_output(path: str, flag: str = "--out") -> str:
  """``path`` (absolute) for a new output: it must not exist yet (nothing already saved is overwritten) and its
  folder must exist and be writable. Local paths only; a gs:// path is returned as is."""
  if path.startswith("gs://"):
    return path
  path = os.path.abspath(os.path.expanduser(path))
  if os.path.exists(path) and not (os.path.isdir(path) and not os.listdir(path)):
    fail(f"{flag}={path} already exists; choose a new path or remove it (nothing is overwritten).")
  parent = os.path.dirname(path.rstrip("/")) or "."
  while not os.path.exists(parent) and parent != os.path.dirname(parent):
    parent = os.path.dirname(parent)
  if not os.access(parent, os.W_OK | os.X_OK):
    fail(f"{flag}={path} cannot be written: the folder {parent} is not writable.")
  return path
