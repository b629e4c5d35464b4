r"""Pretraining of the shapes-world MAR with MAR's masked objective (``config.mode = 'pretrain'``).

The loss is ``models/objective.py``'s (random order and mask ratio per image, CFG label drop, the diffusion loss
``MSE(eps) + VLB`` of the masked tokens at ``diffusion_batch_mul`` noise levels each), on fresh renders encoded
by the tokenizer. AdamW, warm-up + cosine, grad clipping, EMA.

Training survives being killed: data and randomness depend only on ``(seed, step)``, the full state
(params, EMA, optimizer) is checkpointed with Orbax, and rerunning the same command resumes.
"""
from __future__ import annotations

import concurrent.futures
import functools
import math
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from clu import metric_writers, periodic_actions
from flax import nnx

from margrpo_jax import checkpoint, config_files, fileio, generate, interrupt, optim, validate
from margrpo_jax.data import shapes, tfds_builders
from margrpo_jax.diffusion import gaussian
from margrpo_jax.models import families, objective, text, tiny
from margrpo_jax.parallel import hosts, mesh as mesh_lib, sharding


RANGES = dict(ema_decay=(0, 1, True, False))  # the job's own numbers (each block's: its owner's table)


def check(config) -> None:
  """The pretraining job's own keys (validate.py has checked the blocks and the model)."""
  config_files.check_ranges(config, RANGES, "")


def init_state(config, seed: int | None = None):
  """``(graphdef, tx, state)``: a fresh model, its optimizer and the train state ``{'step', 'params', 'ema',
  'opt'}`` (params as a pure dict; every component trainable, the schedule spanning ``config.num_steps``)."""
  graphdef, state = nnx.split(families.build(config.model, config.seed if seed is None else seed))
  params = nnx.to_pure_dict(state)
  tx = optim.make(config.optim, tuple(params), config.num_steps)
  return graphdef, tx, dict(step=jnp.int32(0), params=params, ema=jax.tree.map(jnp.copy, params),
                            opt=tx.init(params))


def state_shardings(mesh, tx, state: dict, rules) -> dict:
  """Shardings of the train state: params and EMA by ``rules``, optimizer state like its params."""
  p = sharding.param_shardings(mesh, state["params"], sharding.hashable_rules(rules))
  return dict(step=sharding.replicated(mesh), params=p, ema=p, opt=sharding.opt_shardings(mesh, tx, state["params"], p))


def make_step_fn(graphdef, tx, config, mesh=None, state=None):
  """The jitted, state-donating :func:`train_step` for ``config``; on a ``mesh``, with the explicit shardings
  of ``state`` (:func:`state_shardings`) and of the batch (split over the batch axes)."""
  diff = gaussian.make_diffusion(config.model.diffusion.num_train_steps)
  fn = functools.partial(train_step, graphdef, tx, diff, config)
  if mesh is None:
    return jax.jit(fn, donate_argnums=0)
  st = state_shardings(mesh, tx, state, config.parallel.rules)
  batch = dict(ids=sharding.batch_sharding(mesh, 2), tokens=sharding.batch_sharding(mesh, 3))
  return jax.jit(sharding.traced_on(fn, mesh), in_shardings=(st, batch), out_shardings=(st, sharding.replicated(mesh)),
                 donate_argnums=0)


def train_step(graphdef, tx, diff, config, state: dict, batch: dict):
  """One jitted update: ``state = {'step', 'params', 'ema', 'opt'}`` -> (new state, metrics)."""
  key = jax.random.fold_in(jax.random.key(config.seed), state["step"])
  obj = objective.MaskedObjective.from_config(config.mar)
  loss, grads = jax.value_and_grad(lambda p: objective.mar_loss(nnx.merge(graphdef, p), diff, obj, batch, key))(
      state["params"])
  updates, opt = tx.update(grads, state["opt"], state["params"])
  params = jax.tree.map(jnp.add, state["params"], updates)
  n = state["step"].astype(jnp.float32)
  decay = jnp.minimum(config.ema_decay, (1.0 + n) / (10.0 + n))  # EMA warm-up: early EMAs forget the init
  new = dict(step=state["step"] + 1, params=params, opt=opt, ema=optim.ema_update(state["ema"], params, decay))
  return new, dict(loss=loss, grad_norm=optim.global_norm(grads), param_norm=optim.global_norm(params))


