"""The likelihood estimators of ``rl/estimators/``: each one's gradient is the one its docstring states."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from margrpo_jax.diffusion import gaussian
from margrpo_jax.models import objective, text
from margrpo_jax.rl import batch as batch_lib, estimators, loss as loss_lib, step as step_lib
from margrpo_jax.rl.estimators import forward
from margrpo_jax.sampling import sampler as S

PROMPTS = ["a red circle", "a red circle", "two blue squares", "two blue squares"]
ADV = jnp.array([1.7, -0.4, 0.6, -2.0])


def test_registry_names_and_what_each_reads():
  assert estimators.NAMES == ("chain", "token_elbo", "image_elbo", "awm", "nft", "elbo_hinge")
  assert [estimators.get(n).READS_CHAINS for n in estimators.NAMES] == [True, True, False, False, False, False]
  assert [estimators.get(n).REENCODES for n in estimators.NAMES] == [False, False, True, True, True, True]
  with pytest.raises(ValueError, match="rl.estimator='reinforce' is not one of chain, token_elbo"):
    estimators.get("reinforce")


def test_presets_are_the_estimators_they_name():
  """configs/shapes_rl.py: the main job is the image ELBO; ``paper`` is the official estimator with every
  stabiliser and only the window fix; every study preset has the matched budget, strict reward and an EMA, and
  each one validates."""
  from margrpo_jax import config_files  # noqa: PLC0415
  from margrpo_jax.rl import config as rl_config  # noqa: PLC0415
  assert config_files.load("shapes_rl").variant == "image_elbo"
  for v in ("paper", "token_elbo", "image_elbo", "awm", "nft"):
    c = config_files.load("shapes_rl", v)
    rl_config.resolve_fidelity(c)
    sc = rl_config.step_config(c)
    assert sc.estimator == ("chain" if v == "paper" else v)
    images = 51_200 if v == "image_elbo" else 12_800  # the main job: at most 200 iterations of 32 prompts x 8 images
    assert (c.num_iters * c.rl.group_size * c.rl.prompts_per_iter, c.rl.ema_decay) == (images, 0.95), v
    assert c.rl.rewards.shapes_strict == 1.0 and c.rl.rewards.shapes_partial == 0.0, v
    if v == "image_elbo":
      assert (c.rl.elbo_rows, c.rl.export_interpolation, c.rl.positive_only, c.rl.diversity_floor) == (128, 1.0, True,
                                                                                                        0.8)
  c = config_files.load("shapes_rl", "paper")
  changed = rl_config.resolve_fidelity(c)
  assert c.rl.diffusion_window == "1:-3" and not any("diffusion_window" in x for x in changed)
  assert c.rl.official.mask_after_step and c.rl.official.selection_chains == "scored" and c.rl.consistency
  assert c.rl.mte_seeds
  assert c.rl.topk_fraction < 1.0 and not c.rl.train_head


def test_rollouts_have_their_own_guidance_scale():
  """``rl.rollout_cfg_scale`` guides the rollouts only; the job's own eval and every reading of the export use
  ``sampling.cfg_scale`` (0 = the rollouts use it too)."""
  from margrpo_jax import config_files  # noqa: PLC0415
  from margrpo_jax.rl import config as rl_config  # noqa: PLC0415
  c = config_files.load("shapes_rl", "awm")
  assert c.rl.rollout_cfg_scale == 0.0 and rl_config.step_config(c).sampler.cfg_scale == c.sampling.cfg_scale
  c.rl.rollout_cfg_scale = 7.0
  assert rl_config.step_config(c).sampler.cfg_scale == 7.0 and c.sampling.cfg_scale == 3.0
  assert rl_config.step_config(c).sampler.temperature == c.sampling.temperature == 1.0
  c.rl.rollout_temperature = 1.25
  assert rl_config.step_config(c).sampler.temperature == 1.25 and c.sampling.temperature == 1.0


@pytest.fixture(scope="module")
def images(small_model):
  """The small model, its prompts' ids and one draw of four images' tokens (stand-ins for re-encoded images)."""
  model_cfg, graphdef, params = small_model
  ids = jnp.asarray(text.tokenize(PROMPTS, model_cfg.text.max_len))
  diff = gaussian.make_diffusion(1000, "10")
  final, rec = S.make_sample_fn(graphdef, diff, S.SamplerConfig(num_steps=6, cfg_scale=2.0, clip_denoised=1.0),
                                record=True)(params, ids, jax.random.key(0))
  return graphdef, params, ids, final, rec, diff


def _ctx(graphdef, params, estimator, **fc):
  sc = step_lib.StepConfig(sampler=S.SamplerConfig(), batch=batch_lib.BatchConfig(), loss=loss_lib.LossConfig(),
                           estimator=estimator, forward=forward.ForwardConfig(**fc))
  policy = {k: params[k] for k in ("text_encoder", "backbone")}
  frozen = {k: v for k, v in params.items() if k not in policy}
  anchor = jax.tree.map(lambda x: x + 0.01 * jnp.sin(jnp.arange(x.size).reshape(x.shape)), policy)  # != policy
  ctx = step_lib.Context(graphdef, sc, gaussian.make_diffusion(1000), frozen,
                         dict(ref=anchor, rollout=policy, ema=anchor))
  return ctx, policy, frozen, anchor


def _grad(fn, p):
  return jnp.concatenate([x.ravel() for x in jax.tree.leaves(jax.grad(fn)(p))])


@pytest.mark.slow
def test_forward_estimators_state_their_gradients(images):
  """image_elbo: mean_i A_i grad l_i; awm: the same with clipped A plus beta grad of the eps distance to the
  anchor; nft: at theta = old, its gradient is that of awm's policy term on the eps MSE, 2 mean_i clip(A_i) (eps - eps_t)
  grad eps. Each against a formula written here from forward.draw's draws."""
  graphdef, params, ids, final, _, _ = images
  key = jax.random.key(5)
  block = step_lib.Block(ids, ADV, final)
  obj = objective.MaskedObjective(label_drop=0.0)

  def parts(p, ctx):
    d = forward.draw(obj, ctx.train_diff, final, key)
    out = forward.head_out(graphdef, {**ctx.frozen, **p}, ids, final, d)
    l = forward.per_image(gaussian.training_loss(ctx.train_diff, out, final, d.x_t, d.t, d.noise), d)
    eps = gaussian.split_output(out)[0]
    return d, l, eps

  ctx, policy, frozen, anchor = _ctx(graphdef, params, "image_elbo", objective=obj)
  d = forward.draw(obj, ctx.train_diff, final, key)  # every estimator below scores these draws
  got = _grad(lambda p: estimators.get("image_elbo").loss(ctx, p, block, d)[0], policy)
  want = _grad(lambda p: jnp.mean(ADV * parts(p, ctx)[1]), policy)
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-7)

  clipped = jnp.clip(ADV, -1, 1)
  ctx, policy, frozen, anchor = _ctx(graphdef, params, "awm", objective=obj, beta=0.3, anchor="ref")
  eps_a = jax.lax.stop_gradient(parts(anchor, ctx)[2])

  def awm(p):
    d, l, eps = parts(p, ctx)
    return jnp.mean(clipped * l) + 0.3 * jnp.mean(forward.per_image(0.5 * jnp.mean((eps - eps_a) ** 2, -1), d))

  got = _grad(lambda p: estimators.get("awm").loss(ctx, p, dataclasses.replace(block, adv=clipped), d)[0], policy)
  np.testing.assert_allclose(got, _grad(awm, policy), rtol=1e-4, atol=1e-7)

  ctx, policy, frozen, anchor = _ctx(graphdef, params, "nft", objective=obj, nft_strength=0.5, anchor="rollout")

  def first_order(p):
    d, _, eps = parts(p, ctx)
    return jnp.mean(forward.per_image(clipped[None, :, None] * jnp.mean((eps - d.noise) ** 2, -1), d))

  got = _grad(lambda p: estimators.get("nft").loss(ctx, p, block, d)[0], policy)
  np.testing.assert_allclose(got, _grad(first_order, policy), rtol=1e-4, atol=1e-7)


