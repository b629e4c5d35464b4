r"""One MAR-GRPO update as a pure, jitted function of explicit state (the RL job, ``jobs/rl.py``, drives it).

``rl_step(state, frozen, ref, ids, adv, rec, final, key) -> (state, metrics)``:

1. :func:`build_batch` (no gradients): the recorded rollout -> :class:`loss.TrainBatch` (MTE chains, token
   selection, the frozen reference's transitions), ``rl/batch.py``;
2. :func:`update`: ``num_inner`` passes over the batch, each ``num_minibatches`` optimizer steps on consecutive
   row blocks of ``B / num_minibatches`` images (PPO epochs and minibatches; the ratio is 1 at the first one), or,
   with ``sequential``, one optimizer step per scored AR step (the official DeepSpeed loop, docs/algorithm.md B8).

That is the ``chain`` and ``token_elbo`` estimators (``rl/estimators/``). The forward-process estimators
(``image_elbo``, ``awm``, ``nft``) score no recorded chain: :func:`forward_update` replaces both halves with
their loss on the image's final tokens (``final`` then holds the tokenizer's re-encoding of the decoded images),
e.g. for ``image_elbo``

    loss = mean_i A_i l_i,   l_i = L_MAR(x_i | c_i) ~ -log p(x_i | c_i) + const   (models/objective.py).

With ``ema_decay`` the state also carries ``ema = d ema + (1 - d) policy`` after every update (what is
exported and evaluated).

The trained ``policy`` lives in the donated ``state = {step, policy, opt}``; ``frozen`` (the diffusion head unless
it is trained, the tokenizer-side parts) and ``ref`` (the frozen reference policy) are plain arguments that no
optimizer ever sees. With LoRA (``sc.lora.rank > 0``, ``rl/lora.py``) the policy is the adapter tree, ``frozen``
every base weight and ``ref`` the empty tree (the base: adapters off); the model is always
``lora.assemble(frozen, policy)``. With ``rl.frozen_dtype='bfloat16'`` ``frozen`` and ``ref`` are stored
in bfloat16 (:func:`halves`). Everything static is one hashable :class:`StepConfig`.
"""
from __future__ import annotations

import dataclasses
import functools
import json

import flax
import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from margrpo_jax import optim
from margrpo_jax.diffusion import flow, gaussian
from margrpo_jax.models import layers, precision
from margrpo_jax.parallel import sharding
from margrpo_jax.rl import batch as batch_lib, estimators, lora as lora_lib, loss as loss_lib
from margrpo_jax.rl.estimators import forward as forward_lib
from margrpo_jax.sampling import sampler as sampler_lib


@dataclasses.dataclass(frozen=True)
class StepConfig:
  """The static configuration of an RL update, resolved and validated from ``config`` by ``jobs/rl.py``."""
  sampler: sampler_lib.SamplerConfig
  batch: batch_lib.BatchConfig
  loss: loss_lib.LossConfig
  num_inner: int = 1           # passes over each rollout's batch (PPO epochs)
  num_minibatches: int = 1     # optimizer steps per pass, on consecutive blocks of B / num_minibatches rows
  microbatch: int = 0          # > 0: each optimizer step's rows scored this many at a time, the gradients summed
                               # (exact: the loss is a sum over rows); 0 = all at once
  sequential: bool = False     # official: one optimizer step per scored AR step instead (B8)
  estimator: str = "chain"     # rl.estimator (rl/estimators/): chain, token_elbo, image_elbo, awm, nft
  forward: forward_lib.ForwardConfig = forward_lib.ForwardConfig()  # the forward-process estimators' settings
  ema_decay: float = 0.0       # > 0: an EMA of the policy in the state (exported and evaluated)
  export_interpolation: float = 1.0  # a in (0, 1]: export and evaluate theta_0 + a (theta - theta_0) (WiSE-FT)
  lora: lora_lib.LoraConfig = lora_lib.LoraConfig()  # rank > 0: the policy is LoRA adapters over the frozen base
  frozen_dtype: str = "float32"  # how the frozen parts and the reference are stored ('bfloat16': half the bytes)
  respacing: str = "25"        # the rollout's diffusion steps (a respacing of num_train_steps)
  optim: str = "{}"            # config.optim as JSON (hashable)
  total_steps: int = 1         # optimizer steps over the run (the learning-rate schedule's length)
  num_train_steps: int = 1000  # the base's diffusion training steps
  trainable: tuple[str, ...] = ()  # the components the optimizer sees (the policy)
  ids_ndim: int = 2            # condition rank: 1 for class labels, 2 for token ids
  flow: tuple[float, float] | None = None  # a flow head (NOVA): (rollout SDE noise level, sigma shift); None:
                                           # the Gaussian head's diffusion

  @property
  def reads_chains(self) -> bool:
    """Whether the estimator scores the recorded chains (the rollout then records them)."""
    return estimators.get(self.estimator).READS_CHAINS