def make_batch(records: list[dict], step: int, batch_size: int, seed: int, model_cfg, rows=slice(None)) -> dict:
  """The step's batch, a pure function of ``(seed, step)``: prompts from the train split, fresh layouts, rendered
  and turned into tokens (the tokenizer's latents, or raw patches). ``rows``: the rows to return (a process's
  share): the whole batch is drawn and rendered (one generator, in order; cheap), only ``rows`` are encoded."""
  r = np.random.default_rng([seed, step])
  mds = [records[i] for i in r.integers(len(records), size=batch_size)]
  images = shapes.render_batch(mds, r)[rows]
  return dict(ids=text.tokenize([m["prompt"] for m in mds[rows]], model_cfg.text.max_len),
              tokens=tiny.TinyMAR.encode_images(model_cfg, images))


def evaluate(graphdef, params, config, records: list[dict], num: int, mesh=None) -> tuple[dict, np.ndarray]:
  """Sample (on ``mesh`` when given) and verify ``num`` eval records (all of them, or tasks in turn over distinct
  prompts)."""
  recs = records if num >= len(records) else shapes.stratified_subset(records, num)
  images = generate.generate(graphdef, params, config.model, [r["prompt"] for r in recs], config.sampling,
                             seed=config.eval.seed, batch_size=config.eval.batch_size, mesh=mesh,
                             rules=config.parallel.rules if mesh is not None else ())
  return generate.score(images, recs), images


