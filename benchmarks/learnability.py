r"""The learnability ladder: which rewards can each RL variant move from the shipped base, above a control?

python benchmarks/learnability.py [--rewards=brightness,jpeg_compressibility,shapes_strict]
    [--variants=grpo,margrpo,focused] [--iters=12] [--seeds=0] [--eval_prompts=64] [--no_control]
    [--set optim.lr=1e-4 --set sampling.num_steps=16 ...]

For every reward, variant and seed: ``iters`` RL iterations optimising that reward alone (same prompts and seeds
for every variant), then the reward on ``eval_prompts`` fixed eval prompts (stratified over the four tasks, a
fixed sampling seed) before and after, paired per image: ``z = mean(after - before) / se``. The control
(``rl.shuffle_advantages``: advantages permuted inside each group) runs with the same seeds; ``gap_z`` compares
the variant's images after training with the control's (paired). Prints a table, then one JSON line
``{"<reward>/<variant>": {"before": x, "after": y, "z": ..., "control_after": ..., "gap_z": ...}, ...}``
(means over seeds; per-seed figures under ``"seeds"``).
"""
import argparse
import json
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from margrpo_jax import config_files  # noqa: E402
from margrpo_jax.data import shapes  # noqa: E402
from margrpo_jax.jobs import learnability as L  # noqa: E402
from margrpo_jax.jobs import rl as rl_job  # noqa: E402

DEFAULT_SETTINGS = ("sampling.num_steps=8", "rl.prompts_per_iter=4", "rl.group_size=4", "optim.lr=0.0003",
                    "eval.batch_size=32")


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--rewards", default="brightness,jpeg_compressibility,shapes_strict")
  ap.add_argument("--variants", default="grpo,margrpo,focused")
  ap.add_argument("--iters", type=int, default=12)
  ap.add_argument("--seeds", default="0")
  ap.add_argument("--eval_prompts", type=int, default=64)
  ap.add_argument("--no_control", action="store_true")
  ap.add_argument("--set", action="append", default=[],
                  help=f"config override block.key=value (repeatable; applied after {' '.join(DEFAULT_SETTINGS)})")
  args = ap.parse_args()
  jax.config.update("jax_threefry_partitionable", True)
  train_recs = shapes.split_records("train", num_train=2000)
  ev = shapes.split_records("eval")  # task-major, 128 per task: a stride gives each task the same share
  eval_recs = [ev[i] for i in np.linspace(0, len(ev) - 1, args.eval_prompts).round().astype(int)]
  results, t0 = {}, time.time()
  print("| reward | variant | seed | before | after | z | control after | control z | gap z | min |")
  print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
  for reward in args.rewards.split(","):
    before = None
    for variant in args.variants.split(","):
      for seed in map(int, args.seeds.split(",")):
        c = L.rl_config(variant, reward, args.iters, dict(seed=seed))
        for a in DEFAULT_SETTINGS + tuple(args.set):
          config_files.override(c, a)
        s = rl_job.setup(c)
        before = L.eval_rewards(c, s, s.params, eval_recs, reward) if before is None else before
        t1 = time.time()
        row = L.run_one(c, train_recs, eval_recs, reward, before, s)
        after = row.pop("after_rewards")
        if not args.no_control:
          c.rl.shuffle_advantages = True
          ctrl = L.run_one(c, train_recs, eval_recs, reward, before, s)
          row.update(control_after=ctrl["after"], control_z=ctrl["z"],
                     gap_z=L.paired(ctrl["after_rewards"], after)["z"])
        results.setdefault(f"{reward}/{variant}", []).append(dict(seed=seed, **row))
        ctrl_cols = (f"{row['control_after']:.4f} | {row['control_z']:+.1f} | {row['gap_z']:+.1f}"
                     if "gap_z" in row else "- | - | -")
        print(f"| {reward} | {variant} | {seed} | {row['before']:.4f} | {row['after']:.4f} | {row['z']:+.1f} | "
              f"{ctrl_cols} | {(time.time() - t1) / 60:.1f} |", flush=True)
  summary = {}
  for name, rows in results.items():
    mean = lambda k: float(np.mean([r[k] for r in rows])) if k in rows[0] else None
    summary[name] = {k: mean(k) for k in ("before", "after", "z", "control_after", "control_z", "gap_z")
                     if k in rows[0]}
    summary[name]["seeds"] = [{k: v for k, v in r.items() if k != "rollout_reward"} for r in rows]
  print(f"total {(time.time() - t0) / 60:.1f} min; settings: {' '.join(DEFAULT_SETTINGS + tuple(args.set))}")
  print(json.dumps(summary))


if __name__ == "__main__":
  main()
