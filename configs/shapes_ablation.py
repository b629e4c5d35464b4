"""The ablation experiment: `grpo`, `paper` (MAR-GRPO as the official code computes it) and `image_elbo` (the main
job) over 3 seeds, strict pass on the eval split (not run by CI; benchmarks/estimator_study.py is the matched-budget
study with validation-split choices, controls and sampling seeds).

python -m margrpo_jax.main --config=configs/shapes_ablation.py --workdir=runs/ablation
    [--config.variants=grpo,frozen_head,frozen_head_mte,frozen_head_mte_topk,margrpo,paper,focused,token_elbo,image_elbo,awm,nft]
    [--config.seeds=0,1,2] [--config.overrides.num_iters=100]

Each variant runs with its own settings (``configs/shapes_rl.py:VARIANT``) plus ``overrides``.

Writes W/ablation.md (table), W/ablation.png (curves) and W/ablation.json; every run lives in W/<variant>/seed<n>.
"""
import ml_collections


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  if arg:
    raise ValueError(f"unknown config arg {arg!r} for shapes_ablation")
  c = ml_collections.ConfigDict()
  c.mode = "ablation"
  c.variants = "grpo,paper,image_elbo"
  c.seeds = "0,1,2"
  c.checkpoint = ""   # base export; '' = the shipped base
  c.tfds_dir = ""
  c.rl_config = ""    # '' = configs/shapes_rl.py
  c.table_every = 10
  c.smoke = False     # each variant's ',smoke' config (a quick check of the pipeline)
  # Applied to every variant's shapes_rl config: all 512 eval prompts (a 0.022 standard error on strict pass).
  c.overrides = dict(eval=dict(num_prompts=512))
  return c
