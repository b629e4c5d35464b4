r"""The RL job (``config.mode = 'rl'``): MAR-GRPO fine-tuning of a base export.

Each iteration: rollout (recorded, jitted) -> rewards (registry) -> group advantages -> one jitted update
(``rl/step.py`` with the estimator ``rl.estimator`` of ``rl/estimators/``: from the recorded chains, batch with MTE,
token selection and reference, then the loss of ``rl/loss.py``; or a forward-process estimator on the tokenizer's
re-encoding of the images, with a rollout that records nothing) of the policy (the AR
backbone and text encoder); the diffusion head (unless ``rl.train_head``) and the reference are separate
pytrees that never reach the optimizer. ``config.rl`` is resolved once, when the config is read
(``rl/config.py``: ``rl.fidelity='official'`` writes the official value of every switch into it, so
``config.json`` records the values the run used) and turned into one validated :class:`step.StepConfig`.

Any generator family (``models/families.py``): the shapes-world model, MAR (class labels), Harmon and NOVA (its
flow head scored on the recorded SDE transitions); prompts from ``rl/prompts.py`` (the shapes world, class labels
or a prompt file), rewards from the registry, evaluation on the eval prompts with the RL rewards (mean and spread;
strict pass and the per-task table too when the prompts are shapes-world prompts). A config with ``init='random'``
(``configs/{mar,harmon,nova}.py:random``) starts from a random-weight instance of its family written into
``W/random_base`` (``models/random_instance.py``).

Iteration ``it`` draws everything from ``fold_in(key(seed), it)`` and the prompts from ``(seed, it)``, and the
whole train state is checkpointed: rerunning the same command resumes and ends with the same parameters.
"""
from __future__ import annotations

import dataclasses
import math
import os
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import logging
from clu import metric_writers, periodic_actions

from margrpo_jax import checkpoint, fileio, generate, interrupt, metrics, optim, rng, validate
from margrpo_jax.data import shapes
from margrpo_jax.jobs import eval as eval_job
from margrpo_jax.models import families, precision, random_instance
from margrpo_jax.parallel import hosts, mesh as mesh_lib, sharding
from margrpo_jax.rewards import registry
from margrpo_jax.rl import (advantages, augment, config as rl_config, estimators, lora as lora_lib,
                            prompts as rl_prompts, step as step_lib)
from margrpo_jax.sampling import sampler as sampler_lib


def verifiable(model_cfg, recs: list[dict]) -> bool:
  """Whether the shapes-world verifier applies: shapes-world prompts and a shapes-world (32 px) generator."""
  return model_cfg.family == "tiny" and rl_prompts.all_shapes(recs)


def eval_rewards(config, shapes_task: bool) -> list[str]:
  """The rewards the eval scores: every reward the run optimises, and the verifier's strict / partial scores on
  shapes-world prompts."""
  names = [k for k, v in config.rl.rewards.items() if v]
  extra = ["shapes_strict", "shapes_partial"] if shapes_task else []
  return names + [n for n in extra if n not in names]


def _evaluate(graphdef, params, model_cfg, config, recs, mesh=None):
  """Eval summary and the images, sampled with the eval settings and ``config.eval.seed``: ``rewards`` (the eval
  job's table: mean, std and count per reward, overall and per category), ``per_image`` values, and, on
  shapes-world prompts, strict pass, partial and the per-task table. ``mesh``: sample on it (the run's mesh)."""
  images = generate.generate(graphdef, params, model_cfg, [r["prompt"] for r in recs], config.sampling,
                             seed=config.eval.seed, batch_size=config.eval.batch_size, mesh=mesh,
                             rules=config.parallel.rules if mesh is not None else ())
  shapes_task = verifiable(model_cfg, recs)
  values = eval_job.score(images, recs, eval_rewards(config, shapes_task), config.get("rewards"))
  summary = eval_job.summarize(values, recs)
  out = dict(rewards=summary["rewards"],
             per_image=[{k: float(v[i]) for k, v in values.items()} for i in range(len(recs))])
  if shapes_task:  # the verifier's figures, from the values scored above (each image is verified once)
    out.update(strict_pass=float(np.mean(values["shapes_strict"])), partial=float(np.mean(values["shapes_partial"])),
               per_task=summary["geneval"]["per_task"])
    for p in out["per_image"]:
      p.update(strict=bool(p["shapes_strict"]), partial=p["shapes_partial"])
  return out, images


