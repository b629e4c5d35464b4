r"""The RL run's configuration: ``config.rl`` (with ``sampling`` and ``optim``) resolved and validated into the
one static :class:`step.StepConfig` the jitted update is built from.

``rl.fidelity='official'`` is resolved first, in place: :func:`resolve_fidelity` writes the official code's value
of every switch (:data:`OFFICIAL`, docs/algorithm.md sections 13-14) into ``config.rl``, so the config that is
recorded and run is the one that was checked. :func:`step_config` raises :class:`config_files.ConfigError` in one
sentence for an impossible option string, window or combination.
"""
from __future__ import annotations

import dataclasses

from flax import nnx

from margrpo_jax import config_files
from margrpo_jax.diffusion import gaussian
from margrpo_jax.models import families, objective, precision
from margrpo_jax.rewards import registry
from margrpo_jax.rl import (advantages, augment, batch as batch_lib, estimators, lora as lora_lib, loss as loss_lib,
                            step as step_lib)
from margrpo_jax.rl.estimators import forward as forward_lib
from margrpo_jax.sampling import sampler as sampler_lib, schedule as schedule_lib


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


FIDELITIES = ("intended", "official")   # rl.fidelity: resolved here (resolve_fidelity)
ROLLOUT_POLICIES = ("policy", "base")   # rl.rollout_policy: the rollouts' sampler (jobs/rl.py's iteration)
# The rl.* option strings read outside the step's dataclasses, each tuple owned by the code that dispatches on it;
# the dataclasses' own (:data:`STEP_OPTIONS`, from rl/loss.py and rl/batch.py) are checked by step_config too.
OPTIONS = dict(fidelity=FIDELITIES, advantage=advantages.KINDS, reward_norm=registry.NORMALIZE,
               estimator=estimators.NAMES, anchor=forward_lib.ANCHORS, rollout_policy=ROLLOUT_POLICIES,
               augment=augment.KINDS, frozen_dtype=tuple(precision.DTYPES))
STEP_OPTIONS = {k: v for k, v in {**loss_lib.OPTIONS, **batch_lib.OPTIONS}.items() if k != "logp"}  # logp: estimator's
config_key = loss_lib.config_key  # rl.official.<switch> or rl.<key>
# rl.<key> -> (low, high, low included, high included) of the numbers step_config reads (the step's own counts and
# their combinations are checked in step_config, rl.flow_noise_level with the reason it needs noise)
INF = float("inf")
RANGES = dict(beta=(0, INF, True, False), clip_eps=(0, INF, True, False), adv_clip=(0, INF, True, False),
              pretrain_mix=(0, INF, True, False), rollout_cfg_scale=(0, INF, True, False),
              rollout_temperature=(0, INF, True, False), diversity_bonus=(0, INF, True, False),
              diversity_floor=(0, 1, True, False),
              export_interpolation=(0, 1, False, True), nft_strength=(0, 1, False, True), ema_decay=(0, 1, True, False))

# rl.fidelity='official': the official code's value of every switch (docs/algorithm.md sections 13-14), those of
# the rl.official block (loss.OFFICIAL_SWITCHES) and rl.diffusion_window, rl.clip_eps and, on NOVA,
# rl.channel_reduction (settings of their own)
OFFICIAL = dict(diffusion_window=":", mask_after_step=True, mte_latent="commit", mte_commit_guided=True,
                topk_scope="all", selection_chains="scored", clip_eps=0.0, ratio="none", kl="official",
                cfg_in_loss=False, sigma_grad=False, mte_actual="replace", sequential_updates=True)
# ... and where the official NOVA code differs from the official Harmon code (docs/algorithm.md section 13, B6):
# it trains with the pre-step mask (visibility = known before step i, the loss region includes the tokens decoded
# at i: B1 is Harmon's alone); its MTE duplicates the commit-time cond latent into the uncond slot (unguided) and it averages over channels
# and draws the scored diffusion steps per AR step and casts its log-probs to bfloat16; its uncertainty top-k ranks
# latent pixels (a quarter token) and adds one random pixel (A3, C3)
OFFICIAL_NOVA = dict(OFFICIAL, mask_after_step=False, mte_commit_guided=False, channel_reduction="mean", diffusion_per_ar_step=True,
                     logp_bf16=True, uncertainty_unit="pixel", topk_random=1)


def head_kind(config, model_cfg=None) -> str:
  """'flow' (NOVA's head) or 'gaussian' (MAR / Harmon / shapes), from the model config."""
  m = model_cfg if model_cfg is not None else config.get("model")
  return str(m.get("diffusion", {}).get("kind", "gaussian")) if m is not None else "gaussian"


