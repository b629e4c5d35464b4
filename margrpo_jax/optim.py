"""Optimizers over a parameter dict whose frozen parts never enter the optimizer.

``make(cfg, params, trainable)``: AdamW with linear warm-up then constant or cosine decay, global-norm
clipping, weight decay only on matrices of trainable parts (MAR: no decay on biases, norms, the head),
wrapped in ``optax.masked`` so frozen leaves carry no optimizer moments and get no update.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import ml_collections
import optax

DECAYS = ("constant", "cosine")  # optim.decay: after the warm-up, lr held or cosine-decayed to final_lr_frac lr
# optim.<key> -> (low, high, low included, high included); validate.py checks the config against it
RANGES = dict(lr=(0, math.inf, False, False), b1=(0, 1, True, False), b2=(0, 1, True, False),
              eps=(0, math.inf, False, False), weight_decay=(0, math.inf, True, False),
              grad_clip=(0, math.inf, False, False), final_lr_frac=(0, 1, True, True),
              warmup_steps=(0, math.inf, True, False))


def lr_schedule(cfg: ml_collections.ConfigDict, total_steps: int) -> optax.Schedule:
  warm = optax.linear_schedule(0.0, cfg.lr, max(cfg.warmup_steps, 1))
  if cfg.decay == "constant":
    after = optax.constant_schedule(cfg.lr)
  elif cfg.decay == "cosine":
    after = optax.cosine_decay_schedule(cfg.lr, max(total_steps - cfg.warmup_steps, 1), alpha=cfg.final_lr_frac)
  else:
    raise ValueError(f"optim.decay={cfg.decay!r} is not one of {', '.join(DECAYS)}")
  return optax.join_schedules([warm, after], [cfg.warmup_steps])


def path_mask(params, predicate):
  """A pytree of bools over ``params`` from ``predicate(path_tuple, leaf)``."""
  return jax.tree_util.tree_map_with_path(
      lambda p, x: bool(predicate(tuple(getattr(k, "key", getattr(k, "idx", k)) for k in p), x)), params)


def make(cfg: ml_collections.ConfigDict, trainable: tuple[str, ...], total_steps: int):
  """Optimizer over the top-level components named in ``trainable`` (e.g. ('text_encoder', 'backbone')).

  The masks are functions of the parameter tree, so the optimizer can be built (and cached) before params.
  """
  train_mask = lambda params: path_mask(params, lambda p, x: p[0] in trainable)
  frozen_mask = lambda params: jax.tree.map(lambda m: not m, train_mask(params))
  decay_mask = lambda params: path_mask(params, lambda p, x: p[0] in trainable and p[0] != "head" and x.ndim >= 2
                                        and not p[-1].endswith("pos_embed_learned") and p[-1] != "pos_embed")
  inner = optax.chain(
      optax.clip_by_global_norm(cfg.grad_clip),
      optax.adamw(lr_schedule(cfg, total_steps), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay,
                  mask=decay_mask))
  return optax.chain(optax.masked(inner, train_mask), optax.masked(optax.set_to_zero(), frozen_mask))


def ema_update(ema, params, decay: float):
  return jax.tree.map(lambda e, p: decay * e + (1.0 - decay) * p, ema, params)


def global_norm(tree) -> jax.Array:
  leaves = jax.tree.leaves(tree)
  return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in leaves)) if leaves else jnp.zeros(())
