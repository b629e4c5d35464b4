r"""Signal-to-noise of the MAR-GRPO policy gradient on the shapes world, overall and per diffusion step.

python benchmarks/grad_snr.py [--variant=margrpo|paper|focused|token_elbo|image_elbo|awm|nft] [--reward=shapes_partial|brightness|...]
    [--prompts=16] [--group_size=8] [--parts=4] [--keys=2] [--set rl.num_ar_steps=4 --set optim.lr=1e-4 ...]

One rollout of the base policy (``prompts x group_size`` images), rewards, group advantages; the images are cut
into ``parts`` disjoint sets of whole groups and the policy gradient ``g_q`` of the loss is computed on each,
averaged over ``keys`` batch-building keys (fresh per part: which AR and diffusion steps are scored, MTE and
tentative chains). If the expected gradient ``mu`` shows above the per-part noise ``sigma``,
``cos(g_q, g_r) ~ |mu|^2 / (|mu|^2 + sigma^2 / n)`` > 0 for q != r. The control permutes the advantages inside
each group (no reward information): its cosine is the level that shared structure gives without signal.

A forward-process estimator (image_elbo, awm, nft: no recorded chains) gets the overall cosines only, its loss on
each part's re-encoded images with ``keys`` draws of masks and noise levels, and the cosine between two draws on
the same images (near 0: the draws' own noise, not the images, dominates one draw's gradient; ``--set
rl.elbo_draws=4`` averages four per image).

Per diffusion step (chain estimators): the same parts scored at one list position n at a time (every position of the chain, the
window ignored), with the share of the squared gradient norm each step holds, the mean step std sigma over the
loss region and the cosine of real and shuffled advantages. Prints both tables and, last, one JSON line.
"""
import argparse
import dataclasses
import functools
import itertools
import json
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from margrpo_jax import config_files  # noqa: E402
from margrpo_jax.data import shapes  # noqa: E402
from margrpo_jax.diffusion import gaussian  # noqa: E402
from margrpo_jax.rewards import registry  # noqa: E402
from margrpo_jax.jobs import rl as rl_job  # noqa: E402
from margrpo_jax.rl import advantages, estimators, loss as loss_lib, prompts as rl_prompts  # noqa: E402
from margrpo_jax.rl import config as rl_config, step as step_lib  # noqa: E402
from margrpo_jax.rl.estimators import forward  # noqa: E402
from margrpo_jax.sampling.sampler import Record  # noqa: E402

K_AXIS = dict(j=1, x_t=1, x_prev=1, old_logp=1, ref_mean=1, ref_std=1, mte_x_t=2, mte_x_prev=2, mte_old_logp=2)


def at_step(batch, n):
  """The batch scored at its diffusion list entry ``n`` only (k = 1)."""
  return batch.replace(**{f: jax.lax.dynamic_slice_in_dim(getattr(batch, f), n, 1, ax) for f, ax in K_AXIS.items()})


