"""Every config value a user can set, checked when the config is read: before any model is loaded, any image
generated or anything in the workdir touched.

:func:`check` (the entry point calls it on the run's one config object) raises
:class:`config_files.ConfigError` with one sentence naming the key and value for

- a value out of its range (counts, rates, probabilities, finite floats), an option string not among its choices;
- a combination that cannot work (the RL switches, ``rl/step.py``'s :class:`StepConfig`; a reward weight with no
  reward behind it; mesh sizes vs the device count vs the batch);
- a workdir that is a file or cannot be written; a checkpoint that is not a model export, or of a family the
  mode cannot use.

It also resolves ``rl.fidelity='official'`` into the switches it implies (in place), so the config that is
checked, recorded in ``config.json`` and run is one and the same.

:func:`begin_run` makes "resume" mean "the same run": a workdir whose ``config.json`` differs from the config is
refused with the differing keys listed; with ``allow_changes`` the keys of :data:`SAFE_TO_CHANGE` (e.g.
``num_iters``, to extend a run) may differ, and ``config.json`` is rewritten with the values in effect.
"""
from __future__ import annotations

import json
import math
import os

import jax
from absl import logging

from margrpo_jax import checkpoint, config_files, fileio, generate, optim
from margrpo_jax.data import prompt_files, shapes, tfds_builders
from margrpo_jax.diffusion import gaussian
from margrpo_jax.models import families, objective, precision, random_instance
from margrpo_jax.parallel import mesh as mesh_lib
from margrpo_jax.rewards import clip_rewards, registry
from margrpo_jax.rl import config as rl_config, estimators, lora, loss as loss_lib, prompts as rl_prompts
from margrpo_jax.rl import step as step_lib
from margrpo_jax.sampling import sampler, schedule
from margrpo_jax.config_files import ConfigError

# The run-level keys (the config files' own, read by main and the jobs); each block's numbers are declared by the
# code that reads them (OWNED_RANGES) and the RL step's by rl/config.py (step_config).
# key -> smallest allowed integer (checked where the config has the key)
AT_LEAST = {
    "seed": 0, "num_iters": 1, "num_steps": 1, "batch_size": 1, "log_every": 1, "log_images_every": 1,
    "eval.batch_size": 1, "eval.num_prompts": 1, "eval.final_num_prompts": 0, "eval.seed": 0, "eval.every": 0,
    "eval.num_images": 1,
    "save.every": 1, "save.keep": 1, "grid_size": 0,
    "max_prompts": 0, "images_per_prompt": 1, "per_category": 0, "table_every": 1, "parallel.init_timeout_s": 1,
}
MAX_SEED = 2 ** 31 - 1
AT_MOST = {"eval.num_prompts": 100_000, "max_prompts": 1_000_000}  # prompt lists held in memory
# block -> its numbers' (low, high, low included, high included), owned by the code that consumes the block
OWNED_RANGES = {"optim": optim.RANGES, "sampling": sampler.RANGES}
# key -> its choices, each the table of the code that dispatches on it (rl.* options: rl/config.py's step_config)
OPTIONS = {
    "optim.decay": optim.DECAYS, "sampling.cfg_schedule": schedule.CFG_SCHEDULES,
    "export.dtype": precision.DTYPES, "rl.compute_dtype": precision.DTYPES,
    "init": random_instance.INITS, "sampling.mask_schedule": sampler.MASK_SCHEDULES,
}
# keys a resumed run may change with --allow_changes: they extend it or change how it is run, not what it computes
SAFE_TO_CHANGE = ("num_iters", "num_steps", "save.every", "save.keep",
                  "log_every", "log_images_every", "eval.batch_size", "tfds_dir", "export.dir",
                  "export.dtype", "parallel.")
