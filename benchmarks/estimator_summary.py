r"""The estimator study's tables and figure, from ``R/results.jsonl`` and ``R/base.jsonl`` (estimator_study.py;
``R`` is the committed record, ``benchmarks/results``).

    python benchmarks/estimator_study.py --summarize [--record=benchmarks/results] [--doc=docs/estimators.md]

For every split and sampling setting, one row per cell (and per control): the number of training seeds, the
strict-pass gain over the base (each training seed's gain is paired with the base on the same sampling seeds and
averaged over them; the row shows the mean over training seeds +- its standard error, and each seed's value),
the per-task gains, the partial-score gain, diversity relative to the base's, the drift from the base, the
training wall time and images/s, and the raw last iterate's gain. The tables replace the text between the
``<!-- study:begin -->`` and ``<!-- study:end -->`` markers of the doc; the figure (``estimators.png`` beside it)
shows each cell's per-seed gains on the validation split. Grad-SNR lines come from ``R/grad_snr.jsonl`` (one
``benchmarks/grad_snr.py`` JSON line per estimator), when present.

``R/archive.json`` holds table rows whose per-sampling-seed records were not kept (the rows as the summary printed
them, with their per-seed strict gains); such a row is shown, marked ``(a)``, until a new record of the same cell,
control and split replaces it.
"""
from __future__ import annotations

import collections
import json
import os

import numpy as np

from margrpo_jax import fileio
from margrpo_jax.data import shapes

BEGIN, END = "<!-- study:begin -->", "<!-- study:end -->"


def _jsonl(path):
  return fileio.read_jsonl(path) if fileio.exists(path) else []


def _mean_se(v):
  v = np.asarray(v, float)
  return float(v.mean()), (float(v.std(ddof=1) / np.sqrt(len(v))) if len(v) > 1 else float("nan"))


def _gains(rec_rates, base_rates, key):
  """One run's gain on ``key``: the mean over sampling seeds of (run - base) on the same seed."""
  return float(np.mean([r[key] - b[key] for r, b in zip(rec_rates, base_rates)]))


def rows(results, bases):
  """``{(split, sampling): [row, ...]}``: one row per (cell, control) with its per-seed figures."""
  base = {(b["split"], b["sampling"], tuple(b["seeds"])): b for b in bases}
  groups = collections.defaultdict(list)
  for r in results:
    cell = r["cell"] if r.get("images", 12_800) == 12_800 else f"{r['cell']} ({r['images']:,} images)"
    groups[(r["split"], r["sampling"], cell, r["control"], tuple(r["seeds"]))].append(r)
  out = collections.defaultdict(list)
  for (split, sampling, cell, control, seeds), runs in groups.items():
    b = base.get((split, sampling, seeds))
    if b is None:
      continue
    runs = sorted({r["seed"]: r for r in runs}.values(), key=lambda r: r["seed"])  # the last line of each seed
    if any(r.get("stopped_early") for r in runs):  # rl.diversity_floor: each seed's own length
      cell = cell.replace(" images)", f" images at most; stopped at {', '.join(str(r['iterations']) for r in runs)})")
    keys = ["strict", "partial", *shapes.TASKS]
    gain = {k: [_gains(r["ema"]["rates"], b["rates"], k) for r in runs] for k in keys}
    raw = [_gains(r["raw"]["rates"], b["rates"], "strict") for r in runs if "raw" in r]
    div = [np.mean(r["ema"]["diversity"]) / np.mean(b["diversity"]) for r in runs]
    out[(split, sampling)].append(dict(
        cell=cell, control=control, note=runs[0].get("note", ""), seeds=[r["seed"] for r in runs],
        base=float(np.mean([x["strict"] for x in b["rates"]])),
        base_tasks={k: float(np.mean([x[k] for x in b["rates"]])) for k in keys},
        gain=gain, raw=raw, diversity=div, drift=[r["drift"] for r in runs],
        minutes=[r["train_seconds"] / 60 for r in runs], ips=[r["images_per_s"] for r in runs],
        sampling_seeds=list(seeds)))
  for v in out.values():
    v.sort(key=lambda r: (-np.mean(r["gain"]["strict"]) if not r["control"] else 1.0, r["cell"], r["control"]))
  return out


def _pm(v, digits=3):
  m, se = _mean_se(v)
  return f"{m:+.{digits}f}" + ("" if np.isnan(se) else f" +- {se:.{digits}f}")


def _header(r) -> str:
  if "header" in r:
    return r["header"]
  return (f"base strict pass {r['base']:.3f}, mean of sampling seeds {', '.join(map(str, r['sampling_seeds']))}; "
          f"single_object {r['base_tasks']['single_object']:.3f}")


