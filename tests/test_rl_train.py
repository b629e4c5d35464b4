"""The RL job end to end on the small model: updates reach the AR backbone only (head bitwise unchanged), a NaN
reward skips the step, and a killed run resumes to the same parameters as an uninterrupted one."""
import copy
import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fake_gcs
from margrpo_jax import checkpoint, config_files, main
from margrpo_jax.data import shapes
from margrpo_jax.jobs import rl as rl_job
from margrpo_jax.models import families
from margrpo_jax.rl import config as rl_config, prompts as rl_prompts


def _config(base, **rl):
  c = config_files.load("shapes_rl", "margrpo,smoke")
  c.checkpoint = base
  c.rl.rewards.update(shapes_partial=0.0, jpeg_compressibility=1.0)  # varies within a group: non-zero advantages
  c.rl.update(rl)
  c.optim.lr = 1e-3
  return c


@pytest.fixture(scope="module")
def base(tmp_path_factory, small_model):
  cfg, _, params = small_model
  folder = tmp_path_factory.mktemp("base")  # as if converted from an official file (source.json)
  return checkpoint.save_model(str(folder / "export"), params, cfg, source=str(folder / "official.pth")), params


def _same(a, b):
  return all(jax.tree.leaves(jax.tree.map(lambda x, y: np.array_equal(np.asarray(x), np.asarray(y)), a, b)))


@pytest.fixture(scope="module")
def local_run(tmp_path_factory, base, shapes_tfds):
  """``(config, workdir, final state)`` of the RL smoke job run uninterrupted on a local folder."""
  config = _config(base[0])
  tmp_path = tmp_path_factory.mktemp("rl")
  config.tfds_dir = shapes_tfds
  return config, tmp_path, rl_job.run(config, str(tmp_path / "w"))


@pytest.mark.slow
def test_rl_updates_backbone_only_and_writes_the_report(local_run, base):
  _, params = base
  config, tmp_path, state = local_run
  assert int(state["step"]) == config.num_iters
  assert set(state["policy"]) == {"text_encoder", "backbone"}
  assert not _same(state["policy"]["backbone"], params["backbone"])
  _, _, final = checkpoint.load_model(str(tmp_path / "w" / "export"))
  assert checkpoint.official_source(str(tmp_path / "w" / "export")) == checkpoint.official_source(base[0])
  assert _same(final["head"], params["head"])  # the frozen head is bitwise unchanged
  report = json.loads((tmp_path / "w" / "report.json").read_text())
  assert {"strict_pass", "partial"} <= set(report["base"]) and {"strict_pass", "partial"} <= set(report["final"])
  assert report["checkpoint"] == str(tmp_path / "w" / "export")
  for name in ("before.png", "after.png", "curves.png", "report.md"):
    assert (tmp_path / "w" / name).exists()
  history = [json.loads(l) for l in (tmp_path / "w" / "metrics.jsonl").read_text().splitlines()]
  assert len(history) == config.num_iters and all(h["grad_norm"] > 0 for h in history)
  assert all(h["rollout_images_per_s"] > 0 and h["update_images_per_s"] > 0 for h in history)
  assert abs(history[0]["logp_diff"]) < 1e-3  # first update: recomputed log-probs equal the rollout's