# Keys added after runs were recorded, each with the value that computes what a run recorded without it did: such a
# run resumes (or is read) under a newer version while the key keeps that value.
ADDED_KEYS = {"rl.export_interpolation": 1.0, "rl.elbo_rows": 0, "rl.elbo_draws": 1, "rl.microbatch": 0,
              "rl.rollout_policy": "policy", "rl.flow_noise_level": 0.7, "rl.diversity_bonus": 0.0,
              "rl.rollout_cfg_scale": 0.0, "rl.rollout_temperature": 0.0, "rl.lora.rank": 0, "rl.lora.alpha": 0.0,
              "rl.lora.targets": lora.DEFAULT_TARGETS, "rl.rollout_prompts": 0, "rl.augment": "none",
              "rl.diversity_floor": 0.0, "rl.frozen_dtype": "float32", "rl.remat_ar_steps": True}
# Keys removed from the schema, each with the value at which a recorded run computed what today's code does.
REMOVED_KEYS = {"rl.debug_nan_iter": -1}
# Keys moved in the schema: a run recorded under the old name resumes (the official code's switches moved into the
# rl.official block; pretraining's and the tokenizer's train-state saving took the RL job's name, so that
# `checkpoint` always names a model export to load; pretraining's TFDS folder that of the other jobs).
RENAMED_KEYS = {**{f"rl.{k}": f"rl.official.{k}" for k in loss_lib.OFFICIAL_SWITCHES},
                "checkpoint.every": "save.every", "checkpoint.keep": "save.keep", "data.tfds_dir": "tfds_dir"}
RESUMABLE = ("rl", "pretrain", "tokenizer")  # modes that checkpoint a train state in the workdir


def flatten(tree: dict, prefix: str = "") -> dict:
  out = {}
  for k, v in tree.items():
    if isinstance(v, dict):
      out.update(flatten(v, f"{prefix}{k}."))
    else:
      out[f"{prefix}{k}"] = v
  return out


def _has(config, key: str):
  node = config
  for part in key.split("."):
    if not hasattr(node, "keys") or part not in node:
      return False, None
    node = node[part]
  return True, node


def check_values(config) -> None:
  """Ranges and option strings of every key the config has (tables above)."""
  for key, low in AT_LEAST.items():
    present, v = _has(config, key)
    if present and not isinstance(v, (dict,)) and hasattr(v, "__int__") and v < low:
      raise ConfigError(f"{key}={v} must be at least {low}")
    if present and key.endswith("seed") and isinstance(v, int) and v > MAX_SEED:
      raise ConfigError(f"{key}={v} must be at most {MAX_SEED} (a 32-bit PRNG seed)")
    if present and key in AT_MOST and isinstance(v, int) and v > AT_MOST[key]:
      raise ConfigError(f"{key}={v} must be at most {AT_MOST[key]:,}")
  for block, ranges in OWNED_RANGES.items():
    if block in config:
      config_files.check_ranges(config[block], ranges, f"{block}.")
  for name, settings in config.get("rewards", {}).items():
    config_files.check_ranges(settings, registry.SETTING_RANGES, f"rewards.{name}.")
  for key, allowed in OPTIONS.items():
    present, v = _has(config, key)
    if present and v not in allowed:
      raise ConfigError(f"{key}={v!r} is not one of {', '.join(allowed)}")
  if _has(config, "mar.mask_ratio")[0]:  # pretraining's masked objective: its keys checked by their owner
    try:
      objective.validate(objective.MaskedObjective.from_config(config.mar))
    except ValueError as e:
      raise ConfigError(str(e)) from None
  present, steps = _has(config, "sampling.diffusion_steps")
  if present:
    try:
      n = gaussian.make_diffusion(1000, str(steps)).num_steps
      if n < 1:
        raise ValueError
    except (ValueError, KeyError, IndexError, ZeroDivisionError):
      raise ConfigError(f"sampling.diffusion_steps={steps!r} is not a respacing of 1000 steps (e.g. '25', "
                        "'ddim50')") from None
  present, dtypes = _has(config, "plan.dtypes")
  bad = [d for d in str(dtypes or "").split(",") if d.strip() not in ("float32", "bfloat16")] if present else []
  if dtypes and bad:
    raise ConfigError(f"plan.dtypes={dtypes!r} names {bad[0].strip()!r}, not float32 or bfloat16")
  if "model" in config and hasattr(config.model, "to_dict"):
    check_model_values(config.model, "config.model")
  if "rewards" in config:
    for name, settings in config.rewards.items():
      for option, choices in clip_rewards.CHOICES.items():
        v = settings.get(option, "")
        if v and v not in choices:
          raise ConfigError(f"rewards.{name}.{option}={v!r} is not one of {', '.join(choices)} ('' for the default)")
  if "rl" in config:
    for name, w in config.rl.get("rewards", {}).items():
      if isinstance(w, (int, float)) and not math.isfinite(w):
        raise ConfigError(f"rl.rewards.{name}={w} must be a finite weight")


