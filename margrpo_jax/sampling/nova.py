r"""NOVA's generation loop (docs/models.md section 3.3, docs/algorithm.md sections 3.3-3.4): set-based AR over the
image tokens with a flow head.

Mask schedule over ``N`` AR steps and ``L`` tokens: ``m_i = round(L cos(pi/2 i/N))`` (half to even, as numpy and
torch round), ``counts_i = m_i - m_{i+1}``, zero counts dropped (L = 1024, N = 64: 63 steps 1, 2, 2, 3, ...).
One random order per image (shared by the cond / uncond rows); step ``s`` decodes ``order[starts_s :
starts_s + counts_s]``. Per AR step: ``z = backbone(canvas, mask, c)`` for the rows ``[cond ; uncond]`` (the
uncond condition is the video encoder on the null text), fresh N(0, I) noise for the decoded tokens, then the
``T`` flow steps of :mod:`margrpo_jax.diffusion.flow` with ``v = v_u + w (v_c - v_u)`` (CFG on the velocity,
constant ``w``); the result is written into the canvas. ``noise_level = 0`` is NOVA's Euler ODE (no temperature);
0.7 is the Flow-GRPO SDE of the RL rollouts. Like the MAR sampler, every step gathers a static ``K = max(counts)``
positions (``valid`` marks the real ones), so the loop is one ``lax.scan``; with ``record=True`` it returns a
:class:`margrpo_jax.sampling.sampler.Record` (``xs`` are ``x_0 = noise, ..., x_T``, the flow's own direction).

How to use:
    fn = make_sample_fn(graphdef, NovaSamplerConfig(num_steps=64, diffusion_steps=25, cfg_scale=5.0))
    tokens, record = fn(params, ids, jax.random.key(0))       # ids: NOVA.prompt_ids(model_cfg, prompts)
    images = NOVA.decode_images(model_cfg, np.asarray(tokens))
"""
from __future__ import annotations

import dataclasses
import functools
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from margrpo_jax import rng
from margrpo_jax.diffusion import flow
from margrpo_jax.sampling.sampler import Record, _gather, commit
from margrpo_jax.sampling.schedule import MaskSchedule


@dataclasses.dataclass(frozen=True)
class NovaSamplerConfig:
  num_steps: int = 64          # AR steps N (before dropping zero-count steps)
  diffusion_steps: int = 25    # flow steps T
  cfg_scale: float = 5.0       # w, constant
  noise_level: float = 0.0     # 0: Euler ODE (NOVA); 0.7: Flow-GRPO SDE (rollouts)
  shift: float = 1.0           # scheduler shift of the sigmas


def sampler_config(sampling) -> NovaSamplerConfig:
  """From a config's ``sampling`` block (``configs/nova.py``)."""
  return NovaSamplerConfig(num_steps=sampling.num_steps, diffusion_steps=int(sampling.diffusion_steps),
                           cfg_scale=sampling.cfg_scale, noise_level=sampling.get("flow_noise_level", 0.0),
                           shift=sampling.get("flow_shift", 1.0))


def nova_schedule(seq_len: int, num_steps: int) -> MaskSchedule:
  """NOVA's cosine schedule: ``round``, zero-count steps skipped (``remaining`` = tokens still masked after)."""
  m = np.round(np.cos(math.pi / 2 * np.arange(num_steps + 1) / num_steps) * seq_len).astype(np.int64)
  counts = (m[:-1] - m[1:])
  counts = counts[counts > 0].astype(np.int32)
  starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int32)
  return MaskSchedule(counts=counts, starts=starts, remaining=(seq_len - starts - counts).astype(np.int32))


def velocity(model, x, t, z_c, z_u=None, scale=None):
  """Head velocity at ``x`` (..., C), guided ``v_u + w (v_c - v_u)`` when ``z_u`` is given."""
  if z_u is None:
    return model.head(x, t, z_c)
  t = t if t.shape[0] == 1 else jnp.concatenate([t, t])
  v_c, v_u = jnp.split(model.head(jnp.concatenate([x, x]), t, jnp.concatenate([z_c, z_u])), 2)
  return v_u + jnp.asarray(scale, v_c.dtype) * (v_c - v_u)


def run_flow(model, sched: flow.FlowSchedule, x_init, z_c, z_u, scale, key):
  """The ``T`` flow steps from ``x_init`` (noise); returns ``(x_T, xs (T+1, ...), std (T, ...), logp (T, ...))``."""
  keys = jax.random.split(key, sched.num_steps)
  ts = jnp.asarray(sched.t, jnp.float32)

  def body(x, inp):
    n, k = inp
    t = jnp.broadcast_to(ts[n], (1,) * (x.ndim - 1))  # one time embedding for all tokens
    v = velocity(model, x, t, z_c, z_u, scale)
    x_next, _, std, logp = flow.step(sched, v, x, jnp.full(x.shape[:-1], n), jax.random.normal(k, x.shape))
    return x_next, (x_next, std, logp.sum(-1))

  x, (xs, std, logp) = jax.lax.scan(body, x_init, (jnp.arange(sched.num_steps), keys))
  return x, jnp.concatenate([x_init[None], xs]), std, logp