def make_chain(sc: StepConfig):
  """The rollout's per-token chain: the respaced Gaussian diffusion, or the flow SDE schedule (``sc.flow``)."""
  if sc.flow is not None:
    return flow.make_flow(int(sc.respacing), sc.flow[0], sc.flow[1], sc.num_train_steps)
  return gaussian.make_diffusion(sc.num_train_steps, sc.respacing)


def halves(params: dict, sc: StepConfig, key: jax.Array) -> tuple[dict, dict, dict]:
  """``(policy, frozen, ref)`` of the base ``params``: the trained policy and the frozen rest (:func:`lora.split`;
  ``key`` draws LoRA's A) and the frozen reference (LoRA: ``{}``, the base with adapters off; else the policy's
  values). With ``sc.frozen_dtype='bfloat16'`` the frozen parts and the reference are stored in bfloat16 and the
  policy (float32) starts at the same rounded values, so that policy = reference at the start; every layer still
  computes in float32 on the rounded weights (:func:`precision.stored`), log-probs included. Works on abstract
  (``ShapeDtypeStruct``) trees too (plan mode)."""
  policy, frozen = lora_lib.split(params, sc.trainable, sc.lora, key)
  frozen = precision.stored(frozen, sc.frozen_dtype)
  if sc.lora.rank:
    return policy, frozen, {}
  policy = precision.stored(precision.stored(policy, sc.frozen_dtype), "float32")
  return policy, frozen, precision.stored(policy, sc.frozen_dtype)


def assemble(frozen, policy, sc: StepConfig) -> dict:
  """The model's parameters, :func:`lora.assemble`; with LoRA the merged kernels pinned to their base kernels'
  shardings (:func:`sharding.constrain_params`)."""
  params = lora_lib.assemble(frozen, policy, sc.lora)
  return sharding.constrain_params(params) if sc.lora.rank else params


def build_batch(graphdef, diff, sc: StepConfig, policy, frozen, ref, ids, adv, rec, final, key):
  """The gradient-free half of an update: ``(TrainBatch, info)`` (MTE chains, selection, reference)."""
  model = nnx.merge(graphdef, assemble(frozen, policy, sc))
  ref_model = nnx.merge(graphdef, assemble(frozen, ref, sc))
  return batch_lib.build(model, ref_model, diff, sc.sampler, sc.batch, sc.loss, rec, final, ids, adv, key)


def accumulate(chunk_loss, params, parts: int):
  """``((loss, metrics), grads)`` of ``sum_c chunk_loss(params, c)`` over the microbatches ``c < parts`` of an
  optimizer step's rows: one ``value_and_grad`` for one part, else a ``lax.scan`` whose carry is the running sum
  (the activation memory of one microbatch)."""
  vg = jax.value_and_grad(chunk_loss, has_aux=True)
  if parts == 1:
    return vg(params, 0)
  zero = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), jax.eval_shape(vg, params, 0))
  add = lambda acc, c: (jax.tree.map(jnp.add, acc, vg(params, c)), None)
  return jax.lax.scan(add, zero, jnp.arange(parts))[0]


def num_parts(rows: int, microbatch: int) -> int:
  """Microbatches of an optimizer step's ``rows`` (``microbatch`` 0, or covering them: one)."""
  return rows // microbatch if 0 < microbatch < rows else 1


def update(graphdef, tx, diff, sc: StepConfig, state, frozen, batch: loss_lib.TrainBatch):
  """The loss-and-update half; ``frozen`` never reaches the optimizer. Metrics are means over the optimizer
  steps taken."""
  def one(state, sub, steps=None):
    parts = num_parts(sub.adv.shape[0], sc.microbatch)
    norm = loss_lib.counts(sub, steps) if parts > 1 else None  # the whole batch's, so the parts' losses sum

    def chunk(p, c):
      part = sub if parts == 1 else sub.microbatch(c, parts)
      return loss_lib.loss_fn(nnx.merge(graphdef, assemble(frozen, p, sc)), diff, sc.loss, part, steps,
                              norm)
    (loss, m), grads = accumulate(chunk, state["policy"], parts)
    updates, opt = tx.update(grads, state["opt"], state["policy"])
    policy = jax.tree.map(jnp.add, state["policy"], updates)
    return dict(state, policy=policy, opt=opt), dict(loss=loss, grad_norm=optim.global_norm(grads), **m)

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