def check_workdir(workdir: str) -> None:
  """The workdir is (or can become) a writable folder; a URL's bucket answers."""
  if fileio.is_url(workdir):
    fileio.check_scheme(workdir, "--workdir")
    root = "/".join(workdir.split("/")[:3])  # scheme://bucket
    try:
      if workdir.startswith("gs://") and not fileio.exists(root):
        raise ConfigError(f"--workdir={workdir}: the bucket {root} does not exist or cannot be seen")
      if fileio.exists(workdir) and not fileio.isdir(workdir):
        raise ConfigError(f"--workdir={workdir} is a file, not a folder")
    except ConfigError:
      raise
    except Exception as e:  # noqa: BLE001 - the bucket's client raises its own error types (no network)
      detail = next((l.strip() for l in str(e).splitlines() if l.strip()), type(e).__name__)
      raise ConfigError(f"--workdir={workdir} cannot be reached ({detail[:200]}); nothing was written") from None
    return
  if os.path.exists(workdir) and not os.path.isdir(workdir):
    raise ConfigError(f"--workdir={workdir} is a file, not a folder")
  parent = workdir
  while not os.path.exists(parent):
    parent = os.path.dirname(parent)
  if not os.path.isdir(parent):
    raise ConfigError(f"--workdir={workdir} cannot be created: {parent} is a file")
  if not os.access(parent, os.W_OK | os.X_OK):
    raise ConfigError(f"--workdir={workdir} cannot be written (no write permission on {parent})")


def check_mesh(config) -> None:
  """Mesh sizes vs the device count, and the batches the mode splits over the batch axes."""
  if "parallel" not in config:
    return
  try:
    shape = dict(zip(mesh_lib.AXES, mesh_lib.resolve_shape(config.parallel.mesh, jax.device_count())))
  except ValueError as e:
    raise ConfigError(str(e).rstrip(".")) from None
  split = shape["data"] * shape["fsdp"]
  if config.mode == "rl" or (config.mode == "plan" and config.get("plan", {}).get("compile")):
    images = config.rl.group_size * config.rl.prompts_per_iter
    rows = images // max(config.rl.num_minibatches, 1)
    if images % split or rows % split:
      raise ConfigError(f"rl.group_size x rl.prompts_per_iter = {images} images ({rows} per minibatch) cannot be "
                        f"split over the batch axes data x fsdp = {split} of parallel.mesh={shape}")
    drawn = config.rl.group_size * config.rl.get("rollout_prompts", 0)
    if drawn % split:
      raise ConfigError(f"rl.group_size x rl.rollout_prompts = {drawn} rollout images cannot be split over the batch "
                        f"axes data x fsdp = {split} of parallel.mesh={shape}")
  elif config.mode == "pretrain" and config.batch_size % split:
    raise ConfigError(f"batch_size={config.batch_size} cannot be split over the batch axes data x fsdp = {split} "
                      f"of parallel.mesh={shape}")
  if config.mode in ("rl", "pretrain") and config.eval.batch_size % split:  # the eval samples on the run's mesh
    raise ConfigError(f"eval.batch_size={config.eval.batch_size} cannot be split over the batch axes data x fsdp = "
                      f"{split} of parallel.mesh={shape}")