def test_elbo_hinge_pushes_a_failing_image_back_only_while_it_is_likelier_than_under_the_reference(images):
  """elbo_hinge: grad = mean_i A_i^+ grad l_i - mean_i A_i^- 1[l_i < l_i^ref] grad l_i (formula written here);
  at the reference itself every hinge is closed, so only the better images move the policy."""
  graphdef, params, ids, final, _, _ = images
  obj = objective.MaskedObjective(label_drop=0.0)
  ctx, policy, frozen, anchor = _ctx(graphdef, params, "elbo_hinge", objective=obj)
  d = forward.draw(obj, ctx.train_diff, final, jax.random.key(5))
  block, est = step_lib.Block(ids, ADV, final), estimators.get("elbo_hinge")
  l = lambda p: forward.per_image(gaussian.training_loss(
      ctx.train_diff, forward.head_out(graphdef, {**frozen, **p}, ids, final, d), final, d.x_t, d.t, d.noise), d)
  pos, neg, open_ = jnp.maximum(ADV, 0), jnp.maximum(-ADV, 0), l(policy) < l(anchor)
  got = _grad(lambda p: est.loss(ctx, p, block, d)[0], policy)
  np.testing.assert_allclose(got, _grad(lambda p: jnp.mean(pos * l(p) - neg * open_ * l(p)), policy),
                             rtol=1e-4, atol=1e-7)
  at_ref = dataclasses.replace(ctx, anchors=dict(ctx.anchors, ref=policy))
  loss, m = est.loss(at_ref, policy, block, d)
  assert float(m["hinge_active"]) == 0.0 and float(m["kl"]) == 0.0
  np.testing.assert_allclose(_grad(lambda p: est.loss(at_ref, p, block, d)[0], policy),
                             _grad(lambda p: jnp.mean(pos * l(p)), policy), rtol=1e-4, atol=1e-7)


