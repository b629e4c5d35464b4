"""RL step benchmark: `margrpo` (S = 4 MTE trajectories, top 30 %, consistency) against `grpo` at the same batch.

python benchmarks/rl_step.py [--checkpoint=DIR] [--repeats=3] [--group_size=8] [--prompts=4] [--ar_steps=4]
    [--diffusion_steps=8]

Both variants start from the same base (the shipped one by default) and score the same recorded rollout. An
update has two jitted halves, timed and sized separately:

* build: gradient-free; the tentative chains, the MTE chains and uncertainty top-k, the consistency filter and
  the reference transitions (`rl/batch.py`);
* loss-and-update: value_and_grad of `rl/loss.py` and the optimizer step (what the paper's "negligible
  overhead" is about: MTE adds S scorings of the K uncertain tokens through the small head).

Memory is XLA's compiled footprint per call, arguments + outputs + temporaries - donated aliases
(`compiled.memory_analysis()`), the same on CPU, GPU and TPU. Also prints rollout images/s. The last line is
one JSON object; `margrpo_over_grpo_time_ratio` and `margrpo_over_grpo_memory_ratio` are for loss-and-update.
"""
import argparse
import functools
import json
import time

import jax
import jax.numpy as jnp

from margrpo_jax import config_files
from margrpo_jax.data import shapes
from margrpo_jax.jobs import rl as rl_job
from margrpo_jax.rl import advantages, prompts as rl_prompts, step as step_lib

def footprint(compiled) -> int:
  m = compiled.memory_analysis()
  return int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes)


def timed(fn, make_args, repeats: int) -> float:
  """Mean seconds per call; arguments (fresh copies: the state is donated) are made outside the clock."""
  jax.block_until_ready(fn(*make_args()))
  total = 0.0
  for _ in range(repeats):
    args = make_args()
    jax.block_until_ready(args)
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    total += time.perf_counter() - t0
  return total / repeats


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--checkpoint", default="")
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--group_size", type=int, default=8)
  ap.add_argument("--prompts", type=int, default=4)
  ap.add_argument("--ar_steps", type=int, default=4, help="AR steps scored per rollout (M)")
  ap.add_argument("--diffusion_steps", type=int, default=8, help="diffusion steps scored per AR step (k)")
  args = ap.parse_args()
  out = dict(device=str(jax.devices()[0].device_kind), batch=args.group_size * args.prompts, variants={})
  recs = rl_prompts.from_metadata(shapes.split_records("train", num_train=512))
  ro = None
  for variant in ("grpo", "margrpo"):
    config = config_files.load("shapes_rl", variant)
    config.checkpoint = args.checkpoint
    config.rl.update(group_size=args.group_size, prompts_per_iter=args.prompts, num_ar_steps=args.ar_steps,
                     num_diffusion_steps=args.diffusion_steps)
    s = rl_job.setup(config)
    sc = s.static
    bcfg = sc.batch
    if ro is None:  # one recorded rollout, shared by both variants
      ro = rl_job.rollout(config, s, s.policy, recs, 0)
      ids = ro["ids"]
      rollout_s = timed(s.rollout_fn, lambda: (s.model_params(s.policy), ids, jax.random.key(1)), args.repeats)
      out["rollout_images_per_s"] = round(len(ids) / rollout_s, 2)
      adv = advantages.group_advantages(ro["reward"], args.group_size, "drgrpo") + 0.1  # any non-zero advantages
    key = jax.random.key(2)
    build = jax.jit(functools.partial(step_lib.build_batch, s.graphdef, s.diff, sc))
    build_args = lambda: (s.policy, s.frozen, s.ref, ro["ids"], adv, ro["rec"], ro["final"], key)
    batch, _ = build(*build_args())
    update = jax.jit(functools.partial(step_lib.update, s.graphdef, s.tx, s.diff, sc), donate_argnums=0)
    update_args = lambda: (jax.tree.map(jnp.copy, s.init_state()), s.frozen, batch)
    res = dict(
        trainable=sorted(s.policy), mte_seeds=bcfg.mte_seeds, topk_fraction=bcfg.topk_fraction,
        build_s=timed(build, build_args, args.repeats),
        update_s=timed(update, update_args, args.repeats),
        build_bytes=footprint(build.lower(*build_args()).compile()),
        update_bytes=footprint(update.lower(*update_args()).compile()))
    out["variants"][variant] = res
    print(f"{variant:>8}: build {res['build_s']:.3f} s ({res['build_bytes'] / 2**20:.1f} MiB), loss-and-update "
          f"{res['update_s']:.3f} s ({res['update_bytes'] / 2**20:.1f} MiB)", flush=True)
  g, m = out["variants"]["grpo"], out["variants"]["margrpo"]
  out["margrpo_over_grpo_time_ratio"] = round(m["update_s"] / g["update_s"], 3)
  out["margrpo_over_grpo_memory_ratio"] = round(m["update_bytes"] / g["update_bytes"], 3)
  out["margrpo_over_grpo_build_time_ratio"] = round(m["build_s"] / g["build_s"], 3)
  out["margrpo_over_grpo_total_time_ratio"] = round((m["build_s"] + m["update_s"]) / (g["build_s"] + g["update_s"]), 3)
  print(f"rollout: {out['rollout_images_per_s']} images/s; margrpo / grpo loss-and-update: time "
        f"{out['margrpo_over_grpo_time_ratio']}x, memory {out['margrpo_over_grpo_memory_ratio']}x; build + update "
        f"time {out['margrpo_over_grpo_total_time_ratio']}x")
  print(json.dumps(out))


if __name__ == "__main__":
  main()