def _check_export(path: str, what: str, mode: str):
  model_cfg = checkpoint.check_export(checkpoint.resolve(path), what)
  try:
    cls = families.generator(model_cfg.family, f"{what} {checkpoint.resolve(path)}")
  except families.UnknownFamily as e:
    raise ConfigError(str(e).rstrip(".")) from None
  return model_cfg, cls


# the last part of a model-config key whose number must be above 0 (every other number: finite, integers >= 0)
MODEL_POSITIVE = ("mlp_ratio", "eps", "rms_eps", "rope_theta", "rotary_fraction", "vae_scale", "scale")


def check_model_values(model_cfg, what: str) -> None:
  """The numbers of a model config: finite, integers (sizes, counts, ids) not negative, ratios, epsilons and
  scales above 0. ``what``: ``'config.model'`` or where a ``model.json`` came from."""
  for key, value in flatten(model_cfg.to_dict()).items():
    for v in value if isinstance(value, (tuple, list)) else (value,):
      if isinstance(v, bool) or not isinstance(v, (int, float)):
        continue
      positive = key.rsplit(".", 1)[-1] in MODEL_POSITIVE
      if not math.isfinite(v) or v < 0 or (positive and v == 0):
        name = f"config.model.{key}" if what == "config.model" else f"{what}: {key}"
        raise ConfigError(f"{name}={value} must be a finite number {'above 0' if positive else 'of at least 0'}")


def _check_model(config, model_cfg, what: str) -> None:
  """The model ``model_cfg`` describes builds and runs the sampler on one prompt (abstractly: shapes only,
  nothing allocated or computed), and the sampler's settings fit it (no more AR steps than image tokens)."""
  check_model_values(model_cfg, what)
  try:
    cls = families.generator(model_cfg.family, what)
  except families.UnknownFamily as e:
    raise ConfigError(str(e).rstrip(".")) from None
  cls.check_config(model_cfg, what)
  kind = model_cfg.get("diffusion", {}).get("kind", cls.head_kind)
  if kind != cls.head_kind:
    raise ConfigError(f"{what}: diffusion.kind={kind!r} must be {cls.head_kind!r}, the {model_cfg.family} family's "
                      "diffusion head")
  for key, value in cls.fixed_sampling.items():
    if "sampling" in config and key in config.sampling and config.sampling[key] != value:
      raise ConfigError(f"sampling.{key}={config.sampling[key]!r}: the {model_cfg.family} sampler always runs with "
                        f"{value!r}, so another value would be ignored")
  try:
    model = families.abstract(model_cfg)
  except Exception as e:  # noqa: BLE001 - any value that cannot build the model (heads, groups, widths)
    raise ConfigError(f"{what} does not build a {model_cfg.family} model ({first_line(e)})") from None
  seq_len = getattr(getattr(model, "backbone", None), "seq_len", None)
  if "sampling" in config and isinstance(seq_len, int) and not families.get(model_cfg.family).own_sampler():
    try:
      sampler.mask_schedule(sampler.SamplerConfig().mask_schedule, seq_len, config.sampling.num_steps)
    except ValueError:
      raise ConfigError(f"sampling.num_steps={config.sampling.num_steps} must lie in [1, {seq_len}]: the model "
                        f"decodes {seq_len} image tokens, at least one per AR step") from None
  if "sampling" in config:
    try:
      generate.trace(model_cfg, config.sampling)
    except ConfigError:
      raise
    except Exception as e:  # noqa: BLE001 - a structure that builds but cannot run (heads, widths, schedules)
      raise ConfigError(f"{what} with this config's sampling block cannot generate an image ({first_line(e)})"
                        ) from None


def first_line(e: Exception) -> str:
  """An exception as ``Type: first line`` (for a sentence that reports what a trace raised)."""
  return f"{type(e).__name__}: {str(e).splitlines()[0]}" if str(e).strip() else type(e).__name__


