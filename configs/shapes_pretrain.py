"""Pretrain the shapes-world MAR from scratch (the shipped base checkpoint came from this config).

python -m margrpo_jax.main --config=configs/shapes_pretrain.py --workdir=runs/pretrain
The MAR models the latents of the shipped shapes-world tokenizer (``model.vae_checkpoint='shapes_tokenizer'``:
16 tokens of 8 values; configs/shapes_tokenizer.py trained it); arg ``:patches`` models raw 4 x 4 pixel patches
instead (64 tokens of 48 values). Arg ``:smoke`` shrinks everything for a seconds-long CPU check.
"""
import ml_collections

from margrpo_jax.models import tiny
from margrpo_jax.parallel import mesh


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  parts = [a for a in (arg or "").split(",") if a]
  unknown = [p for p in parts if p not in ("smoke", "patches")]
  if unknown:
    raise ValueError(f"unknown config arg {unknown[0]!r} for shapes_pretrain (known: 'smoke', 'patches')")
  c = ml_collections.ConfigDict()
  c.mode = "pretrain"
  c.seed = 0
  c.model = tiny.tiny_config("" if "patches" in parts else "shapes_tokenizer")
  c.tfds_dir = ""  # where the shapes_world TFDS is built; '' = <workdir>/tfds
  c.batch_size = 64
  c.num_steps = 10000
  c.log_every = 50
  c.optim = dict(lr=5e-4, warmup_steps=200, decay="cosine", final_lr_frac=0.05, b1=0.9, b2=0.95, eps=1e-8,
                 weight_decay=0.02, grad_clip=3.0)
  c.ema_decay = 0.999
  # mask_ratio: 'cosine' (MaskGIT, matches the sampler) | 'truncnorm' (MAR: [mask_ratio_min, 1], std 0.25)
  c.mar = dict(mask_ratio="cosine", mask_ratio_min=0.7, mask_ratio_std=0.25, diffusion_batch_mul=4, label_drop=0.1)
  c.parallel = mesh.config()  # device mesh, sharding rules, multi-host (margrpo_jax/parallel/mesh.py)
  c.export = dict(dtype="float32", dir="")  # mode=export: params-only checkpoint ('bfloat16' halves it)
  # clip_denoised = r: x0_hat clipped to [-r, r] in each diffusion step: the pixels' range, or 5 for the tokenizer's
  # unit-variance latents (|x| < 4.9 for 99.9 % of them); unclipped, the first step's 1 / sqrt(abar) ~ 650 turns
  # the head's eps error into latents of std ~ 500
  c.sampling = dict(num_steps=16, diffusion_steps="25", cfg_scale=3.0, cfg_schedule="linear", temperature=1.0,
                    clip_denoised=1.0 if "patches" in parts else 5.0)
  # every `every` steps: `num_prompts` eval prompts; after the last step: `final_num_prompts` (0: all 512)
  c.eval = dict(every=1000, num_prompts=128, final_num_prompts=0, batch_size=64, seed=0)
  c.save = dict(every=250, keep=3)  # train-state checkpoints (Orbax) every N steps
  if "smoke" in parts:
    c.model.text.update(width=32, depth=1, num_heads=2)
    c.model.backbone.update(width=32, encoder_depth=1, decoder_depth=1, num_heads=2)
    c.model.head.update(width=32, depth=1)
    c.batch_size, c.num_steps, c.log_every = 8, 4, 2
    c.optim.warmup_steps = 2
    c.sampling.update(num_steps=4, diffusion_steps="5")
    c.eval.update(every=4, num_prompts=8, final_num_prompts=8, batch_size=8)
    c.save.every = 2
  return c
