r"""Gaussian DDPM as MAR uses it (ADM/DiT code path): cosine schedule, respacing, learned-range variance.

Forward process over ``N = 1000`` training steps with the cosine schedule

    abar(u) = cos^2((u + 0.008) / 1.008 * pi / 2),
    beta_i  = min(1 - abar((i+1)/N) / abar(i/N), 0.999).

Sampling respaces to ``T`` kept indices ``tau_0 < ... < tau_{T-1}`` (ADM's ``space_timesteps``) with
``beta'_j = 1 - abar_{tau_j} / abar_{tau_{j-1}}``; the network always sees the original index ``tau_j``.

The network predicts ``[eps_hat | v]``; with ``f = (v + 1) / 2`` the step variance is the learned
interpolation ``log sigma^2 = f log beta'_j + (1 - f) log sigmatilde^2_j`` (clipped posterior variance).
``x0_hat = sqrt(1/abar) x_t - sqrt(1/abar - 1) eps_hat`` (no clipping) and the mean is the q-posterior mean.
A step draws ``x_{j-1} = mu + 1[j != 0] * sigma * tau * xi`` (temperature ``tau`` scales the step noise only).
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np


def cosine_betas(num_steps: int = 1000, max_beta: float = 0.999) -> np.ndarray:
  """Betas of the cosine schedule, float64."""
  abar = lambda u: math.cos((u + 0.008) / 1.008 * math.pi / 2) ** 2
  return np.array([min(1 - abar((i + 1) / num_steps) / abar(i / num_steps), max_beta)
                   for i in range(num_steps)], dtype=np.float64)


def space_timesteps(num_timesteps: int, section_counts: str | int) -> list[int]:
  """ADM's ``space_timesteps``: evenly strided kept indices per section (``"100"`` -> 0, 10, ..., 999).

  The stride is accumulated in floating point and rounded with Python's ``round`` (half to even),
  exactly as the reference does, so e.g. 25 steps keep 0, 42, 83, 125, 166, ...
  """
  counts = [int(c) for c in str(section_counts).split(",")]
  size_per, extra = divmod(num_timesteps, len(counts))
  start, kept = 0, []
  for i, count in enumerate(counts):
    size = size_per + (1 if i < extra else 0)
    if size < count:
      raise ValueError(f"cannot divide a section of {size} steps into {count}")
    stride = 1 if count <= 1 else (size - 1) / (count - 1)
    cur = 0.0
    for _ in range(count):
      kept.append(start + round(cur))
      cur += stride
    start += size
  return sorted(set(kept))


@dataclasses.dataclass(frozen=True)
class Diffusion:
  """Tables of a (possibly respaced) Gaussian diffusion, float64 numpy; index j = respaced step."""
  betas: np.ndarray
  timesteps: np.ndarray  # original index fed to the network for each respaced step

  def __post_init__(self):
    b = self.betas
    ac = np.cumprod(1.0 - b)
    ac_prev = np.append(1.0, ac[:-1])
    post_var = b * (1.0 - ac_prev) / (1.0 - ac)
    tables = dict(
        alphas_cumprod=ac,
        sqrt_alphas_cumprod=np.sqrt(ac),
        sqrt_one_minus_alphas_cumprod=np.sqrt(1.0 - ac),
        sqrt_recip_alphas_cumprod=np.sqrt(1.0 / ac),
        sqrt_recipm1_alphas_cumprod=np.sqrt(1.0 / ac - 1.0),
        posterior_variance=post_var,
        posterior_log_variance_clipped=np.log(np.append(post_var[1], post_var[1:])),
        posterior_mean_coef1=b * np.sqrt(ac_prev) / (1.0 - ac),
        posterior_mean_coef2=(1.0 - ac_prev) * np.sqrt(1.0 - b) / (1.0 - ac),
        log_betas=np.log(b),
    )
    # mu = coef1 * x0_hat + coef2 * x_t with x0_hat = sqrt(1/abar) x_t - sqrt(1/abar - 1) eps, folded in
    # float64 so that float32 never forms x0_hat (~2e4 x_t at the noisiest respaced step).
    tables["mean_coef_x"] = tables["posterior_mean_coef1"] * tables["sqrt_recip_alphas_cumprod"] + \
        tables["posterior_mean_coef2"]
    tables["mean_coef_eps"] = tables["posterior_mean_coef1"] * tables["sqrt_recipm1_alphas_cumprod"]
    for k, v in tables.items():
      object.__setattr__(self, k, v)

  @property
  def num_steps(self) -> int:
    return len(self.betas)

  def table(self, name: str, j):
    """``self.<name>[j]`` as float32, broadcastable against ``(..., C)`` when ``j`` has shape ``(...)``."""
    return jnp.asarray(getattr(self, name), jnp.float32)[j][..., None]


def make_diffusion(num_train_steps: int = 1000, respacing: str | int | None = None) -> Diffusion:
  """The cosine diffusion, respaced to ``respacing`` steps (None: the full training process)."""
  base = cosine_betas(num_train_steps)
  if respacing is None or str(respacing) == str(num_train_steps):
    return Diffusion(betas=base, timesteps=np.arange(num_train_steps))
  kept = space_timesteps(num_train_steps, respacing)
  ac = np.cumprod(1.0 - base)
  betas, last = [], 1.0
  for i in kept:
    betas.append(1.0 - ac[i] / last)
    last = ac[i]
  return Diffusion(betas=np.array(betas), timesteps=np.array(kept))


def split_output(out: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Network output ``[eps_hat | v]`` -> (eps_hat, v)."""
  c = out.shape[-1] // 2
  return out[..., :c], out[..., c:]


