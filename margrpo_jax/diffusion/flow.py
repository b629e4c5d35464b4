r"""Rectified flow as NOVA uses it (docs/models.md section 3.4) and the flow SDE step of Flow-GRPO
(docs/algorithm.md section 3.4).

Forward process ``x_sigma = sigma eps + (1 - sigma) x_0``, target velocity ``v = eps - x_0``; training draws
``u = floor(sigmoid(N(0,1)) * 1000)`` per token, ``sigma = (1000 - u) / 1000`` and feeds ``t = 1000 sigma``.

Sampling over ``T`` steps: ``sigma_n = linspace(1, 1/N_train, T)`` (optionally shifted
``s sigma / (1 + (s - 1) sigma)``), ``sigma_T = 0``, ``Delta_n = sigma_{n+1} - sigma_n < 0``; the network sees
``t_n = 1000 sigma_n``. With noise level ``a`` (0.7 in mar-grpo) and ``sigma_max = sigma_1``:

    s_n   = a sqrt(sigma_n / (1 - (sigma_n == 1 ? sigma_max : sigma_n)))
    mu_n  = x_n (1 + s_n^2 / (2 sigma_n) Delta_n) + v (1 + s_n^2 (1 - sigma_n) / (2 sigma_n)) Delta_n
    x_n+1 = mu_n + s_n sqrt(-Delta_n) xi,        std_n = s_n sqrt(-Delta_n).

``a = 0`` is NOVA's deterministic Euler ODE ``x <- x + Delta_n v``. The coefficients are float64 tables.

How to use:
    sched = make_flow(25, noise_level=0.7)
    for n in range(sched.num_steps):
      v = head(x, sched.t[n], z)                                        # guided velocity
      x, mean, std, logp = step(sched, v, x, n, jax.random.normal(k, x.shape))
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from margrpo_jax.diffusion.gaussian import gaussian_logprob


@dataclasses.dataclass(frozen=True)
class FlowSchedule:
  """Per-step float64 tables, index n = 0..T-1 (step ``x_n -> x_{n+1}``)."""
  sigmas: np.ndarray       # (T + 1,) sigma_0 = 1 ... sigma_T = 0
  noise_level: float
  num_train_steps: int = 1000

  def __post_init__(self):
    sig, nxt = self.sigmas[:-1], self.sigmas[1:]
    delta = nxt - sig
    sigma_max = self.sigmas[1] if len(self.sigmas) > 2 else 0.0
    denom = 1.0 - np.where(sig == 1.0, sigma_max, sig)
    s = self.noise_level * np.sqrt(sig / denom)
    tables = dict(
        delta=delta,
        t=self.num_train_steps * sig,
        coef_x=1.0 + s**2 / (2.0 * sig) * delta,
        coef_v=(1.0 + s**2 * (1.0 - sig) / (2.0 * sig)) * delta,
        std=s * np.sqrt(-delta),
    )
    for k, v in tables.items():
      object.__setattr__(self, k, v)

  @property
  def num_steps(self) -> int:
    return len(self.sigmas) - 1

  def table(self, name: str, n):
    """``self.<name>[n]`` as float32, broadcastable against ``(..., C)`` when ``n`` has shape ``(...)``."""
    return jnp.asarray(getattr(self, name), jnp.float32)[n][..., None]


def make_flow(num_steps: int = 25, noise_level: float = 0.0, shift: float = 1.0,
              num_train_steps: int = 1000) -> FlowSchedule:
  """diffusers' FlowMatchEuler sigmas ``linspace(1, 1/N, T)`` (+ shift), then 0; ``noise_level`` 0 = Euler ODE."""
  sig = np.linspace(1.0, 1.0 / num_train_steps, num_steps, dtype=np.float64)
  sig = shift * sig / (1.0 + (shift - 1.0) * sig)
  return FlowSchedule(sigmas=np.append(sig, 0.0), noise_level=float(noise_level), num_train_steps=num_train_steps)


def mean_and_std(sched: FlowSchedule, v: jax.Array, x: jax.Array, n):
  """``(mu_n, std_n)`` of the step from ``x = x_n`` with velocity ``v``; ``n`` (...) against ``x`` (..., C)."""
  return sched.table("coef_x", n) * x + sched.table("coef_v", n) * v, sched.table("std", n)


def step(sched: FlowSchedule, v: jax.Array, x: jax.Array, n, noise: jax.Array):
  """One SDE (or, at noise level 0, Euler) step ``x_n -> x_{n+1}``.

  Returns ``(x_next, mean, std, logp)`` like :func:`margrpo_jax.diffusion.gaussian.step`: ``std`` is the
  per-element std (broadcast to ``x``), ``logp`` the elementwise log-density of ``x_next`` (0 where std = 0).
  """
  mean, std = mean_and_std(sched, v, x, n)
  std = jnp.broadcast_to(std, x.shape)
  x_next = mean + std * noise
  return x_next, mean, std, transition_logprob(x_next, mean, std)


def transition_logprob(x_next, mean, std):
  """Elementwise ``log N(x_next; mean, std^2)``; 0 for deterministic (std = 0) steps."""
  safe = jnp.where(std > 0, std, 1.0)
  return jnp.where(std > 0, gaussian_logprob(x_next, mean, safe), 0.0)


# -- training (NOVA's flow-matching objective) --------------------------------------------------------------------
def sample_sigmas(key: jax.Array, shape, num_train_steps: int = 1000) -> jax.Array:
  """Logit-normal sigmas ``(N - floor(sigmoid(N(0,1)) N)) / N`` in [1/N, 1], one per element of ``shape``."""
  u = jnp.floor(jax.nn.sigmoid(jax.random.normal(key, shape)) * num_train_steps)
  return (num_train_steps - jnp.minimum(u, num_train_steps - 1)) / num_train_steps


def q_sample(x0, sigma, noise):
  """``x_sigma = sigma noise + (1 - sigma) x0`` with ``sigma`` (...) against (..., C)."""
  return sigma[..., None] * noise + (1.0 - sigma[..., None]) * x0


def training_loss(v_hat, x0, noise):
  """Per-token MSE against the velocity ``noise - x0``, averaged over channels."""
  return jnp.mean((v_hat - (noise - x0)) ** 2, axis=-1)
