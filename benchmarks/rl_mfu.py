"""MAR-GRPO step time and model FLOPs utilisation at real model size (MAR-L by default).

python benchmarks/rl_mfu.py [--size=large] [--prompts=8] [--group_size=4] [--ar_steps=64] [--scored_ar_steps=12]
    [--diffusion_steps=100] [--scored_diffusion_steps=10] [--mte_seeds=5] [--repeats=3] [--peak_tflops=X]
    [--dtype=float32|bfloat16]

Random weights in MAR's exact shapes (class-conditional, 256 tokens x 16 channels), on the mesh of
``configs/mar.py`` (FSDP over every local device). Times one recorded rollout (images/s) and one RL update
(build + loss-and-update, the jitted ``rl_step``); FLOPs per call come from XLA's cost analysis of the compiled
programs, and MFU = FLOPs / time / peak. The peak is looked up from the device kind (dense bf16 tensor-core
figures: with --dtype=float32, MFU is a lower bound; --dtype=bfloat16 is ``rl.compute_dtype``, every layer
but the diffusion head in bf16) or given with --peak_tflops. The last
line is one JSON object.
"""
import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from margrpo_jax import config_files, rng
from margrpo_jax.jobs import rl as rl_job
from margrpo_jax.models import families

PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "TPU v4": 275.0, "TPU v5 lite": 197.0,
               "TPU v5p": 459.0, "TPU v6 lite": 918.0}


def flops(compiled) -> float:
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  return float(cost.get("flops", 0.0)) if cost else 0.0


def peak_for(kind: str, override: float) -> float:
  if override:
    return override * 1e12
  return next((v * 1e12 for k, v in PEAK_TFLOPS.items() if k.lower() in kind.lower()), 0.0)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--size", default="large")
  ap.add_argument("--prompts", type=int, default=8)
  ap.add_argument("--group_size", type=int, default=4)
  ap.add_argument("--ar_steps", type=int, default=64)
  ap.add_argument("--scored_ar_steps", type=int, default=12)
  ap.add_argument("--diffusion_steps", type=int, default=100)
  ap.add_argument("--scored_diffusion_steps", type=int, default=10)
  ap.add_argument("--mte_seeds", type=int, default=5)
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--peak_tflops", type=float, default=0.0, help="per device; default: from the device kind")
  ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="rl.compute_dtype")
  a = ap.parse_args()
  c = config_files.load("mar", a.size)
  c.sampling.update(num_steps=a.ar_steps, diffusion_steps=str(a.diffusion_steps))
  c.rl.update(group_size=a.group_size, prompts_per_iter=a.prompts, num_ar_steps=a.scored_ar_steps,
              num_diffusion_steps=a.scored_diffusion_steps, mte_seeds=a.mte_seeds, compute_dtype=a.dtype)
  graphdef, state = nnx.split(families.build(c.model, seed=0))
  s = rl_job.setup(c, (c.model, graphdef, nnx.to_pure_dict(state)))
  del state
  batch = a.group_size * a.prompts
  labels = jnp.asarray(np.random.default_rng(0).integers(1000, size=batch), jnp.int32)
  key = jax.random.key(0)
  params = s.model_params(s.policy)

  t0 = time.perf_counter()
  roll = s.rollout_fn.lower(params, labels, key).compile()
  compile_rollout = time.perf_counter() - t0
  jax.block_until_ready(roll(params, labels, key))
  t0 = time.perf_counter()
  for i in range(a.repeats):
    final, rec = jax.block_until_ready(roll(params, labels, jax.random.fold_in(key, i)))
  t_rollout = (time.perf_counter() - t0) / a.repeats

  adv = jnp.asarray(np.random.default_rng(1).standard_normal(batch), jnp.float32)
  step_args = lambda st: (st, s.frozen, s.ref, labels, adv, rec, final, rng.stream(key, "train"))
  t0 = time.perf_counter()
  step = s.step_fn.lower(*step_args(s.init_state())).compile()
  compile_step = time.perf_counter() - t0
  st = jax.block_until_ready(step(*step_args(s.init_state()))[0])
  t0 = time.perf_counter()
  for _ in range(a.repeats):
    st = jax.block_until_ready(step(*step_args(st))[0])
  t_step = (time.perf_counter() - t0) / a.repeats

  n = len(jax.devices())
  peak = peak_for(jax.devices()[0].device_kind, a.peak_tflops)
  f_roll, f_step = flops(roll), flops(step)  # per device (SPMD program)
  out = dict(device=jax.devices()[0].device_kind, devices=n, size=a.size, batch=batch, dtype=a.dtype,
             backbone_params=int(sum(x.size for x in jax.tree.leaves(s.policy))),
             compile_s=dict(rollout=round(compile_rollout, 1), rl_step=round(compile_step, 1)),
             rollout_s=round(t_rollout, 3), rollout_images_per_s=round(batch / t_rollout, 2),
             rl_step_s=round(t_step, 3), rl_step_tflops_per_device=round(f_step / 1e12, 3),
             rl_step_achieved_tflops_per_s=round(f_step / t_step / 1e12, 3),
             rollout_achieved_tflops_per_s=round(f_roll / t_rollout / 1e12, 3),
             peak_tflops_per_device=peak / 1e12 or None,
             rl_step_mfu=round(f_step / t_step / peak, 4) if peak else None,
             rollout_mfu=round(f_roll / t_rollout / peak, 4) if peak else None)
  for k, v in out.items():
    print(f"{k}: {v}")
  print(json.dumps(out))


if __name__ == "__main__":
  main()