def table(split, sampling, rs) -> str:
  header = next((_header(r) for r in rs if "header" not in r), _header(rs[0]))
  lines = [f"### split `{split}`, sampling `{sampling}` ({header})", "",
           "| cell | seeds | strict gain (each seed) | single | two | counting | position | partial | raw iterate | "
           "diversity x base | drift | train min | images/s |",
           "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
  for r in rs:
    if "line" in r:  # an archived row, as printed when it was measured
      lines.append(r["line"].replace(" | ", " (a) | ", 1))
      continue
    g = r["gain"]
    each = ", ".join(f"{x:+.3f}" for x in g["strict"])
    name = f"{r['cell']} (shuffled control)" if r["control"] else f"**{r['cell']}**"
    lines.append(f"| {name} | {len(r['seeds'])} | {_pm(g['strict'])} ({each}) | "
                 + " | ".join(f"{np.mean(g[t]):+.3f}" for t in shapes.TASKS)
                 + f" | {np.mean(g['partial']):+.3f} | {(_pm(r['raw']) if r['raw'] else '')} | "
                 f"{np.mean(r['diversity']):.2f} | {np.mean(r['drift']):.4f} | {np.mean(r['minutes']):.1f} | "
                 f"{np.mean(r['ips']):.1f} |")
  return "\n".join(lines)


def snr_table(snrs) -> str:
  lines = ["| variant | settings | images | cos real | cos shuffled | same images, other draws (real) |",
           "|---|---|---:|---:|---:|---:|"]
  for s in snrs:
    same = s.get("cos_real_same_images")
    lines.append(f"| {s['variant']} | {' '.join(s.get('overrides', [])) or 'defaults'} | {s['images']} | "
                 f"{s['cos_real']:+.4f} +- {s['cos_real_se']:.4f} | {s['cos_shuffled']:+.4f} +- "
                 f"{s['cos_shuffled_se']:.4f} | {'' if same is None else f'{same:+.4f}'} |")
  return "\n".join(lines)


def figure(rs, path):
  import matplotlib  # noqa: PLC0415
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415
  fig, ax = plt.subplots(figsize=(8, 0.45 * len(rs) + 1.2))
  for y, r in enumerate(rs):
    g = r["gain"]["strict"]
    color = "0.6" if r["control"] else "C0"
    ax.scatter(g, [y] * len(g), color=color, s=18, zorder=3)
    m, se = _mean_se(g)
    ax.errorbar([m], [y], xerr=[0 if np.isnan(se) else se], fmt="D", color="k" if not r["control"] else "0.4",
                ms=5, zorder=4)
  ax.axvline(0, color="k", lw=0.8)
  ax.set_yticks(range(len(rs)), [r["cell"] + (" (shuffled)" if r["control"] else "") for r in rs])
  ax.invert_yaxis()
  ax.set_xlabel("strict-pass gain over the base\n(validation split, mean of 3 sampling seeds; dots: training seeds)")
  ax.grid(axis="x", alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def with_archive(by, archive):
  """Adds the archived rows that no new record replaces (same split, sampling, cell and control; and, where the
  archived row names its training ``seeds``, a record of each of them)."""
  for a in archive:
    key = (a["split"], a["sampling"])
    if any(r["cell"] == a["cell"] and r["control"] == a["control"] and set(a.get("seeds", ())) <= set(r["seeds"])
           for r in by.get(key, [])):
      continue
    by[key].append(dict(a, gain={"strict": a["strict"]}))
  for v in by.values():
    v.sort(key=lambda r: (-np.mean(r["gain"]["strict"]) if not r["control"] else 1.0, r["cell"], r["control"]))
  return by


def summarize(record: str, doc: str):
  results, bases = _jsonl(os.path.join(record, "results.jsonl")), _jsonl(os.path.join(record, "base.jsonl"))
  path = os.path.join(record, "archive.json")
  archive = json.load(open(path)) if os.path.exists(path) else {"rows": [], "grad_snr": []}
  by = with_archive(rows(results, bases), archive["rows"])
  order = sorted(by, key=lambda k: (["val", "eval", "grammar"].index(k[0]), k[1] != "default", k[1]))
  parts = [table(split, sampling, by[(split, sampling)]) for split, sampling in order]
  snrs = _jsonl(os.path.join(record, "grad_snr.jsonl"))
  setting = lambda x: (x["variant"], tuple(x.get("overrides", [])))
  snrs += [a for a in archive["grad_snr"] if setting(a) not in {setting(x) for x in snrs}]
  if snrs:
    parts.append("### grad-SNR (benchmarks/grad_snr.py: mean pairwise cosine of the gradients of disjoint image "
                 "sets, real vs shuffled advantages)\n\n" + snr_table(snrs))
  text = "\n\n".join(parts)
  print(text)
  if ("val", "default") in by:
    figure(by[("val", "default")], os.path.join(os.path.dirname(doc) or ".", "estimators.png"))
  if os.path.exists(doc):
    old = open(doc).read()
    if BEGIN in old and END in old:
      head, rest = old.split(BEGIN, 1)
      with open(doc, "w") as f:
        f.write(head + BEGIN + "\n" + text + "\n" + END + rest.split(END, 1)[1])
      print(f"wrote the tables into {doc}")
  with open(os.path.join(record, "summary.json"), "w") as f:
    json.dump({f"{k[0]}/{k[1]}": v for k, v in by.items()}, f)
