"""Sample a checkpoint (the shipped base by default) on the shapes eval split or a prompt file.

python -m margrpo_jax.main --config=configs/shapes_sample.py --workdir=runs/sample \
    [--config.prompt_file=prompts.jsonl] [--config.checkpoint=DIR] [--config.seed=0]
"""
import ml_collections

from margrpo_jax.parallel import mesh


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.mode = "sample"
  c.checkpoint = ""      # a model export dir (model.json + params/); '' = the shipped base
  c.prompt_file = ""     # JSONL (shapes metadata, GenEval, MAR-GRPO) or TXT, one prompt per line; '' = eval split
  c.tfds_dir = ""        # where the shapes_world TFDS split is built; '' = <workdir>/tfds
  c.max_prompts = 0      # 0 = all
  c.seed = 0
  c.batch_size = 64
  c.grid_size = 64
  c.parallel = mesh.config()  # device mesh, sharding rules, multi-host (margrpo_jax/parallel/mesh.py)
  # The shipped model's generation defaults (docs/shapes_base.md): 8 AR steps for its 16 tokens (16 steps score
  # 0.611 instead of 0.578 on the eval split; 8 halve the cost of RL's rollouts), CFG rising linearly to 3,
  # x0_hat clipped to [-5, 5] (the tokenizer's latents; use 1.0 for a raw-patch model's pixels).
  c.sampling = dict(num_steps=8, diffusion_steps="25", cfg_scale=3.0, cfg_schedule="linear", temperature=1.0,
                    clip_denoised=5.0)
  if arg:
    raise ValueError(f"unknown config arg {arg!r} for shapes_sample")
  return c
