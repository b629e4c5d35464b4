r"""From a recorded rollout to the loss's :class:`TrainBatch` (no gradients).

For each selected AR step ``i`` (``M`` of ``N``, drawn without replacement; with group-shared rollout noise, the
``M`` steps whose noise varied inside the groups, ``rec.varied``):

* the canvas and masks the step saw; ``visible`` / ``region`` are the known-before / unknown-before sets
  (intended), or the post-step mask for both (official bug B1);
* the main trajectory on *every* position: tokens decoded at ``i`` keep their actual rollout transitions; the
  other still-unknown positions get the tentative chain the head draws from the step's latent (as the
  official code does at its logged steps);
* ``S`` MTE trajectories from the step latent (intended) or from each token's commit-time latent (official
  A2), and the uncertainty top-k mask ``U`` (inside the loss region, intended; over all positions, official);
* consistency-aware selection ``M'`` from the tentative predictions at ``i`` and ``i - 1``;
* ``U`` and ``M'`` are chosen from chains drawn for that purpose only (intended) or from the very samples the
  loss scores (official), which correlates the selection with the scored noise;
* ``k`` diffusion steps (shared by all selected AR steps, or drawn per AR step) from the scored-step window, list positions
  ``[lo, hi)`` of the ``T`` transitions (every window step when ``num_diffusion_steps = 0``);
* the frozen reference's transition means and stds.

Where the reward signal is (docs/rl_signal.md): a chain drawn from ``p(. | z)`` independently of the image has
``E[A grad log p(y)] = A grad integral p = 0``, so only the tokens decoded at a scored step, through their own
image-producing chains, carry signal; tentative and MTE chains only add (MTE: averaged) noise. Deviation ids (B1, A2, B6, ...) and the ``rl.*`` switch
reproducing each: docs/algorithm.md sections 13-14.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from margrpo_jax import rng
from margrpo_jax.diffusion import gaussian
from margrpo_jax.rl import selection
from margrpo_jax.rl.loss import LossConfig, TrainBatch, check_options
from margrpo_jax.sampling import sampler as sampler_lib


@dataclasses.dataclass(frozen=True)
class BatchConfig:
  """How a rollout becomes a training batch; the defaults are ``configs/shapes_rl.py:margrpo``'s."""
  num_ar_steps: int = 2            # M selected AR steps per rollout
  num_diffusion_steps: int = 4     # k diffusion steps scored per AR step (0: every step of the window)
  diffusion_window: tuple[int, int] = (1, -3)  # scored steps among list positions [lo, hi) of the T transitions
                                   # x_n -> x_{n+1} (j = T - 1 - n; negative: from the end; hi None: to the end).
                                   # (1, -3) drops the saturated first step (t = 999) and the near-deterministic
                                   # last ones (j = 2, 1) and j = 0; official: (0, None), every step
  mte_seeds: int = 4               # S (0: no MTE)
  topk_fraction: float = 0.3       # U = top 30 % most uncertain tokens
  consistency: bool = True         # consistency-aware selection
  mask_after_step: bool = False    # official B1: post-step mask for visibility and loss region
  mte_latent: str = "step"         # 'step' (intended) | 'commit' (official A2)
  mte_commit_guided: bool = False  # with 'commit': CFG at the constant sampler scale from the commit-time cond
                                   # and uncond latents (official Harmon); False: unguided (official NOVA, B6)
  topk_scope: str = "region"       # U among the loss region's tokens | 'all' positions (official)
  uncertainty_unit: str = "token"  # U ranks tokens | 'pixel': the latent pixels of pixel_channels values inside
                                   # each token, MTE mixed per element (official NOVA, A3)
  pixel_channels: int = 0          # values per latent pixel (0: the whole token; NOVA: its VAE's 4 channels)
  topk_random: int = 0             # pixels drawn uniformly among the rest and added to U (official NOVA: 1, C3)
  selection_chains: str = "independent"  # U and M' from chains of their own | 'scored': from the scored samples
                                         # (official)
  loss_tokens: str = "unknown"     # 'unknown': every not-yet-known token (tentative chains too, as the paper and
                                   # the official code) | 'decoded': only the tokens committed at the step (the
                                   # actions that reach the image: plain REINFORCE credit assignment)
  diffusion_per_ar_step: bool = False  # draw the k diffusion steps per selected AR step (official NOVA) instead
                                       # of once for all of them (official Harmon)
  logp: str = "chain"              # a token's log-likelihood: 'chain' = its recorded diffusion transitions (the
                                   # paper; rl.estimator='chain') | 'elbo' = the head's denoising ELBO of its final
                                   # value x_0 at num_diffusion_steps noise levels of the window with fresh noise,
                                   # q-MTE on U (rl.estimator='token_elbo')


