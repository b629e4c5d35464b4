r"""Training of the shapes-world tokenizer, a small KL autoencoder (``config.mode = 'tokenizer'``).

MAR models images as continuous latents of a KL autoencoder (KL-16); the shapes-world tokenizer is the same
network (:class:`margrpo_jax.models.vae.AutoencoderKL`, kind ``shapes``) at 32 x 32: a 4 x 4 grid of 8-channel
latents, 128 numbers per image instead of 3,072 pixels. Per batch of fresh renders ``x`` in [-1, 1]:

    (mu, log s^2) = E(x),  z = mu + s * eps,  x' = D(z)
    L = |x - x'|_1 + |x - x'|_2^2 + beta * KL(N(mu, s^2) || N(0, 1))   (each a per-element mean)

The posterior noise teaches the decoder to draw clean shapes from latents a little off the data, as the MAR
sampler produces. At the end the export's latent ``scale`` is set to ``1 / std(mu)`` (the LDM convention), so
the MAR sees unit-variance tokens, and ``W/tokenizer.json`` records the round-trip figures: strict pass of
the verifier on encoded-then-decoded eval renders and the fraction of pixels whose palette class survives.

Resumable like pretraining: data depend only on ``(seed, step)``; rerunning the same command resumes.
"""
from __future__ import annotations

import functools
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from clu import metric_writers, periodic_actions
from flax import nnx

from margrpo_jax import checkpoint, config_files, fileio, generate, interrupt, optim, rng, validate
from margrpo_jax.config_files import ConfigError
from margrpo_jax.data import shapes
from margrpo_jax.models import families, vae
from margrpo_jax.parallel import hosts
from margrpo_jax.rewards import shapes_verifier

TRAINABLE = ("encoder", "decoder", "quant_conv", "post_quant_conv")


def to_unit(images) -> jax.Array:
  """uint8 images -> float32 in [-1, 1]."""
  return jnp.asarray(images, jnp.float32) / 127.5 - 1.0


def ae_loss(model: vae.AutoencoderKL, images: jax.Array, key: jax.Array, beta: float):
  """``(loss, metrics)`` of the KL autoencoder on uint8 ``images`` (module docstring)."""
  x = to_unit(images)
  mean, logvar = model.posterior(x)
  z = mean + jnp.exp(0.5 * logvar) * jax.random.normal(rng.stream(key, "noise"), mean.shape)
  err = model.decode_unscaled(z) - x
  l1, l2 = jnp.mean(jnp.abs(err)), jnp.mean(jnp.square(err))
  kl = 0.5 * jnp.mean(jnp.square(mean) + jnp.exp(logvar) - 1.0 - logvar)
  return l1 + l2 + beta * kl, dict(l1=l1, l2=l2, kl=kl, latent_std=jnp.std(mean))


def train_step(graphdef, tx, config, state: dict, images: jax.Array):
  key = jax.random.fold_in(jax.random.key(config.seed), state["step"])
  (loss, m), grads = jax.value_and_grad(
      lambda p: ae_loss(nnx.merge(graphdef, p), images, key, config.beta), has_aux=True)(state["params"])
  updates, opt = tx.update(grads, state["opt"], state["params"])
  params = jax.tree.map(jnp.add, state["params"], updates)
  return dict(step=state["step"] + 1, params=params, opt=opt), dict(loss=loss, grad_norm=optim.global_norm(grads), **m)


RANGES = dict(beta=(0, float("inf"), True, False))  # the job's own numbers: the KL weight


def check(config) -> None:
  """The autoencoder config is a KL autoencoder that builds and runs its loss on one render (abstractly: shapes
  only, nothing computed); otherwise one sentence."""
  config_files.check_ranges(config, RANGES, "")
  if config.model.family != "vae":
    raise ConfigError(f"config.model.family={config.model.family!r} must be 'vae': the tokenizer job trains a KL "
                      "autoencoder")
  validate.check_model_values(config.model, "config.model")
  try:
    vae.check_config(config.model)
  except ValueError as e:
    raise ConfigError(str(e)) from None
  images = jax.ShapeDtypeStruct((1, shapes.IMAGE_SIZE, shapes.IMAGE_SIZE, 3), jnp.uint8)
  try:
    jax.eval_shape(lambda x: ae_loss(families.build(config.model), x, jax.random.key(0), config.beta), images)
  except Exception as e:  # noqa: BLE001 - any structure that cannot encode and decode a render
    raise ConfigError(f"config.model cannot encode and decode a {shapes.IMAGE_SIZE} x {shapes.IMAGE_SIZE} render "
                      f"({validate.first_line(e)})") from None


def make_batch(step: int, batch_size: int, seed: int) -> np.ndarray:
  """Fresh renders of train-split prompts, a pure function of ``(seed, step)``."""
  r = np.random.default_rng([seed, step, 7])
  pool = shapes.task_pools("train")
  return shapes.render_batch([shapes.sample_metadata(r, pool=pool) for _ in range(batch_size)], r)


def eval_renders(num: int, seed: int = 0) -> tuple[np.ndarray, list[dict]]:
  """``num`` eval-split renders, tasks in turn (fixed seed)."""
  r = np.random.default_rng([seed, 11])
  pool = shapes.task_pools("eval")
  mds = [shapes.sample_metadata(r, task=shapes.TASKS[i % len(shapes.TASKS)], pool=pool) for i in range(num)]
  return shapes.render_batch(mds, r), mds