def test_forward_update_scores_the_heaviest_rows_with_several_draws(images):
  """``forward.rows`` keeps the rows of largest |A| with weights scaled by rows / B, ``forward.draws`` scores each
  several times: the update equals a plain one on that hand-made batch (the same shapes, so the same draws)."""
  import optax  # noqa: PLC0415
  graphdef, params, ids, final, _, _ = images
  obj = objective.MaskedObjective(label_drop=0.0)
  ctx, policy, frozen, anchor = _ctx(graphdef, params, "image_elbo", objective=obj)
  tx, key = optax.sgd(1e-2), jax.random.key(3)  # sgd: the weights' scale shows in the step
  adv = jnp.array([0.0, 1.5, 0.0, 0.5])  # positive-only weights: two rows carry all of it

  def update(fc, ids, adv, tokens):
    sc = dataclasses.replace(ctx.sc, forward=fc)
    state = dict(policy=policy, opt=tx.init(policy), step=jnp.zeros((), jnp.int32))
    new, m = step_lib.forward_update(graphdef, tx, ctx.train_diff, sc, state, frozen, anchor, ids, adv, tokens, key)
    return jnp.concatenate([x.ravel() for x in jax.tree.leaves(new["policy"])]), m

  got, m = update(forward.ForwardConfig(objective=obj, rows=2, draws=3), ids, adv, final)
  tiled = lambda x: jnp.concatenate([x[jnp.array([1, 3])]] * 3)
  want, _ = update(forward.ForwardConfig(objective=obj), tiled(ids), tiled(adv) * 2 / 4, tiled(final))
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
  assert float(m["kept_weight"]) == 1.0
  assert float(update(forward.ForwardConfig(objective=obj, rows=1), ids, adv, final)[1]["kept_weight"]) == 0.75


@pytest.mark.parametrize("name", ["image_elbo", pytest.param("awm", marks=pytest.mark.slow),
                                  pytest.param("nft", marks=pytest.mark.slow)])
def test_microbatches_sum_to_the_one_shot_update(images, name):
  """``microbatch`` scores an optimizer step's rows a few at a time at the whole block's draws and sums the
  gradients: the update equals the one-shot update (sgd, so any weighting error shows)."""
  import optax  # noqa: PLC0415
  graphdef, params, ids, final, _, _ = images
  obj = objective.MaskedObjective(label_drop=0.5)
  ctx, policy, frozen, anchor = _ctx(graphdef, params, name, objective=obj, beta=0.3, anchor="ref", draws=2)
  tx = optax.sgd(1e-2)

  def update(microbatch):
    sc = dataclasses.replace(ctx.sc, microbatch=microbatch)
    state = dict(policy=policy, opt=tx.init(policy), step=jnp.zeros((), jnp.int32))
    new, m = step_lib.forward_update(graphdef, tx, ctx.train_diff, sc, state, frozen, anchor, ids, ADV, final,
                                     jax.random.key(4))
    return jnp.concatenate([x.ravel() for x in jax.tree.leaves(new["policy"])]), m

  (got, m), (want, w) = update(2), update(0)
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-7)
  for k in ("loss", "policy", "kl", "mar_loss", "grad_norm"):
    np.testing.assert_allclose(float(m[k]), float(w[k]), rtol=1e-4, atol=1e-7, err_msg=k)
  if name == "image_elbo":  # rl.remat (each transformer block recomputed in the backward pass): the same update
    ctx = dataclasses.replace(ctx, sc=dataclasses.replace(ctx.sc, loss=dataclasses.replace(ctx.sc.loss, remat=True)))
    np.testing.assert_allclose(update(2)[0], want, rtol=1e-4, atol=1e-7)