def block_of(rl, name: str):
  """The block of ``rl`` (a ConfigDict or the dict of a recorded config.json) holding switch ``name``:
  ``rl.official`` or ``rl``."""
  return rl["official"] if name in loss_lib.OFFICIAL_SWITCHES else rl


def official_values(config) -> dict:
  """The switch values ``rl.fidelity`` asks for: :data:`OFFICIAL` (or :data:`OFFICIAL_NOVA`) without the switches
  of ``rl.official_except``; none with 'intended'."""
  if config.rl.fidelity not in FIDELITIES:
    raise config_files.ConfigError(f"rl.fidelity={config.rl.fidelity!r} is not one of {', '.join(FIDELITIES)}")
  if config.rl.fidelity != "official":
    if str(config.rl.official_except).strip():
      raise config_files.ConfigError(f"rl.official_except={config.rl.official_except!r} only applies with "
                                     f"rl.fidelity='official' (it is {config.rl.fidelity!r})")
    return {}
  official = dict(OFFICIAL_NOVA if head_kind(config) == "flow" else OFFICIAL)
  for k in (k.strip() for k in str(config.rl.official_except).split(",") if k.strip()):
    if k not in official:
      raise config_files.ConfigError(f"rl.official_except names {k!r}, not a switch of rl.fidelity='official' "
                                     f"(switches: {', '.join(official)})")
    del official[k]
  return official


def resolve_fidelity(config) -> list[str]:
  """With ``rl.fidelity='official'``, write :data:`OFFICIAL` into ``config.rl`` and ``config.rl.official`` (in
  place), except the switches named in ``rl.official_except`` (comma-separated names; they keep their configured
  value); returns the ``key=value`` assignments that changed something. Done once, by the entry point
  (``validate.check``); :func:`step_config` refuses a config it was not done to."""
  official = official_values(config)
  for k in official:  # a value it overwrites must still have been a valid one
    if k in STEP_OPTIONS and block_of(config.rl, k)[k] not in STEP_OPTIONS[k]:
      raise config_files.ConfigError(f"{config_key(k)}={block_of(config.rl, k)[k]!r} is not one of "
                                     f"{', '.join(STEP_OPTIONS[k])}")
  changed = [f"{config_key(k)}={v!r}" for k, v in official.items() if block_of(config.rl, k)[k] != v]
  for k, v in official.items():
    block_of(config.rl, k)[k] = v
  return changed


