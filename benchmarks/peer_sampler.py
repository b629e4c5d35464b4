"""This project's jitted MAR sampler beside a PyTorch one written as the official ``MAR.sample_tokens`` is, in one
run on the same machine, on the same weights.

    python benchmarks/peer_sampler.py [--size=base] [--batch=2] [--num_steps=8] [--diffusion_steps=25]
                                      [--cfg=2.9] [--temperature=1.0] [--repeats=2] [--threads=0]
                                      [--segments=1,4,8] [--depth=0]
    python benchmarks/peer_sampler.py --growth [--growth_tokens=16,64,256] [--growth_steps=8,32,64] [...]

The PyTorch side (:class:`TorchMAR`, official key names) follows LTH14/mar's ``sample_tokens``: per AR step the
MAE encoder on the buffer and the visible tokens, the decoder with mask tokens, the cosine mask schedule over a
random order, linear CFG, and the diffusion head's ancestral loop (``diffloss.sample``: learned-range variance,
eps-CFG on the doubled batch, ``temperature`` on the noise) for the tokens of that step only. Its random weights
are converted with ``convert/mar.py`` into the JAX model, and the two encoder / decoder passes are checked to
agree before anything is timed. Prints images/s for both (steady state, after a warm-up call), the JAX compile
time separately (this sampler at each ``--segments``: its AR steps in that many scans of their own shapes), the
work of each (encoder and decoder token-passes, head rows x diffusion steps) and, as JSON on the last line, the
ratio for the last ``--segments``. ``--growth``: how the cost grows, both samplers' s / batch (and this one's compile
time) over a grid of image-token counts (MARs of that ``seq_len``, same widths) and AR steps, in one run.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import torch  # noqa: E402  (before TensorFlow, which the project imports)
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from margrpo_jax.convert import mar as mar_convert  # noqa: E402
from margrpo_jax.diffusion import gaussian  # noqa: E402
from margrpo_jax.models import class_mar, families  # noqa: E402
from margrpo_jax.sampling import sampler as sampler_lib  # noqa: E402


class Block(nn.Module):
  """timm's pre-norm ViT block (qkv, proj, fc1, fc2)."""

  def __init__(self, d: int, heads: int):
    super().__init__()
    self.heads = heads
    self.norm1, self.norm2 = nn.LayerNorm(d, eps=1e-6), nn.LayerNorm(d, eps=1e-6)
    self.attn = nn.Module()
    self.attn.qkv, self.attn.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
    self.mlp = nn.Module()
    self.mlp.fc1, self.mlp.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

  def forward(self, x):
    b, n, d = x.shape
    q, k, v = self.attn.qkv(self.norm1(x)).reshape(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
    x = x + self.attn.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, d))
    return x + self.mlp.fc2(F.gelu(self.mlp.fc1(self.norm2(x))))


class Head(nn.Module):
  """SimpleMLPAdaLN (``diffloss.net``)."""

  def __init__(self, cin: int, width: int, cond: int, depth: int):
    super().__init__()
    self.time_embed = nn.Module()
    self.time_embed.mlp = nn.Sequential(nn.Linear(256, width), nn.SiLU(), nn.Linear(width, width))
    self.cond_embed, self.input_proj = nn.Linear(cond, width), nn.Linear(cin, width)
    self.res_blocks = nn.ModuleList()
    for _ in range(depth):
      b = nn.Module()
      b.in_ln = nn.LayerNorm(width, eps=1e-6)
      b.mlp = nn.Sequential(nn.Linear(width, width), nn.SiLU(), nn.Linear(width, width))
      b.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(width, 3 * width))
      self.res_blocks.append(b)
    self.final_layer = nn.Module()
    self.final_layer.norm_final = nn.LayerNorm(width, eps=1e-6, elementwise_affine=False)
    self.final_layer.linear = nn.Linear(width, 2 * cin)
    self.final_layer.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(width, 2 * width))

  def forward(self, x, t, c):
    freqs = torch.exp(-math.log(10000.0) * torch.arange(128, dtype=c.dtype) / 128)
    args = t.to(c.dtype)[:, None] * freqs[None]
    y = self.time_embed.mlp(torch.cat([torch.cos(args), torch.sin(args)], -1)) + self.cond_embed(c)
    x = self.input_proj(x)
    for b in self.res_blocks:
      shift, scale, gate = b.adaLN_modulation(y).chunk(3, -1)
      x = x + gate * b.mlp(b.in_ln(x) * (1 + scale) + shift)
    shift, scale = self.final_layer.adaLN_modulation(y).chunk(2, -1)
    return self.final_layer.linear(self.final_layer.norm_final(x) * (1 + scale) + shift)