@pytest.mark.slow
def test_rl_killed_and_resumed_on_a_bucket_then_export_and_sample_jobs_there(local_run, tmp_path, monkeypatch):
  """The RL job on a gs:// workdir (``tests/fake_gcs.py``), killed after its first checkpoint and resumed by the
  same command, then the export and sample jobs from that bucket: every file lands in the bucket, nothing in a
  local folder named after the URL, and the resumed run's final state equals the uninterrupted local run's."""
  from margrpo_jax.jobs import export
  config, local, want = local_run
  config = copy.deepcopy(config)
  monkeypatch.chdir(tmp_path)
  with fake_gcs.bucket(monkeypatch) as store:
    run = "gs://fake-bucket/run"
    rl_job.run(config, run, max_iters_this_run=1)  # "killed" after its first checkpoint
    main._dispatch(config, run)  # the same command: validated against the bucket's config.json, resumed
    mngr = checkpoint.manager(run + "/checkpoints", keep=1_000_000)
    _, got = checkpoint.restore_latest(mngr, want)
    assert _same(got, want)
    _, _, exported = checkpoint.load_model(run + "/export")
    _, _, local_export = checkpoint.load_model(str(local / "w" / "export"))
    assert _same(exported, local_export)
    config.export.dir = run + "/export_again"
    export.run(config, run)
    assert checkpoint.official_source(config.export.dir) == checkpoint.official_source(config.checkpoint)
    sample = config_files.load("shapes_sample", None)
    sample.update(checkpoint=run + "/export_again", max_prompts=8, batch_size=8, tfds_dir=config.tfds_dir)
    sample.sampling.update(num_steps=4, diffusion_steps="5")
    main._dispatch(sample, "gs://fake-bucket/samples")
    files = store.files()
  names = {k.split("/", 2)[2] for k in files if k.startswith("fake-bucket/run/")}
  assert {"config.json", "metrics.jsonl", "base_eval.json", "report.json", "report.md", "before.png", "after.png",
          "curves.png", "export/model.json", "export/source.json", "export_again/model.json"} <= names
  assert {n.split("/")[1] for n in names if n.startswith("checkpoints/")} >= {"1", str(config.num_iters)}
  assert len([k for k in files if k.startswith("fake-bucket/samples/samples/")]) == 8
  assert json.loads(files["fake-bucket/samples/scores.json"])["num_images"] == 8
  assert os.listdir(tmp_path) == []  # no ./gs: folder


@pytest.mark.slow
def test_export_mode_writes_a_bf16_policy_that_sample_loads(tmp_path, base, shapes_tfds):
  from margrpo_jax.jobs import export
  base_dir, _ = base
  config = _config(base_dir)
  config.num_iters, config.tfds_dir = 1, shapes_tfds
  state = rl_job.run(config, str(tmp_path / "w"))
  config.export.update(dtype="bfloat16", dir=str(tmp_path / "bf16"))
  out = export.run(config, str(tmp_path / "w"))
  _, _, got = checkpoint.load_model(out)  # up-cast to float32 on load
  want = jax.tree.map(lambda x: np.asarray(x).astype(jnp.bfloat16).astype(np.float32), state["policy"])
  assert _same({k: got[k] for k in want}, want)
  config.export.dtype = "float16"
  with pytest.raises(checkpoint.CheckpointError, match="export.dtype='float16'"):
    export.run(config, str(tmp_path / "w"))


@pytest.mark.slow
def test_nan_reward_skips_the_step(tmp_path, base, shapes_tfds, monkeypatch):
  base_dir, params = base
  rollout = rl_job.rollout

  def nan_at_first(config, s, policy, recs, it):  # one non-finite reward in iteration 0
    ro = rollout(config, s, policy, recs, it)
    if it == 0:
      ro["reward"] = np.where(np.arange(len(ro["reward"])) == 0, np.nan, ro["reward"])
    return ro
  monkeypatch.setattr(rl_job, "rollout", nan_at_first)
  config = _config(base_dir)
  config.num_iters, config.tfds_dir = 1, shapes_tfds
  state = rl_job.run(config, str(tmp_path / "w"))
  assert _same(state["policy"], {k: params[k] for k in ("text_encoder", "backbone")})


@pytest.mark.slow
def test_a_reward_that_is_never_finite_stops_the_run_instead_of_exporting_the_base(tmp_path, base, shapes_tfds):
  config = _config(base[0])
  config.rl.rewards.update(jpeg_compressibility=1e39)  # overflows float32 on every image
  config.num_iters, config.tfds_dir = 5, shapes_tfds
  with pytest.raises(checkpoint.NonFiniteError, match=f"non-finite in {rl_job.MAX_SKIPPED} iterations in a row"):
    rl_job.run(config, str(tmp_path / "w"))
  assert not (tmp_path / "w" / "export").exists() and not (tmp_path / "w" / "report.json").exists()


