"""Entry point: ``python -m margrpo_jax.main --config=configs/NAME.py[:arg] --workdir=DIR [--config.k=v]``.

Dispatches on ``config.mode``. Every error a user can cause ends in one sentence naming the file, key or
value, and a non-zero exit; nothing already saved is touched.
"""
from __future__ import annotations

import importlib
import logging as std_logging
import re

from absl import app, flags, logging
from ml_collections import config_flags

from margrpo_jax import cli
from margrpo_jax.errors import UserError

_CONFIG = config_flags.DEFINE_config_file("config", None, "Path to a config file, optionally :arg.", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints, logs and outputs.")
_ALLOW_CHANGES = flags.DEFINE_bool(
    "allow_changes", False, "Resume a workdir whose run was started with another value of a key that only extends "
    "it or changes how it runs (num_iters / num_steps, save and log intervals, eval.batch_size, data dirs, "
    "parallel.*); every other difference is refused.")
# config.mode -> the module whose run(config, workdir) does the job
JOBS = {"pretrain": "margrpo_jax.jobs.pretrain", "sample": "margrpo_jax.jobs.sample", "rl": "margrpo_jax.jobs.rl",
        "ablation": "margrpo_jax.jobs.ablation", "plan": "margrpo_jax.jobs.plan", "export": "margrpo_jax.jobs.export",
        "eval": "margrpo_jax.jobs.eval", "tokenizer": "margrpo_jax.jobs.tokenizer"}
MODES = tuple(JOBS)
LOCKED = ("rl", "pretrain", "tokenizer", "ablation")  # modes that own their workdir while they run (W/.lock)


def user_errors() -> tuple[type[Exception], ...]:
  """The exceptions that carry a user's mistake as one sentence (``error: ...``, exit code 2): every module's
  own derives from :class:`errors.UserError`; a missing file is the operating system's."""
  return (UserError, FileNotFoundError)


def prepare(config, workdir: str):
  """Every check of ``config`` for its mode, before anything is loaded or written: ``validate.check`` (every value
  and combination), then the job's own ``check`` (e.g. the ablation job validates each of its runs' configs).
  Returns ``(job module, resolved)``: what the checks built for the job to run from (the RL step's
  :class:`step.StepConfig`; None for the other modes), so the run uses the very object that was checked. Raises
  one of :func:`user_errors`."""
  from margrpo_jax import validate
  if config.mode not in JOBS:
    raise UserError(f"config.mode={config.mode!r} is not one of {', '.join(MODES)}.")
  job = importlib.import_module(JOBS[config.mode])
  resolved = validate.check(config, workdir)
  if hasattr(job, "check"):
    job.check(config)
  return job, resolved


def _dispatch(config, workdir: str, allow_changes: bool = False):
  """Validate the whole config (:func:`prepare`), make sure a rerun is the same run, then run the job."""
  from margrpo_jax import validate, workdir_lock
  from margrpo_jax.parallel import hosts
  job, resolved = prepare(config, workdir)
  lock = workdir_lock.acquire(workdir) if config.mode in LOCKED and hosts.is_main() else None
  try:
    if config.mode in validate.RESUMABLE:
      validate.begin_run(config, workdir, allow_changes)
    job.run(config, workdir, **({} if resolved is None else {"resolved": resolved}))
  finally:
    workdir_lock.release(lock)


class _QuietOrbax:
  """Drops Orbax's per-save INFO chatter from the log (warnings and errors still show)."""

  def filter(self, record):
    return record.levelno >= std_logging.WARNING or "orbax" not in record.pathname


def main(argv):
  logging.get_absl_handler().python_handler.addFilter(_QuietOrbax())  # ABSLHandler skips its own filters
  cli.check_args(argv, {})
  if not (_WORKDIR.value or "").strip():
    cli.fail("--workdir is required and must not be empty (the directory for checkpoints, logs and outputs).")
  from margrpo_jax import fileio
  try:
    fileio.check_scheme(_WORKDIR.value, "--workdir")
  except fileio.UnsupportedPath as e:
    cli.fail(cli.sentence(e))
  try:
    config = _CONFIG.value
    _ = config.mode  # the flag defers load errors to the first attribute access
  except Exception as e:  # noqa: BLE001 - a config file that is missing or raises
    detail = [l.strip() for l in str(e).splitlines() if l.strip()][-1]
    cli.fail(f"--config could not be loaded: {detail}.")
  import jax
  jax.config.update("jax_threefry_partitionable", True)
  from margrpo_jax import checkpoint, interrupt
  from margrpo_jax.parallel import mesh
  if "parallel" in config:
    try:
      mesh.initialize(config.parallel)  # multi-host: before anything touches the devices
    except mesh.CoordinatorError as e:
      cli.fail(cli.sentence(e))
  interrupt.install()  # SIGTERM / SIGINT: a checkpoint and one line, never a traceback
  try:
    _dispatch(config, fileio.resolve(_WORKDIR.value), _ALLOW_CHANGES.value)
  except user_errors() as e:
    cli.fail(cli.sentence(e))
  except checkpoint.NonFiniteError as e:  # not the user's doing, but one sentence all the same
    cli.fail(cli.sentence(e), code=1)
  except checkpoint.StorageError as e:
    cli.fail(cli.sentence(e.strerror), code=1, hard=True)
  except OSError as e:  # disk full, read-only or vanished folders: nothing already saved is touched
    where = f" {e.filename}" if e.filename else ""
    cli.fail(f"writing or reading{where} failed: {e.strerror or e}; files already saved are untouched.", code=1,
             hard=True)


def parse_flags(argv: list[str]) -> list[str]:
  """absl flag parsing that turns every config / flag mistake into one sentence and exit code 2."""
  overrides = [a for a in argv[1:] if a.startswith("--config.")]
  try:
    return flags.FLAGS(argv)
  except (AttributeError, KeyError) as e:
    from margrpo_jax import validate
    found = re.search(r"'(\w+)", str(e))
    name = found.group(1) if found else str(e)
    bad = [a for a in overrides if re.search(rf"\b{re.escape(name)}\b", a.split("=")[0])] or overrides
    hint = re.search(r'Did you mean "([^"]+)"', str(e))
    flag = bad[0].split("=")[0] if bad else "--config"
    moved = validate.RENAMED_KEYS.get(flag[len("--config."):])
    tail = f" (it moved: --config.{moved})." if moved else f" (did you mean {hint.group(1)!r}?)." if hint else "."
    cli.fail(f"{flag} names a key {name!r} that the config does not have{tail}")
  except flags.Error as e:
    cli.fail(cli.flag_error(e))
  except Exception as e:  # noqa: BLE001 - config files are user code: report, don't trace
    cfg = next((a for a in argv[1:] if a.startswith("--config=")), "--config")
    cli.fail(f"{cfg} could not be loaded: {str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__}.")


def run():
  flags.mark_flags_as_required(["config"])
  app.run(main, flags_parser=parse_flags)


if __name__ == "__main__":
  run()
