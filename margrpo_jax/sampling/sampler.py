r"""The MAR sampler: cosine mask schedule, random order per image, CFG, temperature, in one jitted loop; the
same loop samples NOVA (its rounded schedule, flow head: ``sampling/nova.py``).

Per AR step ``s``: ``z = backbone(canvas, mask, cond)`` (rows ``[cond ; uncond]`` under guidance), then the
diffusion head samples the ``counts[s]`` tokens at positions ``order[starts[s] : starts[s] + counts[s]]`` with a
``lax.scan`` over the respaced diffusion steps. The schedule is static, so each step's work is known: the AR steps
run as at most ``SamplerConfig.segments`` consecutive ``lax.scan`` s (:func:`step_segments`, chosen by dynamic
programming), each at the largest shape of its steps: MAR's encoder on the buffer and the known tokens only
(``encode_known``, the official code's work; padding key-masked), the head on the segment's largest count (the
surplus rows computed and discarded; ``valid`` marks the real ones; record fields are padded to ``K =
max(counts)``). ``segments=1`` is one scan at the largest shape (the full encoder); ``segments >= N`` every step at
its own. Noise is drawn for ``K`` tokens and sliced, so every segmentation draws the same images from one key.
Decoding the order from its front is equivalent in law to MAR's masking of the order's first ``n`` entries.

CFG (MAR): both branches start from the same noise and are evaluated at the same state ``x``;
``eps = eps_u + w (eps_c - eps_u)``; the variance channels stay the conditional ones. The per-token chain is
the Gaussian head's ancestral chain (``diff`` a :class:`gaussian.Diffusion`) or, with ``diff`` a
:class:`flow.FlowSchedule`, the flow SDE / ODE of :mod:`margrpo_jax.diffusion.flow` with CFG on the velocity
``v = v_u + w (v_c - v_u)`` and no temperature. Either way the chain's list positions are ``n = 0..T-1``
(``x_n -> x_{n+1}``; the Gaussian's respaced step is ``j = T - 1 - n``).

With ``record=True`` the sampler also returns a :class:`Record` with what each AR step saw and decoded,
enough to recompute every transition's log-prob (see :func:`score_step`).
"""
from __future__ import annotations

import dataclasses
import functools
import math

import chex
import flax
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from margrpo_jax import rng
from margrpo_jax.diffusion import flow, gaussian
from margrpo_jax.parallel import sharding
from margrpo_jax.sampling import schedule as schedule_lib


# sampling.<key> -> (low, high, low included, high included) of SamplerConfig's numbers (validate.py reads it);
# flow_noise_level is NOVA's flow sampler's (sampling/nova.py): 0 the ODE, up to 1 Flow-GRPO's SDE
RANGES = dict(num_steps=(1, math.inf, True, False), cfg_scale=(0, math.inf, True, False),
              temperature=(0, math.inf, False, False), clip_denoised=(0, math.inf, True, False),
              flow_noise_level=(0, 1, True, True))


@dataclasses.dataclass(frozen=True)
class SamplerConfig:
  num_steps: int = 16            # AR steps N
  cfg_scale: float = 1.0         # w
  cfg_schedule: str = "linear"   # 'linear' | 'constant'
  temperature: float = 1.0       # tau, scales the per-step diffusion noise
  guidance: bool | None = None   # run the [cond; uncond] branches; None: only when some step has w != 1
  clip_denoised: float = 0.0     # r > 0: clip x0_hat to [-r, r] in each step (off in MAR; True = 1 for pixels)
  order_group: int = 1           # rows [g i, g (i + 1)) share one generation order (RL: a GRPO group, so the
                                 # group baseline is not spent on order luck the policy does not control)
  vary_steps: int = 0            # with order_group g > 1: the rows of a group also share every diffusion noise
                                 # except at this many AR steps, drawn per call (Record.varied); 0: independent
  mask_schedule: str = "cosine"  # 'cosine' (MAR: floor, >= 1 token per step) | 'cos_round' (NOVA: round,
                                 # zero-count steps dropped)
  segments: int = 4              # AR steps run in at most this many scans, each at its own static shape
                                 # (schedule.segments); 1: one scan at the largest step's shape. Each one
                                 # compiles (~1 s on CPU at MAR-B): 4 keeps compile time within 2x of one scan