def cosines(gs):
  c = [float(jnp.dot(u, v) / (jnp.linalg.norm(u) * jnp.linalg.norm(v))) for u, v in itertools.combinations(gs, 2)]
  return float(np.mean(c)), float(np.std(c) / np.sqrt(len(c)))


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--checkpoint", default="")
  ap.add_argument("--variant", default="margrpo")
  ap.add_argument("--reward", default="shapes_partial", choices=sorted(registry.REWARDS))
  ap.add_argument("--prompts", type=int, default=16)
  ap.add_argument("--group_size", type=int, default=8)
  ap.add_argument("--parts", type=int, default=4)
  ap.add_argument("--keys", type=int, default=2, help="batch-building keys averaged per part")
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--no_per_step", action="store_true")
  ap.add_argument("--set", action="append", default=[], help="config override block.key=value (repeatable)")
  args = ap.parse_args()
  config = config_files.load("shapes_rl", args.variant)
  config.checkpoint = args.checkpoint
  config.seed = args.seed
  config.rl.rewards.update({k: 0.0 for k in config.rl.rewards})
  config.rl.rewards[args.reward] = 1.0
  config.rl.update(group_size=args.group_size, prompts_per_iter=args.prompts)
  for a in args.set:
    config_files.override(config, a)
  rl_config.resolve_fidelity(config)  # e.g. the paper preset: the official switches
  s = rl_job.setup(config)
  t0 = time.time()
  ro = rl_job.rollout(config, s, s.policy, rl_prompts.from_metadata(shapes.split_records("train", num_train=2000)), 0)
  n_img, g = args.prompts * args.group_size, args.group_size
  adv = np.asarray(advantages.group_advantages(ro["reward"], g, config.rl.advantage))
  weights = lambda a: np.asarray(advantages.shape_weights(a, config.rl.positive_only, config.rl.adv_clip))
  print(f"rollout: {n_img} images in {time.time() - t0:.0f} s, mean {args.reward} {float(np.mean(ro['reward'])):.3f}"
        f" ({args.variant}, {' '.join(args.set) or 'defaults'})")
  sc = s.static
  bcfg, lcfg = sc.batch, sc.loss
  all_steps = dataclasses.replace(bcfg, diffusion_window=(0, None), num_diffusion_steps=0)

  def builder(b):
    return jax.jit(functools.partial(step_lib.build_batch, s.graphdef, s.diff, dataclasses.replace(sc, batch=b)))

  @jax.jit
  def grad(policy, batch):
    g = jax.grad(lambda p: loss_lib.loss_fn(nnx.merge(s.graphdef, s.model_params(p)), s.diff, lcfg, batch)[0])(
        policy)
    return jnp.concatenate([x.ravel() for x in jax.tree.leaves(g)])

  n = n_img // args.parts
  shuffled = advantages.shuffle_in_groups(adv, g, args.seed)
  out = dict(images=n_img, parts=args.parts, keys=args.keys, reward=args.reward, variant=args.variant,
             estimator=config.rl.estimator, overrides=args.set)
  if not estimators.get(config.rl.estimator).READS_CHAINS:  # a forward-process estimator: parts of (ids, A, tokens)
    tokens, est = rl_job.training_tokens(config, s, ro, 0), estimators.get(config.rl.estimator)
    anchors = dict(ref=s.ref, rollout=s.policy, ema=s.policy)
    ctx = step_lib.Context(s.graphdef, sc, gaussian.make_diffusion(sc.num_train_steps), s.frozen, anchors)

    @jax.jit
    def fgrad(policy, ids, a, tok, key):
      ids, a, tok, _ = step_lib.heaviest_rows(sc.forward, ids, a, tok)  # rl.elbo_rows / rl.elbo_draws as the job
      b = step_lib.Block(*(step_lib.repeat_rows(sc.forward, x) for x in (ids, a, tok)))
      d = forward.draw(sc.forward.objective, ctx.train_diff, b.tokens, key)
      g = jax.grad(lambda p: est.loss(ctx, p, b, d)[0])(policy)
      return jnp.concatenate([x.ravel() for x in jax.tree.leaves(g)])

    cut = lambda x, q: x[q * n:(q + 1) * n]
    for name, a in (("real", adv), ("shuffled", shuffled)):
      a = jnp.asarray(weights(a))
      per_key = [[fgrad(s.policy, cut(ro["ids"], q), cut(a, q), cut(tokens, q), jax.random.key(1000 * q + r))
                  for r in range(args.keys)] for q in range(args.parts)]
      gs = [sum(g) for g in per_key]
      out[f"cos_{name}"], out[f"cos_{name}_se"] = cosines(gs)
      # the same images at other draws of MAR's training randomness: how much of one draw's gradient is the draw
      same = [cosines(g)[0] for g in per_key] if args.keys > 1 else [float("nan")]
      out[f"cos_{name}_same_images"] = float(np.mean(same))
      print(f"{name:8s} advantages: mean pairwise cosine {out[f'cos_{name}']:+.4f} +- {out[f'cos_{name}_se']:.4f}; "
            f"same images, other draws {out[f'cos_{name}_same_images']:+.4f}")
    print(json.dumps(out))
    return
  def part(q):  # the record rows of part q
    cut = lambda a, ax: a if ax is None else jax.lax.slice_in_dim(a, q * n, (q + 1) * n, axis=ax)
    return Record(**{f: cut(getattr(ro["rec"], f), ax) for f, (_, ax) in Record.LAYOUT.items()})

  def part_batch(build, q, a, key):
    cut = lambda x: jax.lax.slice_in_dim(x, q * n, (q + 1) * n, axis=0)
    return build(s.policy, s.frozen, s.ref, cut(ro["ids"]), jnp.asarray(weights(a)[q * n:(q + 1) * n]), part(q),
                 cut(ro["final"]), key)[0]

  build = builder(bcfg)
  for name, a in (("real", adv), ("shuffled", shuffled)):
    gs = [sum(grad(s.policy, part_batch(build, q, a, jax.random.key(1000 * q + r))) for r in range(args.keys))
          for q in range(args.parts)]
    out[f"cos_{name}"], out[f"cos_{name}_se"] = cosines(gs)
    print(f"{name:8s} advantages: mean pairwise cosine {out[f'cos_{name}']:+.4f} +- {out[f'cos_{name}_se']:.4f}, "
          f"|g| {float(np.mean([jnp.linalg.norm(x) for x in gs])):.4f}")
  if not args.no_per_step:
    build = builder(all_steps)
    rows, t_count = [], s.diff.num_steps
    batches = {name: [part_batch(build, q, a, jax.random.key(1000 * q)) for q in range(args.parts)]
               for name, a in (("real", adv), ("shuffled", shuffled))}
    for pos in range(t_count):
      row = dict(n=pos, j=t_count - 1 - pos, t=int(s.diff.timesteps[t_count - 1 - pos]))
      b0 = batches["real"][0]
      region = jnp.broadcast_to(b0.region[:, None, ..., None], b0.ref_std.shape)
      row["sigma"] = float(jnp.sum(b0.ref_std[:, pos:pos + 1] * region[:, pos:pos + 1]) /
                           jnp.maximum(jnp.sum(region[:, pos:pos + 1]), 1))
      for name, bs in batches.items():
        gs = [grad(s.policy, at_step(b, pos)) for b in bs]
        row[f"norm2_{name}"] = float(np.mean([jnp.sum(x ** 2) for x in gs]))
        row[f"cos_{name}"], row[f"cos_{name}_se"] = cosines(gs)
      rows.append(row)
    total = sum(r["norm2_real"] for r in rows)
    print("\nper diffusion step (list position n: x_n -> x_{n+1}; every step scored alone)")
    print("|  n |  j |   t | sigma   | share of |g|^2 | cos real        | cos shuffled    |")
    print("|---:|---:|----:|--------:|---------------:|----------------:|----------------:|")
    for r in rows:
      r["share"] = r["norm2_real"] / total
      print(f"| {r['n']:2d} | {r['j']:2d} | {r['t']:3d} | {r['sigma']:.4f} | {r['share']:14.4f} | "
            f"{r['cos_real']:+.3f} +- {r['cos_real_se']:.3f} | {r['cos_shuffled']:+.3f} +- {r['cos_shuffled_se']:.3f} |")
    out["per_step"] = rows
  print(json.dumps(out))


if __name__ == "__main__":
  main()
