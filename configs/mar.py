"""MAR-B/L/H (class-conditional, as released by LTH14/mar) at real size: sample a converted checkpoint, or plan a
sharded MAR-GRPO run.

Sample (prompts are class labels, "207" or "class 207"; images are 256 x 256 through the KL-16 export):
python -m margrpo_jax.convert --family=mar --src=pretrained_models/mar/mar_base/checkpoint-last.pth --out=MAR_B
python -m margrpo_jax.convert --family=kl16 --src=pretrained_models/vae/kl16.ckpt --out=KL16
python -m margrpo_jax.main --config=configs/mar.py:base --config.mode=sample --workdir=W \
    --config.checkpoint=MAR_B --config.model.vae_checkpoint=KL16 [--config.prompts=207,88,979]
Generation defaults (docs/models.md section 1.3): 64 AR steps, 100 diffusion steps, linear CFG 2.9 / 3.0 / 3.2
(B / L / H), temperature 1.0 (the README evaluates with 256 AR steps: --config.sampling.num_steps=256).

Plan:

python -m margrpo_jax.main --config=configs/mar.py:huge --config.mode=plan --workdir=W \
    [--config.parallel.mesh.fsdp=8 --config.parallel.mesh.data=1]
(on CPU, simulate the pod: XLA_FLAGS=--xla_force_host_platform_device_count=8). Prints the parameters per
component (docs/models.md section 1.7) and the per-device compiled memory of the sharded rollout and RL step.
Random (a few-layer random-weight MAR with its KL-16-layout VAE, nothing downloaded; RL on JPEG compressibility
over the class labels, a few minutes on CPU; rerunning resumes):
python -m margrpo_jax.main --config=configs/mar.py:random --config.mode=rl --config.num_iters=2 --workdir=W
RL hyper-parameters are the paper's (docs/algorithm.md section 10): 64 AR steps with 12 scored, 10 diffusion steps
scored per AR step, S = 5 MTE trajectories, top 30%, G = 4, lr 1e-6, beta 0.01.
"""
import ml_collections

from margrpo_jax import config_files
from margrpo_jax.models import class_mar


CFG = {"base": 2.9, "large": 3.0, "huge": 3.2}  # docs/models.md section 1.3 (README evaluation)


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  size = arg or "base"
  if size == "tiny":  # the name it had before "random"
    raise ValueError("config arg 'tiny' is now 'random' (the few-layer random-weight instance)")
  if size == "random":
    return config_files.random_weights(get_config("base"), "mar")
  if size not in class_mar.SIZES:
    raise ValueError(f"unknown config arg {size!r} for mar (sizes: {', '.join(class_mar.SIZES)}, or random)")
  c = config_files.real_size(class_mar.mar_config(size), prompts="207,360,387,974,88,979,417,279",
                              batch_size=8, grid_size=64)
  c.sampling.update(num_steps=64, diffusion_steps="100", cfg_scale=CFG[size], cfg_schedule="linear",
                    temperature=1.0, clip_denoised=False)
  c.rl.update(group_size=4, prompts_per_iter=8, num_ar_steps=12, num_diffusion_steps=10, mte_seeds=5,
              topk_fraction=0.3, remat=True)
  c.rl.rewards.jpeg_compressibility = 1.0  # needs no download; set rl.rewards.imagereward etc. with checkpoints
  c.optim.update(lr=1e-6, grad_clip=1.0)
  return c
