r"""NOVA's generation settings on the shared sampler (docs/models.md section 3.3, docs/algorithm.md sections
3.3-3.4): set-based AR over the image tokens with a flow head.

NOVA's loop is the MAR loop of :mod:`margrpo_jax.sampling.sampler` with three differences, all settings of it:
the rounded cosine mask schedule (``mask_schedule='cos_round'``: ``m_i = round(L cos(pi/2 i/N))``, zero-count
steps dropped; L = 1024, N = 64 gives 63 steps), constant CFG applied only above 1 against the null text (the
video encoder on the null rows), and the flow head: ``T`` steps of :mod:`margrpo_jax.diffusion.flow` with
``v = v_u + w (v_c - v_u)`` and no temperature. ``noise_level = 0`` is NOVA's Euler ODE; 0.7 is the Flow-GRPO SDE
of the RL rollouts. Records (``xs`` = ``x_0 = noise, ..., x_T``) are the MAR sampler's :class:`Record`, and the
RL rollouts get its mesh shardings, order groups and group-shared noise.

How to use:
    fn = make_sample_fn(graphdef, NovaSamplerConfig(num_steps=64, diffusion_steps=25, cfg_scale=5.0))
    tokens, record = fn(params, ids, jax.random.key(0))       # ids: NOVA.prompt_ids(model_cfg, prompts)
    images = NOVA.decode_images(model_cfg, np.asarray(tokens))
"""
from __future__ import annotations

import dataclasses

from margrpo_jax.diffusion import flow
from margrpo_jax.sampling import sampler as sampler_lib
from margrpo_jax.sampling.sampler import Record


@dataclasses.dataclass(frozen=True)
class NovaSamplerConfig:
  num_steps: int = 64          # AR steps N (before dropping zero-count steps)
  diffusion_steps: int = 25    # flow steps T
  cfg_scale: float = 5.0       # w, constant
  noise_level: float = 0.0     # 0: Euler ODE (NOVA); 0.7: Flow-GRPO SDE (rollouts)
  shift: float = 1.0           # scheduler shift of the sigmas


def sampler_config(sampling, noise_level: float | None = None) -> NovaSamplerConfig:
  """From a config's ``sampling`` block (``configs/nova.py``); ``noise_level`` overrides its
  ``flow_noise_level`` (the RL rollouts' ``rl.flow_noise_level``)."""
  return NovaSamplerConfig(num_steps=sampling.num_steps, diffusion_steps=int(sampling.diffusion_steps),
                           cfg_scale=sampling.cfg_scale,
                           noise_level=sampling.get("flow_noise_level", 0.0) if noise_level is None else noise_level,
                           shift=sampling.get("flow_shift", 1.0))


def shared_config(cfg: NovaSamplerConfig, **overrides) -> sampler_lib.SamplerConfig:
  """The :class:`sampler.SamplerConfig` of NOVA's loop (``overrides``: e.g. the RL order groups)."""
  return sampler_lib.SamplerConfig(num_steps=cfg.num_steps, cfg_scale=cfg.cfg_scale, cfg_schedule="constant",
                                   temperature=1.0, guidance=cfg.cfg_scale > 1.0, mask_schedule="cos_round",
                                   **overrides)


def flow_schedule(cfg: NovaSamplerConfig) -> flow.FlowSchedule:
  return flow.make_flow(cfg.diffusion_steps, cfg.noise_level, cfg.shift)


def make_sample_fn(graphdef, cfg: NovaSamplerConfig, record: bool = False):
  """A cached jitted ``fn(state, ids, key) -> (tokens, record)`` (ids: Phi-2 token ids, -1 = padding)."""
  return sampler_lib.make_sample_fn(graphdef, flow_schedule(cfg), shared_config(cfg), record)


def score_step(model, cfg: NovaSamplerConfig, rec: Record, step: int, cond, null):
  """Recompute the log-probs (T, B, K) and stds (T, B, K, C) of the recorded flow transitions of AR step ``step``:
  ``z`` from the recorded canvas and mask, then every ``x_n -> x_{n+1}`` scored under the step's Gaussian."""
  return sampler_lib.score_step(model, flow_schedule(cfg), shared_config(cfg), rec, step, cond, null,
                                cfg.cfg_scale > 1.0)
