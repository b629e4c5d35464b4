#!/usr/bin/env bash
# Fresh clone -> virtual environment -> the main job on the shapes world (CPU is enough).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv && . .venv/bin/activate
pip install -q -r requirements.txt && pip install -q --no-deps -e .
python -m margrpo_jax.main --config=configs/shapes_rl.py --workdir="${1:-runs/rl}"