def step_config(config, model_cfg=None) -> step_lib.StepConfig:
  """The static :class:`step.StepConfig` of ``config`` (already resolved by :func:`resolve_fidelity`),
  validated: an impossible option, window or combination raises :class:`config_files.ConfigError` in one
  sentence, before anything is loaded. With the base's ``model_cfg`` its own fields are filled in too (the
  diffusion's training steps, the trained components, the condition rank)."""
  rl, o = config.rl, config.rl.official
  for name, allowed in {**OPTIONS, **STEP_OPTIONS}.items():
    if block_of(rl, name)[name] not in allowed:
      raise config_files.ConfigError(f"{config_key(name)}={block_of(rl, name)[name]!r} is not one of "
                                     f"{', '.join(allowed)}")
  config_files.check_ranges(rl, RANGES, "rl.")
  official = official_values(config)
  unresolved = [k for k, v in official.items() if block_of(rl, k)[k] != v]
  if unresolved:
    k = unresolved[0]
    raise config_files.ConfigError(f"rl.fidelity='official' was not resolved into this config ({config_key(k)}="
                                   f"{block_of(rl, k)[k]!r}, official {official[k]!r}): the entry "
                                   "point does it; a caller of the jobs runs rl_config.resolve_fidelity(config) first")
  est = estimators.get(rl.estimator)
  if rl.group_size < 2 or rl.prompts_per_iter < 1:
    raise config_files.ConfigError(f"rl.group_size={rl.group_size} must be >= 2 and rl.prompts_per_iter="
                                   f"{rl.prompts_per_iter} >= 1 (group advantages need two images per prompt)")
  if rl.rollout_prompts and (rl.rollout_prompts < rl.prompts_per_iter or est.READS_CHAINS):
    raise config_files.ConfigError(f"rl.rollout_prompts={rl.rollout_prompts} must be 0 or at least rl.prompts_per_iter="
                                   f"{rl.prompts_per_iter} (the groups the update keeps), with an estimator that does "
                                   f"not score recorded chains (rl.estimator={rl.estimator!r})")
  images = rl.group_size * rl.prompts_per_iter
  if rl.num_inner < 1 or rl.num_minibatches < 1 or images % rl.num_minibatches:
    raise config_files.ConfigError(f"rl.num_inner={rl.num_inner} must be >= 1 and rl.num_minibatches="
                                   f"{rl.num_minibatches} >= 1 and divide the {images} images of an iteration")
  ar_steps = config.sampling.num_steps
  model = model_cfg if model_cfg is not None else config.get("model")
  if config.sampling.get("mask_schedule") == "cos_round" and model is not None:  # NOVA drops zero-count steps
    ar_steps = schedule_lib.rounded_cosine_schedule(model.seq_len, ar_steps).num_steps
  if rl.num_ar_steps < 0 or rl.num_ar_steps > ar_steps:
    raise config_files.ConfigError(f"rl.num_ar_steps={rl.num_ar_steps} must lie in [0, {ar_steps}], the AR steps "
                                   f"of sampling.num_steps={config.sampling.num_steps} (0 = every AR step)")
  num_ar = rl.num_ar_steps or ar_steps
  is_flow = head_kind(config, model_cfg) == "flow"
  est_logp = getattr(est, "BATCH_LOGP", "chain")
  scfg = sampler_lib.SamplerConfig(num_steps=config.sampling.num_steps,
                                   cfg_scale=rl.rollout_cfg_scale or config.sampling.cfg_scale,
                                   cfg_schedule=config.sampling.cfg_schedule,
                                   temperature=rl.rollout_temperature or config.sampling.temperature, guidance=True,
                                   clip_denoised=float(config.sampling.clip_denoised),
                                   order_group=rl.group_size if rl.shared_order or rl.shared_noise else 1,
                                   vary_steps=num_ar if rl.shared_noise else 0,
                                   mask_schedule=config.sampling.get("mask_schedule", "cosine"))
  bcfg = batch_lib.BatchConfig(num_ar_steps=num_ar, num_diffusion_steps=rl.num_diffusion_steps,
                               diffusion_window=parse_window(rl.diffusion_window), mte_seeds=rl.mte_seeds,
                               topk_fraction=rl.topk_fraction, consistency=rl.consistency,
                               mask_after_step=o.mask_after_step, mte_latent=o.mte_latent,
                               mte_commit_guided=o.mte_commit_guided, topk_scope=o.topk_scope,
                               selection_chains=o.selection_chains, loss_tokens=rl.loss_tokens,
                               logp=est_logp, diffusion_per_ar_step=bool(o.diffusion_per_ar_step),
                               uncertainty_unit=o.uncertainty_unit,
                               topk_random=int(o.topk_random))
  lcfg = loss_lib.LossConfig(beta=rl.beta, clip_eps=rl.clip_eps, ratio=o.ratio, kl=o.kl,
                             channel_reduction=rl.channel_reduction, cfg_in_loss=o.cfg_in_loss,
                             temperature=config.sampling.temperature, clip_denoised=float(config.sampling.clip_denoised),
                             remat=rl.remat, remat_ar_steps=rl.remat_ar_steps,
                             sigma_grad=o.sigma_grad, mte_actual=o.mte_actual,
                             logp=est_logp, logp_bf16=bool(o.logp_bf16))
  steps = (int(config.sampling.diffusion_steps) if is_flow else
           gaussian.make_diffusion(1000, config.sampling.diffusion_steps).num_steps)
  if is_flow and rl.estimator != "chain":
    raise config_files.ConfigError(f"rl.estimator={rl.estimator!r} scores the Gaussian head's denoising ELBO: a flow "
                                   "head (NOVA) is scored on its recorded SDE transitions (rl.estimator='chain')")
  noise = float(rl.flow_noise_level)
  if not 0.0 < noise <= 1.0:
    raise config_files.ConfigError(f"rl.flow_noise_level={noise} must lie in (0, 1]: the rollouts need a "
                                   "stochastic flow SDE (0 is NOVA's deterministic ODE, which has no log-prob)")
  try:
    batch_lib.validate(bcfg, steps)
  except ValueError as e:
    raise config_files.ConfigError(str(e)) from None
  if bcfg.uncertainty_unit == "pixel" and o.ratio != "none":
    raise config_files.ConfigError("rl.official.uncertainty_unit='pixel' mixes the MTE estimate per latent pixel "
                                   "inside a token, exact only for the official linear surrogate: set "
                                   "rl.official.ratio='none' (the rollout log-probs are kept per token)")
  if not est.READS_CHAINS and rl.fidelity == "official":
    raise config_files.ConfigError(f"rl.fidelity='official' reproduces the official chain update (one optimizer step "
                                   f"per scored AR step), which rl.estimator={rl.estimator!r} does not have: use "
                                   "rl.fidelity='intended' with it")
  if not est.READS_CHAINS and (o.sequential_updates or rl.train_head):
    raise config_files.ConfigError(f"rl.estimator={rl.estimator!r} scores whole images with MAR's training loss: it "
                                   "has no AR steps to update in turn (rl.official.sequential_updates) and trains "
                                   "the AR side only (rl.train_head)")
  if rl.estimator == "awm" and not rl.beta:
    raise config_files.ConfigError("rl.estimator='awm' needs its anchor: set rl.beta > 0 (without it the negative "
                                   "half raises the denoising loss of typical samples without limit)")
  if rl.anchor == "ema" and not rl.ema_decay and rl.estimator in ("awm", "nft"):
    raise config_files.ConfigError(f"rl.anchor='ema' holds {rl.estimator} to the policy's EMA: set rl.ema_decay > 0")
  rows = min(rl.elbo_rows, images) % images  # at most the iteration's images; all of them = 0
  if rl.elbo_rows or rl.elbo_draws != 1:
    if est.READS_CHAINS:
      raise config_files.ConfigError(f"rl.elbo_rows / rl.elbo_draws choose the images and draws of MAR's training "
                                     f"loss, which rl.estimator={rl.estimator!r} does not score: set them only with "
                                     "image_elbo, awm or nft")
    if rl.elbo_rows < 0 or rows % rl.num_minibatches or rl.elbo_draws < 1:
      raise config_files.ConfigError(f"rl.elbo_rows={rl.elbo_rows} must be >= 0 (0 = all images) and the images it "
                                     f"keeps divide by rl.num_minibatches={rl.num_minibatches}, and "
                                     f"rl.elbo_draws={rl.elbo_draws} must be >= 1")
  step_rows = (rows or images) // rl.num_minibatches * (1 if est.READS_CHAINS else rl.elbo_draws)
  if rl.microbatch < 0 or (rl.microbatch and step_rows % rl.microbatch):
    raise config_files.ConfigError(f"rl.microbatch={rl.microbatch} must be 0 (all at once) or divide the "
                                   f"{step_rows} rows an optimizer step scores")
  try:
    masked = objective.MaskedObjective.from_config(rl.mar_objective)
    objective.validate(masked, "rl.mar_objective.")
  except ValueError as e:
    raise config_files.ConfigError(str(e)) from None
  try:
    lora_cfg = lora_lib.parse(rl.lora.rank, rl.lora.alpha, rl.lora.targets)
  except ValueError as e:
    raise config_files.ConfigError(str(e)) from None
  fcfg = forward_lib.ForwardConfig(objective=masked, beta=float(rl.beta), anchor=rl.anchor,
                                   nft_strength=float(rl.nft_strength), rows=int(rows),
                                   draws=int(rl.elbo_draws))
  sc = step_lib.StepConfig(sampler=scfg, batch=bcfg, loss=lcfg, num_inner=rl.num_inner,
                           num_minibatches=rl.num_minibatches, microbatch=rl.microbatch,
                           sequential=o.sequential_updates,
                           estimator=rl.estimator, forward=fcfg,
                           ema_decay=float(rl.ema_decay), export_interpolation=float(rl.export_interpolation),
                           lora=lora_cfg, frozen_dtype=rl.frozen_dtype, respacing=str(config.sampling.diffusion_steps),
                           optim=config.optim.to_json(sort_keys=True),
                           total_steps=config.num_iters * rl.num_inner * rl.num_minibatches,
                           flow=(noise, float(config.sampling.get("flow_shift", 1.0))) if is_flow else None)
  if model_cfg is None:
    return sc
  family = families.get(model_cfg.family)
  if est.REENCODES and not family.can_encode():
    raise config_files.ConfigError(f"rl.estimator={rl.estimator!r} scores the tokenizer's re-encoding of the images, "
                                   f"and the {model_cfg.family} family's image encoder is not implemented: use "
                                   "rl.estimator='chain'")
  trainable = family.policy_components + (("head",) if rl.train_head else ())
  if lora_cfg.rank:  # every regex must match a 2-D parameter of the trained components (abstract shapes)
    params = nnx.to_pure_dict(nnx.state(families.abstract(model_cfg)))
    try:
      lora_lib.targets({k: params[k] for k in trainable}, lora_cfg.targets)
    except ValueError as e:
      raise config_files.ConfigError(str(e)) from None
  pixel = int(model_cfg.get("latent_channels", 0))  # NOVA's tokens are 2 x 2 patches of 4-channel pixels
  return dataclasses.replace(sc, num_train_steps=int(model_cfg.diffusion.num_train_steps), trainable=trainable,
                             ids_ndim=family.condition_ndim,
                             batch=dataclasses.replace(bcfg, pixel_channels=pixel))
