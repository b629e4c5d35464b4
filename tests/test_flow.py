"""Rectified flow and the Flow-GRPO SDE step (docs/algorithm.md section 3.4): std table, recorded log-probs, Euler
ODE."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from margrpo_jax.diffusion import flow

# docs/algorithm.md section 3.4, per-step std (3 decimals, the last one 4)
STD_TABLE = [0.700, 0.685, 0.474, 0.378, 0.320, 0.279, 0.248, 0.223, 0.202, 0.185, 0.169, 0.155, 0.143, 0.132,
             0.121, 0.111, 0.101, 0.092, 0.083, 0.073, 0.064, 0.054, 0.043, 0.030, 0.0007]


def test_sigmas_and_std_table():
  """sigma_n = linspace(1, 0.001, 25) then 0, t_n = 1000 sigma_n; std_n matches the table to its rounding."""
  s = flow.make_flow(25, noise_level=0.7)
  np.testing.assert_allclose(s.sigmas[:-1], np.linspace(1, 0.001, 25))
  assert s.sigmas[-1] == 0 and s.num_steps == 25
  np.testing.assert_allclose(s.t, 1000 * s.sigmas[:-1])
  np.testing.assert_allclose(s.std[:-1], STD_TABLE[:-1], atol=5e-4)
  np.testing.assert_allclose(s.std[-1], STD_TABLE[-1], atol=5e-5)


def test_mean_matches_the_formula_in_float64():
  """mu_n = x (1 + s^2/(2 sig) D) + v (1 + s^2 (1 - sig)/(2 sig)) D, with sigma_max = sigma_1 at sigma = 1."""
  s = flow.make_flow(25, noise_level=0.7)
  rng = np.random.default_rng(0)
  x, v = rng.standard_normal((2, 3, 16))
  for n in (0, 7, 24):
    sig, d = s.sigmas[n], s.sigmas[n + 1] - s.sigmas[n]
    sn = 0.7 * np.sqrt(sig / (1 - (s.sigmas[1] if sig == 1 else sig)))
    want = x * (1 + sn**2 / (2 * sig) * d) + v * (1 + sn**2 * (1 - sig) / (2 * sig)) * d
    mean, std = flow.mean_and_std(s, jnp.asarray(v, jnp.float32), jnp.asarray(x, jnp.float32), jnp.full((3,), n))
    np.testing.assert_allclose(np.asarray(mean), want, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(std)[:, 0], sn * np.sqrt(-d), rtol=1e-6)


def _velocity(x, t):
  return 0.3 * x - 0.01 * t[..., None] + 0.5


def test_recorded_logprob_equals_recomputation():
  """A 25-step SDE chain records (x_n, x_n+1, logp); rescoring each recorded transition from x_n alone gives the
  same log-prob (rtol 1e-4: float32, and the last step's std 7e-4 turns ~1e-7 mean differences between the jitted
  chain and the eager rescoring into ~2e-5 relative), and the recorded std is the table's."""
  s = flow.make_flow(25, noise_level=0.7)
  x = jax.random.normal(jax.random.key(0), (2, 5, 16))

  def body(x, inp):
    n, k = inp
    nn = jnp.full(x.shape[:-1], n)
    x_next, mean, std, logp = flow.step(s, _velocity(x, s.table("t", nn)[..., 0]), x, nn,
                                        jax.random.normal(k, x.shape))
    return x_next, (x, x_next, logp.sum(-1), std)

  _, (xs, xn, logp, std) = jax.jit(lambda x: jax.lax.scan(body, x, (jnp.arange(25), jax.random.split(
      jax.random.key(1), 25))))(x)
  ns = jnp.broadcast_to(jnp.arange(25)[:, None, None], xs.shape[:-1])
  mean, std2 = flow.mean_and_std(s, _velocity(xs, s.table("t", ns)[..., 0]), xs, ns)
  re = flow.transition_logprob(xn, mean, jnp.broadcast_to(std2, xs.shape)).sum(-1)
  np.testing.assert_allclose(np.asarray(re), np.asarray(logp), atol=1e-4, rtol=1e-4)
  np.testing.assert_allclose(np.asarray(std)[:, 0, 0, 0], s.std, rtol=1e-6)
  assert np.all(np.isfinite(np.asarray(logp)))


def test_euler_ode_without_noise():
  """Noise level 0: std = 0, logp = 0, noise ignored, x <- x + D v; the true velocity eps - x0 from x_1 = eps
  lands on x0 (sum of D = -1), to 1e-5."""
  s = flow.make_flow(25, noise_level=0.0)
  assert np.all(s.std == 0)
  rng = np.random.default_rng(0)
  x0, eps = (jnp.asarray(a, jnp.float32) for a in rng.standard_normal((2, 4, 16)))
  x = eps
  for n in range(25):
    nn = jnp.full((4,), n)
    x_next, mean, std, logp = flow.step(s, eps - x0, x, nn, jnp.full(x.shape, 1e3))
    np.testing.assert_allclose(np.asarray(x_next), np.asarray(x + s.delta[n] * (eps - x0)), atol=1e-6)
    assert np.all(np.asarray(logp) == 0) and np.all(np.asarray(std) == 0)
    x = x_next
  np.testing.assert_allclose(np.asarray(x), np.asarray(x0), atol=1e-5)


def test_shift_and_training_pieces():
  s = flow.make_flow(4, shift=3.0)
  sig = np.linspace(1, 0.001, 4)
  np.testing.assert_allclose(s.sigmas[:-1], 3 * sig / (1 + 2 * sig))
  sig = flow.sample_sigmas(jax.random.key(0), (4096,))
  assert float(sig.min()) >= 0.001 and float(sig.max()) <= 1.0
  np.testing.assert_allclose(np.asarray(sig * 1000), np.round(np.asarray(sig * 1000)), atol=1e-3)
  x0, eps = jnp.ones((2, 3)), jnp.zeros((2, 3))
  np.testing.assert_allclose(np.asarray(flow.q_sample(x0, jnp.array([0.25, 1.0]), eps)), [[0.75] * 3, [0] * 3])
  assert float(flow.training_loss(eps - x0, x0, eps).max()) == 0