def run(config, workdir: str, max_steps_this_run: int | None = None) -> dict:
  """Train (or resume) in ``workdir``; returns the final state. ``max_steps_this_run`` simulates a kill."""
  tiny.check_tokenizer(config.model, "config.model")  # a tokenizer that does not fit the model: one sentence
  validate.begin_run(config, workdir)  # a rerun must be the same run
  writer = metric_writers.create_default_writer(workdir, just_logging=not hosts.is_main())
  data_dir = config.tfds_dir or os.path.join(workdir, "tfds")
  train_recs = [r["metadata"] for r in tfds_builders.load_split("shapes_world", "train", data_dir)]
  eval_recs = [r["metadata"] for r in tfds_builders.load_split("shapes_world", "eval", data_dir)]

  graphdef, tx, train_state = init_state(config)
  mesh = mesh_lib.make_mesh(config.parallel.mesh)
  train_state = jax.device_put(train_state, state_shardings(mesh, tx, train_state, config.parallel.rules))
  mngr = checkpoint.manager(os.path.join(workdir, "checkpoints"), keep=config.save.keep)
  restored, train_state = checkpoint.restore_latest(mngr, train_state)  # onto this run's mesh
  start = int(train_state["step"])
  if restored is not None:
    logging.info("resumed from %s at step %d", mngr.directory, start)
  step_fn = make_step_fn(graphdef, tx, config, mesh, train_state)
  end = config.num_steps if max_steps_this_run is None else min(config.num_steps, start + max_steps_this_run)
  batch_sh = dict(ids=sharding.batch_sharding(mesh, 2), tokens=sharding.batch_sharding(mesh, 3))

  def batch_fn(step):  # this host's rows of the step's batch, placed as a global array
    rows = make_batch(train_recs, step, config.batch_size, config.seed, config.model,
                      sharding.host_rows(config.batch_size))
    return sharding.to_global(rows, batch_sh)
  progress = periodic_actions.ReportProgress(num_train_steps=config.num_steps, writer=writer)
  t0, t_last, m_last = time.time(), time.time(), {}
  with concurrent.futures.ThreadPoolExecutor(1) as pool, metric_writers.ensure_flushes(writer), interrupt.polled():
    nxt = pool.submit(batch_fn, start) if start < end else None
    for step in range(start, end):
      batch = nxt.result()
      nxt = pool.submit(batch_fn, step + 1) if step + 1 < end else None
      train_state, metrics = step_fn(train_state, batch)
      done = step + 1
      progress(done)
      if done % config.log_every == 0 or done == end:
        m = {k: float(v) for k, v in jax.device_get(metrics).items()}
        if not math.isfinite(m["loss"]):
          checkpoint.wait(mngr)
          raise checkpoint.NonFiniteError(f"pretraining loss became {m['loss']} at step {done}; nothing of it was "
                                          f"saved (the newest checkpoint in {mngr.directory} is the last good one).")
        m["steps_per_sec"] = config.log_every / max(time.time() - t_last, 1e-9)
        m_last = m
        t_last = time.time()
        writer.write_scalars(done, m)
        logging.info("step %d/%d loss %.4f grad_norm %.3f (%.1f min)", done, config.num_steps, m["loss"],
                     m["grad_norm"], (time.time() - t0) / 60)
      stop = done % config.log_every == 0 and interrupt.requested()  # polled where the step syncs anyway
      if done % config.save.every == 0 or done == end or stop:
        checkpoint.save_state(mngr, done, train_state, f"the pretraining state at step {done}")
      if stop and done < end:
        checkpoint.wait(mngr)
        interrupt.stop(f"the pretraining state at step {done} is saved in {mngr.directory}")
      if config.eval.every and (done % config.eval.every == 0 or done == config.num_steps):
        num = ((config.eval.get("final_num_prompts") or len(eval_recs)) if done == config.num_steps
               else config.eval.num_prompts)
        res, images = evaluate(graphdef, train_state["ema"], config, eval_recs, num, mesh)
        writer.write_scalars(done, {"eval/strict_pass": res["strict_pass"], "eval/partial": res["partial"],
                                    **{f"eval/strict_{k}": v for k, v in res["per_task"].items()}})
        writer.write_images(done, {"eval/samples": generate.image_grid(images[:64], scale=2)[None]})
        logging.info("step %d eval on %d prompts: strict %.3f partial %.3f %s", done, num, res["strict_pass"],
                     res["partial"], res["per_task"])
        _append_history(workdir, dict(step=done, loss=m_last.get("loss"), num_prompts=num,
                                      strict_pass=res["strict_pass"], partial=res["partial"],
                                      per_task=res["per_task"]))
  checkpoint.wait(mngr)
  if end == config.num_steps:
    out = checkpoint.save_model(os.path.join(workdir, "export"), train_state["ema"], config.model)
    logging.info("exported EMA params to %s (%.1f min in total)", out, (time.time() - t0) / 60)
    _plot_history(workdir)
  return train_state


def _append_history(workdir: str, row: dict) -> None:
  """One eval row per line in ``W/eval_history.jsonl`` (a resumed run drops the rows past its restart)."""
  path = os.path.join(workdir, "eval_history.jsonl")
  fileio.write_jsonl(path, [r for r in fileio.read_jsonl(path) if r.get("step", 0) < row["step"]] + [row])


def _plot_history(workdir: str) -> None:
  """``W/eval_curves.png``: strict pass per task and overall vs step, from ``W/eval_history.jsonl``."""
  path = os.path.join(workdir, "eval_history.jsonl")
  if not fileio.exists(path):
    return
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  rows = fileio.read_jsonl(path)
  fig, ax = plt.subplots(figsize=(5.5, 3.4))
  steps = [r["step"] for r in rows]
  ax.plot(steps, [r["strict_pass"] for r in rows], "k-o", label="all tasks", lw=2)
  for t in shapes.TASKS:
    ax.plot(steps, [r["per_task"].get(t, np.nan) for r in rows], "--", label=t)
  ax.set(xlabel="pretraining step", ylabel="strict pass (EMA, eval split)", ylim=(0, 1))
  ax.legend(fontsize=7)
  fig.tight_layout()
  fileio.save_figure(os.path.join(workdir, "eval_curves.png"), fig)
  plt.close(fig)
