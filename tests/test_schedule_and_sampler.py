"""The MAR sampler: schedule, decode-once invariant, CFG, determinism, records and their log-probs."""
import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from margrpo_jax.diffusion import gaussian
from margrpo_jax.models import text
from margrpo_jax.rl import batch as batch_lib, loss as loss_lib
from margrpo_jax.sampling import sampler as S
from margrpo_jax.sampling import schedule

DIFF = gaussian.make_diffusion(1000, "25")  # the real respacing (a 6-step one amplifies eps errors ~6000x)
PROMPTS = ["a red circle", "two blue squares", "a green triangle above a cyan square"]


def test_cosine_schedule_by_hand():
  sched = schedule.cosine_schedule(64, 8)
  # Remaining after step s: floor(64 cos(pi/2 (s+1)/8)), clamped to [1, masked - 1]; 0 after the last step.
  rem = [math.floor(64 * math.cos(math.pi / 2 * (s + 1) / 8)) for s in range(8)]
  assert rem == [62, 59, 53, 45, 35, 24, 12, 0]
  np.testing.assert_array_equal(sched.counts, [2, 3, 6, 8, 10, 11, 12, 12])
  np.testing.assert_array_equal(sched.starts, [0, 2, 5, 11, 19, 29, 40, 52])
  assert sched.counts.sum() == 64
  np.testing.assert_array_equal(schedule.cosine_schedule(64, 64).counts, np.ones(64))
  for n in (1, 5, 16, 33):
    s = schedule.cosine_schedule(64, n)
    assert s.counts.sum() == 64 and (s.counts >= 1).all()
  with pytest.raises(ValueError):
    schedule.cosine_schedule(64, 65)


def test_cfg_schedules():
  sched = schedule.cosine_schedule(64, 8)
  np.testing.assert_allclose(schedule.cfg_schedule(sched, 64, 3.0, "constant"), 3.0)
  lin = schedule.cfg_schedule(sched, 64, 3.0, "linear")
  np.testing.assert_allclose(lin, 1 + 2.0 * (64 - sched.remaining) / 64, rtol=1e-6)
  assert lin[0] == pytest.approx(1 + 2 * 2 / 64) and lin[-1] == pytest.approx(1 + 2 * 63 / 64)


def test_segments_cover_the_steps_and_cost_less_with_more_of_them():
  sched = schedule.cosine_schedule(256, 16)
  cost = lambda segs: sum((hi - lo) * (1.0 * sched.starts[hi - 1] + 10.0 * sched.counts[lo:hi].max())
                          for lo, hi in segs)
  costs = []
  for m in (1, 2, 3, 8, 16, 40):
    segs = schedule.segments(sched, m, 1.0, 10.0)
    assert len(segs) <= m and segs[0][0] == 0 and segs[-1][1] == 16
    assert all(a[1] == b[0] and a[0] < a[1] for a, b in zip(segs, segs[1:]))  # consecutive, none empty
    costs.append(cost(segs))
  assert costs == sorted(costs, reverse=True) and costs[0] > costs[-1]
  assert schedule.segments(sched, 16, 1.0, 10.0) == tuple((s, s + 1) for s in range(16))  # each step alone
  # Brute force over every split into at most 3 runs of a 7-step schedule: the DP finds the cheapest.
  small = schedule.cosine_schedule(40, 7)
  c7 = lambda segs: sum((hi - lo) * (2.0 * small.starts[hi - 1] + 5.0 * small.counts[lo:hi].max())
                        for lo, hi in segs)
  splits = [((0, 7),)] + [((0, a), (a, 7)) for a in range(1, 7)] + [
      ((0, a), (a, b), (b, 7)) for a in range(1, 7) for b in range(a + 1, 7)]
  assert c7(schedule.segments(small, 3, 2.0, 5.0)) == min(c7(s) for s in splits)


