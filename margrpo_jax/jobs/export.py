"""Params-only export of a run's latest checkpoint (``config.mode = 'export'``).

``python -m margrpo_jax.main --config=<the run's config> --config.mode=export --workdir=<the run's workdir>
[--config.export.dtype=bfloat16] [--config.export.dir=D]`` writes ``D`` (default ``<workdir>/export``): an
Orbax params checkpoint and ``model.json``, which ``configs/shapes_sample.py --config.checkpoint=D`` loads.
RL runs export the policy merged with the frozen parts; pretraining runs export the EMA parameters.
"""
from __future__ import annotations

import os

from margrpo_jax import checkpoint
from margrpo_jax.jobs import pretrain, rl as rl_job
from margrpo_jax.models.precision import DTYPES


def run(config, workdir: str) -> str:
  if config.export.dtype not in DTYPES:
    raise checkpoint.CheckpointError(f"export.dtype={config.export.dtype!r} is not one of {', '.join(DTYPES)}.")
  mngr = checkpoint.manager(os.path.join(workdir, "checkpoints"), keep=1_000_000)
  if mngr.latest_step() is None:
    raise checkpoint.CheckpointError(f"{mngr.directory} holds no checkpoint to export (run the job there first).")
  if "rl" in config:
    s = rl_job.setup(config, workdir=workdir)
    _, state = checkpoint.restore_latest(mngr, s.init_state())
    params, model_cfg = s.trained_params(state), s.model_cfg
    source = checkpoint.official_source(rl_job.base_checkpoint(config, workdir))
  else:
    _, _, state = pretrain.init_state(config)
    _, state = checkpoint.restore_latest(mngr, state)
    params, model_cfg, source = state["ema"], config.model, None
  out = checkpoint.save_model(config.export.dir or os.path.join(workdir, "export"), params, model_cfg,
                              DTYPES[config.export.dtype], source=source)
  print(f"exported step {mngr.latest_step()} of {workdir} to {out} ({config.export.dtype})", flush=True)
  return out
