r"""The MAR-GRPO loop (``config.mode = 'rl'``): rollout -> rewards -> group advantages -> batch (MTE, token
selection, reference) -> jitted update(s) of the AR backbone and text encoder; the diffusion head (unless
``rl.train_head``) and the reference are separate pytrees that never reach the optimizer.

Iteration ``it`` draws everything from ``fold_in(key(seed), it)`` and the prompts from ``(seed, it)``, and the
whole train state is checkpointed: rerunning the same command resumes and ends with the same parameters.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import logging
from clu import metric_writers

from margrpo_jax import checkpoint, config_files, generate, optim, rng
from margrpo_jax.data import tfds_builders
from margrpo_jax.diffusion import gaussian
from margrpo_jax.parallel import mesh as mesh_lib, sharding
from margrpo_jax.rewards import registry
from margrpo_jax.rl import advantages, batch as batch_lib, loss as loss_lib
from margrpo_jax.sampling import sampler as sampler_lib
from flax import nnx


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
                    mte_actual=("keep", "include", "replace"))


def configs_from(config):
  """Static sampler / batch / loss configs from ``config.rl`` (fidelity 'official' sets every switch), validated:
  an impossible option, window or combination raises :class:`config_files.ConfigError` in one sentence, before
  anything is loaded."""
  rl = config.rl
  for name, allowed in LOSS_OPTIONS.items():
    if rl[name] not in allowed:
      raise config_files.ConfigError(f"rl.{name}={rl[name]!r} is not one of {', '.join(allowed)}")
  if rl.group_size < 2 or rl.prompts_per_iter < 1:
    raise config_files.ConfigError(f"rl.group_size={rl.group_size} must be >= 2 and rl.prompts_per_iter="
                                   f"{rl.prompts_per_iter} >= 1 (group advantages need two images per prompt)")
  official = rl.fidelity == "official"
  pick = lambda v, off: off if official else v
  scfg = sampler_lib.SamplerConfig(num_steps=config.sampling.num_steps, cfg_scale=config.sampling.cfg_scale,
                                   cfg_schedule=config.sampling.cfg_schedule,
                                   temperature=config.sampling.temperature, guidance=True,
                                   clip_denoised=config.sampling.clip_denoised,
                                   order_group=rl.group_size if rl.shared_order or rl.shared_noise else 1,
                                   vary_steps=rl.num_ar_steps if rl.shared_noise else 0)
  bcfg = batch_lib.BatchConfig(num_ar_steps=rl.num_ar_steps, num_diffusion_steps=rl.num_diffusion_steps,
                               diffusion_window=pick(parse_window(rl.diffusion_window), (0, None)),
                               mte_seeds=rl.mte_seeds, topk_fraction=rl.topk_fraction, consistency=rl.consistency,
                               mask_after_step=pick(rl.mask_after_step, True),
                               mte_latent=pick(rl.mte_latent, "commit"),
                               mte_commit_guided=pick(rl.mte_commit_guided, True),
                               topk_scope=pick(rl.topk_scope, "all"),
                               selection_chains=pick(rl.selection_chains, "scored"),
                               loss_tokens=rl.loss_tokens)
  lcfg = loss_lib.LossConfig(beta=rl.beta, clip_eps=pick(rl.clip_eps, 0.0), ratio=pick(rl.ratio, "none"),
                             kl=pick(rl.kl, "official"), channel_reduction=rl.channel_reduction,
                             cfg_in_loss=pick(rl.cfg_in_loss, False), temperature=config.sampling.temperature,
                             clip_denoised=config.sampling.clip_denoised, remat=rl.remat,
                             sigma_grad=pick(rl.sigma_grad, False), mte_actual=pick(rl.mte_actual, "replace"))
  steps = gaussian.make_diffusion(1000, config.sampling.diffusion_steps).num_steps
  try:
    batch_lib.validate(bcfg, steps)
  except ValueError as e:
    raise config_files.ConfigError(str(e)) from None
  if bcfg.num_ar_steps > config.sampling.num_steps:
    raise config_files.ConfigError(f"rl.num_ar_steps={bcfg.num_ar_steps} exceeds the sampler's "
                                   f"sampling.num_steps={config.sampling.num_steps} AR steps")
  if rl.shared_noise and rl.num_ar_steps > config.sampling.num_steps:
    raise config_files.ConfigError("rl.shared_noise needs rl.num_ar_steps <= sampling.num_steps")
  return scfg, bcfg, lcfg, pick(rl.sequential_updates, True)


def trainable_names(config, model_cfg) -> tuple[str, ...]:
  """The components RL trains: the family's policy (e.g. text encoder + backbone), plus the head when
  ``rl.train_head`` (vanilla GRPO)."""
  names = checkpoint.model_class(model_cfg.family).policy_components
  return names + ("head",) if config.rl.train_head else names


def build_batch(graphdef, diff, scfg, bcfg, lcfg, policy, frozen, ref, ids, adv, rec, final, key):
  """The gradient-free half of an update: the :class:`TrainBatch` (MTE chains, selection, reference)."""
  model = nnx.merge(graphdef, {**frozen, **policy})
  ref_model = nnx.merge(graphdef, {**frozen, **ref})
  return batch_lib.build(model, ref_model, diff, scfg, bcfg, lcfg, rec, final, ids, adv, key)


def update(graphdef, tx, diff, lcfg, sequential, num_inner, state, frozen, batch):
  """The loss-and-update half: ``num_inner`` optimizer steps on ``batch`` (or one per selected AR step when
  ``sequential``, the official DeepSpeed behaviour); ``frozen`` never reaches the optimizer."""
  policy = state["policy"]
  groups = [[i] for i in range(batch.j.shape[0])] if sequential else [None]
  metrics = []
  for _ in range(num_inner):
    for steps in groups:
      def objective(p, steps=steps):
        return loss_lib.loss_fn(nnx.merge(graphdef, {**frozen, **p}), diff, lcfg, batch, steps)
      (loss, m), grads = jax.value_and_grad(objective, has_aux=True)(policy)
      updates, opt = tx.update(grads, state["opt"], policy)
      policy = jax.tree.map(jnp.add, policy, updates)
      state = dict(step=state["step"], policy=policy, opt=opt)
      metrics.append(dict(loss=loss, grad_norm=optim.global_norm(grads), **m))
  return dict(state, step=state["step"] + 1), jax.tree.map(lambda *xs: jnp.mean(jnp.stack(xs)), *metrics)


def rl_step(graphdef, tx, diff, scfg, bcfg, lcfg, sequential, num_inner, state, frozen, ref, ids, adv, rec,
            final, key):
  """:func:`build_batch` then :func:`update`, plus the uncertainty statistics. ``frozen`` / ``ref`` are never
  updated."""
  batch, info = build_batch(graphdef, diff, scfg, bcfg, lcfg, state["policy"], frozen, ref, ids, adv, rec, final,
                            key)
  state, out = update(graphdef, tx, diff, lcfg, sequential, num_inner, state, frozen, batch)
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
def compiled_step(graphdef, num_train_steps, respacing, scfg, bcfg, lcfg, sequential, num_inner, optim_json, names,
                  num_iters, mesh=None, rules=None, sigs=None, ids_ndim=2):
  """``(tx, jitted rl_step)`` shared by every run in the process with the same static configuration; the
  train state is donated, the frozen parts and the reference are plain (never donated) arguments. With a
  ``mesh``, ``sigs`` (:func:`sharding.signature` of policy and frozen) give the explicit shardings."""
  tx = optim.make(ml_collections.ConfigDict(json.loads(optim_json)), names, num_iters)
  diff = gaussian.make_diffusion(num_train_steps, respacing)
  fn = functools.partial(rl_step, graphdef, tx, diff, scfg, bcfg, lcfg, sequential, num_inner)
  if mesh is None:
    return tx, jax.jit(fn, donate_argnums=0)
  policy, frozen = (sharding.abstract(sig) for sig in sigs)
  return tx, jax.jit(fn, donate_argnums=0, **step_shardings(mesh, rules, tx, policy, frozen, ids_ndim))


def _evaluate(graphdef, params, model_cfg, config, records):
  images = generate.generate(graphdef, params, model_cfg, [r["prompt"] for r in records], config.sampling,
                             seed=config.eval.seed, batch_size=config.eval.batch_size)
  res = generate.score(images, records)
  return {k: res[k] for k in ("strict_pass", "partial", "noise", "per_task")}, images


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
  static: tuple  # (SamplerConfig, BatchConfig, LossConfig, sequential) from :func:`configs_from`
  mesh: object
  state_shardings: dict

  def init_state(self) -> dict:
    policy = jax.tree.map(jnp.copy, self.policy)  # the state is donated to the step; self.policy stays valid
    return jax.device_put(dict(step=jnp.int32(0), policy=policy, opt=self.tx.init(policy)), self.state_shardings)


def _check_rl_family(family: str) -> None:
  if "make_sample_fn" in vars(checkpoint.model_class(family)):
    raise checkpoint.CheckpointError(f"MAR-GRPO for the {family} family (its own sampler and flow head) is not "
                                     "implemented yet: the loss and batch builder are Gaussian-head only.")


def setup(config, params_override=None) -> Setup:
  """Load ``config.checkpoint`` (default: the shipped base), place it on the mesh of ``config.parallel`` and
  build the static parts. ``params_override``: ``(model_cfg, graphdef, params)`` instead of a checkpoint."""
  from margrpo_jax.jobs.sample import SHIPPED_BASE
  static = configs_from(config)  # every RL option validated before anything is loaded
  family = params_override[0].family if params_override else config.model.family if config.get("model") else "tiny"
  if not (params_override or config.checkpoint) and family != "tiny":
    raise checkpoint.CheckpointError(f"config.checkpoint is not set: a {family} run needs a converted export "
                                     "(python -m margrpo_jax.convert).")
  _check_rl_family(family)  # before loading: a real checkpoint takes a while
  model_cfg, graphdef, params = params_override or checkpoint.load_model(config.checkpoint or SHIPPED_BASE)
  _check_rl_family(model_cfg.family)  # the export's own family (a shapes config may point at any export)
  mesh = mesh_lib.make_mesh(config.parallel.mesh)
  rules = sharding.hashable_rules(config.parallel.rules)
  names = trainable_names(config, model_cfg)
  params = jax.device_put(params, sharding.param_shardings(mesh, params, rules))
  policy = {k: params[k] for k in names}
  frozen = {k: v for k, v in params.items() if k not in names}
  sigs = (sharding.signature(policy), sharding.signature(frozen))
  ids_ndim = checkpoint.model_class(model_cfg.family).condition_ndim
  tx, step_fn = compiled_step(graphdef, model_cfg.diffusion.num_train_steps, config.sampling.diffusion_steps,
                              *static, config.rl.num_inner, config.optim.to_json(), names, config.num_iters,
                              mesh, rules, sigs, ids_ndim)
  diff = gaussian.make_diffusion(model_cfg.diffusion.num_train_steps, config.sampling.diffusion_steps)
  rollout_fn = sampler_lib.make_sample_fn(graphdef, diff, static[0], record=True, mesh=mesh, rules=rules,
                                          params=params, ids_ndim=ids_ndim)
  state_sh = step_shardings(mesh, rules, tx, policy, frozen, ids_ndim)["out_shardings"][0]
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
  adv = sharding.to_global(adv[sharding.host_rows(len(adv))], sharding.batch_sharding(s.mesh, 1))
  state, m = s.step_fn(state, s.frozen, s.ref, ro["ids"], adv, ro["rec"], ro["final"], rng.stream(ro["key"], "train"))
  m = {k: float(v) for k, v in jax.device_get(m).items()}
  strict = ro["parts"].get("shapes_strict", registry.REWARDS["shapes_strict"](ro["images"], ro["mds"]))
  m.update(reward=float(reward.mean()), strict_pass=float(np.mean(strict)),
           group_diversity=float(np.mean(np.std(reward.reshape(-1, g), axis=1))),
           **{f"reward_{name}": float(np.mean(v)) for name, v in ro["parts"].items()})
  return state, m, ro


def run(config, workdir: str, max_iters_this_run: int | None = None) -> dict:
  """MAR-GRPO from ``config.checkpoint`` (the shipped base by default); resumable in ``workdir``."""
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
  eval_recs = eval_recs[::max(1, len(eval_recs) // config.eval.num_prompts)][:config.eval.num_prompts]
  mngr = checkpoint.manager(os.path.join(workdir, "checkpoints"), keep=config.save.keep)
  _, state = checkpoint.restore_latest(mngr, s.init_state())
  start = int(state["step"])

  base_path = os.path.join(workdir, "base_eval.json")
  if not os.path.exists(base_path):
    base_eval, base_images = _evaluate(graphdef, params, model_cfg, config, eval_recs)
    with open(base_path, "w") as f:
      json.dump(base_eval, f)
    np.save(os.path.join(workdir, "base_images.npy"), base_images)
  with open(base_path) as f:
    base_eval = json.load(f)
  logging.info("base policy on %d eval prompts: strict %.3f partial %.3f", len(eval_recs),
               base_eval["strict_pass"], base_eval["partial"])

  hist_path = os.path.join(workdir, "metrics.jsonl")
  history = []
  if os.path.exists(hist_path):
    with open(hist_path) as f:
      history = [h for h in map(json.loads, f) if h["iter"] < start]
  g = config.rl.group_size
  end = config.num_iters if max_iters_this_run is None else min(config.num_iters, start + max_iters_this_run)
  t0 = time.time()
  for it in range(start, end):
    state, m, ro = iteration(config, s, state, train_recs, it)
    if m is None:
      logging.warning("iteration %d: non-finite reward %s; skipped, parameters untouched", it, ro["reward"])
      writer.write_scalars(it, {"skipped_nonfinite_reward": 1.0})
      continue
    if not math.isfinite(m["loss"]):
      raise FloatingPointError(f"RL loss became {m['loss']} at iteration {it}; checkpoints in {mngr.directory} "
                               "are intact.")
    history.append(dict(iter=it, **m))
    writer.write_scalars(it + 1, m)
    if it % config.log_images_every == 0:
      writer.write_images(it + 1, {"rollouts": generate.image_grid(ro["images"][:32], cols=g, scale=4)[None]})
    logging.info("iter %d/%d reward %.3f strict %.3f loss %.4f kl %.4f (%.1f min)", it + 1, config.num_iters,
                 m["reward"], m["strict_pass"], m["loss"], m["kl"], (time.time() - t0) / 60)
    if (it + 1) % config.save.every == 0 or it + 1 == end:
      mngr.save(it + 1, args=checkpoint.ocp.args.StandardSave(state))
      with open(hist_path, "w") as f:
        f.writelines(json.dumps(h) + "\n" for h in history)
  mngr.wait_until_finished()
  if end < config.num_iters:
    return state
  final_params = {**frozen, **state["policy"]}
  export = checkpoint.save_model(os.path.join(workdir, "export"), final_params, model_cfg)
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
  return state


def _write_pictures(workdir, recs, before, after, history, report):
  """Before / after grids on the same prompts and seeds, the reward / pass-rate curve, and report.md."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  from margrpo_jax import visualize
  n = min(32, len(recs))
  for name, ims in (("before", before), ("after", after)):
    visualize.captioned_grid(ims[:n], [r["prompt"] for r in recs[:n]]).save(os.path.join(workdir, f"{name}.png"))
  if history:
    fig, ax = plt.subplots(1, 2, figsize=(9, 3.2))
    it = [h["iter"] + 1 for h in history]
    ax[0].plot(it, [h["reward"] for h in history])
    ax[0].set(xlabel="iteration", ylabel="mean reward (partial score)")
    ax[1].plot(it, [h["strict_pass"] for h in history])
    ax[1].set(xlabel="iteration", ylabel="strict pass (rollouts)")
    fig.tight_layout()
    fig.savefig(os.path.join(workdir, "curves.png"), dpi=120)
    plt.close(fig)
  b, f = report["base"], report["final"]
  md = ["# MAR-GRPO on the shapes world", "", f"{report['iterations']} iterations, "
        f"{report['eval_prompts']} eval prompts (same prompts and seeds before and after).", "",
        "| | strict pass | partial |", "|---|---|---|",
        f"| base | {b['strict_pass']:.3f} | {b['partial']:.3f} |", f"| fine-tuned | {f['strict_pass']:.3f} | "
        f"{f['partial']:.3f} |", "", f"Fine-tuned policy: `{report['checkpoint']}`", "",
        "![before](before.png) ![after](after.png) ![curves](curves.png)"]
  with open(os.path.join(workdir, "report.md"), "w") as fmd:
    fmd.write("\n".join(md) + "\n")