def test_nft_regresses_towards_a_bounded_target(images):
  """Away from the old policy the nft loss is a convex regression in eps_theta with the finite minimiser
  eps* = eps_old + (2 r - 1) (eps - eps_old) / s: its eps-gradient vanishes there and nowhere else."""
  s, r = 0.5, jnp.array([1.0, 0.0, 0.75, 0.2])[None, :, None, None]
  e_old, target = jax.random.normal(jax.random.key(1), (2, 1, 4, 3, 5))
  loss = lambda e: jnp.sum(r * ((1 - s) * e_old + s * e - target) ** 2 + (1 - r) * ((1 + s) * e_old - s * e - target) ** 2)
  star = e_old + (2 * r - 1) * (target - e_old) / s
  np.testing.assert_allclose(jax.grad(loss)(star), 0.0, atol=1e-5)
  assert float(jnp.abs(jax.grad(loss)(star + 0.1)).min()) > 0


@pytest.mark.slow
def test_token_elbo_q_mte_draws_the_committed_tokens_forward_process(images, small_model):
  """token_elbo: the main and the S q-MTE draws of an uncertain token are its committed value noised at the
  scored levels, x_t = sqrt(abar) x_0 + sqrt(1 - abar) eps with x_prev = eps; the loss is finite and reaches the
  AR side; with the policy at the behaviour policy the ratio is 1."""
  graphdef, params, ids, final, rec, diff = images
  scfg = S.SamplerConfig(num_steps=6, cfg_scale=2.0, clip_denoised=1.0)
  bcfg = batch_lib.BatchConfig(num_ar_steps=2, num_diffusion_steps=3, mte_seeds=3, logp="elbo", topk_fraction=0.5,
                               consistency=False)
  lcfg = loss_lib.LossConfig(logp="elbo", clip_denoised=1.0)
  m = nnx.merge(graphdef, params)
  batch, _ = jax.jit(lambda: batch_lib.build(m, m, diff, scfg, bcfg, lcfg, rec, final, ids, ADV,
                                             jax.random.key(2)))()
  assert batch.mte_x_t.shape[0] == 3 and batch.mte_x_t.shape[-2] == batch.uncertain_idx.shape[-1] > 0
  ab = jnp.asarray(diff.alphas_cumprod, jnp.float32)[batch.j]  # (M, k)
  for i in range(2):
    x0 = jnp.take_along_axis(final, batch.positions[i][..., None], axis=1)  # committed values at P (all L)
    x0_u = jnp.take_along_axis(x0, batch.uncertain_idx[i][..., None], axis=1)
    a = ab[i][:, None, None, None]
    np.testing.assert_allclose(batch.x_t[i], jnp.sqrt(a) * x0[None] + jnp.sqrt(1 - a) * batch.x_prev[i], atol=1e-4)
    np.testing.assert_allclose(batch.mte_x_t[:, i], jnp.sqrt(a) * x0_u[None, None] + jnp.sqrt(1 - a)
                               * batch.mte_x_prev[:, i], atol=1e-4)
  loss, metrics = loss_lib.loss_fn(m, diff, lcfg, batch)
  assert np.isfinite(float(loss)) and float(metrics["logp_diff"]) < 1e-3
  g = jax.grad(lambda p: loss_lib.loss_fn(nnx.merge(graphdef, p), diff, lcfg, batch)[0])(params)
  assert float(optax_norm(g["backbone"])) > 0


def optax_norm(tree):
  return jnp.sqrt(sum(jnp.sum(x ** 2) for x in jax.tree.leaves(tree)))