@dataclasses.dataclass
class Setup:
  """Everything static about an RL run: the base model split into the trained ``policy`` and the ``frozen``
  rest, the frozen reference, the optimizer, the jitted update ``step_fn`` and the recording ``rollout_fn``.
  With LoRA (``rl.lora.rank > 0``, ``rl/lora.py``) ``policy`` is the initial adapter tree, ``frozen`` the whole
  base and ``ref`` the empty tree (the base: adapters off)."""
  model_cfg: ml_collections.ConfigDict
  graphdef: object
  params: dict
  policy: dict
  frozen: dict
  ref: dict
  tx: object
  step_fn: object
  rollout_fn: object
  diff: object  # the rollout chain: gaussian.Diffusion, or flow.FlowSchedule for a flow head
  static: step_lib.StepConfig  # rl/config.py's step_config, with the model's own fields
  mesh: object
  state_shardings: dict

  def init_state(self) -> dict:
    policy = jax.tree.map(jnp.copy, self.policy)  # the state is donated to the step; self.policy stays valid
    state = dict(step=jnp.int32(0), policy=policy, opt=self.tx.init(policy))
    if self.static.ema_decay:
      state["ema"] = jax.tree.map(jnp.copy, self.policy)
    return jax.device_put(state, self.state_shardings)

  @property
  def base_policy(self) -> dict:
    """The base's trained components theta_0 as float32 full weights, as the run holds them (rank 0: the policy's
    start, :attr:`policy`; LoRA: those of :attr:`frozen`, rounded under ``rl.frozen_dtype='bfloat16'``)."""
    if not self.static.lora.rank:
      return self.policy
    return precision.stored({k: self.frozen[k] for k in self.static.trainable}, "float32")

  def model_params(self, policy: dict) -> dict:
    """The model's parameters with ``policy`` (the state's, its EMA, or :attr:`ref`): :func:`lora.assemble`."""
    return lora_lib.assemble(self.frozen, policy, self.static.lora)

  def trained_policy(self, state: dict) -> dict:
    """The fine-tuned components theta as full weights (from the EMA when ``rl.ema_decay``, else the last iterate;
    with LoRA the adapters merged into the base), moved only the fraction a = ``rl.export_interpolation`` of the
    way from the base theta_0: theta_0 + a (theta - theta_0) (WiSE-FT weight interpolation; a = 1 is theta itself;
    with LoRA the merge at scale a alpha / r, the merged weights interpolated). What the job evaluates and exports."""
    theta, a = state["ema" if self.static.ema_decay else "policy"], self.static.export_interpolation
    if self.static.lora.rank:
      return lora_lib.merge(self.base_policy, theta, a * self.static.lora.scale)
    return theta if a == 1.0 else jax.tree.map(lambda t, b: b + a * (t - b), theta, self.policy)

  def trained_params(self, state: dict) -> dict:
    """The fine-tuned model's parameters (the base's tree, ordinary weights): the frozen parts with
    :meth:`trained_policy` (float32: a frozen part stored in bfloat16 is exported at its rounded values)."""
    return {**precision.stored(self.frozen, "float32"), **self.trained_policy(state)}


def base_checkpoint(config, workdir: str | None = None) -> str:
  """The export RL starts from: ``config.checkpoint``, the random-weight instance of ``config.init='random'``
  (written into ``W/random_base`` once), or the shipped shapes-world base."""
  if config.checkpoint:
    return config.checkpoint
  if config.get("init") == "random":
    if workdir is None:
      raise checkpoint.CheckpointError("config.init='random' needs a workdir to write the random-weight base into")
    return random_instance.materialize(config.model, os.path.join(workdir, "random_base"), config.seed)
  family = config.model.family if config.get("model") else "tiny"
  if family != "tiny":
    raise checkpoint.CheckpointError(f"config.checkpoint is not set: a {family} run needs a converted export "
                                     "(python -m margrpo_jax.convert).")
  return checkpoint.resolve("shapes_base")


