r"""The likelihood estimators of the RL update, one module each, selected by ``rl.estimator``.

| name | an image's log-likelihood, as the update scores it | reads chains | scores |
|---|---|---|---|
| ``chain`` | its recorded diffusion transitions (the paper: MTE, top-k, consistency) | yes | sampled tokens |
| ``token_elbo`` | the head's denoising ELBO of each committed token under its AR step's latent (q-MTE) | yes | sampled tokens |
| ``image_elbo`` | MAR's training loss of the re-encoded image, advantage-weighted (RAFT when positive-only) | no | re-encoded |
| ``awm`` | the same with signed, clipped advantages and an anchor | no | re-encoded |
| ``nft`` | DiffusionNFT's implicit positive / negative regression | no | re-encoded |
| ``elbo_hinge`` | ``image_elbo`` on the better images, a hinge to the reference on the worse | no | re-encoded |

Each module states its gradient. ``READS_CHAINS``: the rollout records its chains (``sampling.sampler.Record``)
and the update builds its batch from them (``rl/batch.py``, the loss in ``rl/loss.py``); otherwise the rollout
runs without records and the module's ``loss(ctx, params, block, draws)`` is the objective of one optimizer step
at one draw of MAR's training randomness (``forward.draw``; ``rl/step.py: forward_update``). ``REENCODES``: the
update scores the tokenizer's re-encoding of the decoded images instead of the sampled tokens.
"""
from __future__ import annotations

from margrpo_jax.rl.estimators import awm, chain, elbo_hinge, image_elbo, nft, token_elbo

ESTIMATORS = {m.NAME: m for m in (chain, token_elbo, image_elbo, awm, nft, elbo_hinge)}
NAMES = tuple(ESTIMATORS)


def get(name: str):
  """The estimator module registered as ``name`` (``ValueError`` naming the choices otherwise)."""
  if name not in ESTIMATORS:
    raise ValueError(f"rl.estimator={name!r} is not one of {', '.join(NAMES)}")
  return ESTIMATORS[name]
