"""How much of the official MAR sampling loop's arithmetic can be skipped without changing the images.

    python benchmarks/work_bound.py [--size=base] [--batch=2] [--num_steps=8] [--diffusion_steps=25] [--cfg=2.9]

Counts multiply-accumulates (MACs) from the shapes alone (no weights, nothing timed) for one guided batch in the
official structure (``peer_sampler.py``'s defaults): per AR step the encoder on the buffer and the known tokens,
the decoder on all ``buffer + L`` positions, the head on the step's own tokens at every diffusion step; rows
doubled for CFG. A transformer block costs ``12 d^2 + 2 n d`` per query (QKV, output projection, a 4x MLP; scores
and values over ``n`` keys); a head row-step ``SimpleMLPAdaLN``'s linears. Then the products whose results the
images never read, or that repeat: the decoder's last block at positions the head does not read (only its keys
and values are needed there), the head's condition embedding at every diffusion step (once per AR step is
enough), and the unconditional half at a step whose guidance scale is exactly 1. With the two libraries' matrix
products equally fast, the sampler can beat the official loop by at most ``1 / (1 - skippable)``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from margrpo_jax.models import class_mar  # noqa: E402
from margrpo_jax.sampling import sampler as sampler_lib  # noqa: E402
from margrpo_jax.sampling import schedule as schedule_lib  # noqa: E402


def block_macs(queries: int, keys: int, d: int) -> int:
  return queries * (12 * d * d + 2 * keys * d)


def head_row_macs(c: int, cond: int, w: int, depth: int, freq: int = 256) -> dict:
  return dict(time=freq * w + w * w, cond=cond * w, rest=c * w + depth * (3 * w * w + 2 * w * w) + 2 * w * w + w * 2 * c)


def bound(size: str, batch: int, num_steps: int, diffusion_steps: int, cfg: float) -> dict:
  mc = class_mar.mar_config(size)
  d, depth_e, depth_d = mc.backbone.width, mc.backbone.encoder_depth, mc.backbone.decoder_depth
  buf, seq = mc.buffer_size, mc.seq_len
  sched = sampler_lib.mask_schedule("cosine", seq, num_steps)
  scales = schedule_lib.cfg_schedule(sched, seq, cfg, "linear")
  row = head_row_macs(mc.token_dim, d, mc.head.width, mc.head.depth)
  rows, t = 2 * batch, diffusion_steps
  parts = dict(encoder=0, decoder=0, head=0)
  skip = dict(decoder_last_block=0, head_cond_embed=0, uncond_at_scale_1=0)
  for s in range(sched.num_steps):
    known, count = int(sched.starts[s]), int(sched.counts[s])
    enc = depth_e * block_macs(rows * (buf + known), buf + known, d)
    dec = depth_d * block_macs(rows * (buf + seq), buf + seq, d)
    head = rows * count * t * sum(row.values())
    parts["encoder"] += enc
    parts["decoder"] += dec
    parts["head"] += head
    unread = rows * (buf + seq - count)  # the last block's queries the head never reads (keys / values still needed)
    skip["decoder_last_block"] += unread * (10 * d * d + 2 * (buf + seq) * d)
    skip["head_cond_embed"] += rows * count * (t - 1) * row["cond"]
    if scales[s] == 1.0:
      skip["uncond_at_scale_1"] += (enc + dec + head) // 2
  total = sum(parts.values())
  frac = sum(skip.values()) / total
  return dict(size=size, batch=batch, num_steps=num_steps, diffusion_steps=t, first_cfg_scale=float(scales[0]),
              gmacs={k: round(v / 1e9, 1) for k, v in {**parts, "total": total}.items()},
              skippable_gmacs={k: round(v / 1e9, 1) for k, v in skip.items()},
              head_time_embed_share=round(rows * sched.counts.sum() * t * row["time"] / total, 4),
              skippable_fraction=round(frac, 4), max_speedup_at_equal_throughput=round(1 / (1 - frac), 3))


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--size", default="base", choices=sorted(class_mar.SIZES))
  ap.add_argument("--batch", type=int, default=2)
  ap.add_argument("--num_steps", type=int, default=8)
  ap.add_argument("--diffusion_steps", type=int, default=25)
  ap.add_argument("--cfg", type=float, default=2.9)
  a = ap.parse_args()
  r = bound(a.size, a.batch, a.num_steps, a.diffusion_steps, a.cfg)
  print(f"official loop, MAR-{a.size}, batch {a.batch} x 2 (CFG), {a.num_steps} AR x {a.diffusion_steps} diffusion "
        f"steps: " + ", ".join(f"{k} {v} GMAC" for k, v in r["gmacs"].items()))
  print("skippable without changing the images: " + ", ".join(f"{k} {v} GMAC" for k, v in
                                                               r["skippable_gmacs"].items()))
  print(f"(first step's guidance scale {r['first_cfg_scale']:.4f}; the head's time embedding, one per diffusion "
        f"step here, would be {r['head_time_embed_share']:.1%} if run per row)")
  print(f"skippable {r['skippable_fraction']:.1%}: at equal matrix-product speed at most "
        f"{r['max_speedup_at_equal_throughput']:.3f}x the official loop")
  print(json.dumps(r))


if __name__ == "__main__":
  main()
