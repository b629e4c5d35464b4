"""Train the shapes-world tokenizer, a KL autoencoder 32 x 32 x 3 -> 4 x 4 x 8 (the shipped one came from this).

python -m margrpo_jax.main --config=configs/shapes_tokenizer.py --workdir=runs/tokenizer
Arg ``:smoke`` shrinks it to a seconds-long CPU check. See margrpo_jax/jobs/tokenizer.py.
"""
import ml_collections

from margrpo_jax.models import vae


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.mode = "tokenizer"
  c.seed = 0
  c.model = vae.vae_config("shapes")
  c.batch_size = 64
  c.num_steps = 4000
  c.beta = 1e-3  # KL weight (per-element means)
  c.log_every = 100
  c.optim = dict(lr=2e-3, warmup_steps=200, decay="cosine", final_lr_frac=0.02, b1=0.9, b2=0.99, eps=1e-8,
                 weight_decay=0.0, grad_clip=1.0)
  c.eval = dict(every=1000, num_images=256)
  c.save = dict(every=500, keep=2)  # train-state checkpoints (Orbax) every N steps
  if arg == "smoke":
    c.model.update(ch=8, norm_groups=4)
    c.batch_size, c.num_steps, c.log_every = 8, 4, 2
    c.optim.warmup_steps = 2
    c.eval.update(every=4, num_images=8)
    c.save.every = 2
  elif arg:
    raise ValueError(f"unknown config arg {arg!r} for shapes_tokenizer (known: 'smoke')")
  return c