def setup(config, params_override=None, workdir: str | None = None,
          static: step_lib.StepConfig | None = None) -> Setup:
  """Load the base (:func:`base_checkpoint`), place it on the mesh of ``config.parallel`` and build the static
  parts. ``params_override``: ``(model_cfg, graphdef, params)`` instead of a checkpoint; ``static``: the step
  config ``validate.check_rl`` built and checked (the entry point hands it over), else built here."""
  model_cfg, graphdef, params = params_override or checkpoint.load_model(base_checkpoint(config, workdir))
  if static is None:
    static = rl_config.step_config(config, model_cfg)
  graphdef = precision.with_compute(graphdef, params, config.rl.get("compute_dtype", "float32"), static.frozen_dtype)
  mesh = mesh_lib.make_mesh(config.parallel.mesh)
  rules = sharding.hashable_rules(config.parallel.rules)
  params = jax.device_put(params, sharding.param_shardings(mesh, params, rules))
  lora_key = rng.stream(jax.random.key(config.seed), "lora")  # LoRA: A's draws
  policy, frozen, ref = step_lib.halves(params, static, lora_key)  # rl.frozen_dtype: frozen parts, reference
  sigs = (sharding.signature(policy), sharding.signature(frozen))
  tx, step_fn = step_lib.compiled_step(graphdef, static, mesh, rules, sigs)
  diff = step_lib.make_chain(static)  # the Gaussian head's respaced diffusion, or NOVA's flow SDE
  rollout_fn = sampler_lib.make_sample_fn(graphdef, diff, static.sampler, record=static.reads_chains, mesh=mesh,
                                          rules=rules, params=params, ids_ndim=static.ids_ndim)
  state_sh = step_lib.step_shardings(mesh, rules, tx, policy, frozen, static.ids_ndim,
                                     ema=bool(static.ema_decay))["out_shardings"][0]
  policy = jax.device_put(policy, state_sh["policy"])  # LoRA: the new adapters placed (the rest already are)
  # the reference: with LoRA the base itself (no adapters, no copy); else a frozen copy, never donated
  ref = jax.device_put(jax.tree.map(jnp.copy, ref), state_sh["policy"]) if ref else ref
  return Setup(model_cfg, graphdef, params, policy, frozen, ref, tx, step_fn, rollout_fn, diff, static, mesh,
               state_sh)


def rollout(config, s: Setup, policy: dict, train_recs: list[dict], it: int) -> dict:
  """Iteration ``it``'s rollout: ``rl.rollout_prompts or rl.prompts_per_iter`` train prompts x ``group_size``
  images, recorded, decoded and rewarded, sampled from the model with ``policy`` (:meth:`Setup.model_params`: with
  LoRA the adapters merged into the base, ``s.ref`` the base). Everything is a function of ``(config.seed, it)``."""
  g, p = config.rl.group_size, config.rl.rollout_prompts or config.rl.prompts_per_iter
  r = np.random.default_rng([config.seed, it])
  recs = [train_recs[i] for i in r.integers(len(train_recs), size=p) for _ in range(g)]
  prompts = [m["prompt"] for m in recs]
  family = families.get(s.model_cfg.family)
  local = np.asarray(family.prompt_ids(s.model_cfg, prompts[sharding.host_rows(len(recs))]))
  ids = sharding.to_global(local, sharding.batch_sharding(s.mesh, local.ndim))  # each host: its share of prompts
  key = jax.random.fold_in(jax.random.key(config.seed), it)
  final, rec = s.rollout_fn(s.model_params(policy), ids, rng.stream(key, "rollout"))
  images = np.asarray(family.decode_images(s.model_cfg, sharding.to_host(final)))
  shapes_task = verifiable(s.model_cfg, recs)  # else the zero-weight verifier rewards are not even logged
  weights = {k: v for k, v in config.rl.rewards.items() if v or shapes_task or k not in registry.NEEDS_SHAPES}
  reward, parts = registry.compute(weights, images, [m["metadata"] for m in recs], prompts,
                                   settings=config.get("rewards"), normalize_each=config.rl.get("reward_norm", "none"))
  return dict(recs=recs, ids=ids, key=key, final=final, rec=rec, images=images, reward=reward, parts=parts)


