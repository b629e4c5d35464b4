r"""The RL job (``config.mode = 'rl'``): MAR-GRPO fine-tuning of a base export.

Each iteration: rollout (recorded, jitted) -> rewards (registry) -> group advantages -> one jitted update
(``rl/step.py``: batch with MTE, token selection and reference, then the loss of ``rl/loss.py``; or, with
``rl.logp='mar'``, MAR's training ELBO of the tokenizer's re-encoding of the images) of the policy (the AR
backbone and text encoder); the diffusion head (unless ``rl.train_head``) and the reference are separate
pytrees that never reach the optimizer. ``config.rl`` is resolved once, before anything else: ``rl.fidelity=
'official'`` writes the official value of every switch into it (docs/algorithm.md section 14), so ``config.json``
records the values the run used, and :func:`configs_from` turns it into one validated :class:`step.StepConfig`.

Iteration ``it`` draws everything from ``fold_in(key(seed), it)`` and the prompts from ``(seed, it)``, and the
whole train state is checkpointed: rerunning the same command resumes and ends with the same parameters.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import logging
from clu import metric_writers, periodic_actions

from margrpo_jax import checkpoint, config_files, generate, optim, rng
from margrpo_jax.data import shapes, tfds_builders
from margrpo_jax.diffusion import gaussian
from margrpo_jax.models import objective
from margrpo_jax.parallel import mesh as mesh_lib, sharding
from margrpo_jax.rewards import registry
from margrpo_jax.rl import advantages, batch as batch_lib, loss as loss_lib, step as step_lib
from margrpo_jax.sampling import sampler as sampler_lib


def parse_window(window: str) -> tuple[int, int | None]:
  """``'lo:hi'`` (Python slice bounds over the chain's list positions; either may be empty) -> ``(lo, hi)``."""
  parts = str(window).split(":")
  try:
    if len(parts) != 2:
      raise ValueError
    return int(parts[0] or 0), int(parts[1]) if parts[1].strip() else None
  except ValueError:
    raise config_files.ConfigError(f"rl.diffusion_window={window!r} is not 'lo:hi' (list positions of the "
                                   "diffusion chain, Python slice bounds, e.g. '1:-3' or ':')") from None


LOSS_OPTIONS = dict(fidelity=("intended", "official"), ratio=("rollout", "none"), kl=("gaussian", "official"),
                    channel_reduction=("sum", "mean"), advantage=("grpo", "drgrpo", "rloo"),
                    mte_actual=("keep", "include", "replace"), reward_norm=registry.NORMALIZE)

# rl.fidelity='official': the official code's value of every switch (docs/algorithm.md sections 13-14)
OFFICIAL = dict(diffusion_window=":", mask_after_step=True, mte_latent="commit", mte_commit_guided=True,
                topk_scope="all", selection_chains="scored", clip_eps=0.0, ratio="none", kl="official",
                cfg_in_loss=False, sigma_grad=False, mte_actual="replace", sequential_updates=True)


def resolve_fidelity(config) -> list[str]:
  """With ``rl.fidelity='official'``, write :data:`OFFICIAL` into ``config.rl`` (in place); returns the
  ``key=value`` assignments that changed something."""
  if config.rl.fidelity != "official":
    return []
  changed = [f"rl.{k}={v!r}" for k, v in OFFICIAL.items() if config.rl[k] != v]
  config.rl.update(OFFICIAL)
  return changed


def configs_from(config) -> step_lib.StepConfig:
  """The static :class:`step.StepConfig` of ``config`` (already resolved by :func:`resolve_fidelity`),
  validated: an impossible option, window or combination raises :class:`config_files.ConfigError` in one
  sentence, before anything is loaded."""
  rl = config.rl
  for name, allowed in LOSS_OPTIONS.items():
    if rl[name] not in allowed:
      raise config_files.ConfigError(f"rl.{name}={rl[name]!r} is not one of {', '.join(allowed)}")
  if rl.group_size < 2 or rl.prompts_per_iter < 1:
    raise config_files.ConfigError(f"rl.group_size={rl.group_size} must be >= 2 and rl.prompts_per_iter="
                                   f"{rl.prompts_per_iter} >= 1 (group advantages need two images per prompt)")
  images = rl.group_size * rl.prompts_per_iter
  if rl.num_inner < 1 or rl.num_minibatches < 1 or images % rl.num_minibatches:
    raise config_files.ConfigError(f"rl.num_inner={rl.num_inner} must be >= 1 and rl.num_minibatches="
                                   f"{rl.num_minibatches} >= 1 and divide the {images} images of an iteration")
  if rl.num_ar_steps < 0 or rl.num_ar_steps > config.sampling.num_steps:
    raise config_files.ConfigError(f"rl.num_ar_steps={rl.num_ar_steps} must lie in [0, sampling.num_steps="
                                   f"{config.sampling.num_steps}] (0 = every AR step)")
  num_ar = rl.num_ar_steps or config.sampling.num_steps
  scfg = sampler_lib.SamplerConfig(num_steps=config.sampling.num_steps, cfg_scale=config.sampling.cfg_scale,
                                   cfg_schedule=config.sampling.cfg_schedule,
                                   temperature=config.sampling.temperature, guidance=True,
                                   clip_denoised=float(config.sampling.clip_denoised),
                                   order_group=rl.group_size if rl.shared_order or rl.shared_noise else 1,
                                   vary_steps=num_ar if rl.shared_noise else 0)
  bcfg = batch_lib.BatchConfig(num_ar_steps=num_ar, num_diffusion_steps=rl.num_diffusion_steps,
                               diffusion_window=parse_window(rl.diffusion_window), mte_seeds=rl.mte_seeds,
                               topk_fraction=rl.topk_fraction, consistency=rl.consistency,
                               mask_after_step=rl.mask_after_step, mte_latent=rl.mte_latent,
                               mte_commit_guided=rl.mte_commit_guided, topk_scope=rl.topk_scope,
                               selection_chains=rl.selection_chains, loss_tokens=rl.loss_tokens,
                               logp=rl.logp)
  lcfg = loss_lib.LossConfig(beta=rl.beta, clip_eps=rl.clip_eps, ratio=rl.ratio, kl=rl.kl,
                             channel_reduction=rl.channel_reduction, cfg_in_loss=rl.cfg_in_loss,
                             temperature=config.sampling.temperature, clip_denoised=float(config.sampling.clip_denoised),
                             remat=rl.remat, sigma_grad=rl.sigma_grad, mte_actual=rl.mte_actual,
                             logp=rl.logp)
  steps = gaussian.make_diffusion(1000, config.sampling.diffusion_steps).num_steps
  try:
    batch_lib.validate(bcfg, steps)
  except ValueError as e:
    raise config_files.ConfigError(str(e)) from None
  if rl.logp == "mar" and (rl.sequential_updates or rl.train_head):
    raise config_files.ConfigError("rl.logp='mar' scores whole images with MAR's training loss: it has no AR steps "
                                   "to update in turn (rl.sequential_updates) and trains the AR side only "
                                   "(rl.train_head)")
  if not 0.0 <= rl.ema_decay < 1.0:
    raise config_files.ConfigError(f"rl.ema_decay={rl.ema_decay} must lie in [0, 1) (0 = no EMA)")
  try:
    masked = objective.MaskedObjective.from_config(rl.mar_objective)
    objective.validate(masked)
  except ValueError as e:
    raise config_files.ConfigError(str(e)) from None
  return step_lib.StepConfig(sampler=scfg, batch=bcfg, loss=lcfg, num_inner=rl.num_inner,
                             num_minibatches=rl.num_minibatches, sequential=rl.sequential_updates, masked=masked,
                             ema_decay=float(rl.ema_decay))


def trainable_names(config, model_cfg) -> tuple[str, ...]:
  """The components RL trains: the family's policy (e.g. text encoder + backbone), plus the head when
  ``rl.train_head`` (vanilla GRPO)."""
  names = checkpoint.model_class(model_cfg.family).policy_components
  return names + ("head",) if config.rl.train_head else names


def _evaluate(graphdef, params, model_cfg, config, records):
  """Eval summary (strict pass, partial, per task, per-image verdicts) and the images, sampled with the RL
  rollout settings and ``config.eval.seed``."""
  images = generate.generate(graphdef, params, model_cfg, [r["prompt"] for r in records], config.sampling,
                             seed=config.eval.seed, batch_size=config.eval.batch_size)
  res = generate.score(images, records)
  out = {k: res[k] for k in ("strict_pass", "partial", "noise", "per_task")}
  out["per_image"] = [dict(strict=bool(p["strict"]), partial=float(p["partial"])) for p in res["per_image"]]
  return out, images


@dataclasses.dataclass
class Setup:
  """Everything static about an RL run: the base model split into the trained ``policy`` and the ``frozen``
  rest, the frozen reference, the optimizer, the jitted update ``step_fn`` and the recording ``rollout_fn``."""
  model_cfg: ml_collections.ConfigDict
  graphdef: object
  params: dict
  policy: dict
  frozen: dict
  ref: dict
  tx: object
  step_fn: object
  rollout_fn: object
  diff: gaussian.Diffusion
  static: step_lib.StepConfig  # from :func:`configs_from`
  mesh: object
  state_shardings: dict

  def init_state(self) -> dict:
    policy = jax.tree.map(jnp.copy, self.policy)  # the state is donated to the step; self.policy stays valid
    state = dict(step=jnp.int32(0), policy=policy, opt=self.tx.init(policy))
    if self.static.ema_decay:
      state["ema"] = jax.tree.map(jnp.copy, self.policy)
    return jax.device_put(state, self.state_shardings)

  def trained_policy(self, state: dict) -> dict:
    """The fine-tuned policy: its EMA when ``rl.ema_decay``, else the last iterate."""
    return state["ema" if self.static.ema_decay else "policy"]

  def trained_params(self, state: dict) -> dict:
    """The fine-tuned model's parameters: the frozen parts with :meth:`trained_policy`."""
    return {**self.frozen, **self.trained_policy(state)}


def _check_rl_family(family: str) -> None:
  if "make_sample_fn" in vars(checkpoint.model_class(family)):
    raise checkpoint.CheckpointError(f"MAR-GRPO for the {family} family (its own sampler and flow head) is not "
                                     "implemented yet: the loss and batch builder are Gaussian-head only.")


def setup(config, params_override=None) -> Setup:
  """Load ``config.checkpoint`` (default: the shipped base), place it on the mesh of ``config.parallel`` and
  build the static parts. ``params_override``: ``(model_cfg, graphdef, params)`` instead of a checkpoint."""
  static = configs_from(config)  # every RL option validated before anything is loaded
  family = params_override[0].family if params_override else config.model.family if config.get("model") else "tiny"
  if not (params_override or config.checkpoint) and family != "tiny":
    raise checkpoint.CheckpointError(f"config.checkpoint is not set: a {family} run needs a converted export "
                                     "(python -m margrpo_jax.convert).")
  _check_rl_family(family)  # before loading: a real checkpoint takes a while
  model_cfg, graphdef, params = params_override or checkpoint.load_model(config.checkpoint or checkpoint.resolve("shapes_base"))
  _check_rl_family(model_cfg.family)  # the export's own family (a shapes config may point at any export)
  if config.rl.logp == "mar" and config.rl.reencode and not hasattr(checkpoint.model_class(model_cfg.family),
                                                                     "encode_images"):
    raise config_files.ConfigError(f"rl.reencode needs the {model_cfg.family} family's image encoder, which is not "
                                   "implemented: set rl.reencode=False to score the sampled tokens")
  mesh = mesh_lib.make_mesh(config.parallel.mesh)
  rules = sharding.hashable_rules(config.parallel.rules)
  names = trainable_names(config, model_cfg)
  params = jax.device_put(params, sharding.param_shardings(mesh, params, rules))
  policy = {k: params[k] for k in names}
  frozen = {k: v for k, v in params.items() if k not in names}
  sigs = (sharding.signature(policy), sharding.signature(frozen))
  ids_ndim = checkpoint.model_class(model_cfg.family).condition_ndim
  tx, step_fn = step_lib.compiled_step(graphdef, model_cfg.diffusion.num_train_steps,
                                       config.sampling.diffusion_steps, static, config.optim.to_json(), names,
                                       config.num_iters, mesh, rules, sigs, ids_ndim)
  diff = gaussian.make_diffusion(model_cfg.diffusion.num_train_steps, config.sampling.diffusion_steps)
  rollout_fn = sampler_lib.make_sample_fn(graphdef, diff, static.sampler, record=True, mesh=mesh, rules=rules,
                                          params=params, ids_ndim=ids_ndim)
  state_sh = step_lib.step_shardings(mesh, rules, tx, policy, frozen, ids_ndim,
                                     ema=bool(static.ema_decay))["out_shardings"][0]
  ref = jax.device_put(jax.tree.map(jnp.copy, policy), state_sh["policy"])  # frozen copy, never donated
  return Setup(model_cfg, graphdef, params, policy, frozen, ref, tx, step_fn, rollout_fn, diff, static, mesh,
               state_sh)


def rollout(config, s: Setup, policy: dict, train_recs: list[dict], it: int) -> dict:
  """Iteration ``it``'s rollout: ``prompts_per_iter`` train prompts x ``group_size`` images, recorded, decoded
  and rewarded. Everything is a function of ``(config.seed, it)``."""
  g, p = config.rl.group_size, config.rl.prompts_per_iter
  r = np.random.default_rng([config.seed, it])
  mds = [train_recs[i] for i in r.integers(len(train_recs), size=p) for _ in range(g)]
  family = checkpoint.model_class(s.model_cfg.family)
  local = np.asarray(family.prompt_ids(s.model_cfg, [m["prompt"] for m in mds[sharding.host_rows(len(mds))]]))
  ids = sharding.to_global(local, sharding.batch_sharding(s.mesh, local.ndim))  # each host: its share of prompts
  key = jax.random.fold_in(jax.random.key(config.seed), it)
  final, rec = s.rollout_fn({**s.frozen, **policy}, ids, rng.stream(key, "rollout"))
  images = np.asarray(family.decode_images(s.model_cfg, sharding.to_host(final)))
  reward, parts = registry.compute(config.rl.rewards.to_dict(), images, mds, settings=config.get("rewards"),
                                   normalize_each=config.rl.get("reward_norm", "none"))
  return dict(mds=mds, ids=ids, key=key, final=final, rec=rec, images=images, reward=reward, parts=parts)


def iteration(config, s: Setup, state: dict, train_recs: list[dict], it: int):
  """One RL iteration: rollout, rewards, group advantages (permuted inside groups when
  ``rl.shuffle_advantages``, the no-signal control), one jitted update. Returns ``(state, metrics, rollout)``;
  metrics are None (and only the step counter moves) when a reward is non-finite."""
  g = config.rl.group_size
  ro = rollout(config, s, state["policy"], train_recs, it)
  reward = ro["reward"]
  if config.rl.debug_nan_iter == it:  # test hook: a non-finite reward
    reward = ro["reward"] = np.where(np.arange(len(reward)) == 0, np.nan, reward)
  if not np.all(np.isfinite(reward)):
    return dict(state, step=state["step"] + 1), None, ro
  adv = np.asarray(advantages.group_advantages(reward, g, config.rl.advantage))
  if config.rl.shuffle_advantages:
    adv = advantages.shuffle_in_groups(adv, g, [config.seed, it])
  if config.rl.positive_only:  # learn from the better-than-group images only (no push away from the others)
    adv = np.maximum(adv, 0.0)
  adv = sharding.to_global(adv[sharding.host_rows(len(adv))], sharding.batch_sharding(s.mesh, 1))
  final = ro["final"]
  if config.rl.logp == "mar" and config.rl.reencode:  # the tokenizer's latents of the images the reward saw
    family = checkpoint.model_class(s.model_cfg.family)
    local = np.asarray(family.encode_images(s.model_cfg, ro["images"][sharding.host_rows(len(ro["images"]))]))
    final = sharding.to_global(local, sharding.batch_sharding(s.mesh, 3))
  state, m = s.step_fn(state, s.frozen, s.ref, ro["ids"], adv, ro["rec"], final, rng.stream(ro["key"], "train"))
  m = {k: float(v) for k, v in jax.device_get(m).items()}
  strict = ro["parts"].get("shapes_strict", registry.REWARDS["shapes_strict"](ro["images"], ro["mds"]))
  m.update(reward=float(reward.mean()), strict_pass=float(np.mean(strict)),
           group_diversity=float(np.mean(np.std(reward.reshape(-1, g), axis=1))),
           **{f"reward_{name}": float(np.mean(v)) for name, v in ro["parts"].items()})
  return state, m, ro


def run(config, workdir: str, max_iters_this_run: int | None = None) -> dict:
  """MAR-GRPO from ``config.checkpoint`` (the shipped base by default); resumable in ``workdir``."""
  for change in resolve_fidelity(config):
    logging.info("rl.fidelity='official' sets %s", change)
  configs_from(config)  # a bad option is one sentence before the workdir is touched
  os.makedirs(workdir, exist_ok=True)
  with open(os.path.join(workdir, "config.json"), "w") as f:
    f.write(config.to_json(indent=2, sort_keys=True))
  writer = metric_writers.create_default_writer(workdir, just_logging=jax.process_index() > 0)
  s = setup(config)
  model_cfg, graphdef, params, frozen = s.model_cfg, s.graphdef, s.params, s.frozen
  data_dir = config.tfds_dir or os.path.join(workdir, "tfds")
  train_recs = [r["metadata"] for r in tfds_builders.load_split("shapes_world", "train", data_dir)]
  eval_recs = [r["metadata"] for r in tfds_builders.load_split("shapes_world", "eval", data_dir)]
  eval_recs = shapes.stratified_subset(eval_recs, config.eval.num_prompts)  # tasks in turn, distinct prompts
  mngr = checkpoint.manager(os.path.join(workdir, "checkpoints"), keep=config.save.keep)
  _, state = checkpoint.restore_latest(mngr, s.init_state())
  start = int(state["step"])
  writer.write_texts(start, {"config": "```\n" + config.to_json(indent=2, sort_keys=True) + "\n```"})

  base_path = os.path.join(workdir, "base_eval.json")
  if not os.path.exists(base_path):
    logging.info("evaluating the base policy on %d eval prompts (compiling the sampler first) ...", len(eval_recs))
    base_eval, base_images = _evaluate(graphdef, params, model_cfg, config, eval_recs)
    with open(base_path, "w") as f:
      json.dump(base_eval, f)
    np.save(os.path.join(workdir, "base_images.npy"), base_images)
  with open(base_path) as f:
    base_eval = json.load(f)
  logging.info("base policy on %d eval prompts: strict %.3f partial %.3f %s", len(eval_recs),
               base_eval["strict_pass"], base_eval["partial"], _fmt_tasks(base_eval))

  hist_path = os.path.join(workdir, "metrics.jsonl")
  history = []
  if os.path.exists(hist_path):
    with open(hist_path) as f:
      history = [h for h in map(json.loads, f) if h["iter"] < start]
  g = config.rl.group_size
  end = config.num_iters if max_iters_this_run is None else min(config.num_iters, start + max_iters_this_run)
  steps_per_iter = config.rl.num_inner * config.rl.num_minibatches
  lr = optim.lr_schedule(config.optim, config.num_iters * steps_per_iter)
  progress = periodic_actions.ReportProgress(num_train_steps=config.num_iters, writer=writer)
  t0 = time.time()
  if start < end:
    logging.info("RL iterations %d..%d of %d (%d prompts x %d images each); the first one compiles the rollout "
                 "and the update ...", start + 1, end, config.num_iters, config.rl.prompts_per_iter, g)
  for it in range(start, end):
    t_it = time.time()
    state, m, ro = iteration(config, s, state, train_recs, it)
    progress(it + 1)
    if m is None:
      logging.warning("iteration %d: non-finite reward %s; skipped, parameters untouched", it, ro["reward"])
      writer.write_scalars(it, {"skipped_nonfinite_reward": 1.0})
      continue
    if not math.isfinite(m["loss"]):
      raise FloatingPointError(f"RL loss became {m['loss']} at iteration {it}; checkpoints in {mngr.directory} "
                               "are intact.")
    m.update(learning_rate=float(lr(it * steps_per_iter)), step_seconds=time.time() - t_it)
    history.append(dict(iter=it, **m))
    writer.write_scalars(it + 1, m)
    if it % config.log_images_every == 0:
      writer.write_images(it + 1, {"rollouts": generate.image_grid(ro["images"][:32], cols=g, scale=4)[None]})
    logging.info("iter %d/%d reward %.3f strict %.3f loss %.4f kl %.4f (%.1f s; %.1f min in all)", it + 1,
                 config.num_iters, m["reward"], m["strict_pass"], m["loss"], m["kl"], m["step_seconds"],
                 (time.time() - t0) / 60)
    if (it + 1) % config.save.every == 0 or it + 1 == end:
      mngr.save(it + 1, args=checkpoint.ocp.args.StandardSave(state))
      with open(hist_path, "w") as f:
        f.writelines(json.dumps(h) + "\n" for h in history)
  mngr.wait_until_finished()
  if end < config.num_iters:
    return state
  final_params = s.trained_params(state)
  export = checkpoint.save_model(os.path.join(workdir, "export"), final_params, model_cfg)
  logging.info("evaluating the fine-tuned policy on the same %d prompts and seeds ...", len(eval_recs))
  final_eval, final_images = _evaluate(graphdef, final_params, model_cfg, config, eval_recs)
  report = dict(base=base_eval, final=final_eval, checkpoint=export, iterations=config.num_iters,
                eval_prompts=len(eval_recs))
  with open(os.path.join(workdir, "report.json"), "w") as f:
    json.dump(report, f, indent=1)
  base_images = np.load(os.path.join(workdir, "base_images.npy"))
  writer.write_images(config.num_iters, {"eval/before": generate.image_grid(base_images[:64], scale=4)[None],
                                         "eval/after": generate.image_grid(final_images[:64], scale=4)[None]})
  writer.write_scalars(config.num_iters, {"eval/base_strict_pass": base_eval["strict_pass"],
                                          "eval/final_strict_pass": final_eval["strict_pass"]})
  _write_pictures(workdir, eval_recs, base_images, final_images, history, report)
  writer.flush()
  print(f"strict pass {base_eval['strict_pass']:.3f} (base) -> {final_eval['strict_pass']:.3f} (fine-tuned) on "
        f"{len(eval_recs)} eval prompts; {_fmt_tasks(final_eval)}; report: {os.path.join(workdir, 'report.md')}")
  return state


def _fmt_tasks(ev: dict) -> str:
  return ", ".join(f"{t} {v:.2f}" for t, v in (ev.get("per_task") or {}).items())


def _verdict(p: dict) -> str:
  return ("PASS" if p["strict"] else "fail") + f" {p['partial']:.2f}"


def _write_pictures(workdir, recs, before, after, history, report):
  """Before / after grids on the same prompts and seeds (tasks in turn, each image's verdict under it), the pairs
  side by side, the reward / pass-rate curves, and report.md."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  from margrpo_jax import visualize
  n = min(32, len(recs))
  b, f = report["base"], report["final"]
  prompts = [r["prompt"] for r in recs[:n]]
  for name, ims, ev in (("before", before, b), ("after", after, f)):
    visualize.captioned_grid(ims[:n], prompts, footers=[_verdict(p) for p in ev["per_image"][:n]]).save(
        os.path.join(workdir, f"{name}.png"))
  gap = np.full((n,) + before.shape[1:2] + (2, 3), 255, np.uint8)
  pairs = np.concatenate([before[:n], gap, after[:n]], axis=2)
  footers = [f"{'PASS' if q['strict'] else 'fail'} <- {'PASS' if p['strict'] else 'fail'}"
             for p, q in zip(b["per_image"][:n], f["per_image"][:n])]
  visualize.captioned_grid(pairs, prompts, cols=6, footers=footers).save(os.path.join(workdir, "before_after.png"))
  if history:
    fig, ax = plt.subplots(1, 2, figsize=(9, 3.2))
    it = [h["iter"] + 1 for h in history]
    ax[0].plot(it, [h["reward"] for h in history])
    ax[0].set(xlabel="iteration", ylabel="mean rollout reward")
    ax[1].plot(it, [h["strict_pass"] for h in history])
    ax[1].set(xlabel="iteration", ylabel="strict pass (rollouts)")
    fig.tight_layout()
    fig.savefig(os.path.join(workdir, "curves.png"), dpi=120)
    plt.close(fig)
  tasks = sorted(set(b.get("per_task") or {}) | set(f.get("per_task") or {}))
  row = lambda name, ev: (f"| {name} | {ev['strict_pass']:.3f} | {ev['partial']:.3f} | "
                          + " | ".join(f"{ev['per_task'].get(t, float('nan')):.3f}" for t in tasks) + " |")
  md = ["# MAR-GRPO on the shapes world", "", f"{report['iterations']} iterations, "
        f"{report['eval_prompts']} eval prompts (tasks in turn; same prompts and seeds before and after).", "",
        "| | strict pass | partial | " + " | ".join(tasks) + " |", "|---|---|---|" + "---|" * len(tasks),
        row("base", b), row("fine-tuned", f), "", f"Fine-tuned policy: `{report['checkpoint']}`", "",
        "Each pair: base (left), fine-tuned (right); the verdicts read fine-tuned <- base.", "",
        "![before and after](before_after.png)", "", "![curves](curves.png)"]
  with open(os.path.join(workdir, "report.md"), "w") as fmd:
    fmd.write("\n".join(md) + "\n")