def round_trip(graphdef, params, images: np.ndarray, batch_size: int = 256) -> np.ndarray:
  """Encode (posterior mode) then decode uint8 images."""
  fn = jax.jit(lambda p, x: nnx.merge(graphdef, p).decode(nnx.merge(graphdef, p).encode(to_unit(x))))
  return np.concatenate([vae.to_uint8(fn(params, images[i:i + batch_size]))
                         for i in range(0, len(images), batch_size)])


def round_trip_figures(graphdef, params, num: int) -> dict:
  """Verifier strict pass of the round trip vs the renders themselves, and palette-class pixel agreement."""
  images, mds = eval_renders(num)
  rec = round_trip(graphdef, params, images)
  same = shapes_verifier.classify_pixels(rec) == shapes_verifier.classify_pixels(images)
  return dict(strict_pass=generate.score(rec, mds)["strict_pass"], pixel_class_agreement=float(same.mean()),
              mean_abs_error=float(np.abs(rec.astype(np.float32) - images).mean()), num_images=num)


def latent_scale(graphdef, params, num: int = 1024) -> float:
  """``1 / std`` of the posterior means over ``num`` train renders (the scale that whitens the tokens)."""
  images = make_batch(2 ** 30, num, 0)  # a batch no training step draws
  mean = jax.jit(lambda p, x: nnx.merge(graphdef, p).posterior(to_unit(x))[0])(params, images)
  return float(1.0 / jnp.std(mean))


def run(config, workdir: str, max_steps_this_run: int | None = None) -> dict:
  """Train (or resume) in ``workdir``; export the autoencoder with its latent scale to ``W/export``.
  ``max_steps_this_run`` simulates a kill."""
  validate.begin_run(config, workdir)  # a rerun must be the same run
  writer = metric_writers.create_default_writer(workdir, just_logging=not hosts.is_main())
  graphdef, st = nnx.split(families.build(config.model, config.seed))
  params = nnx.to_pure_dict(st)
  tx = optim.make(config.optim, TRAINABLE, config.num_steps)
  state = dict(step=jnp.int32(0), params=params, opt=tx.init(params))
  mngr = checkpoint.manager(os.path.join(workdir, "checkpoints"), keep=config.save.keep)
  restored, state = checkpoint.restore_latest(mngr, state)
  start = int(state["step"])
  if restored is not None:
    logging.info("resumed from %s at step %d", mngr.directory, start)
  step_fn = jax.jit(functools.partial(train_step, graphdef, tx, config), donate_argnums=0)
  progress = periodic_actions.ReportProgress(num_train_steps=config.num_steps, writer=writer)
  end = config.num_steps if max_steps_this_run is None else min(config.num_steps, start + max_steps_this_run)
  t0 = time.time()
  with metric_writers.ensure_flushes(writer), interrupt.polled():  # SIGTERM / SIGINT: save at a logged step, exit
    for step in range(start, end):
      state, metrics = step_fn(state, jnp.asarray(make_batch(step, config.batch_size, config.seed)))
      done = step + 1
      progress(done)
      if done % config.log_every == 0 or done == config.num_steps:
        m = {k: float(v) for k, v in jax.device_get(metrics).items()}
        if not np.isfinite(m["loss"]):
          checkpoint.wait(mngr)
          raise checkpoint.NonFiniteError(f"tokenizer loss became {m['loss']} at step {done}; nothing of it was "
                                          f"saved (the newest checkpoint in {mngr.directory} is the last good one).")
        writer.write_scalars(done, m)
        logging.info("step %d/%d loss %.4f l1 %.4f kl %.3f latent std %.3f (%.1f min)", done, config.num_steps,
                     m["loss"], m["l1"], m["kl"], m["latent_std"], (time.time() - t0) / 60)
      stop = done % config.log_every == 0 and interrupt.requested()  # polled where the step syncs anyway
      if done % config.save.every == 0 or done == end or stop:
        checkpoint.save_state(mngr, done, state, f"the tokenizer state at step {done}")
      if stop and done < end:
        checkpoint.wait(mngr)
        interrupt.stop(f"the tokenizer state at step {done} is saved in {mngr.directory}")
      if config.eval.every and done % config.eval.every == 0 and done < config.num_steps:
        fig = round_trip_figures(graphdef, state["params"], config.eval.num_images)
        writer.write_scalars(done, {f"eval/{k}": v for k, v in fig.items()})
        logging.info("step %d round trip: %s", done, fig)
  checkpoint.wait(mngr)
  if end < config.num_steps:
    return state
  model_cfg = config.model.copy_and_resolve_references()
  model_cfg.scale = latent_scale(graphdef, state["params"])
  fig = round_trip_figures(graphdef, state["params"], 4 * config.eval.num_images)
  out = checkpoint.save_model(os.path.join(workdir, "export"), state["params"], model_cfg)
  fileio.write_json(os.path.join(workdir, "tokenizer.json"), dict(round_trip=fig, scale=model_cfg.scale,
                                                                  steps=config.num_steps), indent=2)
  logging.info("round trip on %d eval renders: %s; latent scale %.4f; exported to %s (%.1f min)",
               fig["num_images"], fig, model_cfg.scale, out, (time.time() - t0) / 60)
  return state