def check_learned_rewards(config, names, why: str) -> None:
  """The files each learned reward of ``names`` reads (``registry.FILES``: its export, of the right family, and its
  vocabulary) exist, before a run starts. ``why``: what asks for the reward (``{name}`` and ``{weight}`` filled)."""
  for name in names:
    for key, family in registry.FILES[name].items():
      path, what = config.rewards[name].get(key), f"rewards.{name}.{key}"
      if not path:
        asked = why.format(name=name, weight=config.rl.rewards[name] if "rl" in config else "")
        raise ConfigError(f"{asked} needs {what} (a converted reward model and its files; python -m "
                          "margrpo_jax.convert)")
      if family:
        checkpoint.check_export(checkpoint.resolve(path), what, family)
      elif not fileio.isfile(fileio.resolve(path)):
        raise ConfigError(f"{what}={path} does not exist or is not a file")


def check_rl(config) -> step_lib.StepConfig:
  """The RL run's checks; returns its one :class:`step.StepConfig` (built from ``config`` and the base's own
  fields), which the job runs from."""
  weights = {k: v for k, v in config.rl.rewards.items() if v}
  if not weights:
    raise ConfigError("rl.rewards gives every reward weight 0: set at least one (e.g. rl.rewards.shapes_strict=1)")
  unknown = [k for k in weights if k not in registry.names()]
  if unknown:
    raise ConfigError(f"rl.rewards.{unknown[0]} is not a reward in the registry ({', '.join(registry.names())})")
  check_learned_rewards(config, [n for n in weights if n in registry.LEARNED], "rl.rewards.{name}={weight}")
  if config.get("init") == "random" and not config.checkpoint:
    family = config.model.family if config.get("model") else "tiny"
    if family not in random_instance.FAMILIES:
      raise ConfigError(f"config.init='random': no tiny instance of the {family!r} family (one of "
                        f"{', '.join(random_instance.FAMILIES)})")
    model_cfg, cls = config.model, families.generator(family)
    _check_model(config, model_cfg, "config.model")
    given = [k for k in ("vae_checkpoint", "tokenizer_path") if config.model.get(k)]
    if given:  # materialize() writes its own random VAE and tokenizer: a user's path would be dropped silently
      raise ConfigError(f"config.init='random' builds its own random-weight VAE and tokenizer, so "
                        f"config.model.{given[0]}={config.model[given[0]]!r} would be ignored: drop it, or set "
                        "config.checkpoint to a converted export to use real parts")
  else:
    path = config.checkpoint or ("shapes_base" if not config.get("model") else "")
    if not path:
      raise ConfigError(f"config.checkpoint is not set: a {config.model.family} run needs a converted export "
                        "(python -m margrpo_jax.convert)")
    model_cfg, cls = _check_export(path, "config.checkpoint", "rl")
    _check_model(config, model_cfg, f"the model.json of {path}")
  static = rl_config.step_config(config, model_cfg)  # every rl.* option, with the base's fields (head, encoder)
  if config.rl.pretrain_mix and (not estimators.get(config.rl.estimator).REENCODES
                                 or model_cfg.family != "tiny" or config.rl.prompt_file):
    raise ConfigError(f"rl.pretrain_mix={config.rl.pretrain_mix} renders shapes-world train images for the "
                      "update: it needs a forward-process estimator (image_elbo, awm, nft), the shapes-world base "
                      "and its own train prompts (no rl.prompt_file)")
  if config.rl.augment != "none" and (not estimators.get(config.rl.estimator).REENCODES
                                      or model_cfg.family != "tiny"):
    raise ConfigError(f"rl.augment={config.rl.augment!r} moves the decoded images before they are re-encoded, and "
                      "finds their content with the shapes verifier: it needs a forward-process estimator (image_elbo, "
                      "awm, nft) and the shapes-world base")
  verifier = next((k for k in weights if k in registry.NEEDS_SHAPES), None)
  if verifier and model_cfg.family != "tiny":
    raise ConfigError(f"rl.rewards.{verifier} is a shapes-world verifier reward, but the base is a "
                      f"{model_cfg.family} model (its images are not shapes-world images)")
  _check_rl_prompts(config, model_cfg, cls, verifier)
  return static


