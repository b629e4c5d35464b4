"""The ablation experiment (``config.mode = 'ablation'``): every variant of ``configs/shapes_rl.py`` over several
seeds, then one markdown table and one plot.

Each (variant, seed) is an ordinary RL run in ``W/<variant>/seed<n>`` (resumable: rerunning the command skips
finished runs and resumes a killed one). ``W/ablation.md`` tabulates, per variant and every ``table_every``
iterations, the rollout strict pass rate, reward (the configured weighted sum), group diversity (std of the
reward inside a group) and gradient norm as mean +- std over seeds, then the base and final strict pass on the eval prompts;
``W/ablation.png`` plots the same curves (trailing 5-iteration means; mean over seeds, band = min..max).
``W/ablation.json`` has all of it. Seed ``n`` draws the same prompts at each iteration in every variant with the
same prompts per iteration, so the table also gives each variant's rollout strict pass minus the first variant's,
paired by seed (over the iterations both ran).
"""
from __future__ import annotations

import json
import os

import numpy as np
from absl import logging

from margrpo_jax import config_files, fileio, validate
from margrpo_jax.jobs import rl as rl_job
from margrpo_jax.rl import config as rl_config

CURVES = (("strict_pass", "strict pass (rollouts)"), ("reward", "reward (weighted sum)"),
          ("group_diversity", "group diversity (reward std)"), ("grad_norm", "gradient norm"))


def check(config) -> None:
  """Every run of the experiment validated (one sentence naming the variant and key), before anything runs."""
  parse(config)


def parse(config, workdir: str = "") -> list[tuple[str, int, object, str, object]]:
  """``[(variant, seed, rl config, run workdir, its step config)]`` of the experiment, every run's config validated
  (one sentence naming the variant for the first that cannot work)."""
  rl_path = config.rl_config or "shapes_rl"
  try:
    seeds = [int(s) for s in str(config.seeds).split(",") if s.strip()]
  except ValueError:
    raise config_files.ConfigError(f"seeds={config.seeds!r} is not a comma-separated list of integers") from None
  bad = [s for s in seeds if not 0 <= s <= validate.MAX_SEED]
  if bad:
    raise config_files.ConfigError(f"seeds={config.seeds!r} names {bad[0]}, not a seed in [0, {validate.MAX_SEED}]")
  variants = [v.strip() for v in config.variants.split(",") if v.strip()]
  if not seeds or not variants:
    raise config_files.ConfigError(f"seeds={config.seeds!r} and variants={config.variants!r} must each name at "
                                   "least one")
  flat = validate.flatten(config.overrides.to_dict())
  out = []
  for variant in variants:
    for seed in seeds:
      try:
        c = config_files.load(rl_path, variant + (",smoke" if config.smoke else ""))
        c.update_from_flattened_dict(dict(flat, seed=seed, checkpoint=config.checkpoint,
                                          tfds_dir=config.tfds_dir or os.path.join(workdir, "tfds")))
        rl_config.resolve_fidelity(c)
        validate.check_values(c)
        static = validate.check_rl(c)
      except (config_files.ConfigError, ValueError, KeyError, AttributeError, TypeError) as e:
        msg = str(e).strip().strip("'\"").rstrip(".")
        raise config_files.ConfigError(f"ablation variant {variant!r} (seed {seed}, {rl_path}): {msg}") from None
      out.append((variant, seed, c, os.path.join(workdir, variant, f"seed{seed}"), static))
  return out


def run(config, workdir: str) -> dict:
  results = {}
  for variant, seed, c, wd, static in parse(config, workdir):
    if not fileio.exists(os.path.join(wd, "report.json")):
      logging.info("ablation: %s seed %d -> %s", variant, seed, wd)
      rl_job.run(c, wd, resolved=static)
    rep = json.loads(fileio.read_text(os.path.join(wd, "report.json")))
    results.setdefault(variant, []).append(dict(seed=seed, history=fileio.read_jsonl(os.path.join(wd, "metrics.jsonl")),
                                                report=rep, prompts=(c.rl.prompts_per_iter, c.rl.group_size)))
  fileio.write_json(os.path.join(workdir, "ablation.json"), results, indent=None)
  _table(workdir, results, config.table_every)
  _plot(workdir, results)
  return results


