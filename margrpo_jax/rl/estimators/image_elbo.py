r"""``image_elbo``: the whole image's log-likelihood as MAR's own training ELBO of its re-encoding, weighted by
the advantages (RWR / RAFT / ReST-EM when ``rl.positive_only``: filtered fine-tuning on each group's better
images).

    loss(theta) = mean_i A_i l_i(theta) + beta mean_i kappa_i(theta)
    grad        = mean_i A_i grad l_i  ~  -mean_i A_i grad log p_theta(x_i | c_i)      (forward.py)

``kappa_i`` = ``1/2 mean (eps_theta - eps_ref)^2`` over the same draws: the denoisers' distance to the frozen
reference (0 with ``beta = 0``, the main job). No recorded chain is read; the rollout runs without records.
"""
from __future__ import annotations


from margrpo_jax.rl.estimators import forward

NAME = "image_elbo"
READS_CHAINS = False
REENCODES = True


def loss(ctx, params, block, d):
  """``(loss, metrics)`` of one optimizer step on ``block`` (ids, adv, tokens) at the draws ``d``
  (``forward.draw``)."""
  return forward.weighted_elbo(ctx, params, block, d, "ref" if ctx.sc.forward.beta else None)
