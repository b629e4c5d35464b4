r"""``elbo_hinge``: ``image_elbo``'s filter on each group's better images, and on its worse ones a hinge that keeps a
failing image from becoming likelier than it is under the reference (the base):

    loss(theta) = mean_i [ A_i^+ l_i(theta) + A_i^- max(0, l_i^ref - l_i(theta)) ]     A^+- = max(+-A, 0)
    grad        = mean_i A_i^+ grad l_i  -  mean_i A_i^- 1[l_i(theta) < l_i^ref] grad l_i

with ``l_i`` MAR's training loss (``-ELBO`` up to constants, ``forward.py``) and ``l_i^ref`` the reference's at the
same draws. Positive-only filtering cannot undo what self-training on its own images does to the failing ones
(the shuffled control loses 0.06-0.10 at the main job's budget); signed weights can, but push the denoising loss of
typical samples up without limit (``awm`` needs an anchor, ``nft`` collapses). The hinge acts only where the
policy has made a failing image likelier than the base did, and stops once it is back there.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from margrpo_jax.diffusion import gaussian
from margrpo_jax.rl.estimators import forward

NAME = "elbo_hinge"
READS_CHAINS = False
REENCODES = True


def loss(ctx, params, block, d):
  """``(loss, metrics)`` of one optimizer step on ``block`` (ids, adv, tokens) at the draws ``d``
  (``forward.draw``); ``hinge_active``: the share of the negative weight whose hinge is open; ``kl``: the mean of
  ``l^ref - l``, how much likelier the policy finds the images than the reference does."""
  image_loss = lambda out: forward.per_image(
      gaussian.training_loss(ctx.train_diff, out, block.tokens, d.x_t, d.t, d.noise), d)
  l_i = image_loss(forward.head_out(ctx.graphdef, ctx.params(params), block.ids, block.tokens, d))
  l_ref = jax.lax.stop_gradient(image_loss(forward.head_out(ctx.graphdef, ctx.params(ctx.anchors["ref"]), block.ids,
                                                            block.tokens, d)))
  pos, neg = jnp.maximum(block.adv, 0.0), jnp.maximum(-block.adv, 0.0)
  open_ = l_i < l_ref  # closed at the reference itself (no half-gradient at the tie, as jnp.maximum would give)
  total = jnp.mean(pos * l_i + neg * jnp.where(open_, l_ref - l_i, 0.0))
  active = jnp.sum(neg * open_) / jnp.maximum(jnp.sum(neg), 1e-30)
  return total, dict(policy=-total, kl=jnp.mean(l_ref - l_i), mar_loss=jnp.mean(l_i), hinge_active=active)
