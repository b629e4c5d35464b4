"""Evaluate one or more checkpoints on a prompt set with rewards (``config.mode = 'eval'``).

    python -m margrpo_jax.main --config=configs/shapes_eval.py --workdir=W \\
        [--config.checkpoints=base,runs/rl/export]             # one column per checkpoint, same prompts and seeds
        [--config.dataset=geneval --config.manual_dir=DIR]     # or t2i_compbench (--config.split=color_val,...),
        [--config.prompt_file=prompts.jsonl]                   #    margrpo, jsonl, txt; or a file read directly
        [--config.per_category=8] [--config.images_per_prompt=4]
        [--config.rewards.imagereward.checkpoint=DIR --config.rewards.imagereward.vocab=vocab.txt]

Every checkpoint generates ``images_per_prompt`` images per prompt with :func:`generate.generate` (prompt-major
order, same seed and batch size, so the same noise for every checkpoint) and every image is scored by the
rewards of ``config.reward_names`` plus each learned reward whose checkpoint is set under ``config.rewards``.
The shapes-world verifier rewards are computed on the images whose prompt carries shapes-world metadata only.

Writes ``W/eval.json``::

    {"checkpoints": {label: path}, "prompts": {...source, num_prompts, images_per_prompt, seed},
     "results": {label: {"num_images": N,
                         "rewards": {reward: {"all" | category: {"mean", "std", "count"}}},
                         "geneval": {"per_task": {task: accuracy}, "overall": mean over tasks, "num_images"}}}}

(category = the record's tag: the task for shapes / GenEval, the file stem for T2I-CompBench; std is the
population std over images; ``geneval`` = GenEval-style strict accuracy, present when shapes prompts were scored),
``W/eval.md`` (the same as tables, one column per checkpoint) and ``W/grid_<label>.png`` (the first
``grid_size`` images, captioned with their prompt and rewards).
"""
from __future__ import annotations

import os

import numpy as np
from absl import logging

from margrpo_jax import checkpoint, fileio, generate, visualize
from margrpo_jax.data import prompt_files, shapes, tfds_builders
from margrpo_jax.rewards import registry


class EvalError(FileNotFoundError):
  """A bad eval setting (no prompts, unknown reward), reported by main.py as one sentence."""


def load_records(config, workdir: str) -> tuple[list[dict], str]:
  """``([{'prompt', 'category', 'metadata', 'shapes' (shapes metadata or None)}], source)`` in source order,
  at most ``per_category`` per category and ``max_prompts`` in all."""
  if config.prompt_file:
    source = os.path.expanduser(config.prompt_file)
    recs = prompt_files.read_prompt_file(source)
  else:
    data_dir = config.tfds_dir or os.path.join(workdir, "tfds")
    splits = [s.strip() for s in config.split.split(",") if s.strip()]
    source = f"{config.dataset}:{','.join(splits)}"
    recs = [r for s in splits for r in tfds_builders.load_split(config.dataset, s, data_dir,
                                                                 manual_dir=config.manual_dir or None)]
  out, seen = [], {}
  for r in recs:
    cat = r.get("tag") or "-"
    if config.per_category and seen.get(cat, 0) >= config.per_category:
      continue
    seen[cat] = seen.get(cat, 0) + 1
    md = r.get("metadata") or {}
    out.append(dict(prompt=r["prompt"], category=cat, metadata=md, shapes=shapes.verifiable(md)))
  return (out[:config.max_prompts] if config.max_prompts else out), source


def checkpoints(config) -> dict[str, str]:
  """``{label: path}`` from ``config.checkpoints`` (comma-separated; '' or 'base' = the shipped base)."""
  out = {}
  for i, p in enumerate([p.strip() for p in (config.checkpoints or "base").split(",")]):
    path = checkpoint.resolve("shapes_base") if p in ("", "base") else fileio.resolve(p)
    label = "base" if p in ("", "base") else os.path.basename(os.path.normpath(path))
    out[label if label not in out else f"{label}_{i}"] = path
  return out


def score(images: np.ndarray, recs: list[dict], names: list[str], settings) -> dict[str, np.ndarray]:
  """``{reward: (N,) float32}``; NaN where a verifier reward is undefined (no shapes-world metadata)."""
  out = {}
  for name in names:
    if name in registry.NEEDS_SHAPES:
      idx = [i for i, r in enumerate(recs) if r["shapes"] is not None]
      vals = np.full(len(recs), np.nan, np.float32)
      if idx:
        vals[idx] = registry.reward(name, images[idx], [recs[i]["shapes"] for i in idx])
      out[name] = vals
    else:
      out[name] = registry.reward(name, images, [r["metadata"] for r in recs], [r["prompt"] for r in recs],
                                  settings)
  return out


def _stats(v: np.ndarray) -> dict:
  v = v[np.isfinite(v)]
  return dict(mean=float(v.mean()) if len(v) else None, std=float(v.std()) if len(v) else None, count=int(len(v)))


