r"""The MAR-GRPO loss (docs/design.md section 4; docs/algorithm.md sections 4, 6-8 and 8.5).

For each selected AR step ``i`` (leading axis M) and chosen diffusion steps ``j`` (axis k), with the AR latent
recomputed with gradients, ``z_i = backbone(canvas_i, visible_i, prompt)``, each recorded transition is scored
under the frozen head:

    l(x_j -> x_{j-1}) = reduce_c log N(x_{j-1}; mu_head(x_j, j, z_i), sigma^2)     (channel sum | mean)
    rho = exp(l - l_old),   q = min(rho A, clip(rho, 1 - eps, 1 + eps) A)           (PPO, per token and step)
    qbar = (1 - U) q^{main} + U (1/S) sum_s q^{(s)}                                 (MTE on uncertain tokens)
    qbar = q(reduce_c [(1 - U_e) l_e^{main} + U_e (1/S) sum_s l_e^{(s)}])         (per latent pixel, ratio 'none')
    policy = sum M' qbar / sum M'         KL = sum M kappa / sum M                  (unreduced sums + counts)
    loss = -(policy - beta KL)

``M`` is the loss region, ``M'`` the region after consistency-aware selection, ``U`` the top-k uncertain
tokens. With ``U`` per latent pixel (official NOVA, A3) the mixture is per element ``e`` of the token; under
``ratio='none'`` the surrogate is linear in ``l`` (value 1, gradient ``A grad l``), so mixing the log-probs before
``q`` gives exactly the gradient of the official per-element mixture of surrogates. A token decoded at step
``i`` keeps its own chain's ``q^{main}`` inside ``U`` (``mte_actual='keep'``; 'include' averages it with the
``S`` others, 'replace' is the official overwrite): only that chain made the image, the MTE chains are drawn
independently of it and carry no reward signal (docs/rl_signal.md).
With ``sigma_grad`` the policy's ``sigma(z)`` is differentiable in ``l`` and ``kappa`` alike, else detached in both. ``kappa`` is the KL between the two transition Gaussians (policy vs frozen reference) summed over
channels, or, with ``kl='official'``, MAR-GRPO's ``exp(mu_ref - mu) - (mu_ref - mu) - 1`` per element.
Without old log-probs (``ratio='none'``, the official code) ``rho = exp(l - stop_grad(l)) = 1`` in value and
the gradient is ``A grad l``: REINFORCE with group advantages. Sums and counts are returned unreduced so that
accumulating over AR steps or micro-batches gives an exact mean.
"""
from __future__ import annotations

import dataclasses

import flax
import jax
import jax.numpy as jnp

from margrpo_jax.diffusion import flow, gaussian
from margrpo_jax.models import layers
from margrpo_jax.parallel import sharding
from margrpo_jax.sampling.sampler import ENCODER_BUCKETS, ar_latents, head_output, transition_logp


@dataclasses.dataclass(frozen=True)
class LossConfig:
  """The loss's switches; the defaults are ``configs/shapes_rl.py:margrpo``'s."""
  beta: float = 0.01                # KL weight
  clip_eps: float = 0.2             # PPO ratio clipping (0: no clipping)
  ratio: str = "rollout"            # 'rollout': rho against the rollout log-probs | 'none': official, rho = 1
  kl: str = "gaussian"              # 'gaussian' | 'official' (k3 form on the means, per element)
  channel_reduction: str = "sum"    # per-token log-prob: 'sum' (Harmon) | 'mean' (NOVA) over channels
  cfg_in_loss: bool = True          # score under the guided mean the rollout sampled from (official: False)
  temperature: float = 1.0
  clip_denoised: float = 5.0        # clip radius of x0_hat (the sampler's; 0 = none)
  remat: bool = False               # recompute each AR step's forward in the backward pass (real sizes)
  remat_ar_steps: bool = True       # with remat: each scored AR step checkpointed as a whole around its blocks' and
                                    # head steps' checkpoints (memory of one step, not M; one more forward)
  sigma_grad: bool = True           # the policy's sigma(z) differentiable in both the log-prob and the KL | both
                                    # detached (official: the rollout's sigma, gradient through the mean only)
  mte_actual: str = "keep"          # a decoded token in U: 'keep' its own chain's estimate | 'include' it in the
                                    # MTE average | 'replace' it by the MTE mean (official)
  logp: str = "chain"               # 'chain': recorded transitions | 'elbo': denoising terms of the final tokens
                                    # (and q-MTE: forward-process draws of the uncertain ones)
  logp_bf16: bool = False           # round the per-token log-probs through bfloat16 (official NOVA's cast)
  encoder_buckets: int = ENCODER_BUCKETS  # MAR's encoder on the known tokens only, padded to this many static
                                    # sizes (sampler.latents; 0: the key-masked encoder over all positions)