def informative(config, s: Setup, ro: dict) -> dict:
  """The rollout ``ro`` cut to the ``rl.prompts_per_iter`` groups whose rewards vary most
  (:func:`advantages.informative_groups`; ``rl.rollout_prompts`` over-draws); ``ro`` itself when it has no more."""
  g, p = config.rl.group_size, config.rl.prompts_per_iter
  if len(ro["reward"]) == g * p:
    return ro
  rows = advantages.informative_groups(ro["reward"], g, p)
  glob = lambda x: sharding.to_global(sharding.to_host(x)[rows][sharding.host_rows(len(rows))],
                                      sharding.batch_sharding(s.mesh, x.ndim))
  return dict(ro, recs=[ro["recs"][i] for i in rows], ids=glob(ro["ids"]), final=glob(ro["final"]),
              images=ro["images"][rows], reward=ro["reward"][rows], parts={k: np.asarray(v)[rows]
                                                                         for k, v in ro["parts"].items()})


def training_tokens(config, s: Setup, ro: dict, it: int):
  """The tokens the update scores: the rollout's own, or, for an estimator that re-encodes, the tokenizer's latents
  of the decoded images the reward saw (moved as ``rl.augment`` says, rl/augment.py)."""
  if not estimators.get(config.rl.estimator).REENCODES:
    return ro["final"]
  family = families.get(s.model_cfg.family)
  images = ro["images"][sharding.host_rows(len(ro["images"]))]
  images = augment.apply(config.rl.augment, images, np.random.default_rng([config.seed, it, 2, jax.process_index()]))
  local = np.asarray(family.encode_images(s.model_cfg, images))
  return sharding.to_global(local, sharding.batch_sharding(s.mesh, 3))


def with_pretraining_images(config, s: Setup, train_recs: list[dict], it: int, ids, adv: np.ndarray, tokens):
  """``(ids, adv, tokens)`` with ``B / 4`` more rows: train prompts drawn as pretraining draws them, rendered with
  fresh layouts and encoded, each with weight ``rl.pretrain_mix`` (PPO-ptx). The forward estimators' loss
  ``-mean_i w_i ELBO_i`` then adds ``pretrain_mix / 5`` of MAR's pretraining loss to the RL term (4/5 of it)."""
  n = len(adv) // 4
  r = np.random.default_rng([config.seed, it, 1])  # a stream of its own: the rollout's prompts are unchanged
  mds = [train_recs[i]["shapes"] for i in r.integers(len(train_recs), size=n)]
  family = families.get(s.model_cfg.family)
  real_ids = np.asarray(family.prompt_ids(s.model_cfg, [m["prompt"] for m in mds]))
  real_tokens = np.asarray(family.encode_images(s.model_cfg, shapes.render_batch(mds, r)))
  cat = lambda a, b: np.concatenate([sharding.to_host(a), b])
  ids, tokens = cat(ids, real_ids), cat(tokens, real_tokens)
  rows = sharding.host_rows(len(ids))
  return (sharding.to_global(ids[rows], sharding.batch_sharding(s.mesh, ids.ndim)),
          np.concatenate([adv, np.full(n, config.rl.pretrain_mix, adv.dtype)]),
          sharding.to_global(tokens[rows], sharding.batch_sharding(s.mesh, tokens.ndim)))