def _check_rl_prompts(config, model_cfg, cls, verifier) -> None:
  """The prompt sources can be read and suit the family and the rewards."""
  for key in ("rl.prompt_file", "eval.prompt_file"):
    present, path = _has(config, key)
    if not (present and path):
      continue
    try:
      recs = rl_prompts.read_file(path)
    except prompt_files.PromptFileError as e:
      raise ConfigError(f"{key}: {str(e).rstrip('.')}") from None
    if verifier and not rl_prompts.all_shapes(recs):
      first = next(r["prompt"] for r in recs if r["shapes"] is None)
      raise ConfigError(f"rl.rewards.{verifier} is a shapes-world verifier reward, but {key}={path} has prompts "
                        f"without shapes-world metadata (e.g. {first!r})")
    if cls.condition_ndim == 1:  # class-conditional: every prompt must be a class label
      try:
        cls.prompt_ids(model_cfg, [r["prompt"] for r in recs])
      except ValueError as e:
        raise ConfigError(f"{key}={path}: {str(e).rstrip('.')}; a class-conditional model takes class labels, "
                          "not captions") from None


def check_eval(config) -> None:
  if not config.get("prompt_file") and config.get("dataset") not in tfds_builders.NAMES:
    raise ConfigError(f"dataset={config.get('dataset')!r} is not one of {', '.join(tfds_builders.NAMES)} (or set "
                      "prompt_file)")
  if config.get("dataset") == "shapes_world":
    bad = [x for x in str(config.split).split(",") if x.strip() not in shapes.SPLITS]
    if bad:
      raise ConfigError(f"split={config.split!r} names {bad[0].strip()!r}, not a shapes-world split "
                        f"({', '.join(shapes.SPLITS)})")
  entries = [p.strip() for p in (config.checkpoints or "base").split(",")]
  if any(not p for p in entries):
    raise ConfigError(f"checkpoints={config.checkpoints!r} has an empty entry (write 'base' for the shipped base)")
  for p in entries:
    if p != "base":
      _check_export(p, "checkpoints entry", "eval")
  names = [n.strip() for n in config.reward_names.split(",") if n.strip()]
  bad = [n for n in names if n not in registry.names()]
  if bad:
    raise ConfigError(f"reward_names has {', '.join(bad)}, not in the registry ({', '.join(registry.names())})")
  learned = [n for n in registry.LEARNED if n in names or n in registry.configured(config.get("rewards"))]
  check_learned_rewards(config, learned, "reward_names naming {name}")


def check_sample(config) -> None:
  if config.checkpoint:
    model_cfg, _ = _check_export(config.checkpoint, "config.checkpoint", "sample")
    _check_model(config, model_cfg, f"the model.json of {config.checkpoint}")
  elif config.get("model") and config.get("init") != "random":
    raise ConfigError("config.checkpoint is not set: convert the official weights with `python -m "
                      "margrpo_jax.convert` and pass the output folder")
  elif config.get("init") == "random":
    _check_model(config, config.model, "config.model")
  else:
    _check_model(config, checkpoint.read_model_config(checkpoint.resolve("shapes_base")), "the shipped base")


def check_prompt_file(config) -> None:
  path = config.get("prompt_file")
  if path and not fileio.isfile(fileio.resolve(path)):
    raise ConfigError(f"prompt_file {path} does not exist or is not a file")


def check_pretrain(config) -> None:
  _check_model(config, config.model, "config.model")


# a mode's checks that need the model or its files (a job with more of its own has a check(config))
MODE_CHECKS = {"rl": check_rl, "eval": check_eval, "sample": check_sample, "pretrain": check_pretrain}


# mode -> the shipped config written for it: a config switched to a mode must have that config's top-level keys
MODE_CONFIGS = {"sample": "shapes_sample", "rl": "shapes_rl", "export": "shapes_rl", "pretrain": "shapes_pretrain",
                "eval": "shapes_eval", "tokenizer": "shapes_tokenizer", "ablation": "shapes_ablation"}