# The choices of LossConfig's option strings; validation reads them from here.
OPTIONS = dict(ratio=("rollout", "none"), kl=("gaussian", "official"), channel_reduction=("sum", "mean"),
               mte_actual=("keep", "include", "replace"), logp=("chain", "elbo"))
# The step's switches that exist to reproduce the official code (docs/algorithm.md sections 13-14): the config
# holds them in its ``rl.official`` block, every other field of LossConfig / BatchConfig directly in ``rl``.
OFFICIAL_SWITCHES = ("ratio", "kl", "cfg_in_loss", "mask_after_step", "mte_latent", "mte_commit_guided", "mte_actual",
                     "diffusion_per_ar_step", "logp_bf16", "topk_scope", "uncertainty_unit", "topk_random",
                     "selection_chains", "sigma_grad", "sequential_updates")


def config_key(name: str) -> str:
  """The config key of a step switch: ``rl.official.<name>`` or ``rl.<name>``."""
  return f"rl.official.{name}" if name in OFFICIAL_SWITCHES else f"rl.{name}"


def check_options(cfg, options: dict) -> None:
  """``ValueError`` naming the config key for an option string of the dataclass ``cfg`` outside ``options``."""
  for name, allowed in options.items():
    if getattr(cfg, name) not in allowed:
      raise ValueError(f"{config_key(name)}={getattr(cfg, name)!r} is not one of {', '.join(allowed)}")


