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


from margrpo_jax.rl.estimators import forward

NAME = "awm"
READS_CHAINS = False
REENCODES = True


def loss(ctx, params, block, d):
  """``(loss, metrics)`` of one optimizer step on ``block`` (ids, adv, tokens) at the draws ``d``
  (``forward.draw``)."""
  return forward.weighted_elbo(ctx, params, block, d, ctx.sc.forward.anchor)
