r"""What the forward-process estimators (``image_elbo``, ``awm``, ``nft``) share: MAR's training draws on the
scored images and the denoiser predictions of the policy, the rollout policy or an anchor at the same draws.

For images ``x_i`` (the tokenizer's re-encoding of the decoded images, ``(B, L, C)``) and their prompts, one draw
is, per image, a random order and mask ratio (``models/objective.py``), the condition dropped to the null one
with probability ``label_drop``, and per masked token ``m = diffusion_batch_mul`` noise levels ``t`` and noises
``eps``, ``x_t = sqrt(abar_t) x_0 + sqrt(1 - abar_t) eps``. The policy's prediction is
``eps_theta = head(x_t, t, z_theta)``, ``z_theta = backbone(x_masked, mask, c)``, with the head frozen, and

    l_i(theta) = mean over the masked tokens and levels of MSE(eps_theta, eps) + VLB      (MAR's training loss)

is, up to constants and level weights, ``-ELBO(x_i | c_i)``: its gradient is a low-variance estimate of
``-grad log p_theta(x_i | c_i)`` that needs no recorded chain (ESTIMATORS.md; docs/estimators.md).
"""
from __future__ import annotations

import dataclasses

import flax
import jax
import jax.numpy as jnp
from flax import nnx

from margrpo_jax import rng
from margrpo_jax.diffusion import gaussian
from margrpo_jax.models import objective
from margrpo_jax.parallel import sharding


@dataclasses.dataclass(frozen=True)
class ForwardConfig:
  """The forward-process estimators' settings (``config.rl``: ``mar_objective``, ``beta``, ``anchor``,
  ``nft_strength``)."""
  objective: objective.MaskedObjective = objective.MaskedObjective()  # the draws: mask ratio, levels, label drop
  beta: float = 0.0          # anchor weight (awm; image_elbo's optional pull to the reference)
  anchor: str = "ref"        # the model awm is held to / nft's old policy: 'ref' the frozen base | 'ema' the policy's
                             # EMA | 'rollout' the policy that sampled the batch
  nft_strength: float = 1.0  # DiffusionNFT's beta: eps_+- = eps_old +- beta (eps_theta - eps_old)
  rows: int = 0              # > 0: an update scores only the ``rows`` images of largest |A| (the others weigh 0 or
                             # little under ``positive_only``), each row's weight scaled by rows / B so the loss is the
                             # whole batch's sum less the dropped terms
  draws: int = 1             # independent draws (order, mask ratio, noise levels) per scored image, averaged: the
                             # ELBO's own noise, not the images', dominates one draw's gradient (docs/estimators.md)


ANCHORS = ("ref", "ema", "rollout")


@flax.struct.dataclass
class Draws:
  """One draw of MAR's training randomness for a block of images (module docstring)."""
  mask: jax.Array   # (B, L) bool, the masked (scored) tokens
  drop: jax.Array   # (B,) bool, the condition dropped to the null one
  t: jax.Array      # (m, B, L) int32 noise levels
  noise: jax.Array  # (m, B, L, C) eps
  x_t: jax.Array    # (m, B, L, C)

  def microbatch(self, c, n: int) -> "Draws":
    """The draws of microbatch ``c`` of ``n`` (``sharding.microbatch``): a microbatch scores its images at the
    draws the whole block would have."""
    cut = lambda x, ax: sharding.microbatch(x, c, n, ax)
    return Draws(mask=cut(self.mask, 0), drop=cut(self.drop, 0), t=cut(self.t, 1), noise=cut(self.noise, 1),
                 x_t=cut(self.x_t, 1))


def draw(obj: objective.MaskedObjective, diff: gaussian.Diffusion, tokens: jax.Array, key: jax.Array) -> Draws:
  b, seq_len, _ = tokens.shape
  m = obj.diffusion_batch_mul
  t = jax.random.randint(rng.stream(key, "timestep"), (m, b, seq_len), 0, diff.num_steps)
  noise = jax.random.normal(rng.stream(key, "noise"), (m,) + tokens.shape)
  return Draws(mask=objective.sample_mask(obj, b, seq_len, key),
               drop=jax.random.bernoulli(rng.stream(key, "label_drop"), obj.label_drop, (b,)), t=t, noise=noise,
               x_t=gaussian.q_sample(diff, tokens, t, noise))


def head_out(graphdef, params, ids, tokens, d: Draws) -> jax.Array:
  """The head's output ``[eps | v]`` (m, B, L, 2C) at the draws, under the model ``params``."""
  model = nnx.merge(graphdef, params)
  b = tokens.shape[0]
  cond = jnp.where(d.drop[:, None, None], model.null_condition(b), model.condition(ids))
  z = model.backbone(tokens, d.mask, cond)
  return model.head(d.x_t, d.t, jnp.broadcast_to(z, (d.t.shape[0],) + z.shape))


def eps_of(graphdef, params, ids, tokens, d: Draws) -> jax.Array:
  """``stop_gradient(eps)`` (m, B, L, C) of ``params`` at the draws (the rollout policy's or an anchor's)."""
  return jax.lax.stop_gradient(gaussian.split_output(head_out(graphdef, params, ids, tokens, d))[0])


def per_image(values: jax.Array, d: Draws) -> jax.Array:
  """(m, B, L) per-token values -> (B,) means over each image's masked tokens and levels."""
  return objective.per_image(values, d.mask)


def weighted_elbo(ctx, params, block, d: Draws, anchor: str | None):
  """``(loss, metrics)``: ``mean_i A_i l_i + beta mean_i 1/2 |eps_theta - eps_anchor|^2_i`` on ``block`` at the
  draws ``d`` (the anchor term only when ``anchor`` names one of ``ctx.anchors``)."""
  fc = ctx.sc.forward
  out = head_out(ctx.graphdef, ctx.params(params), block.ids, block.tokens, d)
  l_i = per_image(gaussian.training_loss(ctx.train_diff, out, block.tokens, d.x_t, d.t, d.noise), d)
  policy = -jnp.mean(block.adv * l_i)
  kl = jnp.zeros(())
  if anchor is not None:
    eps_a = eps_of(ctx.graphdef, ctx.params(ctx.anchors[anchor]), block.ids, block.tokens, d)
    kl = jnp.mean(per_image(0.5 * jnp.mean((gaussian.split_output(out)[0] - eps_a) ** 2, -1), d))
  return -(policy - fc.beta * kl), dict(policy=policy, kl=kl, mar_loss=jnp.mean(l_i))