def model_config(size: str, seq_len: int = 256, depth: int = 0):
  """MAR at ``class_mar.SIZES[size]`` with ``seq_len`` image tokens and, if ``depth``, that many encoder and decoder
  blocks (the cost-growth grid's smaller models)."""
  cfg = class_mar.mar_config(size)
  cfg.seq_len = seq_len
  if depth:
    cfg.backbone.encoder_depth = cfg.backbone.decoder_depth = depth
  return cfg


class TorchMAR(nn.Module):
  """MAR at ``model_config(...)`` with the official parameter names."""

  def __init__(self, size: str, seq_len: int = 256, depth: int = 0):
    super().__init__()
    cfg = model_config(size, seq_len, depth)
    d, depth, heads = cfg.backbone.width, cfg.backbone.encoder_depth, cfg.backbone.num_heads
    self.seq, self.buf, self.c = cfg.seq_len, cfg.buffer_size, cfg.token_dim
    n = self.seq + self.buf
    self.class_emb = nn.Embedding(cfg.num_classes, d)
    self.fake_latent = nn.Parameter(torch.randn(1, d) * 0.02)
    self.z_proj, self.z_proj_ln = nn.Linear(self.c, d), nn.LayerNorm(d, eps=1e-6)
    self.encoder_pos_embed_learned = nn.Parameter(torch.randn(1, n, d) * 0.02)
    self.encoder_blocks = nn.ModuleList([Block(d, heads) for _ in range(depth)])
    self.encoder_norm = nn.LayerNorm(d, eps=1e-6)
    self.decoder_embed = nn.Linear(d, d)
    self.mask_token = nn.Parameter(torch.randn(1, 1, d) * 0.02)
    self.decoder_pos_embed_learned = nn.Parameter(torch.randn(1, n, d) * 0.02)
    self.decoder_blocks = nn.ModuleList([Block(d, heads) for _ in range(cfg.backbone.decoder_depth)])
    self.decoder_norm = nn.LayerNorm(d, eps=1e-6)
    self.diffusion_pos_embed_learned = nn.Parameter(torch.randn(1, self.seq, d) * 0.02)
    self.diffloss = nn.Module()
    self.diffloss.net = Head(self.c, cfg.head.width, d, cfg.head.depth)

  def encoder(self, x, mask, class_embedding):
    b, d = x.shape[0], self.z_proj.out_features
    x = torch.cat([torch.zeros(b, self.buf, d, dtype=x.dtype), self.z_proj(x)], 1)
    mask = torch.cat([torch.zeros(b, self.buf, dtype=mask.dtype), mask], 1)
    x[:, :self.buf] = class_embedding[:, None]
    x = self.z_proj_ln(x + self.encoder_pos_embed_learned)
    x = x[(1 - mask).nonzero(as_tuple=True)].reshape(b, -1, d)  # the buffer and the visible tokens only
    for blk in self.encoder_blocks:
      x = blk(x)
    return self.encoder_norm(x), mask

  def decoder(self, x, mask):
    x = self.decoder_embed(x)
    full = self.mask_token.repeat(mask.shape[0], mask.shape[1], 1).to(x.dtype)
    full[(1 - mask).nonzero(as_tuple=True)] = x.reshape(-1, x.shape[-1])
    x = full + self.decoder_pos_embed_learned
    for blk in self.decoder_blocks:
      x = blk(x)
    return self.decoder_norm(x)[:, self.buf:] + self.diffusion_pos_embed_learned

  def head_sample(self, z, diff: gaussian.Diffusion, cfg: float, temperature: float):
    """``diffloss.sample`` with CFG: ``z`` is [cond ; uncond], the noise is shared by the two halves."""
    t = {k: torch.tensor(getattr(diff, k), dtype=torch.float32) for k in
         ("mean_coef_x", "mean_coef_eps", "log_betas", "posterior_log_variance_clipped")}
    half = z.shape[0] // 2
    x = torch.randn(half, self.c).repeat(2, 1)
    for j in reversed(range(diff.num_steps)):
      out = self.diffloss.net(x, torch.full((x.shape[0],), int(diff.timesteps[j])), z)
      eps, v = out[:, :self.c], out[:, self.c:]
      eps = torch.cat([eps[half:] + cfg * (eps[:half] - eps[half:])] * 2)
      mean = t["mean_coef_x"][j] * x - t["mean_coef_eps"][j] * eps
      frac = (v + 1) / 2
      log_var = frac * t["log_betas"][j] + (1 - frac) * t["posterior_log_variance_clipped"][j]
      noise = torch.randn(half, self.c).repeat(2, 1)
      x = mean + (j > 0) * torch.exp(0.5 * log_var) * noise * temperature
    return x[:half]

  @torch.no_grad()
  def sample_tokens(self, labels, num_iter: int, diff, cfg: float, temperature: float):
    b = labels.shape[0]
    mask, tokens = torch.ones(b, self.seq), torch.zeros(b, self.seq, self.c)
    orders = torch.stack([torch.randperm(self.seq) for _ in range(b)])
    class_embedding = torch.cat([self.class_emb(labels), self.fake_latent.repeat(b, 1)])
    for step in range(num_iter):
      x, m = self.encoder(torch.cat([tokens, tokens]), torch.cat([mask, mask]), class_embedding)
      z = self.decoder(x, m)
      mask_len = int(np.floor(self.seq * np.cos(math.pi / 2.0 * (step + 1) / num_iter)))
      mask_len = max(1, min(int(mask[0].sum()) - 1, mask_len))
      mask_next = torch.zeros(b, self.seq)
      mask_next.scatter_(1, orders[:, :mask_len], 1.0)
      pred = (mask.bool() if step == num_iter - 1 else mask.bool() & ~mask_next.bool())
      rows = pred.nonzero(as_tuple=True)
      zz = torch.cat([z[:b][rows], z[b:][rows]])
      cfg_iter = 1 + (cfg - 1) * (self.seq - mask_len) / self.seq
      tokens[rows] = self.head_sample(zz, diff, cfg_iter, temperature)
      mask = mask_next
    return tokens


