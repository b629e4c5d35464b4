"""The ``rl.fidelity=official`` loss of one scored AR step against a plain re-implementation of the official
formula (docs/algorithm.md sections 4, 6-8): the DDPM tables recomputed here in float64 from the cosine schedule,
the posterior mean and learned-range variance written out, Python loops over diffusion steps and MTE seeds, no
helper of the package's loss, batch or diffusion modules. The batch (recorded transitions, masks, reference
means) is the data both read."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from margrpo_jax import config_files
from margrpo_jax.diffusion import gaussian
from margrpo_jax.models import text
from margrpo_jax.rl import batch as batch_lib, config as rl_config, loss as loss_lib
from margrpo_jax.sampling import sampler as S

STEPS = 10
PROMPTS = ["a red circle", "a red circle", "two blue squares", "two blue squares"]


def _tables(n_steps: int):
  """Cosine schedule over 1000 steps, respaced to ``n_steps`` evenly strided kept indices (ADM), float64."""
  abar = lambda u: math.cos((u + 0.008) / 1.008 * math.pi / 2) ** 2
  betas = np.array([min(1 - abar((i + 1) / 1000) / abar(i / 1000), 0.999) for i in range(1000)])
  ac = np.cumprod(1 - betas)
  stride = 999 / (n_steps - 1)
  kept = [round(k * stride) for k in range(n_steps)]
  ab = ac[kept]
  ab_prev = np.concatenate([[1.0], ab[:-1]])
  beta = 1 - ab / ab_prev
  post_var = beta * (1 - ab_prev) / (1 - ab)
  post_log_var = np.log(np.concatenate([[post_var[1]], post_var[1:]]))
  return dict(t=np.array(kept), ab=ab, ab_prev=ab_prev, beta=beta, post_log_var=post_log_var)


def golden_loss(model, batch, i, tab, beta, clip, temperature):
  """The official surrogate of AR step ``i``: cond branch only, sigma detached, k3 penalty on the means, MTE
  replacing the uncertain tokens' terms, per-token channel sums, P = sum M' qbar / sum M', K = sum M kappa / sum M."""
  c = batch.x_t.shape[-1]
  z = model.backbone(batch.canvas[i], ~batch.visible[i], model.condition(batch.ids))  # (B, L, D), P = L
  a = batch.adv[:, None]

  def scored(x_t, x_prev, zz, jj):  # (B, N, C) at respaced step jj -> per-token log-prob (B, N), mean
    f = lambda name: jnp.float32(tab[name][jj])
    out = model.head(x_t, jnp.full(x_t.shape[:-1], int(tab["t"][jj]), jnp.int32), zz)
    eps, v = out[..., :c], out[..., c:]
    x0 = jnp.clip(jnp.sqrt(1 / f("ab")) * x_t - jnp.sqrt(1 / f("ab") - 1) * eps, -clip, clip)
    mu = (f("beta") * jnp.sqrt(f("ab_prev")) / (1 - f("ab"))) * x0 + \
         ((1 - f("ab_prev")) * jnp.sqrt(1 - f("beta")) / (1 - f("ab"))) * x_t
    frac = (v + 1) / 2
    sd = jax.lax.stop_gradient(jnp.exp(0.5 * (frac * jnp.log(f("beta")) + (1 - frac) * f("post_log_var")))
                               * temperature)
    lp = -(x_prev - mu) ** 2 / (2 * sd ** 2) - jnp.log(sd) - 0.5 * math.log(2 * math.pi)
    return lp.sum(-1), mu

  pol, n_pol, kl, n_kl = 0.0, 0.0, 0.0, 0.0
  idx = batch.uncertain_idx[i]
  take = lambda x: jnp.take_along_axis(x, idx[..., None], axis=1)
  for kk in range(batch.j.shape[1]):
    jj = int(batch.j[i, kk])
    l1, mu = scored(batch.x_t[i, kk], batch.x_prev[i, kk], z, jj)
    q1 = jnp.exp(l1 - jax.lax.stop_gradient(l1)) * a
    q_m = 0.0
    for s in range(batch.mte_x_t.shape[0]):
      ls, _ = scored(batch.mte_x_t[s, i, kk], batch.mte_x_prev[s, i, kk], take(z), jj)
      q_m = q_m + jnp.exp(ls - jax.lax.stop_gradient(ls)) * a / batch.mte_x_t.shape[0]
    rows = jnp.arange(idx.shape[0])[:, None]
    qbar = q1.at[rows, idx].set(jnp.where(batch.uncertain[i][rows, idx], q_m, q1[rows, idx]))
    keep, region = batch.keep[i].astype(jnp.float32), batch.region[i].astype(jnp.float32)
    d = batch.ref_mean[i, kk] - mu
    kappa = (jnp.exp(d) - d - 1).sum(-1)
    pol, n_pol = pol + jnp.sum(keep * qbar), n_pol + keep.sum()
    kl, n_kl = kl + jnp.sum(region * kappa), n_kl + region.sum()
  return -(pol / n_pol - beta * kl / n_kl)


