"""Foundation benchmark (CPU by default): sampler throughput and compile time vs AR steps, pretraining step time.

python benchmarks/foundation.py [--batch=64] [--steps=8,16,32] [--repeats=2]

Uses the shipped tiny architecture (random weights: speed does not depend on them). Compile time is
lower()+compile() of the whole jitted sampler; it must stay flat in the number of AR steps because the AR
loop is a ``lax.scan``. Prints a table, then one JSON line with every figure.
"""
import argparse
import json
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from margrpo_jax import config_files  # noqa: E402
from margrpo_jax.data import shapes  # noqa: E402
from margrpo_jax.diffusion import gaussian  # noqa: E402
from margrpo_jax.jobs import pretrain  # noqa: E402
from margrpo_jax.models import families, text  # noqa: E402
from margrpo_jax.sampling import sampler as sampler_lib  # noqa: E402


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--batch", type=int, default=64)
  ap.add_argument("--steps", default="8,16,32")
  ap.add_argument("--repeats", type=int, default=2)
  args = ap.parse_args()
  config = config_files.load("shapes_pretrain")
  graphdef, state = nnx.split(families.build(config.model, 0))
  params = nnx.to_pure_dict(state)
  diff = gaussian.make_diffusion(1000, config.sampling.diffusion_steps)
  recs = shapes.split_records("eval")
  ids = jnp.asarray(text.tokenize([recs[i % len(recs)]["prompt"] for i in range(args.batch)], config.model.text.max_len))
  out = dict(device=str(jax.devices()[0].device_kind), batch=args.batch, diffusion_steps=diff.num_steps,
             cfg_scale=config.sampling.cfg_scale, sampling={})
  print(f"{'AR steps':>8} {'compile s':>10} {'images/s':>9}")
  for n in [int(s) for s in args.steps.split(",")]:
    scfg = sampler_lib.SamplerConfig(num_steps=n, cfg_scale=config.sampling.cfg_scale, clip_denoised=True)

    def fn(p, i, k, scfg=scfg):
      model = nnx.merge(graphdef, p)
      return sampler_lib.sample(model, diff, scfg, model.condition(i), model.null_condition(i.shape[0]), k)[0]

    t0 = time.perf_counter()
    compiled = jax.jit(fn).lower(params, ids, jax.random.key(0)).compile()
    compile_s = time.perf_counter() - t0
    compiled(params, ids, jax.random.key(0)).block_until_ready()
    t0 = time.perf_counter()
    for r in range(args.repeats):
      compiled(params, ids, jax.random.key(r + 1)).block_until_ready()
    ips = args.batch * args.repeats / (time.perf_counter() - t0)
    out["sampling"][n] = dict(compile_s=round(compile_s, 2), images_per_s=round(ips, 2))
    print(f"{n:>8} {compile_s:>10.2f} {ips:>9.2f}")
  graphdef, tx, ts = pretrain.init_state(config)
  step = pretrain.make_step_fn(graphdef, tx, config)
  batch = pretrain.make_batch(shapes.split_records("train", num_train=512), 0, config.batch_size, 0,
                              config.model)
  ts, m = step(ts, batch)
  jax.block_until_ready(m)
  t0, reps = time.perf_counter(), 5
  for _ in range(reps):
    ts, m = step(ts, batch)
  jax.block_until_ready(m)
  out["pretrain_step_s"] = round((time.perf_counter() - t0) / reps, 3)
  out["pretrain_batch"] = config.batch_size
  print(f"pretraining step (batch {config.batch_size}): {out['pretrain_step_s']:.3f} s")
  print(json.dumps(out))


if __name__ == "__main__":
  main()