@flax.struct.dataclass
class Record:
  """Rollout record; leading axis = AR step (N), then batch (B), K = max tokens per step, T = diff. steps."""
  canvas: jax.Array     # (N, B, L, C) canvas given to the backbone
  mask: jax.Array       # (N, B, L) bool, True = unknown before the step (the visibility mask given)
  positions: jax.Array  # (N, B, K) int32 positions decoded at the step
  valid: jax.Array      # (N, B, K) bool, False for the padded surplus positions (their chains: zeros or
                        # computed and discarded)
  z: jax.Array          # (N, B, K, D) conditional AR latents at those positions
  z_u: jax.Array        # (N, B, K, D) unconditional AR latents there (zeros when the sampler is unguided)
  xs: jax.Array         # (N, T+1, B, K, C) diffusion states x_T, ..., x_0
  std: jax.Array        # (N, T, B, K, C) per-element std used (sigma * temperature)
  logp: jax.Array       # (N, T, B, K) log-prob of each transition, summed over channels
  cfg: jax.Array        # (N,) guidance scale of each step
  order: jax.Array      # (B, L) generation order
  varied: jax.Array     # (N,) bool, the steps whose diffusion noise differs inside an order group (all True
                        # unless SamplerConfig.vary_steps)

  # (rank, batch axis) of every field, for sharding records over the mesh's batch axes
  LAYOUT = dict(canvas=(4, 1), mask=(3, 1), positions=(3, 1), valid=(3, 1), z=(4, 1), z_u=(4, 1), xs=(5, 2),
                std=(5, 2), logp=(4, 2), cfg=(1, None), order=(2, 0), varied=(1, None))

  @classmethod
  def shardings(cls, mesh):
    """A ``Record`` of ``NamedSharding``: each field split along its batch axis."""
    return cls(**{k: sharding.replicated(mesh) if ax is None else sharding.batch_sharding(mesh, nd, ax)
                  for k, (nd, ax) in cls.LAYOUT.items()})


def is_flow(diff) -> bool:
  """Whether ``diff`` is a flow schedule (NOVA's head) rather than a Gaussian diffusion."""
  return isinstance(diff, flow.FlowSchedule)


def head_output(model, x, t, z_cond, z_uncond=None, scale=None, velocity: bool = False):
  """Diffusion-head output at state ``x``, guided when ``z_uncond`` is given: ``[eps | v]`` with CFG on ``eps``
  (the variance channels stay the conditional ones), or, with ``velocity``, a flow velocity guided as a whole."""
  if z_uncond is None:
    return model.head(x, t, z_cond)
  t = t if t.shape[0] == 1 else jnp.concatenate([t, t])
  out = model.head(jnp.concatenate([x, x]), t, jnp.concatenate([z_cond, z_uncond]))
  out_c, out_u = jnp.split(out, 2)
  scale = jnp.asarray(scale, out_c.dtype)
  if velocity:
    return out_u + scale * (out_c - out_u)
  (eps_c, v_c), (eps_u, _) = gaussian.split_output(out_c), gaussian.split_output(out_u)
  return jnp.concatenate([eps_u + scale * (eps_c - eps_u), v_c], axis=-1)


MASK_SCHEDULES = {"cosine": schedule_lib.cosine_schedule, "cos_round": schedule_lib.rounded_cosine_schedule}


def mask_schedule(kind: str, seq_len: int, num_steps: int) -> schedule_lib.MaskSchedule:
  if kind not in MASK_SCHEDULES:
    raise ValueError(f"sampling.mask_schedule={kind!r} is not one of {', '.join(MASK_SCHEDULES)}")
  return MASK_SCHEDULES[kind](seq_len, num_steps)


ENCODER_BUCKETS = 4  # static sizes of the gathered known set where the mask is traced (:func:`latents`)