def conditions() -> dict:
  """Where a ratio was measured (it moves between machines, docs/reference.md "Benchmarks"): CPU model and ISA
  flags, cores, ``XLA_FLAGS``, JAX and PyTorch versions."""
  info = []
  if os.path.exists("/proc/cpuinfo"):
    with open("/proc/cpuinfo") as f:
      info = f.read().splitlines()
  field = lambda name: next((l.split(":", 1)[1].strip() for l in info if l.startswith(name)), "")
  isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_tile") if f in field("flags").split()]
  return dict(cpu=field("model name") or "?", isa=isa, cores=os.cpu_count(), xla_flags=os.environ.get("XLA_FLAGS", ""),
              jax=jax.__version__, torch=torch.__version__)


def paired_models(size: str, threads: int = 0, seq_len: int = 256, depth: int = 0):
  """``(torch model, its state dict as numpy, model_cfg, graphdef, params)``: a random-weight :class:`TorchMAR`
  (seed 0) and the same weights converted into this project's model by ``convert/mar.py``."""
  if threads:
    torch.set_num_threads(threads)
  torch.manual_seed(0)
  ref = TorchMAR(size, seq_len, depth)
  sd = {k: v.detach().numpy().copy() for k, v in ref.state_dict().items()}
  model_cfg, params, _ = mar_convert.convert(sd, "torch MAR", model_cfg=model_config(size, seq_len, depth))
  graphdef, _ = nnx.split(nnx.eval_shape(lambda: families.build(model_cfg)))
  return ref, sd, model_cfg, graphdef, jax.tree.map(jnp.asarray, params)


def _agree(ref: TorchMAR, graphdef, params, seed: int = 0) -> float:
  """Max |difference| of the decoder outputs z (same tokens, mask, labels) of the two models."""
  g = torch.Generator().manual_seed(seed)
  tokens, labels = torch.randn(2, ref.seq, ref.c, generator=g), torch.tensor([3, 7])
  mask = (torch.rand(2, ref.seq, generator=g) < 0.5).float()
  mask[1] = mask[0]  # same count per row, as the sampler's masks have
  with torch.no_grad():
    x, m = ref.encoder(tokens, mask, ref.class_emb(labels))
    want = ref.decoder(x, m).numpy()
  model = nnx.merge(graphdef, params)
  got = model.backbone(jnp.asarray(tokens.numpy()), jnp.asarray(mask.numpy().astype(bool)),
                       model.condition(jnp.asarray(labels.numpy())))
  return float(np.max(np.abs(np.asarray(got) - want)))


