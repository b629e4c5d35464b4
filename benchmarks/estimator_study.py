r"""Which likelihood estimator learns the shapes world: every cell at the same rollout budget, several training
seeds, shuffled-advantage controls, each export measured over several sampling seeds.

    python benchmarks/estimator_study.py [--cells=image_elbo,chain_paper,...] [--seeds=0,1,2] [--controls]
        [--split=val|eval|grammar] [--sample_seeds=0,1,2] [--extra | --readings=cfg7,...] [--workdir=runs/study]
        [--record=benchmarks/results]
    python benchmarks/estimator_study.py --summarize [--doc=docs/estimators.md]

Each (cell, training seed[, control]) is an ordinary RL run of ``configs/shapes_rl.py`` (the cell's variant plus
its overrides, ``rl.shuffle_advantages`` for the control) in ``W/<cell>/seed<n>[_shuffled]``, with
``rl.prompts_per_iter x rl.group_size x num_iters`` = :data:`BUDGET` rollout images for every cell. The run is
the RL job itself, so a killed study resumes where it stopped (rerun the same command); a finished measurement is
a line of ``R/results.jsonl`` and is never repeated (``R``, the record, is ``benchmarks/results`` in the repository:
the measurements are committed as they come; the runs themselves stay in ``W``). Measured per run and split, for the EMA export and the raw
last iterate, on every sampling seed: strict pass overall and per task, partial score (``metrics.py``), diversity
(mean pairwise latent distance of 8 images of each of 32 prompts of the split), drift from the base, the training
wall time and images per second. ``--extra`` adds, on the split, 16 AR steps and CFG 2 (the EMA export);
``--readings`` any of :data:`READINGS` (another guidance scale or number of AR steps).
The base is measured once per split and sampling setting (``R/base.jsonl``); gains are paired by sampling seed.

Splits: ``val`` (held out by text from train and eval: every choice of settings is read there), ``eval`` (the
final table), ``grammar`` (400 prompts drawn uniformly from the whole grammar, 100 per task, as an outside check
would draw them, ``shapes.grammar_sample(100, 2026)``).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402

from margrpo_jax import checkpoint, config_files, fileio, metrics  # noqa: E402
from margrpo_jax.data import shapes  # noqa: E402
from margrpo_jax.jobs import rl as rl_job  # noqa: E402
from margrpo_jax.rl import config as rl_config  # noqa: E402

BUDGET = 12_800  # rollout images per run (the main job's 200 iterations x 64 images)


@dataclasses.dataclass(frozen=True)
class Cell:
  variant: str           # configs/shapes_rl.py variant
  overrides: tuple = ()  # (key, value) pairs on top of it
  note: str = ""
  batch: tuple = (8, 8)  # (prompts, images per prompt) per iteration; the budget fixes the number of iterations


OFFICIAL = (("rl.fidelity", "official"), ("rl.official_except", "diffusion_window"))  # + only the window fix
PPO4 = (("rl.num_inner", 2), ("rl.num_minibatches", 2))  # 2 passes x 2 minibatches: 4 optimizer steps per rollout
CELLS = {
    # a. the paper's ladder under fidelity=official (only the diffusion-window fix), matched budget
    "grpo_official": Cell("grpo", OFFICIAL,
                          "vanilla GRPO: head trained, one chain"),
    "frozen_head_official": Cell("frozen_head", OFFICIAL,
                                 "+ frozen diffusion head"),
    "mte_official": Cell("frozen_head_mte", OFFICIAL,
                         "+ MTE on every token"),
    "mte_topk_official": Cell("frozen_head_mte_topk", OFFICIAL, "+ MTE on the top 30 %"),
    "paper": Cell("paper", (), "MAR-GRPO, every stabiliser, official (+ window fix)"),
    # b. chain on the decoded tokens, every AR step, every window step
    "chain_decoded_b01": Cell("focused", (("rl.beta", 0.01),), "chain, decoded tokens, KL 0.01"),
    "chain_decoded_b04": Cell("focused", (("rl.beta", 0.04),), "chain, decoded tokens, KL 0.04"),
    "chain_decoded_b04_lr1e4": Cell("focused", (("rl.beta", 0.04), ("optim.lr", 1e-4)),
                                    "chain, decoded tokens, KL 0.04, lr 1e-4"),
    "chain_decoded_b04_lr1e5": Cell("focused", (("rl.beta", 0.04), ("optim.lr", 1e-5)),
                                    "chain, decoded tokens, KL 0.04, lr 1e-5"),
    # c. positive-only chain; a trust region that acts
    "chain_positive": Cell("focused", (("rl.positive_only", True),), "chain, decoded tokens, A >= 0"),
    "chain_ppo": Cell("focused", PPO4, "chain, decoded tokens, 4 PPO steps per rollout"),
    "chain_ppo_clip05": Cell("focused", PPO4 + (("rl.clip_eps", 0.05),),
                             "chain, decoded tokens, 4 PPO steps per rollout, ratio clipped to [0.95, 1.05]"),
    # d. token ELBO with q-MTE
    "token_elbo": Cell("token_elbo", (), "token ELBO, q-MTE, both signs"),
    "token_elbo_positive": Cell("token_elbo", (("rl.positive_only", True),), "token ELBO, q-MTE, A >= 0"),
    # e. forward-process estimators on the re-encoded image
    "image_elbo": Cell("image_elbo", (), "image ELBO, A >= 0 (RAFT / RWR)"),
    "awm": Cell("awm", (), "AWM: signed clipped advantages, anchor"),
    "nft": Cell("nft", (), "DiffusionNFT"),
    "nft_lr1e5": Cell("nft", (("optim.lr", 1e-5),), "DiffusionNFT at a tenth of the learning rate"),
    # f. no label drop in the ELBO estimators (no gradient into the unconditional branch)
    "image_elbo_label_drop": Cell("image_elbo", (("rl.mar_objective.label_drop", 0.1),),
                                  "image ELBO with label drop 0.1 (the earlier main job)"),
    # g. main-job candidates (chosen on val; the long one with --budget=25600)
    "image_elbo_lr2e4": Cell("image_elbo", (("optim.lr", 2e-4),), "image ELBO, A >= 0, lr 2e-4"),
    "image_elbo_ptx": Cell("image_elbo", (("rl.pretrain_mix", 1.0),),
                           "image ELBO, A >= 0, + rendered train images at weight 1 (PPO-ptx)"),
    # the update alone: rollout weights clipped to 1e-6, so only the rendered train images move the policy (Adam's
    # travel at the matched number of steps on pretraining data; its shuffled control is the same run)
    "image_elbo_rendered": Cell("image_elbo", (("rl.pretrain_mix", 1.0), ("rl.adv_clip", 1e-6)),
                                "rendered train images only (rollout weights <= 1e-6): the update without a reward"),
    "image_elbo_rendered_lr3e5": Cell("image_elbo", (("rl.pretrain_mix", 1.0), ("rl.adv_clip", 1e-6),
                                                     ("optim.lr", 3e-5)),
                                      "rendered train images only, lr 3e-5 (the chain cells' rate)"),
    # h. the drift's mechanism and the rollouts' guidance scale (rl.rollout_cfg_scale; every export is read at
    #    CFG 3, the main job's rollouts too). Drawn with CFG 3 the images are not the conditional model's own
    #    samples, so training the conditional on them might distil the guidance into it; drawn without guidance
    #    they are its own and the expected self-training gradient is ~0. The converse: cleaner rollouts (more
    #    guidance) drift less. (The runs of these cells were recorded with sampling.cfg_scale set instead: the same
    #    rollouts, the job's own 16-prompt check read at that scale.)
    "image_elbo_cfg1": Cell("image_elbo", (("rl.rollout_cfg_scale", 1.0),),
                            "image ELBO, A >= 0, rollouts without guidance (the conditional's own samples)"),
    "image_elbo_cfg5": Cell("image_elbo", (("rl.rollout_cfg_scale", 5.0),),
                            "image ELBO, A >= 0, rollouts at CFG 5"),
    "image_elbo_cfg7": Cell("image_elbo", (("rl.rollout_cfg_scale", 7.0),),
                            "image ELBO, A >= 0, rollouts at CFG 7"),
    # i. the batch: in a noise-dominated gradient (grad-SNR above) each Adam step travels about lr whatever its
    #    signal, so the drift grows with the number of steps and the signal with the images behind each step.
    #    Twice the prompts per step at the same number of steps (--budget=25600) or at half of them (12,800).
    "image_elbo_p16": Cell("image_elbo", (), "image ELBO, A >= 0, 16 prompts x 8 images per step", (16, 8)),
    "image_elbo_g16": Cell("image_elbo", (), "image ELBO, A >= 0, 8 prompts x 16 images per step", (8, 16)),
    # j. diversity: the filter keeps each group's modes (diversity 0.75x at 16 x 8). Against it, keeping the
    #    positive-only policy term: an anchor to the base on the images trained on (awm's squared-eps term), or a
    #    reward for how much each image differs from the others of its prompt (rl.diversity_bonus)
    "image_elbo_p16_anchor": Cell("awm", (("rl.positive_only", True), ("rl.adv_clip", 0.0), ("rl.beta", 1.0)),
                                  "image ELBO, A >= 0, 16 x 8, squared-eps anchor to the base at beta 1", (16, 8)),
    "image_elbo_p16_div": Cell("image_elbo", (("rl.diversity_bonus", 0.5),),
                               "image ELBO, A >= 0, 16 x 8, + distinctness bonus 0.5 in the reward", (16, 8)),
    # k. the ELBO's own noise: one draw of MAR's training randomness per image gives a gradient whose cosine with
    #    another draw on the same images is 0.08 (128 images, base policy), so the draws, not the images, dominate
    #    each step. Scoring only the 64 images of largest weight (positive-only weights leave about half at 0) with 2
    #    or 4 independent draws each: the same or twice the update cost, 2-4x less draw noise per step.
    "image_elbo_p16_r64d2": Cell("image_elbo", (("rl.elbo_rows", 64), ("rl.elbo_draws", 2)),
                                 "image ELBO, A >= 0, 16 x 8, the 64 heaviest images x 2 draws", (16, 8)),
    "image_elbo_p16_r64d4": Cell("image_elbo", (("rl.elbo_rows", 64), ("rl.elbo_draws", 4)),
                                 "image ELBO, A >= 0, 16 x 8, the 64 heaviest images x 4 draws", (16, 8)),
    # l. the self-training loop: on-policy, each round filters the policy's own images, so its idiosyncrasies
    #    compound (the controls' drift, the diversity lost). Rollouts from the frozen base instead fit the base's
    #    passing images (rejection-sampling fine-tuning): the target p_base(x | c, pass) keeps the base's variety.
    #    And more prompts per step at the same images: 32 prompts x 4.
    "image_elbo_p16_base": Cell("image_elbo", (("rl.rollout_policy", "base"),),
                                "image ELBO, A >= 0, 16 x 8, rollouts from the frozen base", (16, 8)),
    "image_elbo_p32g4": Cell("image_elbo", (), "image ELBO, A >= 0, 32 prompts x 4 images per step", (32, 4)),
    "image_elbo_p16_ld": Cell("image_elbo", (("rl.mar_objective.label_drop", 0.1),),
                              "image ELBO, A >= 0, 16 x 8, label drop 0.1 (the unconditional branch trained too)",
                              (16, 8)),
    # m. exploration against the self-consuming loop: rollouts at a higher diffusion temperature spread the images
    #    the filter keeps (every export is still read at temperature 1)
    "image_elbo_p16_t125": Cell("image_elbo", (("rl.rollout_temperature", 1.25),),
                                "image ELBO, A >= 0, 16 x 8, rollouts at temperature 1.25", (16, 8)),
    "image_elbo_p16_anchor01": Cell("awm", (("rl.positive_only", True), ("rl.adv_clip", 0.0), ("rl.beta", 0.1)),
                                    "image ELBO, A >= 0, 16 x 8, squared-eps anchor to the base at beta 0.1",
                                    (16, 8)),
    # n. dynamic sampling (DAPO): the filter trains only on mixed groups (an all-pass or all-fail group has zero
    #    advantages), so more of them per step is more prompts per step, the one lever that moved the frontier.
    #    24 prompts drawn per rollout, the 16 whose rewards vary most trained on (38,400 rollout images at 25,600)
    "image_elbo_p16_dyn24": Cell("image_elbo", (("rl.rollout_prompts", 24),),
                                 "image ELBO, A >= 0, 16 x 8 of 24 x 8 drawn (the most mixed groups)", (16, 8)),
    # o. the drift the positive-only filter cannot cancel: the worse images pushed down only while the policy finds
    #    them likelier than the base does (a hinge at the reference: bounded, unlike signed weights)
    "image_elbo_p16_hinge": Cell("image_elbo", (("rl.estimator", "elbo_hinge"), ("rl.positive_only", False)),
                                 "image ELBO on A > 0, a hinge to the base on A < 0, 16 x 8", (16, 8)),
    # p. more prompts per step again (16 -> 32, the lever that moved the frontier from 8 -> 16), each update scoring
    #    only the 128 images of largest weight (positive-only weights leave about half at 0): the main job's update
    #    cost, twice its rollouts (51,200 images, about 13 minutes of training alone)
    "image_elbo_p32_r128": Cell("image_elbo", (("rl.elbo_rows", 128),),
                                "image ELBO, A >= 0, 32 prompts x 8 per step, the 128 heaviest images scored", (32, 8)),
    # q. where the diversity goes: the spread of a first object's centroid over a prompt's images falls from 5.4 to
    #    2.0 pixels (two-object prompts; single-object 5.8 -> 2.9) while the objects' areas keep theirs: the filter
    #    and the self-training loop fix the layout. Each trained-on image rolled to a random place that keeps all of
    #    it in the frame (the reward unchanged, rl/augment.py) before it is re-encoded
    "image_elbo_p16_shift": Cell("image_elbo", (("rl.augment", "shift"),),
                                 "image ELBO, A >= 0, 16 x 8, images shifted at random before re-encoding", (16, 8)),
    # r. sharpening without memorising lone winners: grpo's weights give a group's only passing image sqrt(7) = 2.65
    #    times the weight of each image of a half-passing group, so each step fits a few drawn variants hard;
    #    RAFT's uniform weights (rl.advantage='sign' with A >= 0) fit every passing image alike
    "image_elbo_p16_sign": Cell("image_elbo", (("rl.advantage", "sign"),),
                                "image ELBO, 16 x 8, uniform weights on the better images (RAFT)", (16, 8)),
    # s. a diversity budget instead of a fixed length: each seed trains until its rollouts' latent spread (mean of 10
    #    iterations) falls below f times its first 10 iterations' (rl.diversity_floor), at most 200 iterations, so a
    #    seed that keeps its variety longer trains longer (at 150 iterations seeds 0, 1, 2 keep 0.86, 0.79, 0.80 of
    #    the base's diversity on val). With the same keys each run is the prefix of its image_elbo_p32_r128 run.
    **{f"image_elbo_p32_floor{f:g}": Cell("image_elbo", (("rl.elbo_rows", 128), ("rl.diversity_floor", f)),
                                          f"image ELBO, A >= 0, 32 x 8, 128 scored, until the rollouts' spread < {f:g}"
                                          " of its start", (32, 8)) for f in (0.78, 0.8)},
}


def run_config(name: str, seed: int, control: bool, workdir: str, budget: int = BUDGET, save_every: int = 25):
  cell = CELLS[name]
  c = config_files.load("shapes_rl", cell.variant)
  for k, v in cell.overrides:
    config_files.override(c, f"{k}={v}")
  # the matched protocol: strict pass as the reward, the cell's batch (64 images), BUDGET images, an EMA export
  c.rl.rewards.update(shapes_partial=0.0, shapes_strict=1.0)
  c.rl.update(prompts_per_iter=cell.batch[0], group_size=cell.batch[1], ema_decay=c.rl.ema_decay or 0.95)
  c.num_iters = budget // (c.rl.group_size * c.rl.prompts_per_iter)
  c.save.update(every=save_every, keep=c.num_iters // save_every + 1)  # every checkpoint kept (for --at_iters)
  c.seed = seed
  c.rl.export_interpolation = 1.0  # the study reads the trained policy itself (--interpolate adds WiSE readings)
  c.rl.shuffle_advantages = control
  c.eval.update(num_prompts=16, batch_size=16)  # the job's own before / after check; the study measures below
  c.tfds_dir = os.path.join(workdir, "tfds")
  rl_config.resolve_fidelity(c)
  return c


def records(split: str) -> list[dict]:
  return shapes.grammar_sample(100, 2026) if split == "grammar" else shapes.split_records(split)


READINGS = {"ar16": ("num_steps", 16), "cfg2": ("cfg_scale", 2.0), "cfg5": ("cfg_scale", 5.0),
            "cfg7": ("cfg_scale", 7.0)}  # extra readings of every export (and the base): one sampling key changed


def sampling_variants(readings: list[str]):
  """``{'default': shapes_sample's sampling, reading: that sampling with one key changed}``."""
  out = {"default": config_files.load("shapes_sample").sampling}
  for name in readings:
    out[name] = config_files.load("shapes_sample").sampling
    key, value = READINGS[name]
    out[name][key] = value
  return out


def measure(graphdef, params, model_cfg, split: str, sampling, seeds) -> dict:
  recs = records(split)
  distinct = {t: list(dict.fromkeys(r["prompt"] for r in recs if r["tag"] == t))[:8] for t in shapes.TASKS}
  prompts = [p for t in shapes.TASKS for p in distinct[t]]
  out = dict(rates=[], diversity=[])
  for seed in seeds:
    out["rates"].append(metrics.rates(metrics.sample_and_verify(graphdef, params, model_cfg, recs, sampling, seed)))
    out["diversity"].append(metrics.diversity(graphdef, params, model_cfg, prompts, 8, sampling, seed))
  return out


def read_jsonl(path):
  return fileio.read_jsonl(path) if fileio.exists(path) else []


def append(path, rec):
  with open(path, "a") as f:
    f.write(json.dumps(rec) + "\n")


def base_measure(record, split, which, sampling, seeds):
  path = os.path.join(record, "base.jsonl")
  for r in read_jsonl(path):
    if r["split"] == split and r["sampling"] == which and r["seeds"] == list(seeds):
      return r
  model_cfg, graphdef, params = checkpoint.load_model(checkpoint.resolve("shapes_base"))
  r = dict(split=split, sampling=which, seeds=list(seeds), **measure(graphdef, params, model_cfg, split, sampling,
                                                                    seeds))
  append(path, r)
  return r


def wise_name(cell: str, alpha: float) -> str:
  return f"{cell}_wise{alpha:g}"


def study(args):
  alphas = [float(a) for a in args.interpolate.split(",") if a.strip()]
  os.makedirs(args.workdir, exist_ok=True)
  os.makedirs(args.record, exist_ok=True)
  results = os.path.join(args.record, "results.jsonl")
  seeds = [int(s) for s in args.seeds.split(",")]
  sample_seeds = [int(s) for s in args.sample_seeds.split(",")]
  readings = ["ar16", "cfg2"] if args.extra else [r.strip() for r in args.readings.split(",") if r.strip()]
  if any(r not in READINGS for r in readings):
    sys.exit(f"error: --readings={args.readings!r}: each one of {', '.join(READINGS)}")
  variants = sampling_variants(readings)
  cells = [c.strip() for c in args.cells.split(",") if c.strip()] if args.cells else list(CELLS)
  unknown = [c for c in cells if c not in CELLS]
  if unknown:
    sys.exit(f"error: unknown cell {unknown[0]!r} (cells: {', '.join(CELLS)})")
  arms = (True,) if args.controls_only else (False, True) if args.controls else (False,)
  runs = [(c, s, ctl) for c in cells for s in seeds for ctl in arms]
  for which, sampling in variants.items():
    base_measure(args.record, args.split, which, sampling, sample_seeds)
  for i, (name, seed, control) in enumerate(runs):
    images = args.at_iters * np.prod(CELLS[name].batch) if args.at_iters else args.budget
    tag = dict(cell=name, seed=seed, control=control, split=args.split, seeds=sample_seeds, images=int(images))
    done = {r["sampling"] for r in read_jsonl(results) if all(r.get(k) == v for k, v in tag.items())}
    wise = [a for a in alphas if not any(all(r.get(k) == v for k, v in dict(tag, cell=wise_name(name, a)).items())
                                         for r in read_jsonl(results))]
    if set(variants) <= done and not wise:
      continue
    wd = os.path.join(args.workdir, name, f"seed{seed}" + ("_shuffled" if control else "") +
                      ("" if args.budget == BUDGET else f"_{args.budget}img"))
    config = run_config(name, seed, control, args.workdir, args.budget, args.save_every)
    if args.at_iters and (config.optim.decay != "constant" or args.at_iters % config.save.every
                          or args.at_iters > config.num_iters):
      sys.exit(f"error: --at_iters={args.at_iters} reads a checkpoint of a constant-lr run: a multiple of "
               f"save.every={config.save.every} (--save_every), at most {config.num_iters} "
               f"(optim.decay={config.optim.decay!r})")
    print(f"[{i + 1}/{len(runs)}] {name} seed {seed}{' (shuffled control)' if control else ''}: {wd}", flush=True)
    t0 = time.time()
    rl_job.run(config, wd)
    s = rl_job.setup(config)
    mngr = checkpoint.manager(os.path.join(wd, "checkpoints"))
    if args.at_iters:  # the run's train state after at_iters iterations: a run of that length (constant lr, same keys)
      state = mngr.restore(args.at_iters, args=ocp.args.StandardRestore(checkpoint.abstract_like(s.init_state())))
    else:
      _, state = checkpoint.restore_latest(mngr, s.init_state())
    hist = fileio.read_jsonl(os.path.join(wd, "metrics.jsonl"))[:args.at_iters or None]
    train_s = float(sum(h["step_seconds"] for h in hist))
    common = dict(tag, iterations=len(hist), stopped_early=len(hist) < config.num_iters, train_seconds=train_s,
                  images_per_s=images / max(train_s, 1e-9),
                  drift=metrics.drift(s.trained_policy(state), s.base_policy), note=CELLS[name].note,
                  rollout_strict_last20=float(np.mean([h["strict_pass"] for h in hist[-20:]])))
    for which, sampling in variants.items():
      if which in done:
        continue
      rec = dict(common, sampling=which, ema=measure(s.graphdef, s.trained_params(state), s.model_cfg, args.split,
                                                     sampling, sample_seeds))
      if which == "default" and s.static.ema_decay:
        rec["raw"] = measure(s.graphdef, s.model_params(state["policy"]), s.model_cfg, args.split, sampling,
                             sample_seeds)
      append(results, rec)
    for a in wise:  # the export moved a fraction of the way from the base (WiSE-FT): theta_0 + a (theta - theta_0)
      mixed = jax.tree.map(lambda t, b, a=a: b + a * (t - b), s.trained_policy(state), s.base_policy)
      append(results, dict(common, cell=wise_name(name, a), sampling="default", note=f"{CELLS[name].note}; "
                           f"export theta_0 + {a} (theta - theta_0)", drift=metrics.drift(mixed, s.base_policy),
                           ema=measure(s.graphdef, {**s.frozen, **mixed}, s.model_cfg, args.split,
                                       variants["default"], sample_seeds)))
    print(f"    measured in {(time.time() - t0) / 60:.1f} min", flush=True)


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--cells", default="")
  ap.add_argument("--seeds", default="0,1,2")
  ap.add_argument("--controls", action="store_true", help="also run each cell with shuffled advantages")
  ap.add_argument("--controls_only", action="store_true", help="only the shuffled-advantage runs (beside another "
                  "process running the real ones)")
  ap.add_argument("--split", default="val", choices=("val", "eval", "grammar"))
  ap.add_argument("--sample_seeds", default="0,1,2")
  ap.add_argument("--extra", action="store_true", help="also 16 AR steps and CFG 2 on the split")
  ap.add_argument("--readings", default="", help=f"extra readings, comma-separated: {', '.join(READINGS)}")
  ap.add_argument("--workdir", default="runs/study")
  ap.add_argument("--record", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"),
                  help="folder of results.jsonl / base.jsonl / grad_snr.jsonl (committed with the study)")
  ap.add_argument("--budget", type=int, default=BUDGET, help="rollout images per run (a smaller one: a smoke run)")
  ap.add_argument("--at_iters", type=int, default=0, help="read each run at this iteration's checkpoint (a multiple "
                  "of save.every, 25), recorded as a run of at_iters x batch images: with a constant learning rate "
                  "the first iterations of a longer run are the shorter run")
  ap.add_argument("--save_every", type=int, default=25, help="checkpoint every N iterations, all kept (what "
                  "--at_iters can read; the runs are the same whatever N)")
  ap.add_argument("--interpolate", default="", help="also read each run's export moved only this fraction of the "
                  "way from the base (WiSE-FT weight interpolation), comma-separated, e.g. 0.5,0.75")
  ap.add_argument("--summarize", action="store_true")
  ap.add_argument("--doc", default="docs/estimators.md")
  args = ap.parse_args()
  if args.summarize:
    from estimator_summary import summarize  # noqa: PLC0415 (benchmarks/estimator_summary.py)
    summarize(args.record, args.doc)
  else:
    study(args)


if __name__ == "__main__":
  main()
