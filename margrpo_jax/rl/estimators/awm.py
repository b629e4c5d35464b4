r"""``awm``: advantage-weighted matching (AWM, arXiv 2509.25050) on MAR: the image ELBO of ``image_elbo`` weighted
by the signed advantages, clipped to ``[-1, 1]`` (``rl.adv_clip``), with an anchor that bounds the push-down half:

    loss(theta) = mean_i clip(A_i) l_i(theta) + beta mean_i 1/2 |eps_theta - eps_anchor|^2_i
    grad        = -mean_i clip(A_i) grad ELBO_i + beta mean_i (eps_theta - eps_anchor) grad eps_theta

(means over each image's masked tokens and levels; ``forward.py``). The anchor (``rl.anchor``) is the frozen
reference ('ref'), the policy's EMA ('ema', a moving trust region) or the policy that sampled the batch ('rollout',
a trust region for ``rl.num_inner > 1``); without it the negative half raises
the denoising loss of typical samples without limit. No recorded chain is read.
"""
from __future__ import annotations

import jax.numpy as jnp

from margrpo_jax.diffusion import gaussian
from margrpo_jax.rl.estimators import forward

NAME = "awm"
READS_CHAINS = False
REENCODES = True


def loss(ctx, params, block, key):
  fc = ctx.sc.forward
  d = forward.draw(fc.objective, ctx.train_diff, block.tokens, key)
  out = forward.head_out(ctx.graphdef, {**ctx.frozen, **params}, block.ids, block.tokens, d)
  l_i = forward.per_image(gaussian.training_loss(ctx.train_diff, out, block.tokens, d.x_t, d.t, d.noise), d)
  eps_a = forward.eps_of(ctx.graphdef, {**ctx.frozen, **ctx.anchors[fc.anchor]}, block.ids, block.tokens, d)
  kl = jnp.mean(forward.per_image(0.5 * jnp.mean((gaussian.split_output(out)[0] - eps_a) ** 2, -1), d))
  policy = -jnp.mean(block.adv * l_i)
  return -(policy - fc.beta * kl), dict(policy=policy, kl=kl, mar_loss=jnp.mean(l_i))