def iteration(config, s: Setup, state: dict, train_recs: list[dict], it: int):
  """One RL iteration: rollout, rewards, group advantages (permuted inside groups when
  ``rl.shuffle_advantages``, the no-signal control), one jitted update. Returns ``(state, metrics, rollout)``;
  metrics are None (and only the step counter moves) when a reward is non-finite."""
  g = config.rl.group_size
  t0 = time.perf_counter()
  drawn = rollout(config, s, s.ref if config.rl.rollout_policy == "base" else state["policy"], train_recs, it)
  t_rollout = time.perf_counter() - t0  # sampling, decoding and rewards: the rewards are read on the host
  if not np.all(np.isfinite(drawn["reward"])):
    return dict(state, step=state["step"] + 1), None, drawn
  ro = informative(config, s, drawn)
  reward, ids, tokens = ro["reward"], ro["ids"], training_tokens(config, s, ro, it)
  if config.rl.diversity_bonus:
    reward = advantages.with_distinctness(reward, sharding.to_host(tokens), g, config.rl.diversity_bonus)
  adv = np.asarray(advantages.group_advantages(reward, g, config.rl.advantage))
  if config.rl.shuffle_advantages:
    adv = advantages.shuffle_in_groups(adv, g, [config.seed, it])
  adv = advantages.shape_weights(adv, config.rl.positive_only, config.rl.adv_clip)
  if config.rl.pretrain_mix:
    ids, adv, tokens = with_pretraining_images(config, s, train_recs, it, ids, adv, tokens)
  adv = sharding.to_global(adv[sharding.host_rows(len(adv))], sharding.batch_sharding(s.mesh, 1))
  t0 = time.perf_counter()
  state, m = s.step_fn(state, s.frozen, s.ref, ids, adv, ro["rec"], tokens, rng.stream(ro["key"], "train"))
  m = {k: float(v) for k, v in jax.device_get(m).items()}
  m.update(rollout_images_per_s=len(drawn["reward"]) / t_rollout,
           update_images_per_s=len(adv) / (time.perf_counter() - t0))
  if verifiable(s.model_cfg, drawn["recs"]):  # the policy's own pass rate: over every image drawn
    strict = drawn["parts"].get("shapes_strict", registry.REWARDS["shapes_strict"](
        drawn["images"], [m["shapes"] for m in drawn["recs"]]))
    m["strict_pass"] = float(np.mean(strict))
  spread = np.std(reward.reshape(-1, g), axis=1)  # per trained group
  z = sharding.to_host(ro["final"])
  m.update(reward=float(drawn["reward"].mean()), group_diversity=float(spread.mean()),
           latent_spread=metrics.latent_spread(z.reshape(-1, g, *z.shape[1:])),
           informative_groups=float(np.mean(spread > 0)),
           **{f"reward_{name}": float(np.mean(v)) for name, v in drawn["parts"].items()})
  return state, m, ro


SPREAD_WINDOW = 10  # iterations averaged at each end of rl.diversity_floor's comparison


def diversity_spent(config, history: list[dict]) -> bool:
  """``rl.diversity_floor = f > 0``: whether the rollouts' ``latent_spread`` (the mean pairwise latent distance of a
  prompt's images, :func:`metrics.latent_spread`), averaged over the last :data:`SPREAD_WINDOW` iterations of
  ``history``, has fallen below ``f`` times its average over the first ones (the base's, nearly); computed on the
  sampled latents (the study's diversity figure reads the re-encoded decoded images). The filter's
  gain comes with a loss of variety (docs/estimators.md); this spends a fixed share of it, whatever the seed."""
  f, w = config.rl.diversity_floor, SPREAD_WINDOW
  spread = [h["latent_spread"] for h in history if "latent_spread" in h]
  return bool(f) and len(spread) >= 2 * w and np.mean(spread[-w:]) < f * np.mean(spread[:w])


MAX_SKIPPED = 3  # iterations in a row with a non-finite reward before the run stops (one sentence, exit 1)


