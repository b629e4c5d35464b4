"""Readers for user-supplied prompt files (GenEval, T2I-CompBench, MAR-GRPO, shapes world).

Every reader returns records ``{"prompt": str, "tag": str, "metadata": dict}`` in file order, one per
non-blank line. Formats:

* ``jsonl``: one JSON object per line with a non-empty string ``"prompt"`` (GenEval metadata,
  MAR-GRPO's ``train_prompts.jsonl`` / ``geneval_and_t2i_data_final.json``, shapes-world metadata).
  ``tag`` comes from ``"tag"``, else ``"task_type"``, else the shapes-world task when the prompt
  parses as one, else ``''``. ``metadata`` is the JSON object itself, except that a line without
  ``"include"`` whose prompt parses as a shapes-world prompt gets the parsed shapes metadata.
  Lines that do carry ``"include"`` and look like shapes-world metadata are validated with
  ``shapes.validate_metadata``.
* ``txt``: one prompt per line (surrounding whitespace stripped); ``tag`` is the file stem
  (the T2I-CompBench category); ``metadata`` is the parsed shapes metadata when the prompt is a
  shapes-world prompt, else ``{"prompt": text}``.
* ``auto``: ``.jsonl``/``.json`` -> jsonl, ``.txt`` -> txt, anything else: jsonl when the first
  non-blank line starts with ``{``, else txt.

Files are read as UTF-8 (a BOM is ignored); ``\\n``, ``\\r\\n`` and ``\\r`` line ends are accepted.
"""

from __future__ import annotations

import fnmatch
import json
import os
from typing import Any

from margrpo_jax import fileio
from margrpo_jax.errors import UserError
from margrpo_jax.data import shapes

__all__ = ["PromptFileError", "FORMATS", "read_prompt_file", "read_prompt_dir", "prompt_dir_files"]

FORMATS = ("auto", "jsonl", "txt")


class PromptFileError(UserError, ValueError):
  """A prompt file is missing, empty or malformed; the message names the file and line."""


def _err(path, what: str, line: int | None = None) -> PromptFileError:
  where = f"{os.fspath(path)} line {line}" if line is not None else os.fspath(path)
  what = what.rstrip()
  if not what.endswith("."):
    what += "."
  return PromptFileError(f"{where}: {what}")


def _looks_like_shapes_class(cls: Any) -> bool:
  words = cls.split() if isinstance(cls, str) else ()
  return len(words) == 2 and words[0] in shapes.COLORS and words[1] in shapes.SHAPES


def _is_shapes_metadata(obj: dict, parsed: dict | None) -> bool:
  """Whether a JSON object carrying "include" is meant as shapes-world metadata.

  GenEval reuses some task names (single_object, two_object, counting, position), so the tag
  alone is not enough: the record must also have a top-level "position" key (GenEval puts
  positions inside include entries), a prompt that parses as a shapes-world prompt, or
  shapes-world classes ("<colour> <shape>").
  """
  if obj.get("tag") not in shapes.TASKS:
    return False
  if "position" in obj or parsed is not None:
    return True
  include = obj.get("include")
  if isinstance(include, list):
    return any(isinstance(e, dict) and _looks_like_shapes_class(e.get("class")) for e in include)
  return False


def _read_lines(path: str) -> list[tuple[int, str]]:
  """(1-based line number, text) for every non-blank line; raises PromptFileError."""
  if not fileio.exists(path):
    raise _err(path, "file does not exist")
  if fileio.isdir(path):
    raise _err(path, "is a directory, not a file (use read_prompt_dir)")
  data = fileio.read_bytes(path)
  try:
    text = data.decode("utf-8-sig")
  except UnicodeDecodeError as e:
    line = data[: e.start].count(b"\n") + 1
    raise _err(path, f"not valid UTF-8 text (byte 0x{data[e.start]:02x})", line) from None
  text = text.replace("\r\n", "\n").replace("\r", "\n")
  lines = [(i + 1, s) for i, s in enumerate(text.split("\n")) if s.strip()]
  if not lines:
    raise _err(path, "file is empty")
  return lines


def _resolve_format(path: str, fmt: str, first_line: str) -> str:
  if fmt not in FORMATS:
    raise ValueError(f"unknown prompt file format {fmt!r}; expected one of {FORMATS}")
  if fmt != "auto":
    return fmt
  ext = os.path.splitext(path)[1].lower()
  if ext in (".jsonl", ".json"):
    return "jsonl"
  if ext == ".txt":
    return "txt"
  return "jsonl" if first_line.lstrip().startswith("{") else "txt"