@pytest.mark.slow
def test_segmented_sampler_draws_the_same_tokens(small_model):
  """Each AR step at its own shape (the encoder on the known tokens, the head on the step's count) draws the
  tokens and records of one scan at the largest shape from the same key, to float tolerance (the encoder sums
  over fewer keys); with the encoder's gather off, to the rounding of the head's matmuls on fewer rows."""
  cfg = S.SamplerConfig(num_steps=4, cfg_scale=3.0, segments=1)
  one, rec1 = _run(small_model, cfg, key=5)
  scale = float(jnp.max(jnp.abs(one)))
  tok, rec = _run(small_model, dataclasses.replace(cfg, segments=4), key=5)
  np.testing.assert_allclose(tok, one, rtol=0, atol=1e-3 * scale)
  v = np.asarray(rec.valid)
  np.testing.assert_array_equal(rec.positions, rec1.positions)
  np.testing.assert_allclose(np.where(v[:, None], rec.logp, 0), np.where(v[:, None], rec1.logp, 0), rtol=2e-3, atol=0.05)
  model_cfg, graphdef, params = small_model
  model, ids = nnx.merge(graphdef, params), jnp.asarray(text.tokenize(PROMPTS, model_cfg.text.max_len))
  plain = lambda segs: jax.jit(lambda p: S.sample(_NoGather(nnx.merge(graphdef, p)), DIFF, dataclasses.replace(
      cfg, segments=segs), *_conds(model, ids), jax.random.key(5))[0])(params)
  np.testing.assert_allclose(plain(4), plain(1), rtol=0, atol=1e-5 * scale)


class _NoGather:
  """The model with a backbone that hides ``encode_known`` (the masked encoder over all positions)."""

  def __init__(self, model):
    self._m = model
    self.backbone = type("B", (), {"__call__": lambda _, *a: model.backbone(*a),
                                   **{k: getattr(model.backbone, k) for k in ("seq_len", "token_dim")}})()
    self.head = model.head

  def __getattr__(self, name):
    return getattr(self._m, name)


def _conds(model, ids):
  return model.condition(ids), model.null_condition(ids.shape[0])


def _run(small_model, cfg, key=0, record=True):
  model_cfg, graphdef, params = small_model
  fn = S.make_sample_fn(graphdef, DIFF, cfg, record=record)
  ids = jnp.asarray(text.tokenize(PROMPTS, model_cfg.text.max_len))
  return fn(params, ids, jax.random.key(key))


def test_every_token_decoded_once_and_counts_follow_schedule(small_model):
  cfg = S.SamplerConfig(num_steps=8, cfg_scale=2.0)
  tokens, rec = _run(small_model, cfg)
  sched = schedule.cosine_schedule(64, 8)
  valid = np.asarray(rec.valid)
  pos = np.asarray(rec.positions)
  np.testing.assert_array_equal(valid.sum(-1), np.repeat(sched.counts[:, None], len(PROMPTS), 1))
  for b in range(len(PROMPTS)):
    decoded = pos[:, b][valid[:, b]]
    assert sorted(decoded.tolist()) == list(range(64))  # each position exactly once
  mask = np.asarray(rec.mask)
  np.testing.assert_array_equal((~mask).sum(-1), np.repeat(sched.starts[:, None], len(PROMPTS), 1))
  canvas = np.asarray(rec.canvas)
  assert np.all(canvas[mask] == 0.0)  # unknown positions are blank on the recorded canvas
  # The final canvas holds, at every position, the x_0 of the step that decoded it.
  xs = np.asarray(rec.xs)
  for s in range(8):
    for b in range(len(PROMPTS)):
      for k in np.nonzero(valid[s, b])[0]:
        np.testing.assert_array_equal(np.asarray(tokens)[b, pos[s, b, k]], xs[s, -1, b, k])


@pytest.mark.slow
def test_cfg_scale_one_equals_unguided(small_model):
  guided, _ = _run(small_model, S.SamplerConfig(num_steps=6, cfg_scale=1.0, guidance=True, clip_denoised=True), record=False)
  plain, _ = _run(small_model, S.SamplerConfig(num_steps=6, cfg_scale=1.0, guidance=False, clip_denoised=True), record=False)
  np.testing.assert_allclose(guided, plain, atol=1e-4)
  strong, _ = _run(small_model, S.SamplerConfig(num_steps=6, cfg_scale=4.0, clip_denoised=True), record=False)
  assert np.abs(np.asarray(strong) - np.asarray(plain)).max() > 1e-3  # 10x the equality tolerance


def test_deterministic_and_seed_dependent(small_model):
  cfg = S.SamplerConfig(num_steps=6, cfg_scale=2.0)
  a, _ = _run(small_model, cfg, key=1, record=False)
  b, _ = _run(small_model, cfg, key=1, record=False)
  c, _ = _run(small_model, cfg, key=2, record=False)
  np.testing.assert_array_equal(a, b)
  assert not np.array_equal(a, c)