def run(config, workdir: str, max_iters_this_run: int | None = None,
        resolved: step_lib.StepConfig | None = None) -> dict:
  """MAR-GRPO from ``config.checkpoint`` (the shipped base by default); resumable in ``workdir``. ``resolved``:
  the step config the entry point's checks built (:func:`setup`)."""
  validate.begin_run(config, workdir)  # a rerun must be the same run
  writer = metric_writers.create_default_writer(workdir, just_logging=not hosts.is_main())
  s = setup(config, workdir=workdir, static=resolved)
  model_cfg, graphdef = s.model_cfg, s.graphdef
  train_recs, eval_recs = rl_prompts.load(config, model_cfg, config.tfds_dir or os.path.join(workdir, "tfds"))
  shapes_task = verifiable(model_cfg, eval_recs)
  mngr = checkpoint.manager(os.path.join(workdir, "checkpoints"), keep=config.save.keep)
  _, state = checkpoint.restore_latest(mngr, s.init_state())
  start = int(state["step"])
  writer.write_texts(start, {"config": "```\n" + config.to_json(indent=2, sort_keys=True) + "\n```"})

  base_eval, base_images = _base(config, workdir, s, eval_recs)
  logging.info("base policy on %d eval prompts: %s", len(eval_recs), _fmt_eval(base_eval))

  hist_path = os.path.join(workdir, "metrics.jsonl")
  history = [h for h in fileio.read_jsonl(hist_path) if h.get("iter", start) < start]
  g = config.rl.group_size
  spent = diversity_spent(config, history)  # a resumed run that had stopped on its diversity budget
  end = start if spent else (config.num_iters if max_iters_this_run is None
                             else min(config.num_iters, start + max_iters_this_run))
  steps_per_iter = config.rl.num_inner * config.rl.num_minibatches
  lr = optim.lr_schedule(config.optim, config.num_iters * steps_per_iter)
  progress = periodic_actions.ReportProgress(num_train_steps=config.num_iters, writer=writer)
  t0 = time.time()
  if start < end:
    logging.info("RL iterations %d..%d of %d (%d prompts x %d images each); the first one compiles the rollout "
                 "and the update ...", start + 1, end, config.num_iters, config.rl.prompts_per_iter, g)
  skipped = 0  # iterations in a row whose reward was non-finite
  with interrupt.polled():  # SIGTERM / SIGINT: finish the iteration, save, one line, exit 143 / 130
    for it in range(start, end):
      t_it = time.time()
      state, m, ro = iteration(config, s, state, train_recs, it)
      progress(it + 1)
      if it == start:
        t_first = time.time()  # the first iteration compiled: time the others
      skipped = skipped + 1 if m is None else 0
      if skipped == MAX_SKIPPED:
        checkpoint.wait(mngr)
        raise checkpoint.NonFiniteError(
            f"the reward was non-finite in {MAX_SKIPPED} iterations in a row ({it + 2 - MAX_SKIPPED}..{it + 1}; e.g. "
            f"{ro['reward'][:4]}), so nothing is being trained: check rl.rewards; the newest checkpoint in "
            f"{mngr.directory} is kept")
      if m is None:  # the step counter moved, the parameters did not: saved like any other iteration
        logging.warning("iteration %d: non-finite reward %s; skipped, parameters untouched", it, ro["reward"])
        writer.write_scalars(it, {"skipped_nonfinite_reward": 1.0})
      else:
        if not (math.isfinite(m["loss"]) and checkpoint.all_finite(state)):
          checkpoint.wait(mngr)
          newest = mngr.latest_step()
          raise checkpoint.NonFiniteError(
              f"RL iteration {it + 1} produced a non-finite loss ({m['loss']}) or parameters; it was not saved, and "
              + (f"the newest checkpoint (step {newest} in {mngr.directory}) is the last good one."
                 if newest is not None else "no checkpoint had been written yet."))
        m.update(learning_rate=float(lr(it * steps_per_iter)), step_seconds=time.time() - t_it)
        history.append(dict(iter=it, **m))
        writer.write_scalars(it + 1, m)
        if it % config.log_images_every == 0:
          writer.write_images(it + 1, {"rollouts": generate.image_grid(ro["images"][:32], cols=g, scale=4)[None]})
        left = (time.time() - t_first) / (it - start) * (end - it - 1) / 60 if it > start else 0.0
        eta = (f"ETA{' at most' if config.rl.diversity_floor else ''} {left:.1f} min" if it > start else "compiled")
        logging.info("iter %d/%d reward %.3f%s loss %.4f kl %.4f (%.1f s; %.1f min in all; %s)", it + 1,
                     config.num_iters, m["reward"], f" strict {m['strict_pass']:.3f}" if "strict_pass" in m else "",
                     m["loss"], m["kl"], m["step_seconds"],
                     (time.time() - t0) / 60, eta)
      spent = diversity_spent(config, history)
      if spent:
        logging.info("iteration %d: the rollouts' latent spread fell below rl.diversity_floor=%g of its start; "
                     "the run stops here", it + 1, config.rl.diversity_floor)
      stop = interrupt.requested()
      if (it + 1) % config.save.every == 0 or it + 1 == end or stop or spent:
        checkpoint.save_state(mngr, it + 1, state, f"the RL state after iteration {it + 1}")
        fileio.write_jsonl(hist_path, history)
      if stop and it + 1 < end:
        checkpoint.wait(mngr)
        interrupt.stop(f"the RL state after iteration {it + 1} is saved in {mngr.directory}")
      if spent:
        break
  checkpoint.wait(mngr)
  if end < config.num_iters and not spent:
    return state
  iterations = int(state["step"])
  final_params = s.trained_params(state)
  export = checkpoint.save_model(os.path.join(workdir, "export"), final_params, model_cfg,
                                 source=checkpoint.official_source(base_checkpoint(config, workdir)))
  logging.info("evaluating the fine-tuned policy on the same %d prompts and seeds ...", len(eval_recs))
  final_eval, final_images = _evaluate(graphdef, final_params, model_cfg, config, eval_recs, s.mesh)
  report = dict(base=base_eval, final=final_eval, checkpoint=export, iterations=iterations,
                eval_prompts=len(eval_recs), prompts=rl_prompts.source(config, model_cfg), family=model_cfg.family,
                reward_means={k: dict(base=base_eval["rewards"][k]["all"]["mean"],
                                      final=final_eval["rewards"][k]["all"]["mean"]) for k in base_eval["rewards"]})
  writer.write_images(iterations, {"eval/before": generate.image_grid(base_images[:64], scale=4)[None],
                                         "eval/after": generate.image_grid(final_images[:64], scale=4)[None]})
  writer.write_scalars(iterations, {f"eval/{when}_{k}": v[when] for k, v in report["reward_means"].items()
                                          for when in ("base", "final") if v[when] is not None})
  _write_pictures(workdir, eval_recs, base_images, final_images, history, report)
  writer.flush()
  fileio.write_json(os.path.join(workdir, "report.json"), report)  # last: a run with a report.json is finished
  head = (f"strict pass {base_eval['strict_pass']:.3f} (base) -> {final_eval['strict_pass']:.3f} (fine-tuned)"
          if shapes_task else ", ".join(f"{k} {v['base']:.4f} (base) -> {v['final']:.4f} (fine-tuned)"
                                         for k, v in report["reward_means"].items()))
  tasks = f"; {_fmt_tasks(final_eval)}" if shapes_task else ""
  print(f"{head} on {len(eval_recs)} eval prompts{tasks}; report: {os.path.join(workdir, 'report.md')}")
  return state


