r"""One MAR-GRPO update as a pure, jitted function of explicit state (the RL job, ``jobs/rl.py``, drives it).

``rl_step(state, frozen, ref, ids, adv, rec, final, key) -> (state, metrics)``:

1. :func:`build_batch` (no gradients): the recorded rollout -> :class:`loss.TrainBatch` (MTE chains, token
   selection, the frozen reference's transitions), ``rl/batch.py``;
2. :func:`update`: ``num_inner`` passes over the batch, each ``num_minibatches`` optimizer steps on consecutive
   row blocks of ``B / num_minibatches`` images (PPO epochs and minibatches; the ratio is 1 at the first one), or,
   with ``sequential``, one optimizer step per scored AR step (the official DeepSpeed loop, docs/algorithm.md B8).

The trained ``policy`` lives in the donated ``state = {step, policy, opt}``; ``frozen`` (the diffusion head unless
it is trained, the tokenizer-side parts) and ``ref`` (the frozen reference policy) are plain arguments that no
optimizer ever sees. Everything static is one hashable :class:`StepConfig`.
"""
from __future__ import annotations

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from margrpo_jax import optim
from margrpo_jax.diffusion import gaussian
from margrpo_jax.parallel import sharding
from margrpo_jax.rl import batch as batch_lib, loss as loss_lib
from margrpo_jax.sampling import sampler as sampler_lib


@dataclasses.dataclass(frozen=True)
class StepConfig:
  """The static configuration of an RL update, resolved and validated from ``config`` by ``jobs/rl.py``."""
  sampler: sampler_lib.SamplerConfig
  batch: batch_lib.BatchConfig
  loss: loss_lib.LossConfig
  num_inner: int = 1           # passes over each rollout's batch (PPO epochs)
  num_minibatches: int = 1     # optimizer steps per pass, on consecutive blocks of B / num_minibatches rows
  sequential: bool = False     # official: one optimizer step per scored AR step instead (B8)


def build_batch(graphdef, diff, sc: StepConfig, policy, frozen, ref, ids, adv, rec, final, key):
  """The gradient-free half of an update: ``(TrainBatch, info)`` (MTE chains, selection, reference)."""
  model = nnx.merge(graphdef, {**frozen, **policy})
  ref_model = nnx.merge(graphdef, {**frozen, **ref})
  return batch_lib.build(model, ref_model, diff, sc.sampler, sc.batch, sc.loss, rec, final, ids, adv, key)


def update(graphdef, tx, diff, sc: StepConfig, state, frozen, batch: loss_lib.TrainBatch):
  """The loss-and-update half; ``frozen`` never reaches the optimizer. Metrics are means over the optimizer
  steps taken."""
  def one(state, sub, steps=None):
    def objective(p):
      return loss_lib.loss_fn(nnx.merge(graphdef, {**frozen, **p}), diff, sc.loss, sub, steps)
    (loss, m), grads = jax.value_and_grad(objective, has_aux=True)(state["policy"])
    updates, opt = tx.update(grads, state["opt"], state["policy"])
    policy = jax.tree.map(jnp.add, state["policy"], updates)
    return dict(step=state["step"], policy=policy, opt=opt), dict(loss=loss, grad_norm=optim.global_norm(grads), **m)

  mean = lambda ms: jax.tree.map(lambda *xs: jnp.mean(jnp.stack(xs)), *ms)
  if sc.sequential:  # Python loop: each step scores a different AR step
    metrics = []
    for _ in range(sc.num_inner):
      for i in range(batch.j.shape[0]):
        state, m = one(state, batch, [i])
        metrics.append(m)
    return dict(state, step=state["step"] + 1), mean(metrics)
  rows = batch.adv.shape[0] // sc.num_minibatches

  def body(state, u):
    return one(state, batch.rows(u % sc.num_minibatches * rows, rows))

  state, ms = jax.lax.scan(body, state, jnp.arange(sc.num_inner * sc.num_minibatches))
  return dict(state, step=state["step"] + 1), jax.tree.map(jnp.mean, ms)


def rl_step(graphdef, tx, diff, sc: StepConfig, state, frozen, ref, ids, adv, rec, final, key):
  """:func:`build_batch` then :func:`update`, plus the selection statistics. ``frozen`` / ``ref`` are never
  updated."""
  batch, info = build_batch(graphdef, diff, sc, state["policy"], frozen, ref, ids, adv, rec, final, key)
  state, out = update(graphdef, tx, diff, sc, state, frozen, batch)
  out["uncertain_frac"] = batch.uncertain.mean()
  out["keep_frac"] = batch.keep.sum() / jnp.maximum(batch.region.sum(), 1)  # consistency-aware selection
  masked_mean = lambda x, m: jnp.sum(x * m) / jnp.maximum(m.sum(), 1)
  out["uncertainty_mean"] = masked_mean(info["uncertainty"], batch.region)    # MTE std over the loss region
  out["uncertainty_topk_mean"] = masked_mean(info["uncertainty"], batch.uncertain)  # ... over U
  return state, out


def step_shardings(mesh, rules, tx, policy, frozen, ids_ndim: int = 2) -> dict:
  """``in_shardings`` / ``out_shardings`` of :func:`rl_step` on ``mesh``: policy, reference and optimizer
  state sharded by ``rules``, the frozen parts by theirs (the head replicated), batches over the batch axes."""
  p = sharding.param_shardings(mesh, policy, rules)
  rep = sharding.replicated(mesh)
  state = dict(step=rep, policy=p, opt=sharding.opt_shardings(mesh, tx, policy, p))
  b = functools.partial(sharding.batch_sharding, mesh)
  ins = (state, sharding.param_shardings(mesh, frozen, rules), p, b(ids_ndim), b(1),
         sampler_lib.Record.shardings(mesh), b(3), rep)
  return dict(in_shardings=ins, out_shardings=(state, rep))


@functools.lru_cache(maxsize=None)
def compiled_step(graphdef, num_train_steps: int, respacing: str, sc: StepConfig, optim_json: str, names: tuple,
                  num_iters: int, mesh=None, rules=None, sigs=None, ids_ndim: int = 2):
  """``(tx, jitted rl_step)`` shared by every run in the process with the same static configuration; the
  train state is donated, the frozen parts and the reference are plain (never donated) arguments. With a
  ``mesh``, ``sigs`` (:func:`sharding.signature` of policy and frozen) give the explicit shardings."""
  tx = optim.make(ml_collections.ConfigDict(json.loads(optim_json)), names, num_iters * sc.num_inner
                  * sc.num_minibatches)
  diff = gaussian.make_diffusion(num_train_steps, respacing)
  fn = functools.partial(rl_step, graphdef, tx, diff, sc)
  if mesh is None:
    return tx, jax.jit(fn, donate_argnums=0)
  policy, frozen = (sharding.abstract(sig) for sig in sigs)
  return tx, jax.jit(fn, donate_argnums=0, **step_shardings(mesh, rules, tx, policy, frozen, ids_ndim))
