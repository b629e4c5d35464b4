r"""The real-size memory table: every family's RL step at the paper's settings on 8 simulated devices, with and
without each memory measure, from plan mode (``margrpo_jax/jobs/plan.py``), written into the README.

    python benchmarks/plan_table.py [--models=MAR-B,Harmon-1.5B,...] [--record=benchmarks/results/plan.jsonl]
        [--redo] [--jobs=N] [--write=README.md,docs/reference.md]

Each model is one plan-mode run in a subprocess with ``XLA_FLAGS=--xla_force_host_platform_device_count=8``
(``fsdp=8``, float32, ``rl.remat`` on as the real-size configs set it) and ``plan.variants`` = :data:`MEASURES`:
the RL step without rematerialisation, one image per device at a time (``rl.microbatch``), the frozen parts and
the reference in bfloat16 (``rl.frozen_dtype``), LoRA rank 16, and LoRA with the bf16 base. Its
``memory/*/per_device_peak_gib`` lines are appended to the record (a model already recorded is not planned again,
so a killed run resumes; ``--redo`` plans again) and the table between ``<!-- plan:begin -->`` and
``<!-- plan:end -->`` of each ``--write`` file is regenerated from the record. Compiles take minutes per model on 2
cores (Harmon-1.5B and NOVA the longest).
"""
from __future__ import annotations

import argparse
import json
from concurrent import futures
import os
import re
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MODELS = {  # name -> (config, overrides): Harmon's and NOVA's 3 prompts x 4 images do not split over 8 devices
    "MAR-B": ("mar.py:base", ()), "MAR-L": ("mar.py:large", ()), "MAR-H": ("mar.py:huge", ()),
    "Harmon-0.5B": ("harmon.py:0.5b", ("rl.prompts_per_iter=2",)),
    "Harmon-1.5B": ("harmon.py:1.5b", ("rl.prompts_per_iter=2",)),
    "NOVA sd512": ("nova.py:sd512", ("rl.prompts_per_iter=2",)),
}
DEVICES = 8
# column -> the plan.variants entry ('' = the configured step); one image per device is 8 rows at a time
MEASURES = {"without remat": "rl.remat=False", "one image / device": "rl.microbatch=8",
            "frozen + ref bf16": "rl.frozen_dtype=bfloat16", "LoRA 16": "rl.lora.rank=16",
            "LoRA 16, base bf16": "rl.lora.rank=16+rl.frozen_dtype=bfloat16"}
DEVICE_SIZES = ((16, "TPU v5e"), (24, "L4 / A10"), (32, "TPU v4"), (40, "A100-40G"), (80, "H100 / A100-80G"),
                (95, "TPU v5p"), (141, "H200"))
PEAK = re.compile(r"^memory/(rollout|rl_step)(_.*)?/per_device_peak_gib = ([0-9.]+)$")


def plan_model(name: str) -> dict:
  """One plan-mode run of ``name`` with every measure as a variant: ``{line name: GiB}`` and the wall time."""
  config, overrides = MODELS[name]
  images = 32 if config.startswith("mar") else 8  # G x prompts per step
  measures = {k: v for k, v in MEASURES.items() if not (v.startswith("rl.microbatch") and images <= DEVICES)}
  cmd = [sys.executable, "-m", "margrpo_jax.main", f"--config=configs/{config}", "--config.mode=plan",
         f"--workdir={os.path.join('/tmp', 'plan_table')}", "--config.plan.dtypes=float32",
         f"--config.plan.variants={','.join(measures.values())}", f"--config.parallel.mesh.fsdp={DEVICES}",
         *(f"--config.{o}" for o in overrides)]
  env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={DEVICES}", JAX_PLATFORMS="cpu")
  t0 = time.time()
  proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
  if proc.returncode:
    raise SystemExit(f"plan of {name} failed ({' '.join(cmd)}):\n{proc.stderr[-3000:]}")
  peaks = {}
  for line in proc.stdout.splitlines():
    m = PEAK.match(line.strip())
    if m:
      peaks[m.group(1) + (m.group(2) or "")] = float(m.group(3))
  params = sum(int(l.split(" = ")[1]) for l in proc.stdout.splitlines() if l.startswith("params/total"))
  return dict(model=name, config=config, overrides=list(overrides), images=images, params=params,
              measures=measures, peaks=peaks, seconds=round(time.time() - t0, 1))


