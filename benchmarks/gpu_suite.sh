#!/usr/bin/env bash
# The accelerator figures in one prepared run (under 10 minutes on one GPU or TPU host; each part has its own time
# limit, so a slow part is cut, not the whole): MAR-GRPO at MAR-L size in bfloat16 and float32
# (benchmarks/rl_mfu.py: rollout images/s, RL step time, TFLOP/s, MFU), and this project's sampler and RL update
# beside PyTorch ones written as the official sample_tokens and update (benchmarks/peer_sampler.py, peer_update.py). Prints one table; logs and JSON in
# $OUT (default /tmp/gpu_suite).
#
#   bash benchmarks/gpu_suite.sh      (in the environment the README sets up, with jax[cuda12] or jax[tpu])
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_suite}
mkdir -p "$OUT"
part() {  # part NAME SECONDS ARGS...: one benchmark under a time limit, its output in $OUT/NAME.log
  local name=$1 limit=$2
  shift 2
  local t0=$SECONDS
  timeout "$limit" python "$@" >"$OUT/$name.log" 2>&1
  echo "$name: exit $? after $((SECONDS - t0)) s (limit $limit s)" >&2
}
RL=(benchmarks/rl_mfu.py --size=large --repeats=2)
part rl_mfu_bfloat16 200 "${RL[@]}" --dtype=bfloat16
part rl_mfu_float32 140 "${RL[@]}" --dtype=float32
part peer_sampler 140 benchmarks/peer_sampler.py --size=large --batch=16 --num_steps=32 --diffusion_steps=50
part peer_update 110 benchmarks/peer_update.py --size=large --batch=8 --repeats=2
python - "$OUT" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
print("| benchmark | device | figures |\n|---|---|---|")
for name in ("rl_mfu_bfloat16", "rl_mfu_float32"):
  lines = (out / f"{name}.log").read_text(errors="replace").splitlines()
  rows = [json.loads(l) for l in lines if l.startswith("{")]
  if not rows:
    print(f"| {name} | - | did not finish (see {out}/{name}.log) |")
    continue
  r = rows[-1]
  print(f"| {name} (MAR-{r['size']}, {r['batch']} images) | {r['devices']} x {r['device']} | rollout "
        f"{r['rollout_images_per_s']} images/s, RL step {r['rl_step_s']} s, {r['rl_step_achieved_tflops_per_s']} "
        f"TFLOP/s, MFU {r['rl_step_mfu']} (compile {r['compile_s']}) |")
peer = (out / "peer_sampler.log").read_text(errors="replace").splitlines()
cells = [[c.strip() for c in l.strip("|").split("|")] for l in peer
         if l.startswith("| ") and "sampler" not in l and "---" not in l]
figures = [f"{c[0]} {c[1]} images/s (compile {c[3]} s)" for c in cells] + [l for l in peer if l.startswith("speed-up")]
print("| peer_sampler (MAR-large, batch 16) | - | " + ("; ".join(figures) if cells else
      f"did not finish (see {out}/peer_sampler.log)") + " |")
update = [json.loads(l) for l in (out / "peer_update.log").read_text(errors="replace").splitlines()
          if l.startswith("{")]
print("| peer_update (MAR-large, 8 images) | - | " + (
    f"{update[-1]['jax_s']} s / update (compile {update[-1]['compile_s']} s) vs PyTorch {update[-1]['torch_s']} s: "
    f"{update[-1]['speedup_vs_torch']}x" if update else f"did not finish (see {out}/peer_update.log)") + " |")
PY