def sample(model, cfg: NovaSamplerConfig, cond: jax.Array, null: jax.Array, key: jax.Array, record: bool = False):
  """Token canvases (B, L, 16) from video-encoder conditions ``cond`` / ``null`` (B, Lv, D)."""
  bb = model.backbone
  b, seq_len, c = cond.shape[0], bb.seq_len, bb.token_dim
  sched = nova_schedule(seq_len, cfg.num_steps)
  fsched = flow.make_flow(cfg.diffusion_steps, cfg.noise_level, cfg.shift)
  guided = cfg.cfg_scale > 1.0  # NOVA guides only above 1
  k_max = sched.max_count
  order = jax.vmap(lambda k: jax.random.permutation(k, seq_len))(
      jax.random.split(rng.stream(key, "order"), b)).astype(jnp.int32)
  order_pad = jnp.concatenate([order, order[:, :k_max]], axis=1)
  step_keys = jax.random.split(rng.stream(key, "diffusion"), sched.num_steps)
  scale = jnp.float32(cfg.cfg_scale)

  def body(carry, inp):
    canvas, mask = carry
    start, count, k = inp
    if guided:
      z_c, z_u = jnp.split(bb(jnp.concatenate([canvas, canvas]), jnp.concatenate([mask, mask]),
                              jnp.concatenate([cond, null])), 2)
    else:
      z_c, z_u = bb(canvas, mask, cond), None
    pos = jax.lax.dynamic_slice_in_dim(order_pad, start, k_max, axis=1)
    valid = jnp.broadcast_to(jnp.arange(k_max) < count, (b, k_max))
    zc_sel, zu_sel = _gather(z_c, pos), None if z_u is None else _gather(z_u, pos)
    x_init = jax.random.normal(rng.stream(k, "x_T"), (b, k_max, c), canvas.dtype)
    x, xs, std, logp = run_flow(model, fsched, x_init, zc_sel, zu_sel, scale, rng.stream(k, "steps"))
    return commit(canvas, mask, pos, valid, x, zc_sel, zu_sel, xs, std, logp, scale, order, record)

  init = (jnp.zeros((b, seq_len, c), jnp.float32), jnp.ones((b, seq_len), bool))
  xs_in = (jnp.asarray(sched.starts), jnp.asarray(sched.counts), step_keys)
  (canvas, mask), rec = jax.lax.scan(body, init, xs_in)
  chex.assert_shape(canvas, (b, seq_len, c))
  if record:
    rec = rec.replace(order=order)
  return canvas, rec


@functools.lru_cache(maxsize=None)
def make_sample_fn(graphdef, cfg: NovaSamplerConfig, record: bool = False):
  """A cached jitted ``fn(state, ids, key) -> (tokens, record)`` (ids: Phi-2 token ids, -1 = padding)."""

  def fn(state, ids, key):
    model = nnx.merge(graphdef, state)
    return sample(model, cfg, model.condition(ids), model.null_condition(ids.shape[0]), key, record)

  return jax.jit(fn)


def score_step(model, cfg: NovaSamplerConfig, rec: Record, step: int, cond, null):
  """Recompute the log-probs (T, B, K) and stds (T, B, K, C) of the recorded flow transitions of AR step ``step``:
  ``z`` from the recorded canvas and mask, then every ``x_n -> x_{n+1}`` scored under the step's Gaussian."""
  fsched = flow.make_flow(cfg.diffusion_steps, cfg.noise_level, cfg.shift)
  r = jax.tree.map(lambda a: a[step], rec.replace(order=rec.order[None]))
  bb, guided = model.backbone, cfg.cfg_scale > 1.0
  if guided:
    z_c, z_u = jnp.split(bb(jnp.concatenate([r.canvas, r.canvas]), jnp.concatenate([r.mask, r.mask]),
                            jnp.concatenate([cond, null])), 2)
  else:
    z_c, z_u = bb(r.canvas, r.mask, cond), None
  zc_sel, zu_sel = _gather(z_c, r.positions), None if z_u is None else _gather(z_u, r.positions)
  t_count = fsched.num_steps
  x, x_next = r.xs[:-1], r.xs[1:]  # (T, B, K, C)
  ns = jnp.broadcast_to(jnp.arange(t_count)[:, None, None], x.shape[:-1])
  rep = lambda a: None if a is None else jnp.broadcast_to(a, (t_count,) + a.shape)
  t = jnp.asarray(fsched.t, jnp.float32)[:, None, None]  # (T, 1, 1): one time per flow step
  fold = lambda a: None if a is None else a.reshape((-1,) + a.shape[2:])  # (T, B, ...) -> (T B, ...)
  tt = jnp.broadcast_to(t, ns.shape)
  v = velocity(model, fold(x), fold(tt), fold(rep(zc_sel)), fold(rep(zu_sel)), r.cfg)
  mean, std = flow.mean_and_std(fsched, v.reshape(x.shape), x, ns)
  std = jnp.broadcast_to(std, x.shape)
  return flow.transition_logprob(x_next, mean, std).sum(-1), std