@pytest.fixture(scope="module")
def official(small_model):
  model_cfg, graphdef, params = small_model
  c = config_files.load("shapes_rl", "margrpo,smoke")
  c.rl.update(fidelity="official", mte_seeds=2, num_ar_steps=2, num_diffusion_steps=3)
  c.sampling.update(diffusion_steps=str(STEPS), clip_denoised=1.0)
  rl_config.resolve_fidelity(c)
  sc = rl_config.step_config(c, model_cfg)
  diff = gaussian.make_diffusion(1000, str(STEPS))
  ids = jnp.asarray(text.tokenize(PROMPTS, model_cfg.text.max_len))
  final, rec = S.make_sample_fn(graphdef, diff, sc.sampler, record=True)(params, ids, jax.random.key(0))
  adv = jnp.array([1.0, -1.0, 0.5, -0.5])
  m = nnx.merge(graphdef, params)
  batch, _ = jax.jit(lambda: batch_lib.build(m, m, diff, sc.sampler, sc.batch, sc.loss, rec, final, ids, adv,
                                             jax.random.key(1)))()
  return graphdef, params, diff, sc, batch


@pytest.mark.slow
def test_official_loss_and_gradient_equal_a_plain_reimplementation(official):
  graphdef, params, diff, sc, batch = official
  lc = sc.loss
  assert (lc.ratio, lc.clip_eps, lc.kl, lc.cfg_in_loss, lc.sigma_grad, lc.mte_actual) == (
      "none", 0.0, "official", False, False, "replace")
  assert sc.batch.mask_after_step and sc.batch.topk_scope == "all" and sc.batch.consistency
  tab = _tables(STEPS)
  np.testing.assert_array_equal(tab["t"], diff.timesteps)
  checked = 0
  for i in range(batch.j.shape[0]):  # one scored AR step at a time (the official per-step losses)
    if not batch.keep[i].any():  # the last AR step under the after-step mask scores nothing (0 / 0 officially)
      continue
    checked += 1
    ours = lambda p: loss_lib.loss_fn(nnx.merge(graphdef, p), diff, lc, batch, steps=[i])[0]
    gold = lambda p: golden_loss(nnx.merge(graphdef, p), batch, i, tab, lc.beta, lc.clip_denoised, lc.temperature)
    (v1, g1), (v2, g2) = jax.value_and_grad(ours)(params), jax.value_and_grad(gold)(params)
    np.testing.assert_allclose(float(v1), float(v2), rtol=1e-5, atol=1e-6)
    flat = lambda g: np.concatenate([np.asarray(x).ravel() for x in jax.tree.leaves(g)])
    assert np.abs(flat(g2)).max() > 0
    np.testing.assert_allclose(flat(g1), flat(g2), rtol=1e-3, atol=1e-5 * np.abs(flat(g2)).max())
  assert checked