@flax.struct.dataclass
class Block:
  """The rows an optimizer step of a forward-process estimator sees: prompts, advantages, scored tokens."""
  ids: jax.Array
  adv: jax.Array
  tokens: jax.Array


@dataclasses.dataclass(frozen=True)
class Context:
  """What an estimator's loss reads besides the parameters: the model's structure, the frozen parts, and the
  models it may be held to (``anchors``: 'ref' the frozen reference, 'rollout' the policy that sampled the batch,
  'ema' the policy's EMA when the state has one)."""
  graphdef: object
  sc: "StepConfig"
  train_diff: object
  frozen: dict
  anchors: dict

  def params(self, policy: dict) -> dict:
    """The model's parameters with ``policy`` (the trained one, or an anchor): :func:`lora.assemble`."""
    return assemble(self.frozen, policy, self.sc)


def heaviest_rows(fc: forward_lib.ForwardConfig, ids, adv, tokens):
  """``(ids, adv, tokens, kept)``: with ``fc.rows``, the rows of largest ``|A|``, their weights scaled by rows / B
  so that the loss is the whole batch's less the dropped terms, and ``kept`` the share of ``sum |A|`` they hold."""
  if not fc.rows:
    return ids, adv, tokens, jnp.ones(())
  keep = jax.lax.top_k(jnp.abs(adv), fc.rows)[1]
  total = jnp.sum(jnp.abs(adv))
  kept = jnp.where(total > 0, jnp.sum(jnp.abs(adv[keep])) / jnp.maximum(total, 1e-30), 1.0)
  return ids[keep], adv[keep] * (fc.rows / adv.shape[0]), tokens[keep], kept


def repeat_rows(fc: forward_lib.ForwardConfig, x):
  """Each row ``fc.draws`` times: scored at independent draws, which the estimators' mean over rows averages."""
  return jnp.concatenate([x] * fc.draws) if fc.draws > 1 else x


def forward_update(graphdef, tx, train_diff, sc: StepConfig, state, frozen, ref, ids, adv, tokens, key):
  """A forward-process estimator (``sc.estimator``: image_elbo, awm, nft): ``num_inner`` passes of
  ``num_minibatches`` optimizer steps over row blocks of ``(ids, adv, tokens)`` (the ``forward.rows`` of largest
  ``|A|`` when set, each scored with ``forward.draws`` independent draws); step ``u`` draws its own orders, masks
  and noise levels from ``fold_in(key, u)``."""
  est, fc = estimators.get(sc.estimator), sc.forward
  ids, adv, tokens, kept = heaviest_rows(fc, ids, adv, tokens)
  rows = adv.shape[0] // sc.num_minibatches
  anchors = dict(ref=ref, rollout=jax.lax.stop_gradient(state["policy"]))

  def one(state, u):
    block = lambda x: repeat_rows(fc, jax.lax.dynamic_slice_in_dim(x, u % sc.num_minibatches * rows, rows))
    b = Block(block(ids), block(adv), block(tokens))
    d = forward_lib.draw(fc.objective, train_diff, b.tokens, jax.random.fold_in(key, u))
    ctx = Context(graphdef, sc, train_diff, frozen, dict(anchors, **({"ema": state["ema"]} if "ema" in state else {})))
    parts = num_parts(b.adv.shape[0], sc.microbatch)

    def chunk(p, c):  # the estimators' losses are means over rows: a microbatch's is weighted by its share
      with layers.remat_blocks(sc.loss.remat):  # rl.remat: each transformer block recomputed in the backward pass
        if parts == 1:
          return est.loss(ctx, p, b, d)
        part = Block(*(sharding.microbatch(x, c, parts) for x in (b.ids, b.adv, b.tokens)))
        return jax.tree.map(lambda x: x / parts, est.loss(ctx, p, part, d.microbatch(c, parts)))
    (loss, m), grads = accumulate(chunk, state["policy"], parts)
    updates, opt = tx.update(grads, state["opt"], state["policy"])
    policy = jax.tree.map(jnp.add, state["policy"], updates)
    return dict(state, policy=policy, opt=opt), dict(loss=loss, grad_norm=optim.global_norm(grads), **m)

  state, ms = jax.lax.scan(one, state, jnp.arange(sc.num_inner * sc.num_minibatches))
  return dict(state, step=state["step"] + 1), dict(jax.tree.map(jnp.mean, ms), kept_weight=kept)


