"""MAR-B/L/H (class-conditional, as released by LTH14/mar) at real size: plan a sharded MAR-GRPO run.

python -m margrpo_jax.main --config=configs/mar.py:huge --config.mode=plan --workdir=W \
    [--config.parallel.mesh.fsdp=8 --config.parallel.mesh.data=1]
(on CPU, simulate the pod: XLA_FLAGS=--xla_force_host_platform_device_count=8). Prints the parameters per
component (MODELS.md section 1.7) and the per-device compiled memory of the sharded rollout and RL step.
RL hyper-parameters are the paper's (ALGORITHM.md section 10): 64 AR steps with 12 scored, 10 diffusion steps
scored per AR step, S = 5 MTE trajectories, top 30%, G = 4, lr 1e-6, beta 0.01.
"""
import ml_collections

from margrpo_jax import config_files
from margrpo_jax.models import class_mar


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  size = arg or "base"
  if size not in class_mar.SIZES:
    raise ValueError(f"unknown config arg {size!r} for mar (sizes: {', '.join(class_mar.SIZES)})")
  c = config_files.load("shapes_rl", "margrpo")  # the RL schema and MAR-GRPO's stabilisers
  c.mode = "plan"
  c.model = class_mar.mar_config(size)
  c.parallel.mesh.update(data=1, fsdp=-1, tensor=1)  # FSDP over every device: MAR-H's optimizer state is large
  c.sampling.update(num_steps=64, diffusion_steps="100", cfg_scale=3.0, cfg_schedule="linear", temperature=1.0,
                    clip_denoised=False)
  c.rl.update(group_size=4, prompts_per_iter=8, num_ar_steps=12, num_diffusion_steps=10, mte_seeds=5,
              topk_fraction=0.3, remat=True)
  c.optim.update(lr=1e-6, grad_clip=1.0)
  c.plan = dict(compile=True)  # False: parameter counts only
  return c