@pytest.mark.slow
def test_ablation_runs_every_variant_and_seed_and_writes_table_and_plot(tmp_path, base, shapes_tfds):
  from margrpo_jax.jobs import ablation
  c = config_files.load("shapes_ablation")
  c.update(variants="grpo,margrpo", seeds="0,1", checkpoint=base[0], smoke=True, table_every=1,
           tfds_dir=shapes_tfds)
  c.overrides.update(num_iters=2, eval=dict(num_prompts=4))
  results = ablation.run(c, str(tmp_path))
  assert {v: [r["seed"] for r in rs] for v, rs in results.items()} == {"grpo": [0, 1], "margrpo": [0, 1]}
  assert all(len(r["history"]) == 2 for rs in results.values() for r in rs)
  table = (tmp_path / "ablation.md").read_text()
  assert "## grpo (2 seeds)" in table and "## margrpo (2 seeds)" in table and "| 2 |" in table
  assert (tmp_path / "ablation.png").stat().st_size > 0


def test_real_family_rl_needs_a_checkpoint():
  """A real-size RL config without ``checkpoint`` is one sentence (not the shipped shapes model)."""
  from margrpo_jax import checkpoint, config_files
  from margrpo_jax.jobs import rl as rl_job
  for family, arg in (("mar", "base"), ("nova", "sd512")):
    c = config_files.load(family, arg)
    c.mode = "rl"
    with pytest.raises(checkpoint.CheckpointError, match="config.checkpoint is not set"):
      rl_job.setup(c)


@pytest.mark.slow
def test_official_fidelity_is_written_into_the_config_the_run_records(tmp_path, base, shapes_tfds):
  """``rl.fidelity=official`` is resolved once, by the entry point, before anything runs: ``config.json`` holds the
  official switch values the run used (no hidden override), and the step config is built from them. A caller of
  the job that skipped the resolution is refused in one sentence before the workdir is touched."""
  config = _config(base[0], fidelity="official")
  config.num_iters, config.tfds_dir = 1, shapes_tfds
  with pytest.raises(config_files.ConfigError, match="rl.fidelity='official' was not resolved"):
    rl_job.setup(copy.deepcopy(config))
  main._dispatch(config, str(tmp_path / "w"))
  recorded = json.loads((tmp_path / "w" / "config.json").read_text())["rl"]
  assert {k: rl_config.block_of(recorded, k)[k] for k in rl_config.OFFICIAL} == rl_config.OFFICIAL
  sc = rl_config.step_config(config)
  assert sc.sequential and sc.loss.clip_eps == 0.0 and sc.loss.ratio == "none" and sc.batch.diffusion_window == (0, None)


@pytest.mark.slow
def test_minibatches_and_epochs_take_that_many_optimizer_steps(base):
  """``num_inner`` x ``num_minibatches`` optimizer steps per iteration on consecutive row blocks; the Adam step
  counter says how many were taken."""
  config = _config(base[0], num_inner=2, num_minibatches=2, loss_tokens="decoded", mte_seeds=0, consistency=False,
                   num_ar_steps=0)
  s = rl_job.setup(config)
  assert s.static.batch.num_ar_steps == config.sampling.num_steps  # 0 = every AR step
  state, m, _ = rl_job.iteration(config, s, s.init_state(), rl_prompts.from_metadata(shapes.split_records("train", num_train=64)), 0)
  counts = [int(x) for x in jax.tree.leaves(state["opt"]) if getattr(x, "shape", None) == () and
            np.issubdtype(np.asarray(x).dtype, np.integer)]
  assert counts and max(counts) == 4, counts
  assert np.isfinite(m["loss"]) and not _same(state["policy"], s.policy)