def work(model, diff, sched, batch: int, segments) -> dict:
  """Token-passes through the encoder and the decoder and head rows (x diffusion steps) of one guided batch: per
  step, ``segments=None`` is the official loop (the buffer and the known tokens, the step's own count), else this
  sampler's runs of steps (each at its largest known prefix and count; the full encoder without a gather)."""
  bb, rows = model.backbone, 2 * batch  # [cond ; uncond]
  spans = [(s, s + 1) for s in range(sched.num_steps)] if segments is None else sampler_lib.step_segments(
      model, diff, sched, segments)
  gather = segments is None or sampler_lib.gathers_known(model)
  out = dict(encoder=0, decoder=0, head=0)
  for lo, hi in spans:
    for s in range(lo, hi):
      out["encoder"] += rows * (bb.buffer_size + (int(sched.starts[hi - 1]) if gather else bb.seq_len))
      out["decoder"] += rows * (bb.buffer_size + bb.seq_len)
      out["head"] += rows * int(sched.counts[lo:hi].max()) * diff.num_steps
  return out


def time_jax(graphdef, params, diff, labels, repeats: int, **sampler) -> tuple[float, float]:
  """``(s / batch, compile s)`` of this project's jitted sampler (``sampler``: SamplerConfig fields): the median of
  ``repeats`` calls on fresh keys after a first, compiling one."""
  fn = sampler_lib.make_sample_fn(graphdef, diff, sampler_lib.SamplerConfig(cfg_schedule="linear", **sampler))
  t0 = time.perf_counter()
  jax.block_until_ready(fn(params, jnp.asarray(labels), jax.random.key(0)))
  first = time.perf_counter() - t0
  times = []
  for r in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(params, jnp.asarray(labels), jax.random.key(r + 1)))
    times.append(time.perf_counter() - t0)
  return float(np.median(times)), first - float(np.median(times))


def time_torch(ref: TorchMAR, labels, num_steps: int, diff, cfg: float, temperature: float, repeats: int) -> float:
  """s / batch of the official structure: the median of ``repeats`` calls after a one-step warm-up."""
  y = torch.from_numpy(labels).long()
  ref.sample_tokens(y, 1, diff, cfg, temperature)
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    ref.sample_tokens(y, num_steps, diff, cfg, temperature)
    times.append(time.perf_counter() - t0)
  return float(np.median(times))


def growth(a, diff, labels) -> None:
  """The cost-growth grid: for each image-token count (a MAR of that ``seq_len``, same widths) and each number of
  AR steps (at most one token per step), both samplers' s / batch and this one's compile time, in one run."""
  print(f"cost growth: MAR-{a.size}{f' ({a.depth} + {a.depth} blocks)' if a.depth else ''}, batch {a.batch}, "
        f"{diff.num_steps} diffusion steps, CFG {a.cfg}, {a.segments.split(',')[-1]} segments, {a.repeats} timed "
        f"runs each (median)")
  print("| image tokens | AR steps | margrpo_jax s / batch | compile s | PyTorch s / batch | speedup |\n"
        "|---|---|---|---|---|---|")
  cells = []
  for seq_len in [int(x) for x in a.growth_tokens.split(",")]:
    ref, _, _, graphdef, params = paired_models(a.size, a.threads, seq_len, a.depth)
    ref.eval()
    assert _agree(ref, graphdef, params) < 1e-3, "the converted model disagrees with the PyTorch one"
    for n in [int(x) for x in a.growth_steps.split(",")]:
      if n > seq_len:
        print(f"| {seq_len} | {n} | - | - | - | - |")
        continue
      jax_s, comp = time_jax(graphdef, params, diff, labels, a.repeats, num_steps=n, cfg_scale=a.cfg,
                             temperature=a.temperature, segments=int(a.segments.split(",")[-1]))
      torch_s = time_torch(ref, labels, n, diff, a.cfg, a.temperature, a.repeats)
      cells.append(dict(tokens=seq_len, ar_steps=n, jax_s=round(jax_s, 3), compile_s=round(comp, 1),
                        torch_s=round(torch_s, 3), speedup=round(torch_s / jax_s, 3)))
      print(f"| {seq_len} | {n} | {jax_s:.2f} | {comp:.1f} | {torch_s:.2f} | {torch_s / jax_s:.2f}x |", flush=True)
  print(json.dumps(dict(growth=cells, **conditions())))