def summarize(values: dict[str, np.ndarray], recs: list[dict]) -> dict:
  cats = np.array([r["category"] for r in recs])
  res = dict(num_images=len(recs), rewards={
      name: {"all": _stats(v), **{c: _stats(v[cats == c]) for c in sorted(set(cats))}} for name, v in values.items()})
  if "shapes_strict" in values:
    strict = values["shapes_strict"]
    tasks = sorted({r["shapes"]["tag"] for r in recs if r["shapes"] is not None})
    per = {t: float(np.mean([strict[i] for i, r in enumerate(recs) if r["shapes"] is not None
                             and r["shapes"]["tag"] == t])) for t in tasks}
    if per:
      res["geneval"] = dict(per_task=per, overall=float(np.mean(list(per.values()))),
                            num_images=int(np.isfinite(strict).sum()))
  return res


def _cell(s: dict) -> str:
  return "-" if not s or s["count"] == 0 else f"{s['mean']:.4f} ± {s['std']:.4f} ({s['count']})"


def markdown(report: dict) -> str:
  labels = list(report["checkpoints"])
  res, p = report["results"], report["prompts"]
  head = "| " + " | ".join(labels) + " |"
  sep = "|---|---|" + "---|" * len(labels)
  lines = ["# Evaluation", "",
           f"Prompts: {p['num_prompts']} from `{p['source']}`, {p['images_per_prompt']} image(s) per prompt, "
           f"seed {p['seed']}; images per checkpoint: "
           + ", ".join(f"{k} {res[k]['num_images']}" for k in labels) + ".", "",
           "Checkpoints: " + ", ".join(f"`{k}` = `{v}`" for k, v in report["checkpoints"].items()) + ".", "",
           "## Rewards (mean ± std (images))", "", "| reward | category " + head, sep]
  first = res[labels[0]]["rewards"]
  empty = [n for n in first if all(res[k]["rewards"][n]["all"]["count"] == 0 for k in labels)]
  for name in (n for n in first if n not in empty):
    for cat in first[name]:
      lines.append(f"| {name} | {cat} | " + " | ".join(_cell(res[k]["rewards"][name].get(cat)) for k in labels)
                   + " |")
  if empty:
    lines += ["", f"Not applicable to any image (no shapes-world metadata): {', '.join(empty)}."]
  if "geneval" in res[labels[0]]:
    lines += ["", "## GenEval-style accuracy (strict pass per task; overall = mean over tasks)", "",
              "| task " + head, "|---|" + "---|" * len(labels)]
    for task in res[labels[0]]["geneval"]["per_task"]:
      lines.append(f"| {task} | " + " | ".join(f"{res[k]['geneval']['per_task'][task]:.4f}" for k in labels) + " |")
    lines.append("| **overall** | " + " | ".join(f"**{res[k]['geneval']['overall']:.4f}**" for k in labels) + " |")
  return "\n".join(lines) + "\n"


def _footer(vals: dict) -> str:
  """'PASS'/'fail' first (the grid colours the line by it) when the strict verifier applies, then the rewards."""
  strict = vals.get("shapes_strict", np.nan)
  head = "" if not np.isfinite(strict) else ("PASS " if strict else "fail ")
  return head + " ".join(f"{k[:6]} {v:.2f}" for k, v in vals.items() if k != "shapes_strict" and np.isfinite(v))


def run(config, workdir: str) -> dict:
  fileio.makedirs(workdir)
  recs, source = load_records(config, workdir)
  if not recs:
    raise EvalError(f"no prompts to evaluate in {source}.")
  k = max(1, int(config.images_per_prompt))
  recs_k = [r for r in recs for _ in range(k)]
  settings = config.get("rewards")
  names = [n.strip() for n in config.reward_names.split(",") if n.strip()]
  names += [n for n in registry.configured(settings) if n not in names]
  bad = [n for n in names if n not in registry.names()]
  if bad:
    raise EvalError(f"config.reward_names has {', '.join(bad)}, not in the registry ({', '.join(registry.names())}).")
  ckpts = checkpoints(config)
  report = dict(checkpoints=ckpts, prompts=dict(source=source, num_prompts=len(recs), images_per_prompt=k,
                                                seed=config.seed), rewards=names, results={})
  for label, path in ckpts.items():
    model_cfg, graphdef, params = checkpoint.load_model(path)
    logging.info("%s: generating %d images from %s", label, len(recs_k), path)
    images = generate.generate(graphdef, params, model_cfg, [r["prompt"] for r in recs_k], config.sampling,
                               seed=config.seed, batch_size=config.batch_size, progress=True)
    values = score(images, recs_k, names, settings)
    report["results"][label] = summarize(values, recs_k)
    n = min(len(images), config.grid_size)
    footers = [_footer({nm: v[i] for nm, v in values.items()}) for i in range(n)]
    fileio.save_image(os.path.join(workdir, f"grid_{label}.png"),
                      visualize.captioned_grid(images[:n], [r["prompt"] for r in recs_k[:n]], footers=footers))
  fileio.write_json(os.path.join(workdir, "eval.json"), report)
  fileio.write_text(os.path.join(workdir, "eval.md"), markdown(report))
  print(markdown(report))
  return report