@pytest.mark.slow
def test_image_elbo_step_is_the_advantage_weighted_elbo_gradient_and_exports_the_ema(tmp_path, base):
  """``rl.estimator='image_elbo'``: one plain-gradient step moves the policy by ``-lr mean_i A_i grad l_i`` with
  ``l_i`` MAR's training loss of image i at the step's own draws (computed here image by image through
  ``models/objective.py``): credit goes where the advantage is, zero advantages move nothing; the rollout records
  nothing; and ``rl.ema_decay`` keeps ``ema = d base + (1 - d) policy`` after one update, which is what the job
  exports."""
  import optax
  from flax import nnx
  from margrpo_jax.diffusion import gaussian
  from margrpo_jax.models import objective
  from margrpo_jax.rl import step as step_lib
  config = _config(base[0], estimator="image_elbo", positive_only=True, ema_decay=0.5, beta=0.0, mte_seeds=0,
                   consistency=False)
  s = rl_job.setup(config)
  ro = rl_job.rollout(config, s, s.policy, rl_prompts.from_metadata(shapes.split_records("train", num_train=64)), 0)
  assert ro["rec"] is None  # an estimator that reads no chain gets a rollout without records
  tokens = jnp.asarray(families.get("tiny").encode_images(s.model_cfg, ro["images"]))
  diff, key, lr = gaussian.make_diffusion(1000), jax.random.key(3), 0.05
  tx = optax.sgd(lr)
  start = dict(step=jnp.int32(0), policy=s.policy, opt=tx.init(s.policy))
  update = jax.jit(lambda adv: step_lib.forward_update(s.graphdef, tx, diff, s.static, start, s.frozen, s.ref,
                                                       ro["ids"], adv, tokens, key)[0]["policy"])
  per_image = lambda p: objective.per_image(*objective.per_token(
      nnx.merge(s.graphdef, {**s.frozen, **p}), diff, s.static.forward.objective, ro["ids"], tokens,
      jax.random.fold_in(key, 0))[:2])
  grads = jax.jit(jax.jacrev(per_image))(s.policy)  # (B,) per image
  adv = jnp.array([1.5, 0.0, 0.4, 0.0])
  want = jax.tree.map(lambda p, g: p - lr * jnp.tensordot(adv, g, 1) / len(adv), s.policy, grads)
  got = update(adv)
  assert jax.tree.all(jax.tree.map(lambda a, b: np.allclose(a, b, atol=1e-6, rtol=1e-4), got, want))
  assert not _same(got, s.policy) and _same(update(jnp.zeros(len(adv))), s.policy)  # no advantage, no step
  state, m, _ = rl_job.iteration(config, s, s.init_state(), rl_prompts.from_metadata(shapes.split_records("train", num_train=64)), 0)
  assert np.isfinite(m["loss"]) and m["mar_loss"] > 0
  want = jax.tree.map(lambda b, p: 0.5 * b + 0.5 * p, s.policy, state["policy"])
  assert jax.tree.all(jax.tree.map(lambda a, b: np.allclose(a, b, atol=1e-6), state["ema"], want))
  assert not _same(state["ema"], state["policy"]) and s.trained_policy(state) is state["ema"]
  wise = dataclasses.replace(s, static=dataclasses.replace(s.static, export_interpolation=0.25))
  want = jax.tree.map(lambda b, e: b + 0.25 * (e - b), s.policy, state["ema"])  # WiSE-FT: theta_0 + a (theta - theta_0)
  assert jax.tree.all(jax.tree.map(lambda a, b: np.allclose(a, b, atol=1e-7), wise.trained_policy(state), want))
  config.rl.microbatch = 2  # the same iteration with its images scored two at a time: the same update
  s2 = rl_job.setup(config)
  train = rl_prompts.from_metadata(shapes.split_records("train", num_train=64))
  state2, m2, _ = rl_job.iteration(config, s2, s2.init_state(), train, 0)
  # compared on the optimizer's moments (mu = (1 - b1) g, nu = (1 - b2) g^2), i.e. the gradient: Adam's first step
  # turns float noise in a zero gradient (the key bias, which softmax ignores) into +-lr, so the parameters are not
  got, want = (np.concatenate([np.ravel(x) for x in jax.tree.leaves(o["opt"])]) for o in (state2, state))
  np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-5 * np.abs(want).max())
  np.testing.assert_allclose(m2["loss"], m["loss"], rtol=1e-4, atol=1e-7)


