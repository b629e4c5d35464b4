"""Harmon-0.5B / 1.5B (wusize/Harmon: Qwen2.5 + MAR-B / MAR-H, 512 px) at real size: sample a converted
checkpoint, or plan / run MAR-GRPO with the paper's Harmon hyper-parameters.

Convert (the Qwen2.5 tokenizer.json beside the .pth puts the null prompt's ids into the export):
python -m margrpo_jax.convert --family=harmon --src=harmon_0.5b.pth --out=HARMON_05
python -m margrpo_jax.convert --family=kl16 --src=kl16.ckpt --out=KL16
Sample (captions are wrapped in Harmon's chat prompt; CFG against "Generate an image."):
python -m margrpo_jax.main --config=configs/harmon.py:0.5b --config.mode=sample --workdir=W \
    --config.checkpoint=HARMON_05 --config.model.tokenizer_path=Qwen2.5-0.5B-Instruct \
    --config.model.vae_checkpoint=KL16 [--config.prompts="a red apple,two cats"]
Plan (parameters per component, docs/models.md section 2.7; compile needs sharding rules for the LLM's parameters):
python -m margrpo_jax.main --config=configs/harmon.py:1.5b --config.mode=plan --config.plan.compile=False --workdir=W

Random (a few-layer random-weight Harmon: Qwen2.5 layout, MAR encoder / decoder, a byte-level tokenizer and a
random KL-16-layout VAE, nothing downloaded; RL on JPEG compressibility over configs/prompts/captions.txt):
python -m margrpo_jax.main --config=configs/harmon.py:random --config.mode=rl --config.num_iters=2 --workdir=W

Generation defaults (docs/models.md section 2.3): 64 AR steps, 100 diffusion steps, CFG 3.0 constant, temperature 1.0.
RL (docs/algorithm.md section 10, Harmon column): G = 4, lr 1e-6 constant, AdamW (0.9, 0.999, 1e-8) wd 0, grad clip 1.0,
beta 0.01, 12 of 64 AR steps and 10 diffusion steps scored, S = 5 MTE seeds, top 30 %, consistency selection,
1200 iterations, reward HPS v2.1; only the MAR encoder / decoder is trained (``Harmon.policy_components``).
``checkpoint``, ``model.tokenizer_path`` and ``model.vae_checkpoint`` must be set except in plan mode.
"""
import ml_collections

from margrpo_jax import config_files
from margrpo_jax.models import harmon


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  size = arg or "0.5b"
  if size == "tiny":  # the name it had before "random"
    raise ValueError("config arg 'tiny' is now 'random' (the few-layer random-weight instance)")
  if size == "random":
    return config_files.random_weights(get_config("0.5b"), "harmon")
  if size not in harmon.SIZES:
    raise ValueError(f"unknown config arg {size!r} for harmon (sizes: {', '.join(harmon.SIZES)}, or random)")
  c = config_files.real_size(harmon.harmon_config(size))
  c.num_iters = 1200
  c.sampling.update(num_steps=64, diffusion_steps="100", cfg_scale=3.0, cfg_schedule="constant", temperature=1.0,
                    clip_denoised=False)
  c.rl.update(group_size=4, prompts_per_iter=3, num_ar_steps=12, num_diffusion_steps=10, mte_seeds=5,
              topk_fraction=0.3, consistency=True, beta=0.01, remat=True)
  c.rl.rewards.hps = 1.0
  c.optim.update(lr=1e-6, warmup_steps=0, decay="constant", b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.0,
                 grad_clip=1.0)
  return c