@flax.struct.dataclass
class TrainBatch:
  """What the loss needs; axes M (selected AR steps), k (diffusion steps), S (MTE trajectories)."""
  ids: jax.Array           # (B, T_text) prompt token ids
  adv: jax.Array           # (B,) advantages
  cfg: jax.Array           # (M,) guidance scale of each selected step
  canvas: jax.Array        # (M, B, L, C) canvas given to the backbone
  visible: jax.Array       # (M, B, L) bool, visibility in the training forward
  positions: jax.Array     # (M, B, P) int32, the scored positions (all L, or the K decoded at the step); every
                           # per-token field below is laid out over them
  region: jax.Array        # (M, B, P) bool, loss region M (KL term)
  keep: jax.Array          # (M, B, P) bool, M' (policy term; = region without consistency selection)
  decoded: jax.Array       # (M, B, P) bool, the tokens committed at the step (their chains made the image)
  uncertain: jax.Array     # (M, B, P) bool, U (MTE estimate where True)
  uncertain_idx: jax.Array  # (M, B, K) indices into P of U (K = floor(topk_fraction * P); 0 without MTE)
  uncertain_elems: jax.Array  # (M, B, K, C) bool, per latent pixel: the elements of each U token that take the
                              # MTE estimate (last axis 0: U is per token)
  j: jax.Array             # (M, k) scored diffusion steps j = T - 1 - n (n: list position in the chain; the
                           # Gaussian head's respaced step, the flow's steps counted from the end)
  x_t: jax.Array           # (M, k, B, P, C) main trajectory
  x_prev: jax.Array        # (M, k, B, P, C)
  old_logp: jax.Array      # (M, k, B, P) per-token rollout log-probs (channel sum)
  ref_mean: jax.Array      # (M, k, B, P, C) reference transition means
  ref_std: jax.Array       # (M, k, B, P, C)
  mte_x_t: jax.Array       # (S, M, k, B, K, C) MTE trajectories of the U tokens (S = 0: no MTE)
  mte_x_prev: jax.Array    # (S, M, k, B, K, C)
  mte_old_logp: jax.Array  # (S, M, k, B, K)

  # the batch axis of every per-image field (cfg and j have none)
  BATCH_AXES = dict(ids=0, adv=0, canvas=1, visible=1, positions=1, region=1, keep=1, decoded=1, uncertain=1,
                    uncertain_idx=1, uncertain_elems=1, x_t=2, x_prev=2, old_logp=2, ref_mean=2, ref_std=2,
                    mte_x_t=3, mte_x_prev=3, mte_old_logp=3)

  def microbatch(self, c, n: int) -> "TrainBatch":
    """Microbatch ``c`` of ``n``: images ``c, c + n, ...`` (``sharding.microbatch``; ``c`` may be traced)."""
    return self.replace(**{k: sharding.microbatch(getattr(self, k), c, n, ax) for k, ax in self.BATCH_AXES.items()})

  def rows(self, start, size: int) -> "TrainBatch":
    """The images ``[start, start + size)`` of the batch (``start`` may be traced; ``size`` is static)."""
    return self.replace(**{k: jax.lax.dynamic_slice_in_dim(getattr(self, k), start, size, axis=ax)
                           for k, ax in self.BATCH_AXES.items()})


def _surrogate(logp, old, adv, cfg: LossConfig):
  """Per-token clipped surrogate ``(q, clipped)``, ``adv`` broadcast over (k, B, L) from (B,)."""
  ref = jax.lax.stop_gradient(logp) if cfg.ratio == "none" else old
  rho = jnp.exp(jnp.clip(logp - ref, -20.0, 20.0))
  a = adv[None, :, None]
  if cfg.clip_eps <= 0:
    return rho * a, jnp.zeros(rho.shape, bool)
  clipped = jnp.clip(rho, 1.0 - cfg.clip_eps, 1.0 + cfg.clip_eps)
  return jnp.minimum(rho * a, clipped * a), (rho < 1.0 - cfg.clip_eps) | (rho > 1.0 + cfg.clip_eps)


def _kl(mean, std, ref_mean, ref_std, cfg: LossConfig):
  """Elementwise KL-like penalty (k, B, L, C), reduced over channels like the log-probs by the caller."""
  if cfg.kl == "gaussian":  # KL(N(mean, std^2) || N(ref_mean, ref_std^2))
    return jnp.log(ref_std / std) + (std**2 + (mean - ref_mean) ** 2) / (2 * ref_std**2) - 0.5
  d = ref_mean - mean  # official: the k3 form applied to the means
  return jnp.exp(d) - d - 1.0


