r"""Gradient variance of the MTE estimator: S = 1 vs S = 4 diffusion trajectories per token, one fixed rollout.

python benchmarks/grad_variance.py [--checkpoint=DIR] [--pool=64] [--group_size=8] [--prompts=2]

One recorded rollout of the base policy and one training batch (fixed AR steps, diffusion steps, uncertainty
top-k set U and advantages) with a pool of ``P`` MTE trajectories from the same AR latents. The policy gradient
(w.r.t. the AR backbone and text encoder) restricted to the selected tokens U,

    g_S = grad (1 / |U|) sum_{U} A (1/S) sum_{s in group} l^{(s)},

is estimated from ``P`` disjoint groups of S = 1 and ``P / 4`` of S = 4 trajectories. Its variance is the trace of
the covariance across groups, ``mean_g ||g - mean g||^2`` (unbiased). Independent trajectories give
``Var(g_4) / Var(g_1) = 1/4``. The last line is one JSON object with ``variance_ratio_s4_over_s1``.
"""
import argparse
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from margrpo_jax import config_files
from margrpo_jax.data import shapes
from margrpo_jax.jobs import rl as rl_job
from margrpo_jax.rl import advantages, loss as loss_lib, prompts as rl_prompts, step as step_lib


def trace_variance(grads: np.ndarray) -> float:
  """``grads`` (n, P) -> unbiased total variance ``sum_p Var_n``."""
  return float(np.sum(np.var(grads, axis=0, ddof=1)))


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--checkpoint", default="")
  ap.add_argument("--pool", type=int, default=64, help="MTE trajectories in the pool (a multiple of 4)")
  ap.add_argument("--group_size", type=int, default=8)
  ap.add_argument("--prompts", type=int, default=2)
  args = ap.parse_args()
  config = config_files.load("shapes_rl", "margrpo")
  config.checkpoint = args.checkpoint
  config.rl.update(group_size=args.group_size, prompts_per_iter=args.prompts, mte_seeds=args.pool, num_ar_steps=2,
                   consistency=False, beta=0.0)
  s = rl_job.setup(config)
  sc = s.static
  lcfg = sc.loss
  ro = rl_job.rollout(config, s, s.policy, rl_prompts.from_metadata(shapes.split_records("train", num_train=512)), 0)
  adv = advantages.group_advantages(ro["reward"], args.group_size, "grpo")
  if not np.any(np.asarray(adv)):
    adv = jnp.asarray(np.random.default_rng(0).standard_normal(adv.shape), jnp.float32)  # flat rewards: any signal
  build = jax.jit(functools.partial(step_lib.build_batch, s.graphdef, s.diff, sc))
  batch, _ = build(s.policy, s.frozen, s.ref, ro["ids"], adv, ro["rec"], ro["final"], jax.random.key(3))
  batch = batch.replace(keep=batch.uncertain & batch.region)  # the policy term on the selected tokens only

  @jax.jit
  def grad(policy, mte_x_t, mte_x_prev, mte_old_logp):
    b = batch.replace(mte_x_t=mte_x_t, mte_x_prev=mte_x_prev, mte_old_logp=mte_old_logp)
    g = jax.grad(lambda p: loss_lib.loss_fn(nnx.merge(s.graphdef, s.model_params(p)), s.diff, lcfg, b)[0])(policy)
    return jnp.concatenate([jnp.ravel(x) for x in jax.tree.leaves(g)])

  out = dict(pool=args.pool, batch=len(ro["ids"]), selected_tokens=int(np.asarray(batch.keep).sum()))
  for size in (1, 4):
    gs = []
    for start in range(0, args.pool, size):
      sl = slice(start, start + size)
      gs.append(np.asarray(grad(s.policy, batch.mte_x_t[sl], batch.mte_x_prev[sl], batch.mte_old_logp[sl])))
    out[f"variance_s{size}"] = trace_variance(np.stack(gs))
    out[f"groups_s{size}"] = len(gs)
    print(f"S = {size}: {len(gs)} gradient estimates, total variance {out[f'variance_s{size}']:.4e}", flush=True)
  out["variance_ratio_s4_over_s1"] = round(out["variance_s4"] / out["variance_s1"], 4)
  print(f"Var(S=4) / Var(S=1) = {out['variance_ratio_s4_over_s1']} (independent trajectories: 0.25)")
  print(json.dumps(out))


if __name__ == "__main__":
  main()
