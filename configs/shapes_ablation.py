"""The ablation experiment: `grpo`, the ablation ladder and `margrpo` over 3 seeds (not run by CI).

python -m margrpo_jax.main --config=configs/shapes_ablation.py --workdir=runs/ablation
    [--config.variants=grpo,margrpo] [--config.seeds=0,1,2] [--config.overrides.num_iters=100]

Writes W/ablation.md (table), W/ablation.png (curves) and W/ablation.json; every run lives in W/<variant>/seed<n>.
"""
import ml_collections


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  if arg:
    raise ValueError(f"unknown config arg {arg!r} for shapes_ablation")
  c = ml_collections.ConfigDict()
  c.mode = "ablation"
  c.variants = "grpo,frozen_head,frozen_head_mte,frozen_head_mte_topk,margrpo"
  c.seeds = "0,1,2"
  c.checkpoint = ""   # base export; '' = the shipped base
  c.tfds_dir = ""
  c.rl_config = ""    # '' = configs/shapes_rl.py
  c.table_every = 10
  c.smoke = False     # each variant's ',smoke' config (a quick check of the pipeline)
  # Applied to every variant's shapes_rl config (longer than the main job).
  c.overrides = dict(num_iters=80, eval=dict(num_prompts=128))
  return c