def mean_and_log_variance(diff: Diffusion, x_t, j, eps, v, clip_denoised: float = 0.0):
  """q-posterior mean from ``eps`` and the learned-range log-variance at respaced step ``j``.

  Unclipped (MAR), the mean is ``c_x x_t - c_eps eps`` with the two stages (x0_hat, then the posterior
  mean) folded into float64 coefficients: identical maths, no float32 cancellation at high noise levels.
  ``clip_denoised = r > 0`` clips ``x0_hat`` to [-r, r] first (ADM's option with r = 1, ``True``, for data in
  [-1, 1] such as the shapes world's pixels; r ~ 5 for the shapes-world tokenizer's unit-variance latents): at the
  noisiest step ``sqrt(1/abar)`` ~ 650 to 2e4 turns small eps errors into huge means.
  """
  if clip_denoised:
    r = float(clip_denoised)
    x0 = diff.table("sqrt_recip_alphas_cumprod", j) * x_t - diff.table("sqrt_recipm1_alphas_cumprod", j) * eps
    x0 = jnp.clip(x0, -r, r)
    mean = diff.table("posterior_mean_coef1", j) * x0 + diff.table("posterior_mean_coef2", j) * x_t
  else:
    mean = diff.table("mean_coef_x", j) * x_t - diff.table("mean_coef_eps", j) * eps
  frac = (v + 1.0) / 2.0
  log_var = frac * diff.table("log_betas", j) + (1.0 - frac) * diff.table("posterior_log_variance_clipped", j)
  return mean, log_var


def gaussian_logprob(x, mean, std):
  """Elementwise ``log N(x; mean, std^2)``."""
  return -((x - mean) ** 2) / (2.0 * std**2) - jnp.log(std) - 0.5 * math.log(2 * math.pi)


def step(diff: Diffusion, out: jax.Array, x_t: jax.Array, j, noise: jax.Array, temperature: float = 1.0,
         clip_denoised: float = 0.0):
  """One ancestral step ``x_j -> x_{j-1}`` given the (guided) network output.

  Returns ``(x_prev, mean, std, logp)`` with ``std = sigma * temperature`` (the std actually used,
  also at ``j = 0`` where no noise is added) and ``logp`` the elementwise log-density of ``x_prev``.
  """
  mean, log_var = mean_and_log_variance(diff, x_t, j, *split_output(out), clip_denoised=clip_denoised)
  std = jnp.exp(0.5 * log_var) * temperature
  nonzero = (jnp.asarray(j) != 0).astype(x_t.dtype)[..., None]
  x_prev = mean + nonzero * std * noise
  return x_prev, mean, std, gaussian_logprob(x_prev, mean, std)


def q_sample(diff: Diffusion, x0, t, noise):
  """``x_t = sqrt(abar_t) x0 + sqrt(1 - abar_t) noise`` (t indexes this diffusion's own steps)."""
  return diff.table("sqrt_alphas_cumprod", t) * x0 + diff.table("sqrt_one_minus_alphas_cumprod", t) * noise


def _normal_kl(mean1, logvar1, mean2, logvar2):
  return 0.5 * (-1.0 + logvar2 - logvar1 + jnp.exp(logvar1 - logvar2) + (mean1 - mean2) ** 2 * jnp.exp(-logvar2))


def _approx_std_normal_cdf(x):
  return 0.5 * (1.0 + jnp.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


def _discretized_gaussian_loglik(x, means, log_scales):
  """Log-likelihood of data in [-1, 1] discretised to 256 bins (ADM's decoder term)."""
  centered = x - means
  inv_std = jnp.exp(-log_scales)
  cdf_plus = _approx_std_normal_cdf(inv_std * (centered + 1.0 / 255.0))
  cdf_min = _approx_std_normal_cdf(inv_std * (centered - 1.0 / 255.0))
  log_cdf_plus = jnp.log(jnp.maximum(cdf_plus, 1e-12))
  log_one_minus_cdf_min = jnp.log(jnp.maximum(1.0 - cdf_min, 1e-12))
  log_delta = jnp.log(jnp.maximum(cdf_plus - cdf_min, 1e-12))
  return jnp.where(x < -0.999, log_cdf_plus, jnp.where(x > 0.999, log_one_minus_cdf_min, log_delta))


def training_loss(diff: Diffusion, out: jax.Array, x0, x_t, t, noise):
  r"""MAR's per-token diffusion loss ``MSE(eps) + VLB`` (learned-range variance, VLB in bits).

  The VLB term sees a stop-gradient ``eps_hat`` so that it only trains the variance:
  ``KL(q(x_{t-1}|x_t,x_0) || p(x_{t-1}|x_t))`` for ``t > 0`` and the discretised decoder NLL at ``t = 0``.
  Returns a per-token loss with the channel axis reduced by its mean.
  """
  eps, v = split_output(out)
  mse = jnp.mean((noise - eps) ** 2, axis=-1)
  mean, log_var = mean_and_log_variance(diff, x_t, t, jax.lax.stop_gradient(eps), v)
  true_mean = diff.table("posterior_mean_coef1", t) * x0 + diff.table("posterior_mean_coef2", t) * x_t
  true_log_var = diff.table("posterior_log_variance_clipped", t)
  kl = jnp.mean(_normal_kl(true_mean, true_log_var, mean, log_var), axis=-1) / math.log(2.0)
  nll = -jnp.mean(_discretized_gaussian_loglik(x0, mean, 0.5 * log_var), axis=-1) / math.log(2.0)
  return mse + jnp.where(t == 0, nll, kl)