def growth_args(ap: argparse.ArgumentParser, timed: str) -> None:
  """The flags both peer benchmarks share: smaller MARs and the cost-growth grid (run at the last ``timed``)."""
  ap.add_argument("--depth", type=int, default=0, help="encoder and decoder blocks each (0: the size's)")
  ap.add_argument("--growth", action="store_true", help="the cost-growth grid instead (--growth_tokens x "
                  f"--growth_steps, the last {timed})")
  ap.add_argument("--growth_tokens", default="16,64,256")
  ap.add_argument("--growth_steps", default="8,32,64")


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--size", default="base", choices=sorted(class_mar.SIZES))
  ap.add_argument("--batch", type=int, default=2)
  ap.add_argument("--num_steps", type=int, default=8)
  ap.add_argument("--diffusion_steps", default="25")
  ap.add_argument("--cfg", type=float, default=2.9)
  ap.add_argument("--temperature", type=float, default=1.0)
  ap.add_argument("--repeats", type=int, default=2)
  ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
  ap.add_argument("--segments", default="1,4,8", help="this sampler's SamplerConfig.segments to time, comma-separated "
                  "(the last one is the ratio's)")
  growth_args(ap, "--segments")
  a = ap.parse_args()
  diff = gaussian.make_diffusion(1000, a.diffusion_steps)
  labels = np.arange(a.batch, dtype=np.int32) % 1000
  if a.growth:
    return growth(a, diff, labels)
  ref, sd, _, graphdef, params = paired_models(a.size, a.threads, depth=a.depth)
  ref.eval()
  err = _agree(ref, graphdef, params)
  n_params = sum(v.size for v in sd.values())
  print(f"MAR-{a.size}: {n_params / 1e6:.1f}M parameters; encoder/decoder z agree to {err:.1e} (max |diff|)")
  sched = sampler_lib.mask_schedule("cosine", ref.seq, a.num_steps)
  model = nnx.merge(graphdef, params)
  rows = []  # (segments, images/s, s / batch, compile s, work)
  for segments in [int(x) for x in a.segments.split(",")]:
    jax_s, comp = time_jax(graphdef, params, diff, labels, a.repeats, num_steps=a.num_steps, cfg_scale=a.cfg,
                           temperature=a.temperature, segments=segments)
    rows.append((segments, a.batch / jax_s, jax_s, comp, work(model, diff, sched, a.batch, segments)))
  torch_s = time_torch(ref, labels, a.num_steps, diff, a.cfg, a.temperature, a.repeats)
  official = work(model, diff, sched, a.batch, None)
  print("conditions:", json.dumps(conditions()))
  print(f"batch {a.batch}, {a.num_steps} AR steps, {diff.num_steps} diffusion steps, CFG {a.cfg}, temperature "
        f"{a.temperature}, {a.repeats} timed runs each (median), torch threads {torch.get_num_threads()}")
  print("| sampler | images/s | s / batch | compile s | encoder token-passes | decoder token-passes | head rows |\n"
        "|---|---|---|---|---|---|---|")
  for segments, ips, sec, comp, w in rows:
    print(f"| margrpo_jax (jit, {segments} segment{'s' * (segments > 1)}) | {ips:.3f} | {sec:.2f} | {comp:.1f} | "
          f"{w['encoder']} | {w['decoder']} | {w['head']} |")
  print(f"| PyTorch, official structure | {a.batch / torch_s:.3f} | {torch_s:.2f} | - | {official['encoder']} | "
        f"{official['decoder']} | {official['head']} |")
  last = rows[-1]
  print(json.dumps(dict(speedup_vs_torch=round(torch_s / last[2], 3), segments=last[0],
                        more_work_than_official=any(last[4][k] > official[k] for k in official), **conditions())))


if __name__ == "__main__":
  main()
