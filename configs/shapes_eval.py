"""Evaluate the shipped base (or several checkpoints) on the shapes-world eval split with the verifier rewards.

python -m margrpo_jax.main --config=configs/shapes_eval.py --workdir=runs/eval \
    [--config.checkpoints=base,runs/rl/export] [--config.max_prompts=64] [--config.seed=0] \
    [--config.dataset=geneval --config.split=test --config.manual_dir=PATH/geneval --config.per_category=8] \
    [--config.rewards.imagereward.checkpoint=DIR --config.rewards.imagereward.vocab=vocab.txt]

Writes <workdir>/eval.json, eval.md and grid_<checkpoint>.png (margrpo_jax/jobs/eval.py). Sampling settings are
the sample job's (configs/shapes_sample.py), so the strict pass matches its scores.json on the same prompts.
"""
from margrpo_jax import config_files
from margrpo_jax.rewards import registry


def get_config(arg: str | None = None):
  c = config_files.load("shapes_sample")
  c.mode = "eval"
  del c["checkpoint"]
  c.checkpoints = "base"   # comma-separated model exports, one column each; 'base' = the shipped base
  c.dataset = "shapes_world"  # or a prompt_files config: geneval, t2i_compbench, margrpo, jsonl, txt
  c.split = "eval"         # comma-separated splits (t2i_compbench: file stems such as color_val,shape_val)
  c.manual_dir = ""        # prompt_files' source folder; '' = <tfds_dir>/downloads/manual
  c.per_category = 0       # at most this many prompts per category (0 = all), before max_prompts
  c.images_per_prompt = 1  # GenEval's protocol uses 4
  c.reward_names = "shapes_strict,shapes_partial,jpeg_compressibility"
  c.rewards = registry.settings_config()  # a learned reward joins when its checkpoint (and vocab) are set
  if arg:
    raise ValueError(f"unknown config arg {arg!r} for shapes_eval")
  return c
