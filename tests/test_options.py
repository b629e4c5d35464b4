"""Every option string a config can hold, walked through validation and into the code that dispatches on it.

Each option's choices are declared once, by the code that consumes them (``optim.DECAYS``,
``schedule.CFG_SCHEDULES``, ``objective.MASK_RATIOS``, ``rl/loss.py``'s and ``rl/batch.py``'s ``OPTIONS``,
``advantages.KINDS``, ...); validation reads them from there, so it cannot admit a choice the code lacks (the old
split: validation took ``mar.mask_ratio='uniform'``, the objective implemented ``'truncnorm'``). Here every choice
of every option of every shipped config passes the config-level checks or is refused in one sentence naming the key
(a combination that cannot work), every other string is refused naming the key, and each choice runs through its
host-side consumer. The choices consumed inside the jitted loss (``rl/loss.py``, ``rl/batch.py``, the forward
estimators' anchors) run in ``test_rl_loss.py``, ``test_official_golden.py`` and ``test_estimators.py``.
"""
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx

from conftest import small_model_config
from margrpo_jax import config_files, optim, validate
from margrpo_jax.jobs import rl as rl_job
from margrpo_jax.models import families, objective, precision, random_instance
from margrpo_jax.rewards import registry
from margrpo_jax.rl import advantages, augment, config as rl_config, estimators
from margrpo_jax.sampling import sampler, schedule

CONFIGS = [("shapes_rl", "smoke"), ("shapes_rl", "paper,smoke"), ("shapes_rl", "image_elbo,smoke"),
           ("shapes_pretrain", "smoke"), ("shapes_sample", None), ("shapes_eval", None), ("mar", "random"),
           ("harmon", "random"), ("nova", "random")]


def option_tables() -> dict:
  """Dotted config key -> its choices, from every owner."""
  tables = dict(validate.OPTIONS, **{"mar.mask_ratio": objective.MASK_RATIOS,
                                     "rl.mar_objective.mask_ratio": objective.MASK_RATIOS})
  tables.update({f"rl.{k}": v for k, v in rl_config.OPTIONS.items()})
  tables.update({rl_config.config_key(k): v for k, v in rl_config.STEP_OPTIONS.items()})  # rl.official.* among them
  return tables


def _set(config, key: str, value) -> None:
  *blocks, name = key.split(".")
  node = config
  for b in blocks:
    node = node[b]
  with node.ignore_type():
    node[name] = value


def _checks(config) -> None:
  """The config-level checks (no model, no files): fidelity resolved, ranges and options, the RL step's config."""
  if "rl" in config:
    rl_config.resolve_fidelity(config)
  validate.check_values(config)
  if "rl" in config:
    rl_config.step_config(config)


def _has(config, key: str) -> bool:
  return validate._has(config, key)[0]  # noqa: SLF001 - the validator's own lookup


@pytest.mark.parametrize("name,arg", CONFIGS, ids=[n if a is None else f"{n}:{a}" for n, a in CONFIGS])
def test_every_choice_is_checked_and_every_other_string_refused_naming_the_key(name, arg):
  base = config_files.load(name, arg)
  keys = [k for k in option_tables() if _has(base, k)]
  assert keys, f"{name} has no option string"
  accepted = 0
  for key in keys:
    for value in (*option_tables()[key], "no_such_choice"):
      config = ml_collections.ConfigDict(base.to_dict())
      _set(config, key, value)
      try:
        _checks(config)
      except config_files.ConfigError as e:
        message = str(e)
        assert "\n" not in message and key.split(".")[-1] in message, f"{key}={value!r}: {message}"
        assert value != "no_such_choice" or f"{key.split('.')[-1]}='no_such_choice'" in message, message
      else:
        assert value != "no_such_choice", f"{key}='no_such_choice' was accepted"
        accepted += 1
  assert accepted >= len(keys)  # every option's shipped value at least