def _base(config, workdir: str, s: Setup, eval_recs: list[dict]):
  """The base policy's eval summary and images: read back from ``W/base_eval.json`` / ``W/base_images.npy``, or
  computed (and written atomically) when missing or damaged."""
  base_eval = fileio.read_json(os.path.join(workdir, "base_eval.json"))
  try:
    base_images = fileio.load_npy(os.path.join(workdir, "base_images.npy"))
  except (OSError, ValueError, EOFError):
    base_images = None
  if (base_eval is None or "rewards" not in base_eval or base_images is None
      or len(base_images) != len(eval_recs)):
    logging.info("evaluating the base policy on %d eval prompts (compiling the sampler first) ...", len(eval_recs))
    base_eval, base_images = _evaluate(s.graphdef, s.params, s.model_cfg, config, eval_recs, s.mesh)
    fileio.save_npy(os.path.join(workdir, "base_images.npy"), base_images)
    fileio.write_json(os.path.join(workdir, "base_eval.json"), base_eval, indent=None)
  return base_eval, base_images


def _fmt_eval(ev: dict) -> str:
  """One line: strict / partial / per task on shapes-world prompts, then every eval reward's mean ± std."""
  head = f"strict {ev['strict_pass']:.3f} partial {ev['partial']:.3f} {_fmt_tasks(ev)}; " if "strict_pass" in ev else ""
  return head + ", ".join(f"{k} {v['all']['mean']:.4f} ± {v['all']['std']:.4f}" for k, v in ev["rewards"].items())


def _fmt_tasks(ev: dict) -> str:
  return ", ".join(f"{t} {v:.2f}" for t, v in (ev.get("per_task") or {}).items())