# With clip_denoised (the shapes-world setting) chains stay in [-5, 5] and float32 recomputation agrees to
# ~1e-5; unclipped chains of an undertrained head pass through |x| ~ 1e4 at the noisiest step (sqrt(1/abar)
# ~ 2e4), where float32 itself cannot agree to better than ~1 nat.
@pytest.mark.slow
@pytest.mark.parametrize("cfg_scale,temperature", [(1.0, 1.0), (3.0, 0.8)])
def test_recorded_logprobs_equal_recomputed(small_model, cfg_scale, temperature):
  model_cfg, graphdef, params = small_model
  cfg = S.SamplerConfig(num_steps=6, cfg_scale=cfg_scale, temperature=temperature, cfg_schedule="constant",
                        clip_denoised=True)
  _, rec = _run(small_model, cfg)
  guided = cfg_scale != 1.0
  ids = jnp.asarray(text.tokenize(PROMPTS, model_cfg.text.max_len))

  @jax.jit
  def rescore(params, rec, step):
    model = nnx.merge(graphdef, params)
    cond, null = model.text_encoder(ids), model.text_encoder.null(len(PROMPTS))
    return S.score_step(model, DIFF, cfg, rec, step, cond, null, guided)

  for step in range(cfg.num_steps):
    logp, std = rescore(params, rec, step)
    v = np.asarray(rec.valid[step])[None]  # (1, B, K): rows past a step's own count are padding
    np.testing.assert_allclose(np.where(v[..., None], std, 0), np.where(v[..., None], rec.std[step], 0), rtol=1e-5)
    np.testing.assert_allclose(np.where(v, logp, 0), np.where(v, rec.logp[step], 0), rtol=1e-5, atol=1e-3)
  # Sanity: the log-probs depend on the conditioning (a wrong prompt scores differently).
  assert np.isfinite(np.asarray(rec.logp)).all()


def test_compile_once_per_config(small_model):
  cfg = S.SamplerConfig(num_steps=5, cfg_scale=2.0)
  model_cfg, graphdef, params = small_model
  fn = S.make_sample_fn(graphdef, DIFF, cfg)
  ids = jnp.asarray(text.tokenize(PROMPTS, model_cfg.text.max_len))
  for k in range(3):
    fn(params, ids, jax.random.key(k))
  assert fn._cache_size() == 1


def test_order_group_shares_the_generation_order(small_model):
  """``order_group=g``: the rows of a group decode in one order; different groups in different orders."""
  model_cfg, graphdef, params = small_model
  ids = jnp.asarray(text.tokenize(["a red circle"] * 4, model_cfg.text.max_len))
  cfg = S.SamplerConfig(num_steps=4, order_group=2)
  _, rec = S.make_sample_fn(graphdef, DIFF, cfg, record=True)(params, ids, jax.random.key(3))
  order = np.asarray(rec.order)
  np.testing.assert_array_equal(order[0], order[1])
  np.testing.assert_array_equal(order[2], order[3])
  assert (order[0] != order[2]).any()


@pytest.mark.slow
def test_vary_steps_share_the_group_noise_elsewhere(small_model):
  """``vary_steps=m``: exactly ``m`` recorded steps have varied noise. At every other step the rows of a group
  start their chains from one x_T, at the varied ones from their own; different groups never share noise; up to
  the first varied step a group's rows decode identical tokens. The RL batch scores exactly the varied steps."""
  model_cfg, graphdef, params = small_model
  ids = jnp.asarray(text.tokenize(["a red circle"] * 4, model_cfg.text.max_len))
  cfg = S.SamplerConfig(num_steps=4, order_group=2, vary_steps=2)
  for seed in range(3):
    final, rec = S.make_sample_fn(graphdef, DIFF, cfg, record=True)(params, ids, jax.random.key(seed))
    varied = np.asarray(rec.varied)
    assert varied.sum() == 2
    x_T, x0 = np.asarray(rec.xs[:, 0]), np.asarray(rec.xs[:, -1])  # (N, B, K, C) chain starts / decoded tokens
    for i in range(cfg.num_steps):
      assert np.array_equal(x_T[i, 0], x_T[i, 1]) == (not varied[i])
      assert np.array_equal(x_T[i, 2], x_T[i, 3]) == (not varied[i])
      assert not np.allclose(x_T[i, 0], x_T[i, 2])
    first = int(np.argmax(varied))
    for i in range(first):
      np.testing.assert_array_equal(x0[i, 0], x0[i, 1])
    assert not np.allclose(x0[first, 0], x0[first, 1])
  model = nnx.merge(graphdef, params)
  bcfg = batch_lib.BatchConfig(num_ar_steps=2, num_diffusion_steps=2, mte_seeds=0, consistency=False)
  _, info = jax.jit(lambda: batch_lib.build(model, model, DIFF, cfg, bcfg, loss_lib.LossConfig(), rec, final, ids,
                                            jnp.zeros(4), jax.random.key(0)))()
  np.testing.assert_array_equal(np.asarray(info["steps"]), np.nonzero(varied)[0])