def test_the_rl_options_are_each_checked_once_by_their_owner():
  """validate.py keeps no table of the RL step's options or of the masked objective's keys: step_config and
  objective.validate own them, and a bad value is refused by them naming the key."""
  flat = set(validate.AT_LEAST) | set(validate.OPTIONS)
  step_owned = {f"rl.{k}" for k in rl_config.OPTIONS} | {rl_config.config_key(k) for k in rl_config.STEP_OPTIONS}
  assert not flat & step_owned
  assert not {k for k in flat if k.startswith(("mar.", "rl.mar_objective.", "rl.lora."))}
  for key, value in [("mar.label_drop", 1.0), ("mar.mask_ratio_std", float("nan")), ("mar.mask_ratio_min", 1.5),
                     ("mar.diffusion_batch_mul", 0)]:
    c = config_files.load("shapes_pretrain", "smoke")
    _set(c, key, value)
    with pytest.raises(config_files.ConfigError, match=rf"^{key.replace('.', r'[.]')}="):
      validate.check_values(c)
  c = config_files.load("shapes_rl", "image_elbo,smoke")
  c.rl.mar_objective.label_drop = 1.0
  with pytest.raises(config_files.ConfigError, match=r"^rl\.mar_objective\.label_drop=1\.0 must be"):
    rl_config.step_config(c)


def range_tables() -> dict:
  """(config, arg, prefix, the check that owns it) -> that owner's ranges: every table of numbers' spans."""
  from margrpo_jax.jobs import pretrain, tokenizer
  learned = {f"rewards.{name}.": registry.SETTING_RANGES for name in registry.LEARNED}
  return {("shapes_pretrain", "smoke", "optim.", validate.check_values): optim.RANGES,
          ("shapes_sample", None, "sampling.", validate.check_values): sampler.RANGES,
          ("nova", "random", "sampling.", validate.check_values): sampler.RANGES,  # + the flow sampler's noise level
          ("shapes_rl", "smoke", "rl.", _checks): rl_config.RANGES,
          ("shapes_pretrain", "smoke", "", pretrain.check): pretrain.RANGES,
          ("shapes_tokenizer", "smoke", "", tokenizer.check): tokenizer.RANGES,
          **{("shapes_eval", None, prefix, validate.check_values): t for prefix, t in learned.items()}}


def test_every_owned_range_refuses_the_values_just_outside_it_naming_the_key():
  """Each owner's table is what is checked: a value just below / above a bound (or on an excluded bound) and NaN are
  refused in one sentence naming the key, and the bounds it includes pass."""
  checked = set()
  for (name, arg, prefix, check), ranges in range_tables().items():
    for key, (lo, hi, lo_in, hi_in) in ranges.items():
      bad, good = [float("nan")], []
      for bound, included, step in ((lo, lo_in, -1), (hi, hi_in, 1)):
        if abs(bound) != float("inf"):
          (good if included else bad).append(bound)
          bad.append(bound + step * 0.5)
      for value in bad + good:
        c = config_files.load(name, arg) if arg else config_files.load(name)
        node = c
        for part in (prefix + key).split(".")[:-1]:
          node = node[part]
        if key not in node:
          continue
        checked.add(prefix + key)
        old = node[key]
        _set(c, prefix + key, type(old)(value) if isinstance(old, int) and value == value and
             float(value).is_integer() else value)
        if value in bad or value != value:
          with pytest.raises(config_files.ConfigError, match=rf"^{(prefix + key).replace('.', '[.]')}="):
            check(c)
        else:
          try:
            check(c)
          except config_files.ConfigError as e:  # a bound inside the span may still be an impossible combination,
            assert not str(e).startswith(f"{prefix}{key}=") or "must be" not in str(e), e  # never out of range
  missing = {prefix + k for (_, _, prefix, _), t in range_tables().items() for k in t} - checked
  assert missing == {f"rewards.{n}.scale" for n in ("aesthetic", "clip_score", "imagereward")}, missing  # no scale