def _verdict(p: dict) -> str:
  """An image's footer: PASS / fail and partial on shapes-world prompts, else its reward values."""
  if "strict" in p:
    return ("PASS" if p["strict"] else "fail") + f" {p['partial']:.2f}"
  return " ".join(f"{k[:6]} {v:.2f}" for k, v in p.items() if np.isfinite(v))


def _pair_footer(p: dict, q: dict) -> str:
  if "strict" in p:
    return f"{'PASS' if q['strict'] else 'fail'} <- {'PASS' if p['strict'] else 'fail'}"
  k = next(iter(p))
  return f"{k[:6]} {q[k]:.2f} <- {p[k]:.2f}"


def _markdown(report: dict) -> list[str]:
  """report.md's tables: strict pass per task (shapes-world prompts) and every eval reward's mean ± std."""
  b, f = report["base"], report["final"]
  cell = lambda st: "-" if not st or not st["count"] else f"{st['mean']:.4f} ± {st['std']:.4f}"
  lines = []
  if "strict_pass" in b:
    tasks = sorted(set(b.get("per_task") or {}) | set(f.get("per_task") or {}))
    row = lambda name, ev: (f"| {name} | {ev['strict_pass']:.3f} | {ev['partial']:.3f} | "
                            + " | ".join(f"{ev['per_task'].get(t, float('nan')):.3f}" for t in tasks) + " |")
    lines += ["| | strict pass | partial | " + " | ".join(tasks) + " |", "|---|---|---|" + "---|" * len(tasks),
              row("base", b), row("fine-tuned", f), ""]
  lines += ["| reward (mean ± std over images) | base | fine-tuned |", "|---|---|---|"]
  lines += [f"| {k} | {cell(b['rewards'][k]['all'])} | {cell(f['rewards'][k]['all'])} |" for k in b["rewards"]]
  return lines + [""]


def _write_pictures(workdir, recs, before, after, history, report):
  """Before / after grids on the same prompts and seeds (each image's verdict or rewards under it), the pairs
  side by side, the reward (and, on shapes-world prompts, pass-rate) curves, and report.md."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  from margrpo_jax import visualize
  n = min(32, len(recs))
  b, f = report["base"], report["final"]
  prompts = [r["prompt"] for r in recs[:n]]
  for name, ims, ev in (("before", before, b), ("after", after, f)):
    fileio.save_image(os.path.join(workdir, f"{name}.png"),
                      visualize.captioned_grid(ims[:n], prompts, footers=[_verdict(p) for p in ev["per_image"][:n]]))
  gap = np.full((n,) + before.shape[1:2] + (2, 3), 255, np.uint8)
  pairs = np.concatenate([before[:n], gap, after[:n]], axis=2)
  footers = [_pair_footer(p, q) for p, q in zip(b["per_image"][:n], f["per_image"][:n])]
  fileio.save_image(os.path.join(workdir, "before_after.png"),
                    visualize.captioned_grid(pairs, prompts, cols=6, footers=footers))
  if history:
    strict = "strict_pass" in history[0]
    fig, ax = plt.subplots(1, 2 if strict else 1, figsize=(9 if strict else 4.5, 3.2), squeeze=False)
    it = [h["iter"] + 1 for h in history]
    ax[0, 0].plot(it, [h["reward"] for h in history])
    ax[0, 0].set(xlabel="iteration", ylabel="mean rollout reward")
    if strict:
      ax[0, 1].plot(it, [h["strict_pass"] for h in history])
      ax[0, 1].set(xlabel="iteration", ylabel="strict pass (rollouts)")
    fig.tight_layout()
    fileio.save_figure(os.path.join(workdir, "curves.png"), fig)
    plt.close(fig)
  what = "the shapes world" if "strict_pass" in b else f"{report['family']} ({report['prompts']})"
  md = [f"# MAR-GRPO on {what}", "", f"{report['iterations']} iterations, {report['eval_prompts']} eval prompts "
        "(same prompts and seeds before and after).", ""] + _markdown(report) + [
        f"Fine-tuned policy: `{report['checkpoint']}`", "",
        "Each pair: base (left), fine-tuned (right); the footers read fine-tuned <- base.", "",
        "![before and after](before_after.png)", "", "![curves](curves.png)"]
  fileio.write_text(os.path.join(workdir, "report.md"), "\n".join(md) + "\n")