def rl_step(graphdef, tx, diff, sc: StepConfig, state, frozen, ref, ids, adv, rec, final, key, train_diff=None):
  """One update with the estimator ``sc.estimator``: the chain estimators (chain, token_elbo) build their
  batch from the recorded rollout ``rec`` (:func:`build_batch`) and run :func:`update`; the forward-process ones
  (:func:`forward_update` on ``train_diff``, the unrespaced diffusion) read ``final`` (the tokenizer's
  re-encoding of the images) and no record (``rec`` is None). Then the policy's EMA and the selection
  statistics. ``frozen`` / ``ref`` are never updated."""
  if not estimators.get(sc.estimator).READS_CHAINS:
    state, out = forward_update(graphdef, tx, train_diff, sc, state, frozen, ref, ids, adv, final, key)
    return _ema(sc, state), dict(out, clip_frac=jnp.zeros(()), logp_diff=jnp.zeros(()),
                                 tokens=jnp.float32(final.shape[0] * final.shape[1]))
  batch, info = build_batch(graphdef, diff, sc, state["policy"], frozen, ref, ids, adv, rec, final, key)
  state, out = update(graphdef, tx, diff, sc, state, frozen, batch)
  state = _ema(sc, state)
  out["uncertain_frac"] = batch.uncertain.mean()
  out["keep_frac"] = batch.keep.sum() / jnp.maximum(batch.region.sum(), 1)  # consistency-aware selection
  masked_mean = lambda x, m: jnp.sum(x * m) / jnp.maximum(m.sum(), 1)
  out["uncertainty_mean"] = masked_mean(info["uncertainty"], batch.region)    # MTE std over the loss region
  out["uncertainty_topk_mean"] = masked_mean(info["uncertainty"], batch.uncertain)  # ... over U
  return state, out


def _ema(sc: StepConfig, state):
  if not sc.ema_decay:
    return state
  d = sc.ema_decay
  return dict(state, ema=jax.tree.map(lambda e, p: d * e + (1.0 - d) * p, state["ema"], state["policy"]))


def step_shardings(mesh, rules, tx, policy, frozen, ids_ndim: int = 2, ema: bool = False,
                   records: bool = True, lora: bool = False) -> dict:
  """``in_shardings`` / ``out_shardings`` of :func:`rl_step` on ``mesh``: policy, reference and optimizer
  state sharded by ``rules`` (LoRA adapters like their kernels, the reference then the empty tree), the frozen
  parts by theirs (the head replicated), batches over the batch axes; ``records``: the step reads a rollout
  record (else that argument is None)."""
  p = sharding.param_shardings(mesh, policy, rules)
  rep = sharding.replicated(mesh)
  state = dict(step=rep, policy=p, opt=sharding.opt_shardings(mesh, tx, policy, p))
  if ema:
    state["ema"] = p
  b = functools.partial(sharding.batch_sharding, mesh)
  ins = (state, sharding.param_shardings(mesh, frozen, rules), {} if lora else p, b(ids_ndim), b(1),
         sampler_lib.Record.shardings(mesh) if records else None, b(3), rep)
  return dict(in_shardings=ins, out_shardings=(state, rep))


@functools.lru_cache(maxsize=None)
def compiled_step(graphdef, sc: StepConfig, mesh=None, rules=None, sigs=None):
  """``(tx, jitted rl_step)`` shared by every run in the process with the same static configuration; the
  train state is donated, the frozen parts and the reference are plain (never donated) arguments. With a
  ``mesh``, ``sigs`` (:func:`sharding.signature` of policy and frozen) give the explicit shardings."""
  tx = optim.make(ml_collections.ConfigDict(json.loads(sc.optim)), sc.trainable, sc.total_steps)
  train_diff = None if sc.flow is not None else gaussian.make_diffusion(sc.num_train_steps)
  fn = functools.partial(rl_step, graphdef, tx, make_chain(sc), sc, train_diff=train_diff)
  if mesh is None:
    return tx, jax.jit(fn, donate_argnums=0)
  policy, frozen = (sharding.abstract(sig) for sig in sigs)
  shardings = step_shardings(mesh, rules, tx, policy, frozen, sc.ids_ndim, ema=bool(sc.ema_decay),
                             records=sc.reads_chains, lora=bool(sc.lora.rank))
  return tx, jax.jit(sharding.traced_on(fn, mesh, rules), donate_argnums=0, **shardings)