def test_every_host_side_choice_runs_in_its_consumer(tmp_path):
  cfg = ml_collections.ConfigDict(dict(lr=1e-3, warmup_steps=2, final_lr_frac=0.1))
  for decay in optim.DECAYS:
    cfg.decay = decay
    lrs = [float(optim.lr_schedule(cfg, 10)(i)) for i in range(10)]
    assert np.isfinite(lrs).all() and max(lrs) == pytest.approx(1e-3)
  for kind in sampler.MASK_SCHEDULES:
    sched = sampler.mask_schedule(kind, 16, 4)
    assert int(np.sum(sched.counts)) == 16
    for cfg_kind in schedule.CFG_SCHEDULES:
      scales = schedule.cfg_schedule(sched, 16, 3.0, cfg_kind)
      assert scales.shape == (sched.num_steps,) and 1.0 <= scales.min() <= scales.max() <= 3.0
  for ratio in objective.MASK_RATIOS:
    mask = objective.sample_mask(objective.MaskedObjective(mask_ratio=ratio), 8, 16, jax.random.key(0))
    assert mask.shape == (8, 16) and bool(mask.any(axis=1).all())
  rewards = np.array([0.0, 1.0, 1.0, 0.0, 0.5, 0.5, 0.2, 0.9], np.float32)
  for kind in advantages.KINDS:
    adv = np.asarray(advantages.group_advantages(rewards, 4, kind))
    assert adv.shape == (8,) and np.isfinite(adv).all() and abs(adv[:4].sum()) < 1e-5
  images = np.zeros((2, 32, 32, 3), np.uint8)
  images[:, 4:9, 4:9] = 255
  for kind in augment.KINDS:
    moved = augment.apply(kind, images, np.random.default_rng(0))
    assert moved.shape == images.shape and moved.sum() == images.sum()
  for how in registry.NORMALIZE:
    assert np.isfinite(registry.normalize(rewards, how)).all()
  for name in estimators.NAMES:
    assert isinstance(estimators.get(name).READS_CHAINS, bool)
  model_cfg = small_model_config()
  graphdef, state = nnx.split(families.build(model_cfg, 0))
  params = nnx.to_pure_dict(state)
  for dtype, jdtype in precision.DTYPES.items():
    g = precision.with_compute(graphdef, params, dtype)
    dtypes = {getattr(m, "dtype", None) for _, m in nnx.iter_modules(nnx.merge(g, params))}
    assert (jdtype or jnp.float32) in dtypes or (jdtype is None and None in dtypes)
  for init in random_instance.INITS:
    c = config_files.load("mar", "random")
    c.init, c.checkpoint = init, ""
    if init == "random":
      assert rl_job.base_checkpoint(c, str(tmp_path)).startswith(str(tmp_path))
    else:  # '' without a checkpoint: a real family needs a converted export, named in one sentence
      with pytest.raises(Exception, match="config.checkpoint is not set"):
        rl_job.base_checkpoint(c, str(tmp_path))


def test_every_one_sentence_error_derives_from_the_one_user_error_base():
  """``main`` prints any :class:`errors.UserError` as one ``error:`` line (exit code 2); each module's error keeps
  its built-in base too, so code that catches ``ValueError`` still does."""
  from margrpo_jax import checkpoint, errors, fileio, main, workdir_lock
  from margrpo_jax.data import prompt_files
  assert main.user_errors() == (errors.UserError, FileNotFoundError)
  for cls in (config_files.ConfigError, checkpoint.CheckpointError, prompt_files.PromptFileError,
              fileio.UnsupportedPath, families.UnknownFamily):
    assert issubclass(cls, errors.UserError) and issubclass(cls, ValueError), cls
  assert issubclass(workdir_lock.WorkdirInUse, errors.UserError)


def test_the_entry_point_runs_the_job_from_the_step_config_it_checked(tmp_path, monkeypatch):
  """One resolution per run: ``main.prepare`` returns the :class:`step.StepConfig` that ``validate.check_rl`` built
  (fidelity resolved first), and ``main._dispatch`` hands that very object to the RL job."""
  from margrpo_jax import checkpoint, main
  c = config_files.load("shapes_rl", "paper,smoke")
  job, resolved = main.prepare(c, str(tmp_path / "w"))
  base = checkpoint.read_model_config(rl_job.base_checkpoint(c))
  assert job is rl_job and resolved == rl_config.step_config(c, base)
  assert c.rl.official.mask_after_step  # fidelity='official' resolved in place before the step config was built
  seen = {}
  monkeypatch.setattr(rl_job, "run", lambda config, workdir, resolved=None: seen.update(static=resolved))
  monkeypatch.setattr(main, "prepare", lambda config, workdir: (rl_job, resolved))
  main._dispatch(c, str(tmp_path / "w"))
  assert seen["static"] is resolved