def check_keys(config) -> None:
  """A config switched to another mode (``--config.mode=export`` on the sample config) lacks keys that mode's job
  reads: refused naming them, instead of failing inside the job."""
  name = MODE_CONFIGS.get(config.mode)
  if name is None:
    return
  missing = sorted(set(config_files.load(name).keys()) - set(config.keys()))
  if missing:
    raise ConfigError(f"config.mode={config.mode!r} needs the key{'s' if len(missing) > 1 else ''} "
                      f"{', '.join(missing)}, which this config does not have: start from a config written for that "
                      f"mode (configs/{name}.py)")


def check(config, workdir: str):
  """All of the above for ``config.mode``; resolves ``rl.fidelity`` in place first. Returns what the mode's check
  resolved for the job to run from (the RL step's :class:`step.StepConfig`), else None."""
  check_keys(config)
  if "rl" in config:
    for change in rl_config.resolve_fidelity(config):
      logging.info("rl.fidelity='official' sets %s", change)
  check_values(config)
  if config.mode != "plan":
    check_workdir(workdir)
  check_mesh(config)
  check_prompt_file(config)
  if config.mode in MODE_CHECKS:
    return MODE_CHECKS[config.mode](config)
  return None


def _config_dict(config) -> dict:
  return json.loads(config.to_json(sort_keys=True))


def _safe(key: str) -> bool:
  return any(key == s or (s.endswith(".") and key.startswith(s)) for s in SAFE_TO_CHANGE)


def begin_run(config, workdir: str, allow_changes: bool = False) -> None:
  """Record ``config`` in ``W/config.json``, or check it is the config the workdir's run was started with.

  A difference is refused in one sentence listing the keys (nothing written); with ``allow_changes`` the keys
  of :data:`SAFE_TO_CHANGE` may differ and ``config.json`` then records the new values."""
  path = os.path.join(workdir, "config.json")
  now = _config_dict(config)
  ckpt = os.path.join(workdir, "checkpoints")
  before = fileio.read_json(path) if fileio.isdir(ckpt) else None
  if not isinstance(before, dict) and fileio.isdir(ckpt) and any(n.strip("/").isdigit() for n in fileio.listdir(ckpt)):
    raise ConfigError(f"{workdir} holds checkpoints but no readable config.json (the record of the config they "
                      "were trained with), so a rerun cannot tell whether it is the same run: restore "
                      f"{path} or use a new --workdir")
  if isinstance(before, dict):
    a, b = {RENAMED_KEYS.get(k, k): x for k, x in flatten(before).items()}, flatten(now)
    diff = sorted(k for k in set(a) | set(b) if a.get(k, "<absent>") != b.get(k, "<absent>")
                  and not (k not in a and k in ADDED_KEYS and b.get(k) == ADDED_KEYS[k])
                  and not (k not in b and k in REMOVED_KEYS and a.get(k) == REMOVED_KEYS[k]))
    unsafe = [k for k in diff if not (allow_changes and _safe(k))]
    if unsafe:
      shown = ", ".join(f"{k} ({a.get(k, '<absent>')!r} -> {b.get(k, '<absent>')!r})" for k in unsafe[:6])
      more = f" and {len(unsafe) - 6} more" if len(unsafe) > 6 else ""
      safe_hint = ("; --allow_changes resumes it with these (keys that only extend a run or change how it runs)"
                   if not allow_changes and all(_safe(k) for k in unsafe) else "")
      verb = "differs" if len(unsafe) == 1 else "differ"
      raise ConfigError(f"{workdir} holds a run started with another config: {shown}{more} {verb}; rerun with "
                        f"the same config or use a new --workdir{safe_hint}")
    if not diff:
      return
    logging.warning("resuming %s with changed %s", workdir, ", ".join(diff))
  fileio.write_text(path, config.to_json(indent=2, sort_keys=True))