OPTIONS = dict(mte_latent=("step", "commit"), topk_scope=("region", "all"),
               selection_chains=("independent", "scored"), loss_tokens=("unknown", "decoded"),
               logp=("chain", "elbo"), uncertainty_unit=("token", "pixel"))


def window_positions(window: tuple[int, int | None], num_steps: int) -> tuple[int, int]:
  """The window ``(lo, hi)`` (Python slice bounds) as absolute list positions ``0 <= lo < hi <= T``; raises
  ``ValueError`` naming the window when it is empty."""
  lo, hi, _ = slice(*window).indices(num_steps)
  if hi <= lo:
    raise ValueError(f"the scored-step window {window[0]}:{'' if window[1] is None else window[1]} holds no "
                     f"diffusion step of a {num_steps}-step chain")
  return lo, hi


def validate(bcfg: BatchConfig, num_steps: int) -> None:
  """Raise ``ValueError`` with one sentence for an impossible option string, window or combination."""
  check_options(bcfg, OPTIONS)
  lo, hi = window_positions(bcfg.diffusion_window, num_steps)
  if bcfg.num_diffusion_steps < 0 or bcfg.num_diffusion_steps > hi - lo:
    raise ValueError(f"rl.num_diffusion_steps={bcfg.num_diffusion_steps} does not fit the scored-step window "
                     f"{lo}:{hi} of the {num_steps}-step chain ({hi - lo} steps; 0 = all of them)")
  if bcfg.mte_seeds < 0 or not 0.0 <= bcfg.topk_fraction <= 1.0:
    raise ValueError(f"rl.mte_seeds={bcfg.mte_seeds} must be >= 0 and rl.topk_fraction={bcfg.topk_fraction} "
                     "in [0, 1]")
  if bcfg.topk_random < 0 or (bcfg.topk_random and bcfg.uncertainty_unit != "pixel"):
    raise ValueError(f"rl.official.topk_random={bcfg.topk_random} counts extra random latent pixels of U (official "
                     "NOVA: 1): it must be >= 0 and needs rl.official.uncertainty_unit='pixel'")
  if bcfg.uncertainty_unit == "pixel" and not bcfg.mte_seeds:
    raise ValueError("rl.official.uncertainty_unit='pixel' ranks latent pixels by the spread of the MTE "
                     "trajectories: it needs rl.mte_seeds > 0")
  if bcfg.num_ar_steps < 1:
    raise ValueError(f"rl.num_ar_steps={bcfg.num_ar_steps} must be at least 1")


def diffusion_positions(bcfg: BatchConfig, num_steps: int, key: jax.Array) -> jax.Array:
  """(k,) sorted list positions of the scored transitions: ``k`` drawn without replacement from the window, or
  the whole window when ``num_diffusion_steps = 0``."""
  lo, hi = window_positions(bcfg.diffusion_window, num_steps)
  if bcfg.num_diffusion_steps == 0:
    return jnp.arange(lo, hi)
  return lo + jnp.sort(jax.random.choice(key, hi - lo, (bcfg.num_diffusion_steps,), replace=False))

def _chain(model, diff, scfg, z_c, z_u, scale, key):
  x_init = jax.random.normal(rng.stream(key, "x_T"), z_c.shape[:-1] + (model.backbone.token_dim,))
  _, xs, std, logp = sampler_lib.run_chain(model, diff, x_init, z_c, z_u, scale, scfg.temperature,
                                           rng.stream(key, "steps"), scfg.clip_denoised)
  return xs, logp


