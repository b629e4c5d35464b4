r"""Signal-to-noise of the MAR-GRPO policy gradient on the shapes world: is there a direction to follow?

python benchmarks/grad_snr.py [--prompts=16] [--group_size=8] [--parts=4] [--reward=partial|brightness]
    [--set rl.loss_tokens=decoded --set rl.num_ar_steps=16 ...]

One rollout of the base policy (``prompts x group_size`` images), rewards, group advantages; the images are cut
into ``parts`` disjoint sets of whole groups and the policy gradient ``g_q`` of the MAR-GRPO loss is computed on
each (same selected AR and diffusion steps). If the expected gradient ``mu`` is visible above the per-part noise,
``cos(g_q, g_r) ~ |mu|^2 / (|mu|^2 + sigma^2 / n)`` > 0 for q != r. The control shuffles the advantages inside each
part (no reward information left): its cosine is the level that structure shared by all parts (same steps, same
model) gives without any signal. Prints both means (with their standard errors) and one JSON line.

``--reward=brightness`` replaces the verifier by the mean pixel value, a reward every token moves, as a sanity
check of the estimator itself.
"""
import argparse
import functools
import itertools
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from margrpo_jax import config_files
from margrpo_jax.data import tfds_builders
from margrpo_jax.rl import advantages, loss as loss_lib, train
from margrpo_jax.sampling.sampler import Record


def _set(config, assignment: str):
  key, value = assignment.split("=", 1)
  block, name = key.split(".")
  old = config[block][name]
  config[block][name] = (value.lower() in ("1", "true")) if isinstance(old, bool) else type(old)(value)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--checkpoint", default="")
  ap.add_argument("--prompts", type=int, default=16)
  ap.add_argument("--group_size", type=int, default=8)
  ap.add_argument("--parts", type=int, default=4)
  ap.add_argument("--reward", default="partial", choices=["partial", "brightness"])
  ap.add_argument("--set", action="append", default=[], help="config override block.key=value (repeatable)")
  ap.add_argument("--tfds_dir", default=os.path.expanduser("~/.cache/margrpo_jax/tfds"))
  args = ap.parse_args()
  config = config_files.load("shapes_rl", "margrpo")
  config.checkpoint = args.checkpoint
  config.rl.update(group_size=args.group_size, prompts_per_iter=args.prompts)
  for a in args.set:
    _set(config, a)
  s = train.setup(config)
  recs = [r["metadata"] for r in tfds_builders.load_split("shapes_world", "train", args.tfds_dir)]
  t0 = time.time()
  ro = train.rollout(config, s, s.policy, recs, 0)
  n_img = args.prompts * args.group_size
  reward = ro["reward"] if args.reward == "partial" else ro["images"].reshape(n_img, -1).mean(1) / 255.0
  adv = advantages.group_advantages(np.asarray(reward, np.float32), args.group_size, config.rl.advantage)
  print(f"rollout: {n_img} images in {time.time() - t0:.0f} s, mean reward {float(np.mean(reward)):.3f}")
  scfg, bcfg, lcfg, _ = s.static
  build = jax.jit(functools.partial(train.build_batch, s.graphdef, s.diff, scfg, bcfg, lcfg))

  @jax.jit
  def grad(policy, batch):
    g = jax.grad(lambda p: loss_lib.loss_fn(nnx.merge(s.graphdef, {**s.frozen, **p}), s.diff, lcfg, batch)[0])(
        policy)
    return jnp.concatenate([x.ravel() for x in jax.tree.leaves(g)])

  n = n_img // args.parts
  shuffle = np.random.default_rng(0)
  out = {}
  for control in (False, True):
    gs = []
    for q in range(args.parts):
      cut = lambda a, ax: jax.lax.slice_in_dim(a, q * n, (q + 1) * n, axis=ax)
      rec = Record(**{f: getattr(ro["rec"], f) if ax is None else cut(getattr(ro["rec"], f), ax)
                      for f, (_, ax) in Record.LAYOUT.items()})
      a = adv[q * n:(q + 1) * n]
      a = shuffle.permutation(a) if control else a
      batch, _ = build(s.policy, s.frozen, s.ref, cut(ro["ids"], 0), jnp.asarray(a), rec, cut(ro["final"], 0),
                       jax.random.key(1))
      gs.append(grad(s.policy, batch))
    cos = [float(jnp.dot(u, v) / (jnp.linalg.norm(u) * jnp.linalg.norm(v))) for u, v in itertools.combinations(gs, 2)]
    name = "shuffled" if control else "real"
    out[f"cos_{name}"] = float(np.mean(cos))
    out[f"cos_{name}_se"] = float(np.std(cos) / np.sqrt(len(cos)))
    print(f"{name:8s} advantages: mean pairwise cosine {out[f'cos_{name}']:+.4f} +- {out[f'cos_{name}_se']:.4f}, "
          f"|g| {float(np.mean([jnp.linalg.norm(g) for g in gs])):.4f}")
  print(json.dumps(dict(images=n_img, parts=args.parts, reward=args.reward, overrides=args.set, **out)))


if __name__ == "__main__":
  main()