def step_terms(model, diff, cfg: LossConfig, batch: TrainBatch, i, cond, null):
  """Unreduced policy / KL sums and counts, and metrics, for selected AR step ``i``."""
  canvas, visible, region, keep = (a[i] for a in (batch.canvas, batch.visible, batch.region, batch.keep))
  k = batch.j.shape[1]
  at_p = lambda z: jnp.take_along_axis(z, batch.positions[i][..., None], axis=1)  # (B, L, D) -> (B, P, D)
  z_c, z_u = (None if z is None else at_p(z) for z in
              ar_latents(model, canvas, ~visible, cond, null, cfg.cfg_in_loss, buckets=cfg.encoder_buckets))
  scale = batch.cfg[i] if cfg.cfg_in_loss else None
  reduce = (lambda e: e.sum(-1)) if cfg.channel_reduction == "sum" else (lambda e: e.mean(-1))

  def score_at(xt, xp, j, zc, zu):  # transitions (..., C) at steps j (...) under latents (..., D)
    if cfg.logp == "elbo":  # x_t noised final tokens, x_prev their noise: l = -1/2 |eps_hat - eps|^2 per level
      eps = gaussian.split_output(head_output(model, xt, jnp.asarray(diff.timesteps, jnp.int32)[j], zc, zu,
                                              scale))[0]
      return -0.5 * (eps - xp) ** 2, eps, jnp.ones_like(eps)
    _, mean, std = transition_logp(model, diff, xt, xp, diff.num_steps - 1 - j, zc, zu, scale, cfg.temperature,
                                   cfg.clip_denoised)
    std = std if cfg.sigma_grad else jax.lax.stop_gradient(std)
    return flow.transition_logprob(xp, mean, std), mean, std

  def score(xt, xp, zc, zu):  # (k, B, N, C) transitions under latents (B, N, D) -> per-element logp, mean, std
    if cfg.remat:  # one diffusion step at a time, recomputed in the backward pass: the head's activations of
                   # B N rows, not of k B N
      one = lambda a: score_at(a[0], a[1], jnp.broadcast_to(a[2], a[0].shape[:-1]), zc, zu)
      return jax.lax.map(jax.checkpoint(one), (xt, xp, batch.j[i]))
    bk = lambda z: None if z is None else jnp.broadcast_to(z, (k,) + z.shape)
    return score_at(xt, xp, jnp.broadcast_to(batch.j[i][:, None, None], xt.shape[:-1]), bk(zc), bk(zu))

  c = batch.x_t.shape[-1]
  old_scale = 1.0 if cfg.channel_reduction == "sum" else 1.0 / c
  lp, mean, std = score(batch.x_t[i], batch.x_prev[i], z_c, z_u)
  if cfg.logp_bf16:
    reduce = (lambda r: lambda e: r(e).astype(jnp.bfloat16).astype(jnp.float32))(reduce)
  logp = reduce(lp)
  q, clipped = _surrogate(logp, batch.old_logp[i] * old_scale, batch.adv, cfg)
  if batch.mte_x_t.shape[0] and batch.uncertain_idx.shape[-1]:  # MTE on the K uncertain tokens only
    idx = batch.uncertain_idx[i]
    take = lambda z: None if z is None else jnp.take_along_axis(z, idx[..., None], axis=1)
    per_elem = batch.uncertain_elems.shape[-1] > 0
    lp_s = jax.vmap(lambda xt, xp: score(xt, xp, take(z_c), take(z_u))[0])(batch.mte_x_t[:, i],
                                                                          batch.mte_x_prev[:, i])  # (S, k, B, K, C)
    rows = jnp.arange(idx.shape[0])[:, None]
    at_u = lambda m: jnp.take_along_axis(m, idx, axis=1)[None]  # (B, L) mask -> (1, B, K)
    if per_elem:  # mix the element log-probs, then one surrogate per token (exact for ratio='none')
      own, mte, mine = lp[:, rows, idx], lp_s.mean(0), batch.uncertain_elems[i][None]  # (k, B, K, C)
      extra = (own + lp_s.sum(0)) / (lp_s.shape[0] + 1)
    else:
      q_s, _ = jax.vmap(lambda l, o: _surrogate(l, o * old_scale, batch.adv, cfg))(
          reduce(lp_s), batch.mte_old_logp[:, i])
      own, mte, mine = q[:, rows, idx], q_s.mean(0), at_u(batch.uncertain[i])  # (k, B, K)
      extra = (own + q_s.sum(0)) / (q_s.shape[0] + 1)
    dec = at_u(batch.decoded[i])[(...,) + (None,) * per_elem]
    if cfg.logp == "elbo":  # q-MTE: the main draw and the S others are draws of one token's forward process
      mte = extra
    elif cfg.mte_actual == "keep":
      mte = jnp.where(dec, own, mte)
    elif cfg.mte_actual == "include":
      mte = jnp.where(dec, extra, mte)
    mixed = jnp.where(mine, mte, own)
    if per_elem:
      mixed = reduce(mixed)
      mixed = _surrogate(mixed, mixed, batch.adv, cfg)[0]
    q = q.at[:, rows, idx].set(mixed)
  if not cfg.beta:
    kl = jnp.zeros(q.shape)
  elif cfg.logp == "elbo":  # the two denoisers' squared eps difference (their KL up to the level weights)
    kl = reduce(0.5 * (mean - batch.ref_mean[i]) ** 2)
  else:
    kl = reduce(_kl(mean, std, batch.ref_mean[i], batch.ref_std[i], cfg))
  keep_k = jnp.broadcast_to(keep[None], q.shape).astype(jnp.float32)
  region_k = jnp.broadcast_to(region[None], kl.shape).astype(jnp.float32)
  return dict(policy_sum=jnp.sum(keep_k * q), policy_count=keep_k.sum(), kl_sum=jnp.sum(region_k * kl),
              kl_count=region_k.sum(), clipped_sum=jnp.sum(keep_k * clipped),
              logp_diff_sum=jnp.sum(keep_k * jnp.abs(logp - batch.old_logp[i] * old_scale)))


