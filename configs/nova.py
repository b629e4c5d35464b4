"""NOVA (baaivision/NOVA text-to-image, Phi-2 text encoder, SD / SDXL VAE) at real size: sample a converted
checkpoint, or plan / run MAR-GRPO with the paper's NOVA hyper-parameters.

Variants (arg): d48w768 | d48w1024 | d48w1536 (the -sdxl1024 models, 1024 px), sd512 (= d48w1024-sd512, the
model the paper fine-tunes, 512 px), osp480 (text-to-video: plan only), or a full name of models.nova.VARIANTS.

Convert (the pipeline's transformer/ folder; Phi-2 is read from the sibling text_encoder/ folder):
python -m margrpo_jax.convert --family=nova --src=nova-d48w1024-sdxl1024/transformer --out=NOVA_W1024
python -m margrpo_jax.convert --family=sdvae --src=nova-d48w1024-sdxl1024/vae --out=SDXL_VAE
Sample:
python -m margrpo_jax.main --config=configs/nova.py:d48w1024 --config.mode=sample --workdir=W \
    --config.checkpoint=NOVA_W1024 --config.model.tokenizer_path=nova-d48w1024-sdxl1024/tokenizer \
    --config.model.vae_checkpoint=SDXL_VAE [--config.prompts="a red apple,two cats"]
Plan (parameters per component; docs/models.md section 3.7: backbone + head = the transformer, plus Phi-2 and the
null rows):
python -m margrpo_jax.main --config=configs/nova.py:d48w1024 --config.mode=plan --config.plan.compile=False --workdir=W

Random (a few-layer random-weight NOVA: Phi-2 layout, video / image encoders, flow head, a byte-level tokenizer and
a random SD-layout VAE, nothing downloaded; RL with the flow SDE on JPEG compressibility over
configs/prompts/captions.txt):
python -m margrpo_jax.main --config=configs/nova.py:random --config.mode=rl --config.num_iters=2 --workdir=W

Generation defaults (docs/models.md section 3.3): 64 AR steps (cos schedule, round, zero-count steps skipped), 25
Euler flow steps (``sampling.flow_noise_level`` 0 = NOVA's ODE), CFG 5 constant against the null text, no temperature.
RL (docs/algorithm.md section 10, NOVA column): G = 4, 3 prompts per step (3 GPUs x 1), lr 2e-6 constant, AdamW (0.9,
0.999, 1e-8) wd 0, grad clip 1.0, beta 0.01, 12 of the 63 non-empty AR steps and 10 of 25 diffusion steps scored, flow
SDE noise level 0.7 in rollouts (``rl.flow_noise_level``), S = 3 MTE seeds, top 30 %, consistency selection, channel
reduction 'mean', 1200 iterations, reward HPS v2.1; trained: the transformer without its head
(``NOVA.policy_components``); frozen: DiffusionMLP, Phi-2, VAE.
``checkpoint``, ``model.tokenizer_path`` and ``model.vae_checkpoint`` must be set except in plan mode (the sample
job says so in one sentence; so do ``NOVA.prompt_ids`` / ``NOVA.decode_images``).
"""
import ml_collections

from margrpo_jax import config_files
from margrpo_jax.models import nova

SHORT = {"d48w768": "d48w768-sdxl1024", "d48w1024": "d48w1024-sdxl1024", "d48w1536": "d48w1536-sdxl1024",
         "sd512": "d48w1024-sd512", "osp480": "d48w1024-osp480"}


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  if arg == "tiny":  # the name it had before "random"
    raise ValueError("config arg 'tiny' is now 'random' (the few-layer random-weight instance)")
  if arg == "random":
    c = config_files.random_weights(get_config("sd512"), "nova")
    c.sampling.num_steps = 8  # NOVA's rounded schedule drops a zero-count step here: 7 AR steps
    return c
  variant = SHORT.get(arg or "sd512", arg)
  if variant not in nova.VARIANTS:
    raise ValueError(f"unknown config arg {arg!r} for nova (variants: {', '.join(SHORT)} or "
                     f"{', '.join(nova.VARIANTS)}, or random)")
  c = config_files.real_size(nova.nova_config(variant))
  c.num_iters = 1200
  c.sampling.update(num_steps=64, diffusion_steps="25", cfg_scale=5.0, cfg_schedule="constant", temperature=1.0,
                    clip_denoised=False)
  c.sampling.mask_schedule = "cos_round"  # NOVA: m_i = round(L cos(pi/2 i/N)), zero-count steps skipped
  c.sampling.flow_noise_level = 0.0       # Euler ODE (NOVA); rollouts use rl.flow_noise_level
  c.rl.update(group_size=4, prompts_per_iter=3, num_ar_steps=12, num_diffusion_steps=10, mte_seeds=3,
              topk_fraction=0.3, consistency=True, beta=0.01, channel_reduction="mean", remat=True,
              diffusion_window="1:-1")  # no sigma = 1 first step, no near-deterministic last SDE step (std ~7e-4)
  c.rl.rewards.hps = 1.0
  c.optim.update(lr=2e-6, warmup_steps=0, decay="constant", b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.0,
                 grad_clip=1.0)
  return c
