"""Entry point: ``python -m margrpo_jax.main --config=configs/NAME.py[:arg] --workdir=DIR [--config.k=v]``.

Dispatches on ``config.mode``. Every error a user can cause ends in one sentence naming the file, key or
value, and a non-zero exit; nothing already saved is touched.
"""
from __future__ import annotations

import os
import sys

from absl import app, flags, logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "Path to a config file, optionally :arg.", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints, logs and outputs.")
MODES = ("pretrain", "sample")


class UserError(Exception):
  """An error with a one-sentence message for the user."""


def _dispatch(config, workdir: str):
  if config.mode == "pretrain":
    from margrpo_jax.jobs import pretrain
    pretrain.run(config, workdir)
  elif config.mode == "sample":
    from margrpo_jax.jobs import sample
    sample.run(config, workdir)
  else:
    raise UserError(f"config.mode={config.mode!r} is not one of {', '.join(MODES)}.")


class _QuietOrbax:
  """Drops Orbax's per-save INFO chatter from the log (warnings and errors still show)."""

  def filter(self, record):
    return record.levelno >= logging.WARNING or "orbax" not in record.pathname


def main(argv):
  logging.get_absl_handler().addFilter(_QuietOrbax())
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  if _WORKDIR.value is None:
    raise app.UsageError("--workdir is required.")
  import jax
  jax.config.update("jax_threefry_partitionable", True)
  from margrpo_jax import checkpoint
  from margrpo_jax.data import prompt_files
  try:
    _dispatch(_CONFIG.value, os.path.abspath(os.path.expanduser(_WORKDIR.value)))
  except (UserError, checkpoint.CheckpointError, prompt_files.PromptFileError, FileNotFoundError) as e:
    logging.error("%s", e)
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)


def run():
  flags.mark_flags_as_required(["config"])
  app.run(main)


if __name__ == "__main__":
  run()
