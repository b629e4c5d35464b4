"""The MAR-GRPO loss on a real (small) rollout: ratio 1 at the first update, KL 0 against itself, S = 1 MTE
equals the single-trajectory loss, gradients reach the AR backbone and never the frozen head."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from margrpo_jax.diffusion import gaussian
from margrpo_jax.models import text
from margrpo_jax.rl import batch as batch_lib
from margrpo_jax.rl import loss as loss_lib
from margrpo_jax.sampling import sampler as S

DIFF = gaussian.make_diffusion(1000, "10")
SCFG = S.SamplerConfig(num_steps=6, cfg_scale=2.0, cfg_schedule="constant", clip_denoised=True, guidance=True)
LCFG = loss_lib.LossConfig(clip_denoised=True)
PROMPTS = ["a red circle", "a red circle", "two blue squares", "two blue squares"]


@pytest.fixture(scope="module")
def rollout(small_model):
  model_cfg, graphdef, params = small_model
  ids = jnp.asarray(text.tokenize(PROMPTS, model_cfg.text.max_len))
  final, rec = S.make_sample_fn(graphdef, DIFF, SCFG, record=True)(params, ids, jax.random.key(0))
  adv = jnp.array([1.0, -1.0, 0.5, -0.5])

  @functools.partial(jax.jit, static_argnums=0)
  def build(bcfg, params):
    m = nnx.merge(graphdef, params)
    return batch_lib.build(m, m, DIFF, SCFG, bcfg, LCFG, rec, final, ids, adv, jax.random.key(1))

  return graphdef, params, build


def _loss(graphdef, params, batch, lcfg=LCFG):
  return jax.jit(lambda p: loss_lib.loss_fn(nnx.merge(graphdef, p), DIFF, lcfg, batch))(params)


@pytest.mark.slow
def test_first_update_ratio_is_one_and_kl_zero(rollout):
  graphdef, params, build = rollout
  batch, info = build(batch_lib.BatchConfig(num_ar_steps=3, num_diffusion_steps=4, mte_seeds=2), params)
  assert batch.x_t.shape == (3, 4, 4, 64, 48) and batch.mte_x_t.shape == (2, 3, 4, 4, 19, 48)  # K = 19 MTE tokens
  assert (np.diff(np.asarray(info["steps"])) > 0).all()
  # U holds the largest per-token MTE std of each image's loss region: its smallest entry >= every unselected one.
  u, unc, reg = np.asarray(info["uncertainty"]), np.asarray(batch.uncertain), np.asarray(batch.region)
  assert (np.where(unc, u, np.inf).min(-1) >= np.where(unc | ~reg, -np.inf, u).max(-1)).all()
  loss, m = _loss(graphdef, params, batch)
  assert float(m["logp_diff"]) < 1e-3  # recomputed log-probs equal the rollout's: rho = 1
  assert float(m["clip_frac"]) == 0.0
  assert abs(float(m["kl"])) < 1e-5    # reference == policy
  assert np.isfinite(float(loss)) and float(m["tokens"]) > 0
  # Uncertain tokens (intended scope): the top floor(0.3 |region|) of the loss region, per image and step.
  region = np.asarray(batch.region)
  np.testing.assert_array_equal(np.asarray(batch.uncertain).sum(-1), np.floor(0.3 * region.sum(-1) + 1e-6))
  assert (np.asarray(batch.uncertain) <= region).all()
  # Loss region (intended): unknown before the step; it contains the tokens decoded at the step.
  assert (np.asarray(batch.keep) <= np.asarray(batch.region)).all()
  np.testing.assert_array_equal(np.asarray(batch.visible), ~np.asarray(batch.region))


@pytest.mark.slow
def test_mte_with_the_main_trajectory_equals_single_trajectory(rollout):
  graphdef, params, build = rollout
  batch, _ = build(batch_lib.BatchConfig(num_ar_steps=2, num_diffusion_steps=3, mte_seeds=0), params)
  every = jnp.broadcast_to(jnp.arange(batch.uncertain.shape[-1], dtype=jnp.int32), batch.uncertain.shape)
  same = batch.replace(mte_x_t=batch.x_t[None], mte_x_prev=batch.x_prev[None], mte_old_logp=batch.old_logp[None],
                       uncertain=jnp.ones_like(batch.uncertain), uncertain_idx=every)
  l1, _ = _loss(graphdef, params, batch)
  l2, _ = _loss(graphdef, params, same)
  np.testing.assert_allclose(l1, l2, rtol=1e-5)


@pytest.mark.slow
def test_mte_on_gathered_topk_tokens_scatters_back_to_their_positions(rollout):
  """MTE trajectories are kept for the K uncertain tokens only; S = 1 copies of the main trajectory at those
  positions must reproduce the single-trajectory loss exactly (gather and scatter agree)."""
  graphdef, params, build = rollout
  batch, _ = build(batch_lib.BatchConfig(num_ar_steps=2, num_diffusion_steps=3, mte_seeds=2), params)
  idx = batch.uncertain_idx  # (M, B, K), K = 19 < L = 64
  assert idx.shape[-1] == 19 and len(set(np.asarray(idx)[0, 0].tolist())) == 19
  take = lambda a: jnp.take_along_axis(a, idx[:, None].reshape(idx[:, None].shape + (1,) * (a.ndim - 4)),
                                       axis=3)[None]  # (M, k, B, L[, C]) -> (1, M, k, B, K[, C])
  copy = batch.replace(mte_x_t=take(batch.x_t), mte_x_prev=take(batch.x_prev), mte_old_logp=take(batch.old_logp))
  single = batch.replace(mte_x_t=batch.mte_x_t[:0], mte_x_prev=batch.mte_x_prev[:0],
                         mte_old_logp=batch.mte_old_logp[:0])
  grad = lambda b: jax.jit(jax.grad(lambda p: loss_lib.loss_fn(nnx.merge(graphdef, p), DIFF, LCFG, b)[0]))(params)
  flat = lambda b: np.concatenate([np.ravel(x) for x in jax.tree.leaves(grad(b)["backbone"])])
  g_copy, g_single, g_mte = flat(copy), flat(single), flat(batch)
  np.testing.assert_allclose(g_copy, g_single, rtol=1e-4, atol=1e-7)
  assert np.abs(g_mte - g_single).max() > 1e-3 * np.abs(g_single).max()  # real MTE trajectories do differ


@pytest.mark.slow
def test_gradients_reach_the_backbone_not_the_head(rollout):
  graphdef, params, build = rollout
  batch, _ = build(batch_lib.BatchConfig(num_ar_steps=2, num_diffusion_steps=3, mte_seeds=2), params)
  policy = {k: params[k] for k in ("text_encoder", "backbone")}
  frozen = {"head": params["head"]}
  grads = jax.jit(jax.grad(lambda p: loss_lib.loss_fn(nnx.merge(graphdef, {**p, **frozen}), DIFF, LCFG,
                                                      batch)[0]))(policy)
  assert set(grads) == {"text_encoder", "backbone"}
  norm = lambda t: float(jnp.sqrt(sum(jnp.sum(x**2) for x in jax.tree.leaves(t))))
  assert norm(grads["backbone"]) > 0 and norm(grads["text_encoder"]) > 0


@pytest.mark.slow
def test_official_switches(rollout):
  graphdef, params, build = rollout
  off = batch_lib.BatchConfig(num_ar_steps=2, num_diffusion_steps=3, mte_seeds=2, mask_after_step=True,
                              mte_latent="commit", diffusion_window=(0, None), topk_scope="all",
                              selection_chains="scored")
  batch, _ = build(off, params)
  np.testing.assert_array_equal(np.asarray(batch.uncertain).sum(-1), 19)  # floor(0.3 * 64) of all L positions
  # B1: visibility and region both come from the post-step mask (tokens decoded at the step are "visible").
  np.testing.assert_array_equal(np.asarray(batch.visible), ~np.asarray(batch.region))
  lcfg = loss_lib.LossConfig(ratio="none", clip_eps=0.0, kl="official", cfg_in_loss=False, clip_denoised=True,
                             sigma_grad=False, mte_actual="replace")
  loss, m = _loss(graphdef, params, batch, lcfg)
  assert np.isfinite(float(loss)) and float(m["clip_frac"]) == 0.0


@pytest.mark.slow
def test_commit_time_mte_guided_uses_the_recorded_uncond_latents(rollout):
  """Official Harmon: MTE chains from the commit-time cond and uncond latents with CFG; NOVA: unguided (B6).
  Same keys, so the two differ only through the guidance."""
  graphdef, params, build = rollout
  cfg = dict(num_ar_steps=2, num_diffusion_steps=3, mte_seeds=2, mte_latent="commit", topk_fraction=1.0)
  guided, _ = build(batch_lib.BatchConfig(mte_commit_guided=True, **cfg), params)
  plain, _ = build(batch_lib.BatchConfig(mte_commit_guided=False, **cfg), params)
  assert np.isfinite(np.asarray(guided.mte_x_t)).all()
  assert not np.allclose(np.asarray(guided.mte_x_prev), np.asarray(plain.mte_x_prev), atol=1e-4)
  np.testing.assert_array_equal(np.asarray(guided.x_t), np.asarray(plain.x_t))  # the main trajectory is unchanged


def test_decoded_tokens_and_window_switches(rollout):
  """``loss_tokens='decoded'``: the scored positions are exactly the tokens committed at each selected step, with
  their recorded chains; ``diffusion_window=(0, 3)``: scored diffusion steps come from the first three list
  positions (largest j)."""
  graphdef, params, build = rollout
  bcfg = batch_lib.BatchConfig(num_ar_steps=3, num_diffusion_steps=2, mte_seeds=0, loss_tokens="decoded",
                               diffusion_window=(0, 3))
  batch, info = build(bcfg, params)
  _, _, rec = _rollout_record(graphdef, params)
  for m, i in enumerate(np.asarray(info["steps"])):
    np.testing.assert_array_equal(np.asarray(batch.positions[m]), np.asarray(rec.positions[i]))
    np.testing.assert_array_equal(np.asarray(batch.region[m]), np.asarray(rec.valid[i]))
    np.testing.assert_array_equal(np.asarray(batch.decoded[m]), np.asarray(rec.valid[i]))
    n = DIFF.num_steps - 1 - np.asarray(batch.j[m])  # list positions of the scored steps
    np.testing.assert_array_equal(np.asarray(batch.x_t[m]), np.asarray(rec.xs[i])[n])
  assert (np.asarray(batch.j) >= DIFF.num_steps - 3).all()  # the 3 noisiest of 10 steps (j = 9, 8, 7)
  loss, m = _loss(graphdef, params, batch)
  assert np.isfinite(float(loss)) and float(m["logp_diff"]) < 1e-3


def _rollout_record(graphdef, params):
  ids = jnp.asarray(text.tokenize(PROMPTS, 12))
  final, rec = S.make_sample_fn(graphdef, DIFF, SCFG, record=True)(params, ids, jax.random.key(0))
  return ids, final, rec


def test_default_window_drops_the_first_and_last_steps_and_zero_scores_all_of_it(rollout):
  graphdef, params, build = rollout
  batch, _ = build(batch_lib.BatchConfig(num_ar_steps=2, num_diffusion_steps=0, mte_seeds=0), params)
  # 10-step chain, window 1:-3 = list positions 1..6, j = 9 - n = 8..3, all of them.
  np.testing.assert_array_equal(np.asarray(batch.j), np.tile(np.arange(8, 2, -1), (2, 1)))
  for bad, match in (((5, 5), "holds no diffusion step"), ((1, -3, ), None)):
    if match:
      with pytest.raises(ValueError, match=match):
        batch_lib.validate(batch_lib.BatchConfig(diffusion_window=bad), 10)
  with pytest.raises(ValueError, match="does not fit the scored-step window 1:7"):
    batch_lib.validate(batch_lib.BatchConfig(num_diffusion_steps=7), 10)
  with pytest.raises(ValueError, match="rl.official.topk_scope='everywhere' is not one of region, all"):
    batch_lib.validate(batch_lib.BatchConfig(topk_scope="everywhere"), 10)


@pytest.mark.slow
def test_decoded_tokens_in_u_keep_their_own_chain(rollout):
  """U = the whole region = the decoded tokens: with ``mte_actual='keep'`` MTE changes nothing (each decoded
  token's image-producing chain is scored as is); 'replace' (official) swaps it for the MTE mean; 'include'
  averages the own chain with the S others."""
  graphdef, params, build = rollout
  batch, _ = build(batch_lib.BatchConfig(num_ar_steps=2, num_diffusion_steps=3, mte_seeds=2, topk_fraction=1.0,
                                         loss_tokens="decoded"), params)
  np.testing.assert_array_equal(np.asarray(batch.uncertain), np.asarray(batch.region))
  single = batch.replace(mte_x_t=batch.mte_x_t[:0], mte_x_prev=batch.mte_x_prev[:0],
                         mte_old_logp=batch.mte_old_logp[:0])

  def grad(b, mode):  # the policy gradient (its value is -mean(A) = 0 at ratio 1: only the gradient tells)
    lcfg = dataclasses.replace(LCFG, mte_actual=mode, beta=0.0)
    g = jax.jit(jax.grad(lambda p: loss_lib.loss_fn(nnx.merge(graphdef, p), DIFF, lcfg, b)[0]))(params)
    return np.concatenate([np.ravel(x) for x in jax.tree.leaves(g)])

  base = grad(single, "keep")
  scale = np.linalg.norm(base)
  assert scale > 0
  np.testing.assert_allclose(grad(batch, "keep"), base, atol=1e-5 * scale / np.sqrt(base.size))
  assert np.linalg.norm(grad(batch, "replace") - base) > 1e-3 * scale
  assert np.linalg.norm(grad(batch, "include") - base) > 1e-3 * scale


@pytest.mark.slow
def test_uncertainty_comes_from_chains_independent_of_the_scored_ones(rollout):
  """Scoring the last transition, the scored MTE chains' final samples are in the batch: their per-token std is
  the uncertainty U was chosen from with ``selection_chains='scored'`` (official), and is not with
  'independent' (the default), whose selection chains are drawn apart."""
  graphdef, params, build = rollout
  t = DIFF.num_steps
  for mode, same in (("scored", True), ("independent", False)):
    bcfg = batch_lib.BatchConfig(num_ar_steps=2, num_diffusion_steps=1, mte_seeds=3, topk_scope="all",
                                 diffusion_window=(t - 1, None), selection_chains=mode)
    batch, info = build(bcfg, params)
    scored = np.asarray(batch.mte_x_prev)[:, :, 0].std(0).mean(-1)  # (M, B, K) std over S of the final samples
    at_u = np.take_along_axis(np.asarray(info["uncertainty"]), np.asarray(batch.uncertain_idx), axis=-1)
    assert np.allclose(scored, at_u, atol=1e-5) == same


@pytest.mark.slow
def test_sigma_grad_changes_the_gradient_not_the_value(rollout):
  graphdef, params, build = rollout
  batch, _ = build(batch_lib.BatchConfig(num_ar_steps=2, num_diffusion_steps=3, mte_seeds=2), params)
  run = lambda lcfg: jax.jit(jax.value_and_grad(
      lambda p: loss_lib.loss_fn(nnx.merge(graphdef, p), DIFF, lcfg, batch)[0]))(params)
  (v1, g1), (v2, g2) = run(LCFG), run(dataclasses.replace(LCFG, sigma_grad=False))
  np.testing.assert_allclose(v1, v2, rtol=1e-6)
  flat = lambda g: np.concatenate([np.ravel(x) for x in jax.tree.leaves(g["backbone"])])
  assert np.abs(flat(g1) - flat(g2)).max() > 1e-3 * np.abs(flat(g1)).max()


@pytest.mark.slow
def test_elbo_log_likelihood_scores_the_final_tokens(rollout):
  """``logp='elbo'`` (token_elbo): the scored terms are the head's denoising errors of each decoded token's final value at the
  chosen noise levels (fresh noise): ratio 1 and KL 0 at the first update, and a step along the gradient with
  positive advantages lowers those tokens' denoising error (raises their likelihood)."""
  graphdef, params, build = rollout
  bcfg = batch_lib.BatchConfig(num_ar_steps=3, num_diffusion_steps=3, mte_seeds=0, loss_tokens="decoded",
                               logp="elbo")
  batch, info = build(bcfg, params)
  lcfg = dataclasses.replace(LCFG, logp="elbo")
  loss, m = _loss(graphdef, params, batch, lcfg)
  assert float(m["logp_diff"]) < 1e-4 and abs(float(m["kl"])) < 1e-6 and np.isfinite(float(loss))
  final = np.asarray(S.make_sample_fn(graphdef, DIFF, SCFG, record=True)(
      params, jnp.asarray(text.tokenize(PROMPTS, 12)), jax.random.key(0))[1].xs[:, -1])  # (N, B, K, C) x_0
  for m_, i in enumerate(np.asarray(info["steps"])):  # x_t noises the decoded tokens' own final values
    j = np.asarray(batch.j[m_])
    x0 = final[i]
    sa, sb = (np.asarray(DIFF.table(n, j))[:, None, None] for n in ("sqrt_alphas_cumprod",
                                                                    "sqrt_one_minus_alphas_cumprod"))
    want = sa * x0[None] + sb * np.asarray(batch.x_prev[m_])
    dec = np.asarray(batch.region[m_], bool)  # the decoded tokens: their chain's end is their final value
    assert dec.any()
    np.testing.assert_allclose(np.asarray(batch.x_t[m_])[:, dec], want[:, dec], atol=1e-5)
  pos = batch.replace(adv=jnp.ones_like(batch.adv))
  grads = jax.jit(jax.grad(lambda p: loss_lib.loss_fn(nnx.merge(graphdef, p), DIFF, lcfg, pos)[0]))(params)
  moved = jax.tree.map(lambda p, g: p - 1e-3 * g, params, grads)
  err = lambda p: -float(loss_lib.loss_fn(nnx.merge(graphdef, p), DIFF, lcfg, pos)[1]["policy"])
  assert err(moved) < err(params)


@pytest.mark.slow
def test_per_pixel_uncertainty_mixes_the_mte_estimate_per_element(rollout):
  """Official NOVA (A3, C3): U ranks latent pixels (here 4 of 12 values per 48-value token) over all positions and
  adds one random pixel; the loss mixes the MTE estimate per element. Under ratio='none' its gradient is affine
  in the element mask (so it is the official per-element mixture), and whole-token masks give the token path."""
  graphdef, params, build = rollout
  batch, _ = build(batch_lib.BatchConfig(num_ar_steps=2, num_diffusion_steps=2, mte_seeds=2, topk_scope="all",
                                         uncertainty_unit="pixel", pixel_channels=12, topk_random=1), params)
  elems = np.asarray(batch.uncertain_elems)  # (M, B, L, 48)
  px = elems.reshape(elems.shape[:-1] + (4, 12))
  assert (px == px[..., :1]).all()  # whole pixels
  np.testing.assert_array_equal(px[..., 0].sum((-1, -2)), np.floor(0.3 * 64 * 4) + 1)  # top 76 + 1 random
  np.testing.assert_array_equal(np.asarray(batch.uncertain), px[..., 0].any(-1))
  lcfg = dataclasses.replace(LCFG, ratio="none", clip_eps=0.0, beta=0.0, mte_actual="replace")
  grad = jax.jit(lambda b: jax.grad(lambda p: loss_lib.loss_fn(nnx.merge(graphdef, p), DIFF, lcfg, b)[0])(params))
  flat = lambda g: np.concatenate([np.ravel(x) for x in jax.tree.leaves(g)])
  with_elems = lambda e: flat(grad(batch.replace(uncertain_elems=jnp.asarray(e))))
  low = elems & (np.arange(48) < 24)
  g, g0, g1, g2 = (with_elems(e) for e in (elems, np.zeros_like(elems), low, elems & ~low))
  assert np.abs(g - g0).max() > 1e-3 * np.abs(g).max()  # the MTE chains contribute
  np.testing.assert_allclose(g - g0, (g1 - g0) + (g2 - g0), atol=1e-5 * np.abs(g).max())
  whole = np.broadcast_to(np.asarray(batch.uncertain)[..., None], elems.shape)
  tokens = flat(grad(batch.replace(uncertain_elems=jnp.zeros(elems.shape[:-1] + (0,), bool))))
  np.testing.assert_allclose(with_elems(whole), tokens, atol=1e-5 * np.abs(tokens).max())


@pytest.mark.slow
def test_bfloat16_compute_agrees_with_float32(rollout):
  """``rl.compute_dtype='bfloat16'`` (models/precision.py): the same batch scored by the bfloat16 graph gives the
  float32 loss within 2e-2 (relative, floor 1e-2), log-probs within 5e-2 nats of the rollout's, a gradient of
  cosine > 0.99, in float32; and it does compute in bfloat16 (its bf16 dot products appear in the program)."""
  from margrpo_jax.models import precision
  graphdef, params, build = rollout
  batch, _ = build(batch_lib.BatchConfig(num_ar_steps=2, num_diffusion_steps=3, mte_seeds=2), params)
  policy, frozen = {k: params[k] for k in ("text_encoder", "backbone")}, {"head": params["head"]}
  bf16 = precision.with_compute(graphdef, params, "bfloat16")

  def loss_and_grad(g):
    f = lambda p: loss_lib.loss_fn(nnx.merge(g, {**p, **frozen}), DIFF, LCFG, batch)
    return jax.jit(jax.value_and_grad(f, has_aux=True))(policy), jax.make_jaxpr(f)(policy)
  ((l32, m32), g32), _ = loss_and_grad(graphdef)
  ((l16, m16), g16), jaxpr = loss_and_grad(bf16)
  assert "bf16" in str(jaxpr) and all(x.dtype == jnp.float32 for x in jax.tree.leaves(g16))
  # the loss sums O(1) advantages of zero mean per group, so it cancels to a few 1e-3: its error is relative to a
  # floor of 1e-2 (the log-probs and the gradient below carry the strict checks)
  assert abs(float(l16) - float(l32)) <= 2e-2 * max(abs(float(l32)), 1e-2), (float(l16), float(l32))
  assert float(m16["logp_diff"]) < 5e-2, float(m16["logp_diff"])
  a, b = (jnp.concatenate([x.ravel() for x in jax.tree.leaves(g)]) for g in (g32, g16))
  assert float(a @ b / (jnp.linalg.norm(a) * jnp.linalg.norm(b))) > 0.99


@pytest.mark.slow
def test_microbatches_sum_to_the_one_shot_update(rollout):
  """``StepConfig.microbatch``: the chain loss's sums over a few images at a time, normalised by the whole batch's
  counts (``loss.counts``), give the one-shot update (sgd) and metrics, MTE and KL included, with the policy
  moved off the rollout's so that the ratio and the KL are not trivial."""
  import optax  # noqa: PLC0415
  from margrpo_jax.rl import step as step_lib  # noqa: PLC0415
  graphdef, params, build = rollout
  batch, _ = build(batch_lib.BatchConfig(num_ar_steps=2, num_diffusion_steps=2, mte_seeds=2), params)
  policy = jax.tree.map(lambda x: x * 1.01, {k: params[k] for k in ("text_encoder", "backbone")})
  frozen = {k: v for k, v in params.items() if k not in policy}
  tx = optax.sgd(1e-2)

  def update(microbatch):
    sc = step_lib.StepConfig(sampler=SCFG, batch=batch_lib.BatchConfig(), loss=dataclasses.replace(LCFG, beta=0.5),
                             microbatch=microbatch)
    state = dict(policy=policy, opt=tx.init(policy), step=jnp.zeros((), jnp.int32))
    new, m = jax.jit(lambda st: step_lib.update(graphdef, tx, DIFF, sc, st, frozen, batch))(state)
    return jnp.concatenate([x.ravel() for x in jax.tree.leaves(new["policy"])]), m

  (got, m), (want, w) = update(1), update(0)
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-7)
  assert float(w["kl"]) > 0 and float(w["logp_diff"]) > 0
  for k in ("loss", "policy", "kl", "clip_frac", "logp_diff", "tokens", "grad_norm"):
    np.testing.assert_allclose(float(m[k]), float(w[k]), rtol=1e-4, atol=1e-6, err_msg=k)


