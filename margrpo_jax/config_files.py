"""Loading ``configs/NAME.py[:arg]`` files outside absl flags (jobs that run other configs, benchmarks, tests)."""
from __future__ import annotations

import importlib.util
import os

import ml_collections

# The repository's configs/ folder (the package is installed editable, next to it).
CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")


def load(path: str, arg: str | None = None) -> ml_collections.ConfigDict:
  """``get_config(arg)`` of a config file; a bare name like ``'shapes_rl'`` means ``configs/shapes_rl.py``."""
  if os.sep not in path and not path.endswith(".py"):
    path = os.path.join(CONFIGS, path + ".py")
  spec = importlib.util.spec_from_file_location(os.path.splitext(os.path.basename(path))[0], path)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod.get_config(arg) if arg is not None else mod.get_config()