def _decoded_mask(rec, i, seq_len):
  b = rec.positions.shape[1]
  return jnp.zeros((b, seq_len), bool).at[jnp.arange(b)[:, None], rec.positions[i]].max(rec.valid[i])


def build(model, ref_model, diff, scfg: sampler_lib.SamplerConfig, bcfg: BatchConfig,
          lcfg: LossConfig, rec: sampler_lib.Record, final: jax.Array, ids: jax.Array, adv: jax.Array,
          key: jax.Array) -> tuple[TrainBatch, dict]:
  """The training batch of one rollout and ``{'steps': (M,) selected AR steps, 'uncertainty': (M, B, P) per-token
  MTE std at the scored positions (zeros without MTE)}`` (jit this whole function; everything here is
  gradient-free). Scored positions ``P``: the ``K`` tokens decoded at each step with ``loss_tokens='decoded'``,
  else all ``L``; every per-token field of the batch is laid out over them."""
  n_steps, b = rec.mask.shape[:2]
  seq_len = rec.mask.shape[-1]
  guided = bool(scfg.guidance) if scfg.guidance is not None else True
  cond, null = model.condition(ids), model.null_condition(b)
  buckets = lcfg.encoder_buckets  # every backbone pass here on a recorded (traced) mask: MAR's encoder gathered
  steps = jnp.sort(jax.random.choice(rng.stream(key, "ar_steps"), n_steps, (bcfg.num_ar_steps,), replace=False))
  # With group-shared noise the scored steps are the ones whose noise varied (rl/config.py sets the sampler's
  # vary_steps = num_ar_steps).
  varied_steps = jnp.nonzero(rec.varied, size=bcfg.num_ar_steps, fill_value=0)[0]
  steps = jnp.where(jnp.all(rec.varied), steps, varied_steps)
  t_count = diff.num_steps  # list position n: x_n -> x_{n+1}, j = T - 1 - n
  n_shared = diffusion_positions(bcfg, t_count, rng.stream(key, "diff_steps"))
  rows = jnp.arange(b)[:, None]

  def at_commit(z_rec):  # (N, B, K, D) recorded latents -> (B, L, D): each position's at the step it was decoded
    flat = lambda a: jnp.moveaxis(a, 0, 1).reshape((b, -1) + a.shape[3:])  # (N, B, K, ...) -> (B, N K, ...)
    pos = jnp.where(flat(rec.valid), flat(rec.positions), seq_len)  # padded surplus -> out of range, dropped
    return jnp.zeros((b, seq_len, z_rec.shape[-1])).at[rows, pos].set(flat(z_rec), mode="drop")

  commit = bcfg.mte_seeds and bcfg.mte_latent == "commit"
  commit_z = at_commit(rec.z) if commit else None
  commit_z_u = at_commit(rec.z_u) if commit and bcfg.mte_commit_guided else None

  elbo = bcfg.logp == "elbo"
  independent = bcfg.selection_chains == "independent" or elbo  # token ELBO draws no scored chain to select from
  only_decoded = bcfg.loss_tokens == "decoded"  # score the decoded tokens' own chains only: P = K positions

  def elbo_terms(i, canvas, visible, pos, x0, j, k_i, idx):
    """Forward-process draws of the final tokens ``x0`` (B, P, C) at the ``k`` noise levels ``j``:
    ``x_t = q(x_0, j, eps)``, ``x_prev = eps`` (the target), ``old_logp = -1/2 sum_c (eps_hat - eps)^2`` under the
    behaviour policy (guided as the loss scores it), ``ref_mean`` the reference's ``eps_hat``; and q-MTE, ``S``
    further draws on the uncertain tokens ``idx`` (B, K) of P: ``mte_x_t`` (S, k, B, K, C) and the rest alike."""
    scale = rec.cfg[i] if lcfg.cfg_in_loss else None

    def noised(x0, eps):  # (k, B, N, C)
      jb = jnp.broadcast_to(j[:, None, None], j.shape + x0.shape[:2])
      return gaussian.q_sample(diff, x0[None], jb, eps), jnp.asarray(diff.timesteps, jnp.int32)[jb]

    def latents(m):
      at = lambda z: None if z is None else jnp.take_along_axis(z, pos[..., None], axis=1)
      return tuple(at(z) for z in sampler_lib.ar_latents(m, canvas, ~visible, m.condition(ids), m.null_condition(b),
                                                         lcfg.cfg_in_loss, buckets=buckets))

    def eps_hat(m, zc, zu, x_t, t):
      bk = lambda z: None if z is None else jnp.broadcast_to(z, j.shape + z.shape)
      return gaussian.split_output(sampler_lib.head_output(m, x_t, t, bk(zc), bk(zu), scale))[0]

    eps = jax.random.normal(rng.stream(k_i, "elbo"), j.shape + x0.shape)
    x_t, t = noised(x0, eps)
    zc, zu = latents(model)
    logp = lambda e_hat, e: -0.5 * jnp.sum((e_hat - e) ** 2, axis=-1)
    ref = eps_hat(ref_model, *latents(ref_model), x_t, t) if lcfg.beta else jnp.zeros_like(x_t)
    take = lambda a: None if a is None else jnp.take_along_axis(a, idx[..., None], axis=1)
    x0_u, zc_u, zu_u = take(x0), take(zc), take(zu)
    eps_s = jax.random.normal(rng.stream(k_i, "q_mte"), (bcfg.mte_seeds,) + j.shape + x0_u.shape)
    xt_s, t_s = jax.vmap(lambda e: noised(x0_u, e))(eps_s)
    old_s = jax.vmap(lambda xt, tt, e: logp(eps_hat(model, zc_u, zu_u, xt, tt), e))(xt_s, t_s, eps_s)
    return dict(j=j, x_t=x_t, x_prev=eps, old_logp=logp(eps_hat(model, zc, zu, x_t, t), eps), ref_mean=ref,
                ref_std=jnp.ones_like(x_t), mte_x_t=xt_s, mte_x_prev=eps_s, mte_old_logp=old_s)

  def one_step(i, k_i):
    n_sel = (diffusion_positions(bcfg, t_count, rng.stream(k_i, "diff_steps")) if bcfg.diffusion_per_ar_step
             else n_shared)  # the scored diffusion steps: drawn per AR step (official NOVA) or shared
    canvas, unknown = rec.canvas[i], rec.mask[i]
    decoded = _decoded_mask(rec, i, seq_len)
    z_c, z_u = sampler_lib.ar_latents(model, canvas, unknown, cond, null, guided, buckets=buckets)
    chain = lambda name: _chain(model, diff, scfg, z_c, z_u, rec.cfg[i], rng.stream(k_i, name))
    # The scored positions P: the K tokens decoded at the step ('decoded': their recorded chains, nothing else is
    # drawn) or all L positions (the rollout's chains at the decoded ones, tentative chains elsewhere).
    if only_decoded:
      pos, valid = rec.positions[i], rec.valid[i]
      xs, logp = rec.xs[i], rec.logp[i]
    else:
      pos, valid = jnp.broadcast_to(jnp.arange(seq_len, dtype=jnp.int32), (b, seq_len)), jnp.ones((b, seq_len), bool)
    if not only_decoded and not elbo:  # token ELBO scores the final values: no tentative chain is drawn
      xs, logp = chain("tentative")
      act = lambda full, part: full.at[:, rows, rec.positions[i]].set(
          jnp.where(rec.valid[i][(None, ...) + (None,) * (part.ndim - 3)], part, full[:, rows, rec.positions[i]]))
      xs, logp = act(xs, rec.xs[i]), act(logp, rec.logp[i])
    at_p = lambda m: jnp.take_along_axis(m, pos, axis=1)  # (B, L) -> (B, P)
    after = unknown & ~decoded
    region = after if bcfg.mask_after_step else unknown
    if bcfg.loss_tokens == "decoded":
      region = region & decoded
    visible = ~after if bcfg.mask_after_step else ~unknown
    keep = region
    if bcfg.consistency and not only_decoded:  # tentative prediction at i vs one AR step earlier (decoded tokens
                                               # are always kept: a no-op when only they are scored)
      ip = jnp.maximum(i - 1, 0)
      zp_c, zp_u = sampler_lib.ar_latents(model, rec.canvas[ip], rec.mask[ip], cond, null, guided, buckets=buckets)
      prev_xs, _ = _chain(model, diff, scfg, zp_c, zp_u, rec.cfg[ip], rng.stream(k_i, "previous"))
      prev_final = jnp.where(rec.mask[ip][..., None], prev_xs[-1], rec.canvas[ip])
      pred = jnp.where(unknown[..., None], chain("select")[0][-1] if independent else xs[-1], canvas)
      keep = selection.consistency_filter(region, decoded, selection.moved_closer(pred, prev_final, final), i)
    region, keep, decoded_p = at_p(region) & valid, at_p(keep) & valid, at_p(decoded) & valid
    # MTE trajectories and the uncertainty top-k. Only the uncertain tokens' trajectories are kept (the loss
    # uses the MTE estimate nowhere else; per pixel, every scored token's), gathered to (S, T + 1, B, K_U, C); idx
    # indexes P.
    if bcfg.mte_seeds:
      if bcfg.mte_latent == "step":
        zm_c, zm_u, mte_scale = z_c, z_u, rec.cfg[i]
      else:
        zm_c, zm_u, mte_scale = commit_z, commit_z_u, jnp.float32(scfg.cfg_scale)
      seeds = lambda name: jax.vmap(lambda kk: _chain(model, diff, scfg, zm_c, zm_u, mte_scale, kk))(
          jax.random.split(rng.stream(k_i, name), bcfg.mte_seeds))
      if elbo:  # U from model chains drawn for the ranking only; the scored draws are the forward process's
        spread = seeds("mte_select")[0][:, -1]
      else:
        mte_xs, mte_logp = seeds("mte")
        spread = seeds("mte_select")[0][:, -1] if independent else mte_xs[:, -1]  # (S, B, L, C) final samples
      if bcfg.uncertainty_unit == "pixel":  # U over the L p^2 latent pixels; every token keeps its MTE chains
        per_pix = bcfg.pixel_channels or spread.shape[-1]
        u_px = jnp.take_along_axis(selection.pixel_uncertainty(spread, per_pix), pos[..., None], axis=1)
        n_px = u_px.shape[-1]
        scope = jnp.repeat(region if bcfg.topk_scope == "region" else jnp.ones_like(region), n_px, axis=-1)
        flat = u_px.reshape(b, -1)
        if bcfg.topk_scope == "region":
          unc_px = selection.topk_in_region(flat, scope, bcfg.topk_fraction)[1]
        else:
          unc_px = selection.topk_mask(flat, bcfg.topk_fraction)
        if bcfg.topk_random:
          unc_px = selection.add_random(unc_px, scope, rng.stream(k_i, "topk_random"), bcfg.topk_random)
        unc_px = unc_px.reshape(u_px.shape)
        u, unc, idx = u_px.mean(-1), unc_px.any(-1), jnp.broadcast_to(jnp.arange(pos.shape[1]), pos.shape)
        elems = jnp.repeat(unc_px, per_pix, axis=-1)  # (B, P, C): the elements that take the MTE estimate
      else:
        u = at_p(selection.uncertainty(spread))
        if bcfg.topk_scope == "region":  # the top fraction of the loss region's tokens
          idx, unc = selection.topk_in_region(u, region, bcfg.topk_fraction)
        else:  # official: the top fraction of all L positions, known tokens included
          idx = selection.topk_indices(u, bcfg.topk_fraction)
          unc = selection.indices_to_mask(idx, u.shape[-1])
        elems = jnp.zeros(idx.shape + (0,), bool)
      if not elbo:
        idx_l = jnp.take_along_axis(pos, idx, axis=1)
        take = lambda a: jnp.take_along_axis(a, idx_l.reshape((1, 1) + idx_l.shape + (1,) * (a.ndim - 4)), axis=3)
        mte_xs, mte_logp = take(mte_xs), take(mte_logp)
    else:
      idx = jnp.zeros((b, 0), jnp.int32)
      if not elbo:
        mte_xs = jnp.zeros((0,) + xs.shape[:2] + (0,) + xs.shape[3:])
        mte_logp = jnp.zeros((0,) + logp.shape[:2] + (0,))
      u = jnp.zeros(pos.shape)
      unc = jnp.zeros(pos.shape, bool)
      elems = jnp.zeros((b, 0, 0), bool)
    common = dict(canvas=canvas, visible=visible, positions=pos, region=region, keep=keep, decoded=decoded_p,
                  uncertain=unc, uncertain_idx=idx, uncertain_elems=elems, cfg=rec.cfg[i], u=u)
    if elbo:  # denoising terms of the final tokens at the chosen noise levels (j = T - 1 - n), q-MTE on U
      x0 = jnp.take_along_axis(final, pos[..., None], axis=1)  # each scored token's committed value
      return dict(common, **elbo_terms(i, canvas, visible, pos, x0, t_count - 1 - n_sel, k_i, idx))
    common.update(mte_x_t=mte_xs[:, n_sel], mte_x_prev=mte_xs[:, n_sel + 1], mte_old_logp=mte_logp[:, n_sel])
    # Reference transitions at the chosen diffusion steps (not computed without a KL term: beta = 0).
    x_t, x_prev = xs[n_sel], xs[n_sel + 1]
    if lcfg.beta:
      gz = lambda z: None if z is None else jnp.take_along_axis(z, pos[..., None], axis=1)
      rz_c, rz_u = (gz(z) for z in sampler_lib.ar_latents(ref_model, canvas, ~visible, ref_model.condition(ids),
                                                          ref_model.null_condition(b), lcfg.cfg_in_loss,
                                                          buckets=buckets))
      nn = jnp.broadcast_to(n_sel[:, None, None], x_t.shape[:-1])
      # one diffusion step at a time: the head's temporaries of one step (B P rows), not of all k at once
      _, ref_mean, ref_std = jax.lax.map(lambda a: sampler_lib.transition_logp(
          ref_model, diff, *a, rz_c, rz_u, rec.cfg[i] if lcfg.cfg_in_loss else None, lcfg.temperature,
          lcfg.clip_denoised), (x_t, x_prev, nn))
    else:
      ref_mean, ref_std = jnp.zeros_like(x_t), jnp.ones_like(x_t)
    return dict(common, j=t_count - 1 - n_sel, x_t=x_t, x_prev=x_prev, old_logp=logp[n_sel], ref_mean=ref_mean,
                ref_std=ref_std)

  keys = jax.random.split(rng.stream(key, "replay"), bcfg.num_ar_steps)
  per = jax.lax.map(lambda a: one_step(*a), (steps, keys))
  swap = lambda a: jnp.moveaxis(a, 0, 1)  # (M, S, ...) -> (S, M, ...)
  return TrainBatch(ids=ids, adv=adv, cfg=per["cfg"], canvas=per["canvas"], visible=per["visible"],
                    positions=per["positions"], region=per["region"], keep=per["keep"], decoded=per["decoded"], uncertain=per["uncertain"],
                    uncertain_idx=per["uncertain_idx"], uncertain_elems=per["uncertain_elems"], j=per["j"],
                    x_t=per["x_t"], x_prev=per["x_prev"], old_logp=per["old_logp"], ref_mean=per["ref_mean"],
                    ref_std=per["ref_std"], mte_x_t=swap(per["mte_x_t"]), mte_x_prev=swap(per["mte_x_prev"]),
                    mte_old_logp=swap(per["mte_old_logp"])), dict(steps=steps, uncertainty=per["u"])
