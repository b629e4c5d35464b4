"""Where the main job's iteration goes: its parts timed one by one, on the README command's settings.

    python benchmarks/main_job_parts.py [--config=configs/shapes_rl.py] [--iters=3] [--tfds_dir=/tmp/shapes_tfds]

For ``--iters`` iterations after one that compiles (each with its own prompts and keys, as the job draws them):
the rollout as the job runs it (``jobs/rl.py: rollout``), then its parts on the same prompts and keys: the jitted
sampler (``Setup.rollout_fn``, every AR and diffusion step with CFG), the tokenizer's decode, each
reward of the rollout (the job computes the zero-weight verifier rewards too, for its logs), the re-encoding of the
images the forward estimators train on, and the whole iteration (``jobs/rl.py: iteration``, which draws the same
rollout again and runs the jitted update; the update's seconds are read from its own ``update_images_per_s``).
Prints the mean seconds of each part and its share of the iteration, then one JSON line. A part's share is
what making it free would save: the bound on any speed-up that leaves the others alone.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import jax
import numpy as np

from margrpo_jax import config_files, rng
from margrpo_jax.jobs import rl as rl_job
from margrpo_jax.models import families
from margrpo_jax.rewards import registry
from margrpo_jax.rl import estimators, prompts as rl_prompts


def clock(fn, *args):
  t0 = time.perf_counter()
  out = jax.block_until_ready(fn(*args))
  return out, time.perf_counter() - t0


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--config", default="configs/shapes_rl.py", help="a config file (its optional ':arg' too)")
  ap.add_argument("--iters", type=int, default=3, help="timed iterations, after one that compiles")
  ap.add_argument("--tfds_dir", default=os.path.join(tempfile.gettempdir(), "shapes_tfds"))
  a = ap.parse_args()
  name, _, arg = os.path.basename(a.config).removesuffix(".py").partition(":")
  config = config_files.load(name, arg or None)
  config.mode = "rl"
  s = rl_job.setup(config)
  train_recs, _ = rl_prompts.load(config, s.model_cfg, a.tfds_dir)
  family = families.get(s.model_cfg.family)
  state = s.init_state()
  update_rows = config.rl.group_size * config.rl.prompts_per_iter  # the images the update scores (jobs/rl.py)
  update_rows += update_rows // 4 if config.rl.pretrain_mix else 0  # ... with the rendered quarter-batch
  rows = []
  for it in range(a.iters + 1):
    t = {}  # the rollout as the job runs it (sampling, decoding, rewards), then its parts on the same prompts
    ro, t["rollout"] = clock(rl_job.rollout, config, s, state["policy"], train_recs, it)
    (final, _), t["sample"] = clock(s.rollout_fn, s.model_params(state["policy"]), ro["ids"],
                               rng.stream(ro["key"], "rollout"))
    images, t["decode"] = clock(lambda z: np.asarray(family.decode_images(s.model_cfg, z)), final)
    for reward in ro["parts"]:
      _, t[f"reward {reward}"] = clock(registry.reward, reward, images, [m["metadata"] for m in ro["recs"]])
    if estimators.get(config.rl.estimator).REENCODES:
      _, t["re-encode"] = clock(lambda x: np.asarray(family.encode_images(s.model_cfg, x)), images)
    t0 = time.perf_counter()
    state, m, _ = rl_job.iteration(config, s, state, train_recs, it)
    t["iteration"] = time.perf_counter() - t0
    t["update"] = update_rows / m["update_images_per_s"]
    rows.append(t)
    print(f"iteration {it}{' (compiles)' if it == 0 else ''}: " + ", ".join(f"{k} {v:.2f} s" for k, v in t.items()),
          flush=True)
  mean = {k: float(np.mean([r[k] for r in rows[1:]])) for k in rows[0]}
  drawn = config.rl.group_size * (config.rl.rollout_prompts or config.rl.prompts_per_iter)
  print(f"\n{config.rl.estimator}, {drawn} images drawn per iteration, mean of {a.iters} iterations (the rollout "
        "holds sampling, decode and rewards):")
  print("| part | s / iteration | share of the iteration |\n|---|---|---|")
  for k, v in mean.items():
    print(f"| {k} | {v:.3f} | {v / mean['iteration']:.0%} |")
  print(json.dumps(dict(images_per_iteration=drawn, seconds={k: round(v, 4) for k, v in mean.items()},
                        cpu_count=os.cpu_count(), jax=jax.__version__, backend=jax.default_backend(),
                        xla_flags=os.environ.get("XLA_FLAGS", ""))))


if __name__ == "__main__":
  main()