def test_remat_gives_the_same_loss_and_gradient(rollout):
  """``LossConfig.remat`` (each AR step, each transformer and head block, and the head's diffusion steps one at a
  time, recomputed in the backward pass) changes the memory, not the numbers: the same loss, metrics and
  gradient, with MTE, KL and the policy moved off the rollout's; so does dropping the checkpoint around each whole
  AR step (``remat_ar_steps=False``)."""
  graphdef, params, build = rollout
  batch, _ = build(batch_lib.BatchConfig(num_ar_steps=2, num_diffusion_steps=2, mte_seeds=2), params)
  moved = jax.tree.map(lambda x: x * 1.01, params)

  def run(remat, whole_steps=True):
    lcfg = dataclasses.replace(LCFG, beta=0.5, remat=remat, remat_ar_steps=whole_steps)
    f = lambda p: loss_lib.loss_fn(nnx.merge(graphdef, p), DIFF, lcfg, batch)
    return jax.jit(jax.value_and_grad(f, has_aux=True))(moved)

  (v1, m1), g1 = run(False)
  assert float(m1["kl"]) > 0
  flat = lambda g: np.concatenate([np.ravel(x) for x in jax.tree.leaves(g)])
  assert np.abs(flat(g1["backbone"])).max() > 0
  for (v2, m2), g2 in (run(True), run(True, whole_steps=False)):
    np.testing.assert_allclose(float(v2), float(v1), rtol=1e-4, atol=1e-6)
    for k in m1:
      np.testing.assert_allclose(float(m2[k]), float(m1[k]), rtol=1e-4, atol=1e-6, err_msg=k)
    np.testing.assert_allclose(flat(g2), flat(g1), rtol=1e-4, atol=1e-5 * np.abs(flat(g1)).max())  # summation order