def smallest_device(gib: float) -> str:
  for size, name in DEVICE_SIZES:
    if gib <= size:
      return f"{size} GiB ({name})"
  return "none"


def table(records: list[dict]) -> str:
  """The markdown table: GiB per device, each measure's column the RL step with that one setting changed."""
  head = ["model", "parameters", "images / step", "rollout", "RL step", *MEASURES, "smallest device, full FT"]
  rows = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 2) + "---|"]
  gib = lambda x: f"{x:.0f}" if x >= 100 else f"{x:.2f}"
  for name in MODELS:
    r = next((r for r in records if r["model"] == name), None)
    if r is None:
      continue
    cells = [gib(r["peaks"]["rl_step_" + v[len("rl."):].replace("+rl.", "+")]) if k in r["measures"]
             else "(one already)" for k, v in MEASURES.items()]
    exact = [float(c) for k, c in zip(MEASURES, cells) if k == "one image / device" and c[0].isdigit()]
    full = min([r["peaks"]["rl_step"]] + exact)  # the same update: the configured step or one image at a time
    rows.append(f"| {name} (`{r['config']}`) | {r['params'] / 1e6:,.0f} M | {r['images']} | "
                f"{gib(r['peaks']['rollout'])} | **{gib(r['peaks']['rl_step'])}** | " + " | ".join(cells)
                + f" | {smallest_device(full)} |")
  return "\n".join(rows)


def write(path: str, text: str) -> None:
  doc = open(path).read()
  begin, end = "<!-- plan:begin -->", "<!-- plan:end -->"
  if begin not in doc or end not in doc:
    raise SystemExit(f"{path} has no {begin} ... {end} block to write the table into")
  pre, rest = doc.split(begin, 1)
  open(path, "w").write(pre + begin + "\n" + text + "\n" + end + rest.split(end, 1)[1])


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--models", default=",".join(MODELS), help="comma-separated names of MODELS")
  ap.add_argument("--record", default=os.path.join(HERE, "results", "plan.jsonl"))
  ap.add_argument("--redo", action="store_true", help="plan models already in the record again")
  ap.add_argument("--jobs", type=int, default=1, help="models planned at once")
  ap.add_argument("--write", default="README.md,docs/reference.md", help="files whose plan block is regenerated")
  args = ap.parse_args()
  names = [n.strip() for n in args.models.split(",") if n.strip()]
  unknown = [n for n in names if n not in MODELS]
  if unknown:
    raise SystemExit(f"--models names {unknown[0]!r}, not one of {', '.join(MODELS)}")
  records = [json.loads(l) for l in open(args.record)] if os.path.exists(args.record) else []
  todo = [n for n in names if args.redo or not any(r["model"] == n for r in records)]
  print(f"planning {', '.join(todo) or 'nothing'} ({args.jobs} at a time)", flush=True)
  with futures.ThreadPoolExecutor(args.jobs) as pool:  # each plan is its own process (compiles: one core each)
    for r in (f.result() for f in futures.as_completed([pool.submit(plan_model, n) for n in todo])):
      print(json.dumps(r), flush=True)
      records = [x for x in records if x["model"] != r["model"]] + [r]
      with open(args.record, "w") as f:
        f.writelines(json.dumps(x) + "\n" for x in records)
  text = table(records)
  print(text)
  for path in (p.strip() for p in args.write.split(",") if p.strip()):
    write(os.path.join(ROOT, path), text)


if __name__ == "__main__":
  main()