def _curve(runs, key):
  n = min(len(r["history"]) for r in runs)
  return np.array([[h.get(key, np.nan) for h in r["history"][:n]] for r in runs])  # (seeds, iters)


def _table(workdir, results, every):
  lines = ["# Ablation: MAR-GRPO stabilisers on the shapes world", "",
           "Rollout metrics, mean +- std over seeds, averaged over the `table_every` iterations up to the row's "
           "iteration.", ""]
  for variant, runs in results.items():
    lines += [f"## {variant} ({len(runs)} seeds)", "",
              "| iteration | " + " | ".join(label for _, label in CURVES) + " |", "|---" * (len(CURVES) + 1) + "|"]
    n = _curve(runs, "reward").shape[1]
    for end in list(range(every, n + 1, every)) or [n]:
      cells = []
      for key, _ in CURVES:
        v = np.nanmean(_curve(runs, key)[:, end - every:end], axis=1)
        cells.append(f"{v.mean():.3f} +- {v.std():.3f}")
      lines.append(f"| {end} | " + " | ".join(cells) + " |")
    base = [r["report"]["base"]["strict_pass"] for r in runs]
    final = [r["report"]["final"]["strict_pass"] for r in runs]
    lines += ["", f"Eval strict pass ({runs[0]['report']['eval_prompts']} prompts): base {np.mean(base):.3f}, "
              f"final {np.mean(final):.3f} +- {np.std(final):.3f} (per seed: "
              + ", ".join(f"{x:.3f}" for x in final) + ")", ""]
  names = list(results)
  for variant in names[1:]:  # paired by seed: same seeds, so the same prompts at each iteration where settings agree
    first, runs = results[names[0]], results[variant]
    if [(r["seed"], r.get("prompts")) for r in first] != [(r["seed"], r.get("prompts")) for r in runs]:
      continue  # other seeds or other prompts per iteration: nothing to pair
    a, b = _curve(runs, "strict_pass"), _curve(first, "strict_pass")
    n = min(a.shape[1], b.shape[1])
    d = a[:, :n] - b[:, :n]
    lines += [f"## {variant} minus {names[0]}, rollout strict pass paired by seed", "",
              "| iteration | strict pass difference |", "|---|---|"]
    for end in list(range(every, n + 1, every)) or [n]:
      v = np.nanmean(d[:, end - every:end], axis=1)
      lines.append(f"| {end} | {v.mean():+.3f} +- {v.std():.3f} |")
    lines.append("")
  fileio.write_text(os.path.join(workdir, "ablation.md"), "\n".join(lines) + "\n")


def _smooth(c, window: int):
  """Trailing mean over up to ``window`` iterations of each row of ``c`` (seeds, iters)."""
  if window <= 1:
    return c
  cs = np.nancumsum(np.pad(c, ((0, 0), (1, 0))), axis=1)
  lo = np.maximum(np.arange(1, c.shape[1] + 1) - window, 0)
  return (cs[:, 1:] - cs[:, lo]) / (np.arange(1, c.shape[1] + 1) - lo)


def _plot(workdir, results, smooth: int = 5):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, axes = plt.subplots(1, len(CURVES), figsize=(4 * len(CURVES), 3.2))
  for variant, runs in results.items():
    for ax, (key, label) in zip(axes, CURVES):
      c = _smooth(_curve(runs, key), smooth)
      it = np.arange(1, c.shape[1] + 1)
      ax.plot(it, np.nanmean(c, 0), label=variant)
      ax.fill_between(it, np.nanmin(c, 0), np.nanmax(c, 0), alpha=0.2)
      ax.set(xlabel="iteration", title=label + (f" ({smooth}-iter. mean)" if smooth > 1 else ""))
  axes[0].legend(fontsize=7)
  fig.tight_layout()
  fileio.save_figure(os.path.join(workdir, "ablation.png"), fig)
  plt.close(fig)