def counts(batch: TrainBatch, steps=None):
  """``(policy_count, kl_count)`` of :func:`loss_fn` over the AR steps ``steps`` (default: all M): the kept and
  the region tokens times the k scored diffusion steps. They do not depend on the parameters, so a microbatch's
  loss normalised by the whole batch's counts sums, over microbatches, to the whole batch's loss."""
  sel = (lambda a: a) if steps is None else (lambda a: a[jnp.asarray(steps)])
  k = batch.j.shape[1]
  return k * sel(batch.keep).sum().astype(jnp.float32), k * sel(batch.region).sum().astype(jnp.float32)


def loss_fn(model, diff, cfg: LossConfig, batch: TrainBatch, steps=None, norm=None):
  """``(loss, metrics)`` over the selected AR steps ``steps`` (default: all M), reduced as exact means: over the
  batch's own counts, or over ``norm`` (:func:`counts` of the whole batch when ``batch`` is one microbatch of it;
  then the metrics but ``tokens`` are this microbatch's share)."""
  cond = model.condition(batch.ids)
  null = model.null_condition(batch.ids.shape[0])
  terms = lambda i: step_terms(model, diff, cfg, batch, i, cond, null)  # one backbone forward each
  if cfg.remat and cfg.remat_ar_steps:  # keep only each step's inputs for the backward pass: the memory of one AR
    terms = jax.checkpoint(terms)        # step, at one more backbone forward (the step's, then each block's recompute)
  with layers.remat_blocks(cfg.remat):  # ... and, inside it, of one transformer block
    if steps is None:  # all M steps: a scan, so the program holds one backbone, not M
      tot, _ = jax.lax.scan(lambda acc, i: (jax.tree.map(jnp.add, acc, terms(i)), None), terms(0),
                            jnp.arange(1, batch.j.shape[0]))
    else:
      tot = None
      for i in steps:
        t = terms(i)
        tot = t if tot is None else jax.tree.map(jnp.add, tot, t)
  policy_count, kl_count = (tot["policy_count"], tot["kl_count"]) if norm is None else norm
  per = lambda x, n: x / jnp.maximum(n, 1.0)
  policy, kl = per(tot["policy_sum"], policy_count), per(tot["kl_sum"], kl_count)
  metrics = dict(policy=policy, kl=kl, clip_frac=per(tot["clipped_sum"], policy_count),
                 logp_diff=per(tot["logp_diff_sum"], policy_count), tokens=tot["policy_count"])
  return -(policy - cfg.beta * kl), metrics
