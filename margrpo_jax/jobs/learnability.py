r"""The learnability ladder: can an RL variant move a reward at all, and by more than a control without signal?

For each (reward, variant): the RL loop of ``configs/shapes_rl.py:VARIANT`` optimises that reward alone for
``iters`` iterations from the same base, prompts and seeds; the reward is measured before and after on fixed
eval prompts with a fixed sampling seed, so every image is paired:

    d_n = r_n(after) - r_n(before),   z = mean(d) / (std(d) / sqrt(N))

A control run permutes the advantages inside each group (``rl.shuffle_advantages``): the same rollouts' noise,
no reward information. A variant that learns has ``z`` well above the control's.

``benchmarks/learnability.py`` runs the ladder (brightness, JPEG compressibility, strict pass) and prints a table
and one JSON line; ``tests/test_learnability.py`` runs its first rung in CI.
"""
from __future__ import annotations

import time

import ml_collections
import numpy as np
from absl import logging

from margrpo_jax import config_files, generate
from margrpo_jax.rewards import registry
from margrpo_jax.rl.config import resolve_fidelity
from margrpo_jax.jobs import rl as rl_job
from margrpo_jax.rl import prompts as rl_prompts


def rl_config(variant: str, reward: str, iters: int, overrides: dict | None = None) -> ml_collections.ConfigDict:
  """``shapes_rl:VARIANT`` optimising ``reward`` alone for ``iters`` iterations, then ``overrides`` (nested dict)."""
  c = config_files.load("shapes_rl", variant)
  c.rl.rewards.update({k: 0.0 for k in c.rl.rewards})
  c.rl.rewards[reward] = 1.0
  c.num_iters = iters
  c.update(overrides or {})
  resolve_fidelity(c)  # e.g. the paper preset: the official switches, as the entry point writes them
  return c


def eval_rewards(config, s: rl_job.Setup, params: dict, recs: list[dict], reward: str) -> np.ndarray:
  """Per-image ``reward`` (N,) of the model ``params`` (``s.params``, the base, or ``s.trained_params(state)``) on
  ``recs``' prompts, sampled with ``config.eval.seed``."""
  images = generate.generate(s.graphdef, params, s.model_cfg, [r["prompt"] for r in recs],
                             config.sampling, seed=config.eval.seed, batch_size=config.eval.batch_size)
  return np.asarray(registry.REWARDS[reward](images, recs), np.float64)


def paired(before: np.ndarray, after: np.ndarray) -> dict:
  """Means before / after and the paired ``z`` of the difference."""
  d = after - before
  se = float(np.std(d, ddof=1) / np.sqrt(len(d))) if len(d) > 1 else float("nan")
  return dict(before=float(before.mean()), after=float(after.mean()), se=se,
              z=float(d.mean() / se) if se > 0 else 0.0)


def run_one(config, train_recs: list[dict], eval_recs: list[dict], reward: str, before: np.ndarray | None = None,
            setup: rl_job.Setup | None = None) -> dict:
  """``config.num_iters`` RL iterations from the base, then the paired before / after figures (``before``: the
  base's per-image rewards, if already measured on the same prompts and seed). Compiled functions are shared by
  every run with the same static configuration (the control reuses its variant's). ``after_rewards``: the
  per-image rewards after training, to pair with another run's."""
  s = setup or rl_job.setup(config)
  train_recs = rl_prompts.from_metadata(train_recs)  # shapes-world metadata -> the RL job's prompt records
  if before is None:
    before = eval_rewards(config, s, s.params, eval_recs, reward)
  state = s.init_state()
  t0, history = time.time(), []
  for it in range(config.num_iters):
    state, m, _ = rl_job.iteration(config, s, state, train_recs, it)
    if m is not None:
      history.append(m["reward"])
  after = eval_rewards(config, s, s.trained_params(state), eval_recs, reward)
  out = dict(paired(before, after), seconds=time.time() - t0, rollout_reward=history, after_rewards=after)
  logging.info("%s / %s%s: %.4f -> %.4f (z %+.1f, %.0f s)", reward, config.variant,
               " (shuffled)" if config.rl.shuffle_advantages else "", out["before"], out["after"], out["z"],
               out["seconds"])
  return out