@pytest.mark.slow
def test_gathered_encoder_gives_the_same_batch_loss_and_gradient(rollout):
  """MAR's encoder on the known tokens only in the update and the batch build (``LossConfig.encoder_buckets``,
  ``sampler.latents``) changes the work, not the numbers: on one batch the same loss, metrics and gradient as the
  key-masked encoder over all positions, with MTE, CFG in the loss and the KL term on; and the same batch (its
  tentative and MTE chains amplify the latents' float rounding, hence the looser tolerance on the sampled fields)."""
  graphdef, params, _ = rollout
  ids = jnp.asarray(text.tokenize(PROMPTS, 12))
  final, rec = S.make_sample_fn(graphdef, DIFF, SCFG, record=True)(params, ids, jax.random.key(0))
  bcfg = batch_lib.BatchConfig(num_ar_steps=3, num_diffusion_steps=2, mte_seeds=2)
  lcfg = lambda n: dataclasses.replace(LCFG, beta=0.5, encoder_buckets=n)
  m = nnx.merge(graphdef, params)
  build = jax.jit(lambda n: batch_lib.build(m, m, DIFF, SCFG, bcfg, lcfg(n), rec, final, ids,
                                            jnp.array([1.0, -1.0, 0.5, -0.5]), jax.random.key(1))[0],
                  static_argnums=0)
  b0, b4 = build(0), build(4)
  for k in ("x_t", "old_logp", "ref_mean", "mte_old_logp"):
    np.testing.assert_allclose(getattr(b4, k), getattr(b0, k), rtol=1e-2, atol=1e-2, err_msg=k)
  moved = jax.tree.map(lambda x: x * 1.01, params)
  grad = lambda n: jax.jit(jax.value_and_grad(lambda p: loss_lib.loss_fn(nnx.merge(graphdef, p), DIFF, lcfg(n), b0),
                                              has_aux=True))(moved)
  ((v0, m0), g0), ((v4, m4), g4) = grad(0), grad(4)
  np.testing.assert_allclose(float(v4), float(v0), rtol=1e-4, atol=1e-6)
  assert float(m0["kl"]) > 0
  for k in m0:
    np.testing.assert_allclose(float(m4[k]), float(m0[k]), rtol=1e-4, atol=1e-6, err_msg=k)
  flat = lambda g: np.concatenate([np.ravel(x) for x in jax.tree.leaves(g)])
  np.testing.assert_allclose(flat(g4), flat(g0), rtol=1e-4, atol=1e-5 * np.abs(flat(g0)).max())
