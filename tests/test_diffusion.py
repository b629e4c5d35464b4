"""DDPM tables, respacing and learned-range variance against numbers computed by hand from the formulas."""
import math

import jax.numpy as jnp
import numpy as np
import pytest

from margrpo_jax.diffusion import gaussian as G


def abar(u):
  return math.cos((u + 0.008) / 1.008 * math.pi / 2) ** 2


def test_cosine_betas_and_clipping():
  b = G.cosine_betas(1000)
  assert b.shape == (1000,)
  assert b[0] == pytest.approx(1 - abar(0.001) / abar(0.0), rel=1e-12)
  assert b[500] == pytest.approx(1 - abar(0.501) / abar(0.5), rel=1e-12)
  assert b[-1] == 0.999  # clipped


@pytest.mark.parametrize("count,expected_head", [
    ("100", [0, 10, 20, 30]),           # stride 999/99 = 10.09...
    ("25", [0, 42, 83, 125, 166]),      # stride 41.625; 166.5 rounds half-to-even to 166
    ("4", [0, 333, 666, 999]),
])
def test_space_timesteps(count, expected_head):
  kept = G.space_timesteps(1000, count)
  assert len(kept) == int(count) and kept[-1] == 999
  assert kept[:len(expected_head)] == expected_head


def test_respaced_betas_and_posterior():
  d = G.make_diffusion(1000, "25")
  # Base cumulative alphas are abar((i+1)/1000) / abar(0) before clipping.
  ac = lambda i: abar((i + 1) / 1000) / abar(0)
  assert d.timesteps[1] == 42
  assert d.betas[0] == pytest.approx(1 - ac(0), rel=1e-9)
  assert d.betas[1] == pytest.approx(1 - ac(42) / ac(0), rel=1e-9)
  assert d.betas[2] == pytest.approx(1 - ac(83) / ac(42), rel=1e-9)
  # sigma_0 = sqrt(beta'_0) ~ 6.2e-3 (docs/algorithm.md section 2.4: 6.2e-3 to 6.4e-3).
  assert 6.2e-3 <= math.sqrt(d.betas[0]) <= 6.45e-3
  post = lambda j: d.betas[j] * (1 - ac(int(d.timesteps[j - 1]))) / (1 - ac(int(d.timesteps[j])))
  assert d.posterior_variance[2] == pytest.approx(post(2), rel=1e-9)
  assert d.posterior_log_variance_clipped[0] == pytest.approx(math.log(post(1)), rel=1e-9)  # clipped at j=0
  assert d.posterior_log_variance_clipped[5] == pytest.approx(math.log(post(5)), rel=1e-9)


@pytest.mark.parametrize("v,frac", [(1.0, 1.0), (-1.0, 0.0), (0.0, 0.5), (0.5, 0.75)])
def test_learned_range_variance(v, frac):
  d = G.make_diffusion(1000, "25")
  j = 7
  x = jnp.full((1, 3), 0.3)
  eps = jnp.full((1, 3), -0.2)
  mean, log_var = G.mean_and_log_variance(d, x, jnp.array([j]), eps, jnp.full((1, 3), v))
  expect = frac * math.log(d.betas[j]) + (1 - frac) * d.posterior_log_variance_clipped[j]
  np.testing.assert_allclose(log_var, expect, rtol=1e-5)
  acj = d.alphas_cumprod[j]
  x0 = math.sqrt(1 / acj) * 0.3 - math.sqrt(1 / acj - 1) * -0.2
  acp = d.alphas_cumprod[j - 1]
  mu = d.betas[j] * math.sqrt(acp) / (1 - acj) * x0 + (1 - acp) * math.sqrt(1 - d.betas[j]) / (1 - acj) * 0.3
  np.testing.assert_allclose(mean, mu, rtol=1e-5)


def test_step_noise_temperature_and_logprob():
  d = G.make_diffusion(1000, "25")
  x = jnp.array([[0.1, -0.4]])
  out = jnp.array([[0.2, 0.3, 0.0, 0.0]])  # eps, v
  noise = jnp.array([[1.0, -2.0]])
  x_prev, mean, std, logp = G.step(d, out, x, jnp.array([3]), noise, temperature=0.5)
  np.testing.assert_allclose(x_prev, mean + std * noise, rtol=1e-6)
  _, log_var = G.mean_and_log_variance(d, x, jnp.array([3]), out[:, :2], out[:, 2:])
  np.testing.assert_allclose(std, 0.5 * np.exp(0.5 * np.asarray(log_var)), rtol=1e-6)
  np.testing.assert_allclose(logp, -0.5 * np.asarray(noise) ** 2 - np.log(std) - 0.5 * math.log(2 * math.pi),
                             rtol=1e-5)
  x_prev0, mean0, _, _ = G.step(d, out, x, jnp.array([0]), noise)
  np.testing.assert_array_equal(x_prev0, mean0)  # no noise at the last step


def test_training_loss_is_mse_plus_vlb():
  d = G.make_diffusion(1000)
  x0 = jnp.array([[0.5, -0.5, 0.1]])
  noise = jnp.array([[0.3, -1.0, 0.2]])
  t = jnp.array([10])
  x_t = G.q_sample(d, x0, t, noise)
  np.testing.assert_allclose(x_t, math.sqrt(d.alphas_cumprod[10]) * x0 + math.sqrt(1 - d.alphas_cumprod[10]) * noise,
                             rtol=1e-6)
  # Exact eps and the true posterior variance (v such that the log-variance matches) give ~0 loss.
  lo, hi = d.posterior_log_variance_clipped[10], math.log(d.betas[10])
  v = 2 * (lo - lo) / (hi - lo) - 1
  out = jnp.concatenate([noise, jnp.full((1, 3), v)], axis=-1)
  assert float(G.training_loss(d, out, x0, x_t, t, noise)[0]) == pytest.approx(0.0, abs=1e-5)
  bad = jnp.concatenate([noise + 0.5, jnp.full((1, 3), v)], axis=-1)
  assert float(G.training_loss(d, bad, x0, x_t, t, noise)[0]) > 0.25


def test_clip_denoised_clips_x0_then_takes_the_posterior_mean():
  d = G.make_diffusion(1000, "25")
  j = d.num_steps - 1  # the noisiest step, sqrt(1/abar) ~ 2e4
  x = jnp.array([[0.9, -0.3]])
  eps = jnp.array([[0.0, 0.0]])  # a wrong eps: x0_hat = sqrt(1/abar) x is huge
  v = jnp.zeros((1, 2))
  mean, _ = G.mean_and_log_variance(d, x, jnp.array([j]), eps, v, clip_denoised=True)
  x0 = np.clip(np.asarray(x) * math.sqrt(1 / d.alphas_cumprod[j]), -1, 1)
  expect = d.posterior_mean_coef1[j] * x0 + d.posterior_mean_coef2[j] * np.asarray(x)
  np.testing.assert_allclose(mean, expect, rtol=1e-5)
  raw, _ = G.mean_and_log_variance(d, x, jnp.array([j]), eps, v)
  assert float(jnp.abs(raw).max()) > 100 * float(jnp.abs(mean).max())
