"""Named RNG streams: every random choice draws from ``stream(key, name)``, a fold of one base key.

Streams in use: 'order' (generation order), 'diffusion' (per-AR-step head noise), 'mask' / 'ratio'
(pretraining masks), 'label_drop', 'timestep', 'noise', 'data', 'lora' (LoRA's initial A). Same seed, same results.
"""
import zlib

import jax


def stream(key: jax.Array, name: str) -> jax.Array:
  return jax.random.fold_in(key, zlib.crc32(name.encode()) & 0x7FFFFFFF)