def known_sizes(seq_len: int, buckets: int) -> tuple[int, ...]:
  """The static sizes of :func:`latents`' gathered known set: ``ceil(L (b + 1) / buckets)``, ``b < buckets``."""
  return tuple(sorted({-(-seq_len * (i + 1) // buckets) for i in range(buckets)}))


def latents(model, tokens, mask, cond, buckets: int = 0) -> jax.Array:
  """``model.backbone(tokens, mask, cond)`` (B, L, D) for a mask known only when traced (the RL update's recorded
  canvases). With ``buckets > 0`` and a backbone that :func:`gathers_known` (MAR's) the encoder runs, as the
  official code's, on the buffer and the known tokens only: gathered in position order and padded (key-masked)
  to the smallest of :func:`known_sizes` that holds the fullest row's count ``n``, one ``lax.switch`` branch per
  size. Work: ``buffer + n + L / buckets`` encoder tokens at most, against ``buffer + L``; the same latents to float
  rounding."""
  bb = model.backbone
  if not buckets or not gathers_known(model):
    return bb(tokens, mask, cond)
  unknown = mask.astype(jnp.int32)
  n = bb.seq_len - unknown.sum(-1)
  order = jnp.argsort(unknown, axis=-1, stable=True).astype(jnp.int32)  # the known positions first
  sizes = known_sizes(bb.seq_len, buckets)
  run = lambda k: lambda: bb.decode(*bb.encode_known(tokens, order[:, :k], n[:, None], cond))
  return jax.lax.switch(jnp.searchsorted(jnp.asarray(sizes), n.max()), [run(k) for k in sizes])


def ar_latents(model, canvas, mask, cond, null, guided: bool, known=None, buckets: int = 0):
  """Backbone latents ``(z_cond, z_uncond or None)`` for one AR step. With ``known = (positions (B, K), n)`` (a
  backbone with ``encode_known``) the encoder runs on the buffer and those positions only (``mask`` unused); else
  on the known tokens gathered into ``buckets`` static sizes (:func:`latents`; 0: the key-masked full encoder)."""
  two = lambda a: jnp.concatenate([a, a]) if guided else a
  c = jnp.concatenate([cond, null]) if guided else cond
  bb = model.backbone
  if known is not None:
    z = bb.decode(*bb.encode_known(two(canvas), two(known[0]), known[1], c))
  else:
    z = latents(model, two(canvas), two(mask), c, buckets)
  return tuple(jnp.split(z, 2)) if guided else (z, None)


def gathers_known(model) -> bool:
  """Whether the backbone can run its encoder on the known tokens only (MAR's; not Harmon's, not NOVA's)."""
  return hasattr(model.backbone, "encode_known")


def _param_count(module) -> int:
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(module, nnx.Param)))


def step_segments(model, diff, sched, max_segments: int) -> tuple[tuple[int, int], ...]:
  """The sampler's runs of AR steps at one shape (:func:`schedule.segments`), costed by parameter counts: a known
  token costs the encoder blocks' parameters, a head row the head's times its diffusion steps."""
  bb = model.backbone
  token_cost = _param_count(bb.encoder_blocks) if gathers_known(model) else 0
  return schedule_lib.segments(sched, max_segments, token_cost, _param_count(model.head) * diff.num_steps)


def _gather(x, idx):
  return jnp.take_along_axis(x, idx.reshape(idx.shape + (1,) * (x.ndim - 2)), axis=1)


def group_normal(key, shape, dtype, group: int = 1, shared=False):
  """Standard normal noise of ``shape`` (B, ...); where ``shared`` (a traced bool) the rows of each block of
  ``group`` consecutive rows get one draw (common random numbers inside a GRPO group)."""
  own = jax.random.normal(key, shape, dtype)
  if group <= 1:
    return own
  one = jax.random.normal(jax.random.fold_in(key, 1), (shape[0] // group,) + tuple(shape[1:]), dtype)
  return jnp.where(shared, jnp.repeat(one, group, axis=0), own)


def _noise(key, shape, dtype, group, shared, rows):
  """:func:`group_normal` drawn for ``rows`` tokens along axis 1 (None: ``shape[1]``), the first ``shape[1]`` kept."""
  if rows is None or rows == shape[1]:
    return group_normal(key, shape, dtype, group, shared)
  return group_normal(key, (shape[0], rows) + tuple(shape[2:]), dtype, group, shared)[:, :shape[1]]


def _transition(model, diff, x, n, z_c, z_u, scale, temperature, clip_denoised):
  """The head's transition from ``x = x_n`` at list positions ``n`` (x.shape[:-1]): ``(mean, std)``."""
  if is_flow(diff):
    t = diff.table("t", n)[..., 0]
    v = head_output(model, x, t, z_c, z_u, scale, velocity=True)
    mean, std = flow.mean_and_std(diff, v, x, n)
    return mean, jnp.broadcast_to(std, x.shape)
  j = diff.num_steps - 1 - n
  out = head_output(model, x, jnp.asarray(diff.timesteps, jnp.int32)[j], z_c, z_u, scale)
  mean, log_var = gaussian.mean_and_log_variance(diff, x, j, *gaussian.split_output(out),
                                                 clip_denoised=clip_denoised)
  return mean, jnp.exp(0.5 * log_var) * temperature


def run_chain(model, diff, x_init, z_c, z_u, scale, temperature, key, clip_denoised=0.0, group: int = 1,
              shared=False, rows: int | None = None):
  """The full chain from ``x_init`` (B, ..., C) (Gaussian ancestral or flow, :func:`is_flow`); returns
  ``(x_final, xs (T+1,...), std, logp)``. With ``group > 1`` and ``shared``, each block of ``group`` rows draws
  one step noise (:func:`group_normal`). ``rows``: the noise is drawn for this many tokens (axis 1) and the first
  ``x_init.shape[1]`` used, so that a chain on fewer tokens draws the same noise for them."""
  keys = jax.random.split(key, diff.num_steps)
  if is_flow(diff):  # one time embedding for all tokens; the flow has no temperature
    times = jnp.asarray(diff.t, jnp.float32)
  else:
    times = jnp.asarray(diff.timesteps, jnp.int32)[::-1]

  def body(x, inp):
    n, k = inp
    t = jnp.broadcast_to(times[n], (1,) * (x.ndim - 1))
    noise = _noise(k, x.shape, x.dtype, group, shared, rows)
    nn = jnp.full(x.shape[:-1], n)
    if is_flow(diff):
      x_next, _, std, logp = flow.step(diff, head_output(model, x, t, z_c, z_u, scale, velocity=True), x, nn,
                                       noise)
    else:
      x_next, _, std, logp = gaussian.step(diff, head_output(model, x, t, z_c, z_u, scale), x,
                                           diff.num_steps - 1 - nn, noise, temperature, clip_denoised)
    return x_next, (x_next, std, logp.sum(-1))

  x0, (xs, std, logp) = jax.lax.scan(body, x_init, (jnp.arange(diff.num_steps), keys))
  return x0, jnp.concatenate([x_init[None], xs]), std, logp


def commit(canvas, mask, pos, valid, x0, zc_sel, zu_sel, xs, std, logp, scale, order, record: bool, varied=True):
  """One AR step's bookkeeping: write the ``valid`` decoded tokens ``x0`` (B, K, C) at ``pos`` into the canvas,
  mark them known, and (``record``) the step's :class:`Record` slice. Returns ``((canvas, mask), record)``."""
  rows = jnp.arange(canvas.shape[0])[:, None]
  new_canvas = canvas.at[rows, pos].set(jnp.where(valid[..., None], x0, _gather(canvas, pos)))
  new_mask = mask.at[rows, pos].set(mask[rows, pos] & ~valid)
  rec = Record(canvas=canvas, mask=mask, positions=pos, valid=valid, z=zc_sel,
               z_u=jnp.zeros_like(zc_sel) if zu_sel is None else zu_sel, xs=xs, std=std, logp=logp,
               cfg=scale, order=order, varied=jnp.asarray(varied, bool)) if record else None
  return (new_canvas, new_mask), rec


def sample(model, diff, cfg: SamplerConfig, cond: jax.Array, null: jax.Array,
           key: jax.Array, record: bool = False):
  """Generate token canvases (B, L, C) from buffer conditions ``cond`` / ``null`` (B, buffer, D)."""
  bb = model.backbone
  b, seq_len, c = cond.shape[0], bb.seq_len, bb.token_dim
  sched = mask_schedule(cfg.mask_schedule, seq_len, cfg.num_steps)
  scales = schedule_lib.cfg_schedule(sched, seq_len, cfg.cfg_scale, cfg.cfg_schedule)
  guided = cfg.guidance if cfg.guidance is not None else bool(np.any(scales != 1.0))
  k_max = sched.max_count
  g = cfg.order_group if b % max(cfg.order_group, 1) == 0 else 1
  order = jax.vmap(lambda k: jax.random.permutation(k, seq_len))(
      jax.random.split(rng.stream(key, "order"), b // g)).astype(jnp.int32)
  order = jnp.repeat(order, g, axis=0)  # consecutive rows of a group share one order (common random numbers)
  order_pad = jnp.concatenate([order, order[:, :k_max]], axis=1)
  n_steps = sched.num_steps  # NOVA's schedule drops its zero-count steps: n_steps <= cfg.num_steps
  step_keys = jax.random.split(rng.stream(key, "diffusion"), n_steps)
  share = g > 1 and cfg.vary_steps > 0  # common diffusion noise inside a group except at the varied steps
  varied = jnp.ones((n_steps,), bool)
  if share:
    drawn = jax.random.choice(rng.stream(key, "varied"), n_steps, (min(cfg.vary_steps, n_steps),),
                              replace=False)
    varied = jnp.zeros((n_steps,), bool).at[drawn].set(True)
  group = g if share else 1
  gather = gathers_known(model)

  def body(carry, inp, k_enc, k_head):
    canvas, mask = carry
    start, count, scale, k, vary = inp
    known = (order[:, :k_enc], start) if gather else None
    z_c, z_u = ar_latents(model, canvas, mask, cond, null, guided, known)
    pos = jax.lax.dynamic_slice_in_dim(order_pad, start, k_max, axis=1)  # the record's K = max(counts) positions
    valid = jnp.broadcast_to(jnp.arange(k_max) < count, (b, k_max))
    zc_sel = _gather(z_c, pos)
    zu_sel = None if z_u is None else _gather(z_u, pos)
    head = lambda a: None if a is None else a[:, :k_head]  # the head runs on this segment's largest count only
    x_init = _noise(rng.stream(k, "x_T"), (b, k_head, c), canvas.dtype, group, ~vary, k_max)
    x0, xs, std, logp = run_chain(model, diff, x_init, head(zc_sel), head(zu_sel), scale, cfg.temperature,
                                  rng.stream(k, "steps"), cfg.clip_denoised, group, ~vary, k_max)
    pad = lambda a, ax: jnp.pad(a, [(0, k_max - k_head if i == ax else 0) for i in range(a.ndim)])
    x0, xs, std, logp = pad(x0, 1), pad(xs, 2), pad(std, 2), pad(logp, 2)
    return commit(canvas, mask, pos, valid, x0, zc_sel, zu_sel, xs, std, logp, scale, order, record, vary)

  carry = (jnp.zeros((b, seq_len, c), jnp.float32), jnp.ones((b, seq_len), bool))
  xs_in = (jnp.asarray(sched.starts), jnp.asarray(sched.counts), jnp.asarray(scales), step_keys, varied)
  recs = []
  for lo, hi in step_segments(model, diff, sched, cfg.segments):  # each run of steps a scan at its own shape
    seg_body = functools.partial(body, k_enc=int(sched.starts[hi - 1]), k_head=int(sched.counts[lo:hi].max()))
    carry, rec = jax.lax.scan(seg_body, carry, jax.tree.map(lambda a, lo=lo, hi=hi: a[lo:hi], xs_in))
    recs.append(rec)
  canvas, _ = carry
  chex.assert_shape(canvas, (b, seq_len, c))
  rec = jax.tree.map(lambda *a: jnp.concatenate(a), *recs).replace(order=order) if record else None
  return canvas, rec


def transition_logp(model, diff, x_t, x_prev, n, z_c, z_u=None, scale=None, temperature: float = 1.0,
                    clip_denoised: float = 0.0):
  """Score transitions ``x_t -> x_prev`` at chain list positions ``n`` under the head's Gaussian given ``z``
  (Gaussian diffusion: respaced step ``j = T - 1 - n``; flow: the SDE step ``n``).

  Shapes: ``x_t, x_prev`` (N, ..., C), ``n`` (N, ...), ``z_c / z_u`` (N, ..., D); guided when ``z_u`` is
  given. Returns elementwise ``(logp, mean, std)``, each (N, ..., C); ``logp`` is 0 where ``std`` is 0 (a
  deterministic flow step).
  """
  mean, std = _transition(model, diff, x_t, n, z_c, z_u, scale, temperature, clip_denoised)
  return flow.transition_logprob(x_prev, mean, std), mean, std


def score_step(model, diff, cfg: SamplerConfig, rec: Record, step: int, cond, null,
               guided: bool):
  """Recompute the log-probs (T, B, K) and stds of the recorded transitions of AR step ``step``: ``z`` from
  the recorded canvas and mask, then every ``x_j -> x_{j-1}`` scored under the head's Gaussian."""
  r = jax.tree.map(lambda a: a[step], rec.replace(order=rec.order[None]))
  z_c, z_u = ar_latents(model, r.canvas, r.mask, cond, null, guided)
  zc_sel, zu_sel = _gather(z_c, r.positions), (None if z_u is None else _gather(z_u, r.positions))
  t_count = diff.num_steps
  ns = jnp.broadcast_to(jnp.arange(t_count)[:, None, None], r.xs[1:].shape[:-1])
  rep = lambda a: None if a is None else jnp.broadcast_to(a, (t_count,) + a.shape)
  fold = lambda a: None if a is None else a.reshape((-1,) + a.shape[2:])  # (T, B, ...) -> (T B, ...)
  logp, _, std = transition_logp(model, diff, fold(r.xs[:-1]), fold(r.xs[1:]), fold(ns), fold(rep(zc_sel)),
                                 fold(rep(zu_sel)), r.cfg, cfg.temperature, cfg.clip_denoised)
  return logp.sum(-1).reshape(ns.shape), std.reshape(r.xs[1:].shape)


@functools.lru_cache(maxsize=None)
def _jitted(graphdef, dkey, cfg: SamplerConfig, record: bool, mesh=None, rules=None, sig=None, ids_ndim=2):
  diff = _DIFFS[dkey]

  def fn(state, ids, key):
    model = nnx.merge(graphdef, state)
    return sample(model, diff, cfg, model.condition(ids), model.null_condition(ids.shape[0]), key, record)

  if mesh is None:
    return jax.jit(fn)
  params = sharding.param_shardings(mesh, sharding.abstract(sig), rules)
  ids = sharding.batch_sharding(mesh, ids_ndim)
  out = (sharding.batch_sharding(mesh, 3), Record.shardings(mesh) if record else None)
  return jax.jit(sharding.traced_on(fn, mesh), in_shardings=(params, ids, sharding.replicated(mesh)),
                 out_shardings=out)


_DIFFS: dict = {}


def diff_key(diff) -> tuple:
  """A hashable identity of a Gaussian diffusion or flow schedule (the jitted samplers are cached by it)."""
  if is_flow(diff):
    return ("flow", diff.noise_level, tuple(float(s) for s in diff.sigmas))
  return ("gaussian", diff.num_steps, tuple(int(t) for t in diff.timesteps))


def make_sample_fn(graphdef, diff, cfg: SamplerConfig, record: bool = False, mesh=None,
                   rules=(), params=None, ids_ndim: int = 2):
  """A cached jitted ``fn(state, token_ids, key) -> (tokens, record)`` for a conditioned model; with a
  ``mesh``, params (shaped like ``params``) are sharded by ``rules`` and the batch (condition ids of rank
  ``ids_ndim``: (B, T) token ids, (B,) class labels) over the batch axes."""
  key = diff_key(diff)
  _DIFFS.setdefault(key, diff)
  if mesh is None:
    return _jitted(graphdef, key, cfg, record)
  return _jitted(graphdef, key, cfg, record, mesh, sharding.hashable_rules(rules), sharding.signature(params),
                 ids_ndim)