@pytest.mark.slow
def test_a_diverging_run_is_stopped_before_anything_broken_is_saved(tmp_path, base, shapes_tfds):
  """lr = 1e30 turns the parameters non-finite within a few iterations: the iteration that did it is refused in
  one sentence, and the newest checkpoint is the last finite state."""
  config = _config(base[0])
  config.num_iters, config.tfds_dir, config.optim.lr = 4, shapes_tfds, 1e30
  config.save.every = 1
  with pytest.raises(checkpoint.NonFiniteError, match=r"RL iteration (\d) produced a non-finite") as e:
    rl_job.run(config, str(tmp_path / "w"))
  it = int(e.value.args[0].split("iteration ")[1].split()[0])
  mngr = checkpoint.manager(str(tmp_path / "w" / "checkpoints"))
  assert mngr.latest_step() == (it - 1 if it > 1 else None)
  if it > 1:
    _, state = checkpoint.restore_latest(mngr, rl_job.setup(config).init_state())
    assert checkpoint.all_finite(state)
  assert not (tmp_path / "w" / "export").exists() and not (tmp_path / "w" / "report.json").exists()


@pytest.mark.slow
def test_pretrain_mix_adds_rendered_train_images_weighted_like_an_advantage(base):
  """``rl.pretrain_mix``: a quarter-batch of rendered train images joins the update with weight ``pretrain_mix``;
  with every advantage zero (a constant reward) the update is then MAR's pretraining loss alone (it moves the
  policy) and without it nothing moves; the rollout's own rows are unchanged."""
  config = _config(base[0], estimator="image_elbo", positive_only=True, beta=0.0, mte_seeds=0, consistency=False,
                   pretrain_mix=1.0)
  config.rl.rewards.update(jpeg_compressibility=0.0, brightness=0.0, shapes_strict=0.0, shapes_partial=0.0)
  config.rl.rewards.update(shapes_dense=0.0)
  s = rl_job.setup(config)
  recs = rl_prompts.from_metadata(shapes.split_records("train", num_train=64))
  ro = rl_job.rollout(config, s, s.policy, recs, 0)
  adv = np.zeros(len(ro["images"]), np.float32)
  ids, w, tokens = rl_job.with_pretraining_images(config, s, recs, 0, ro["ids"], adv, rl_job.training_tokens(
      config, s, ro, 0))
  n = len(adv) // 4
  assert ids.shape[0] == tokens.shape[0] == len(w) == len(adv) + n and np.all(w[len(adv):] == 1.0)
  np.testing.assert_array_equal(np.asarray(ids)[:len(adv)], np.asarray(ro["ids"]))
  moved, _, _ = rl_job.iteration(config, s, s.init_state(), recs, 0)
  config.rl.pretrain_mix = 0.0
  still, _, _ = rl_job.iteration(config, s, s.init_state(), recs, 0)
  assert not _same(moved["policy"], s.policy) and _same(still["policy"], s.policy)


def test_diversity_spent_compares_the_last_window_of_rollout_spread_with_the_first():
  config = _config("unused")
  w = rl_job.SPREAD_WINDOW
  hist = [dict(latent_spread=1.0)] * w + [dict(latent_spread=0.9)] * w
  assert not rl_job.diversity_spent(config, hist)  # rl.diversity_floor = 0: never
  config.rl.diversity_floor = 0.95
  assert rl_job.diversity_spent(config, hist)
  assert not rl_job.diversity_spent(config, hist[:2 * w - 1])  # too few iterations to compare two windows
  config.rl.diversity_floor = 0.85
  assert not rl_job.diversity_spent(config, hist)


@pytest.mark.slow
def test_a_run_stops_on_its_diversity_budget_exports_there_and_a_rerun_does_not_train_on(tmp_path, base, shapes_tfds,
                                                                                         monkeypatch):
  spreads = iter([1.0, 0.9, 0.5, 0.4, 0.3])  # the rollouts' latent spread, iteration by iteration
  monkeypatch.setattr(rl_job, "SPREAD_WINDOW", 1)
  monkeypatch.setattr(rl_job.metrics, "latent_spread", lambda z: next(spreads))
  config = _config(base[0])
  config.num_iters, config.tfds_dir, config.rl.diversity_floor = 5, shapes_tfds, 0.6
  state = rl_job.run(config, str(tmp_path / "w"))
  assert int(state["step"]) == 3  # 0.5 < 0.6 x 1.0 after the third iteration
  report = json.loads((tmp_path / "w" / "report.json").read_text())
  assert report["iterations"] == 3 and (tmp_path / "w" / "export").exists()
  assert int(rl_job.run(config, str(tmp_path / "w"))["step"]) == 3  # the same command again: nothing more trained
