r"""``nft``: DiffusionNFT's negative-aware fine-tuning (arXiv 2509.16117) on MAR with the head frozen.

Each image gets an optimality probability ``r_i = 1/2 + 1/2 clip(A_i, -1, 1)``. With ``eps_old`` the prediction of
the old policy (``rl.anchor``: 'rollout' the policy that sampled the batch, 'ema' its EMA, 'ref' the base) and ``eps_theta`` the policy's at the same
draws (``forward.py``), the implicit positive and negative policies are
``eps_+ = (1 - s) eps_old + s eps_theta`` and ``eps_- = (1 + s) eps_old - s eps_theta`` (``s = rl.nft_strength``),
and the loss regresses both on the drawn noise:

    loss(theta) = 1/s mean_i [ r_i |eps_+ - eps|^2_i + (1 - r_i) |eps_- - eps|^2_i ]
    grad at theta = old:  2 mean_i clip(A_i) (eps_theta - eps) grad eps_theta                (= awm's policy term)

Each half is a convex regression whose minimiser is finite, ``eps* = eps_old + (2 r - 1) (eps - eps_old) / s``:
repeated steps on one batch (``rl.num_inner``) or a lagging old policy stay bounded, never loss ascent.
"""
from __future__ import annotations

import jax.numpy as jnp

from margrpo_jax.diffusion import gaussian
from margrpo_jax.rl.estimators import forward

NAME = "nft"
READS_CHAINS = False
REENCODES = True


def loss(ctx, params, block, d):
  """``(loss, metrics)`` of one optimizer step on ``block`` (ids, adv, tokens) at the draws ``d``."""
  fc = ctx.sc.forward
  s = fc.nft_strength
  eps = gaussian.split_output(forward.head_out(ctx.graphdef, ctx.params(params), block.ids, block.tokens, d))[0]
  eps_old = forward.eps_of(ctx.graphdef, ctx.params(ctx.anchors[fc.anchor]), block.ids, block.tokens, d)
  r = (0.5 + 0.5 * jnp.clip(block.adv, -1.0, 1.0))[None, :, None]
  pos = jnp.mean(((1.0 - s) * eps_old + s * eps - d.noise) ** 2, -1)
  neg = jnp.mean(((1.0 + s) * eps_old - s * eps - d.noise) ** 2, -1)
  total = jnp.mean(forward.per_image(r * pos + (1.0 - r) * neg, d)) / s
  drift = jnp.mean(forward.per_image(0.5 * jnp.mean((eps - eps_old) ** 2, -1), d))
  return total, dict(policy=-total, kl=drift, mar_loss=jnp.mean(forward.per_image(jnp.mean((eps - d.noise) ** 2, -1),
                                                                                  d)))