def _jsonl_record(path: str, lineno: int, line: str) -> dict:
  try:
    obj = json.loads(line)
  except json.JSONDecodeError as e:
    raise _err(path, f"not valid JSON ({e.msg} at column {e.colno})", lineno) from None
  if isinstance(obj, list) and lineno == 1:
    raise _err(path, "expected one JSON object per line (JSON Lines) but found a JSON array", lineno)
  if not isinstance(obj, dict):
    raise _err(path, f"expected a JSON object but found {type(obj).__name__}", lineno)
  if "prompt" not in obj:
    raise _err(path, "missing the 'prompt' key", lineno)
  prompt = obj["prompt"]
  if not isinstance(prompt, str) or not prompt.strip():
    raise _err(path, "the 'prompt' value must be a non-empty string", lineno)
  tag = obj.get("tag")
  if tag is None:
    tag = obj.get("task_type")
  if tag is not None and not isinstance(tag, str):
    raise _err(path, f"the tag must be a string, got {type(tag).__name__}", lineno)
  parsed = shapes.parse_prompt(prompt)
  if "include" in obj:
    metadata = obj
    if _is_shapes_metadata(obj, parsed):
      try:
        shapes.validate_metadata(obj)
      except ValueError as e:
        msg = str(e).rstrip(".") or type(e).__name__
        raise _err(path, f"invalid shapes-world metadata ({msg})", lineno) from None
  elif parsed is not None:
    metadata = parsed
    if tag is None:
      tag = parsed.get("tag")
  else:
    metadata = obj
  return {"prompt": prompt, "tag": tag or "", "metadata": metadata}


def _txt_record(path: str, line: str) -> dict:
  prompt = line.strip()
  parsed = shapes.parse_prompt(prompt)
  metadata = parsed if parsed is not None else {"prompt": prompt}
  return {"prompt": prompt, "tag": os.path.splitext(os.path.basename(path))[0], "metadata": metadata}


def read_prompt_file(path, fmt: str = "auto") -> list[dict]:
  """Reads one prompt file into ``[{"prompt", "tag", "metadata"}, ...]`` in file order.

  Args:
    path: the file.
    fmt: 'auto', 'jsonl' or 'txt' (see the module docstring).
  Raises:
    PromptFileError: the file is missing, empty, not UTF-8, or a line is malformed.
    ValueError: unknown ``fmt``.
  """
  if fmt not in FORMATS:
    raise ValueError(f"unknown prompt file format {fmt!r}; expected one of {FORMATS}")
  path = fileio.resolve(path)
  lines = _read_lines(path)
  fmt = _resolve_format(path, fmt, lines[0][1])
  if fmt == "jsonl":
    return [_jsonl_record(path, n, s) for n, s in lines]
  return [_txt_record(path, s) for _, s in lines]


def _default_patterns(fmt: str) -> tuple[str, ...]:
  return {"jsonl": ("*.jsonl", "*.json"), "txt": ("*.txt",)}.get(fmt, ("*.jsonl", "*.json", "*.txt"))


def prompt_dir_files(path, fmt: str = "auto", pattern: str | None = None) -> list[str]:
  """The files ``read_prompt_dir`` would read, sorted by name (not recursive)."""
  if fmt not in FORMATS:
    raise ValueError(f"unknown prompt file format {fmt!r}; expected one of {FORMATS}")
  path = fileio.resolve(path)
  if not fileio.isdir(path):
    raise _err(path, "directory does not exist" if not fileio.exists(path) else "is not a directory")
  patterns = (pattern,) if pattern else _default_patterns(fmt)
  names = [n for n in fileio.listdir(path) if any(fnmatch.fnmatchcase(n, pat) for pat in patterns)]
  files = [f for f in (os.path.join(path, n) for n in sorted(set(names))) if fileio.isfile(f)]
  if not files:
    raise _err(path, f"no prompt files matching {' or '.join(patterns)} in this directory")
  return files


def read_prompt_dir(path, fmt: str = "auto", pattern: str | None = None) -> list[dict]:
  """Reads every prompt file of a directory (e.g. T2I-CompBench's ``*.txt``), sorted by file name.

  Args:
    path: the directory (not searched recursively).
    fmt: format of every file ('auto' decides per file).
    pattern: glob for file names; default ``*.jsonl``/``*.json`` for jsonl, ``*.txt`` for txt,
      all three for auto.
  Returns:
    The concatenated records of all files; with txt files ``tag`` is the file stem.
  """
  records: list[dict] = []
  for f in prompt_dir_files(path, fmt, pattern):
    records.extend(read_prompt_file(f, fmt))
  return records
