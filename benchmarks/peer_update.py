"""One MAR-GRPO loss-and-update: this project's jitted step beside a PyTorch one written as the official update
computes it, on the same weights and the same recorded batch, in one run on the same machine.

    python benchmarks/peer_update.py [--size=base] [--batch=4] [--ar_steps=2] [--diffusion_steps=2]
        [--mte_seeds=2] [--sampling_steps=8] [--respacing=25] [--remat=1] [--encoder_buckets=4] [--repeats=2]
        [--threads=0] [--depth=0]
    python benchmarks/peer_update.py --growth [--growth_tokens=16,64,256] [--growth_steps=8,32,64] [...]

Both compute the official loss (``rl.fidelity=official``'s switches, docs/algorithm.md): for each scored AR step
``i`` the backbone's latents recomputed with gradients from the recorded canvas; each recorded transition
``x_j -> x_{j-1}`` (``--diffusion_steps`` per AR step) scored under the frozen head's Gaussian, channel-summed;
``rho = exp(l - sg(l))`` (value 1, gradient ``A grad l``); the mean over ``S`` MTE trajectories replacing the
top-k uncertain tokens; the k3 penalty on the means against the reference; then global-norm clipping and AdamW on
the backbone. The batch (rollout, MTE chains, top-k, consistency selection, reference means) is built once by
this project (``rl/step.py: build_batch``) and handed to both; the PyTorch side (:func:`torch_loss`) follows
``rl/loss.py`` term by term on :class:`peer_sampler.TorchMAR` (official key names). Before anything is timed the
two gradients, the torch one mapped through ``convert/mar.py``, must agree. Prints s / update for both (median
of ``--repeats`` after a warm-up), the JAX compile time, and their ratio; the last line is that ratio as JSON
(``speedup_vs_torch``). ``--growth``: both updates' s / update over a grid of image-token counts (MARs of that
``seq_len``) and the rollout's AR steps, in one run.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import json
import math
import time

import torch  # noqa: I001 - torch, with the optimizers' dynamo / triton imports, before TensorFlow (else a segfault)
import torch._dynamo  # noqa: F401
from peer_sampler import TorchMAR, conditions, growth_args, paired_models  # sets JAX_PLATFORMS and the project's path

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from margrpo_jax import config_files  # noqa: E402
from margrpo_jax.convert import mar as mar_convert  # noqa: E402
from margrpo_jax.jobs import rl as rl_job  # noqa: E402
from margrpo_jax.models import class_mar  # noqa: E402
from margrpo_jax.rl import config as rl_config, loss as loss_lib, step as step_lib  # noqa: E402
from margrpo_jax.sampling import sampler as sampler_lib  # noqa: E402

class_mar.SIZES.setdefault("small", (64, 2, 4, 2, 64))  # --size=small: a quick check of the agreement only
TABLES = ("mean_coef_x", "mean_coef_eps", "log_betas", "posterior_log_variance_clipped", "sqrt_recip_alphas_cumprod",
          "sqrt_recipm1_alphas_cumprod", "posterior_mean_coef1", "posterior_mean_coef2")


def check_official(lc: loss_lib.LossConfig, bc) -> None:
  """The switches :func:`torch_loss` implements (the official ones for MAR-family heads)."""
  want = dict(ratio="none", clip_eps=0.0, kl="official", cfg_in_loss=False, sigma_grad=False, mte_actual="replace",
              logp="chain", logp_bf16=False)
  got = {k: getattr(lc, k) for k in want}
  assert got == want, f"torch_loss implements {want}, the config has {got}"
  assert bc.uncertainty_unit == "token", bc.uncertainty_unit


def torch_loss(model: TorchMAR, diff, lc: loss_lib.LossConfig, b: dict) -> torch.Tensor:
  """``rl/loss.py: loss_fn`` under the official switches, in PyTorch; ``b``: the TrainBatch as torch tensors."""
  tab = {k: torch.tensor(np.asarray(getattr(diff, k)), dtype=b["x_t"].dtype) for k in TABLES}
  timesteps = torch.tensor(np.asarray(diff.timesteps), dtype=torch.long)
  reduce = (lambda e: e.sum(-1)) if lc.channel_reduction == "sum" else (lambda e: e.mean(-1))
  adv = b["adv"][None, :, None]
  cond = model.class_emb(b["ids"])

  def score(xt, xp, z, j):  # (k, B, N, C) transitions under latents z (B, N, D) at respaced steps j (k,)
    k, bsz, n, c = xt.shape
    jj = j[:, None, None].expand(k, bsz, n)
    out = model.diffloss.net(xt.reshape(-1, c), timesteps[jj].reshape(-1),
                             z[None].expand(k, bsz, n, z.shape[-1]).reshape(-1, z.shape[-1])).reshape(k, bsz, n, 2 * c)
    eps, v = out[..., :c], out[..., c:]
    t = {name: tab[name][jj][..., None] for name in TABLES}
    if lc.clip_denoised:
      x0 = (t["sqrt_recip_alphas_cumprod"] * xt - t["sqrt_recipm1_alphas_cumprod"] * eps).clamp(
          -float(lc.clip_denoised), float(lc.clip_denoised))
      mean = t["posterior_mean_coef1"] * x0 + t["posterior_mean_coef2"] * xt
    else:
      mean = t["mean_coef_x"] * xt - t["mean_coef_eps"] * eps
    frac = (v + 1.0) / 2.0
    std = (torch.exp(0.5 * (frac * t["log_betas"] + (1.0 - frac) * t["posterior_log_variance_clipped"]))
           * lc.temperature).detach()
    lp = -((xp - mean) ** 2) / (2.0 * std ** 2) - torch.log(std) - 0.5 * math.log(2 * math.pi)
    return lp, mean

  pol_sum = pol_cnt = kl_sum = kl_cnt = 0.0
  for i in range(b["j"].shape[0]):
    x, m = model.encoder(b["canvas"][i], (~b["visible"][i]).float(), cond)
    z = model.decoder(x, m)
    pos = b["positions"][i]
    z_p = torch.gather(z, 1, pos[..., None].expand(-1, -1, z.shape[-1]))
    lp, mean = score(b["x_t"][i], b["x_prev"][i], z_p, b["j"][i])
    logp = reduce(lp)
    q = torch.exp((logp - logp.detach()).clamp(-20, 20)) * adv
    if b["mte_x_t"].shape[0] and b["uncertain_idx"].shape[-1]:
      idx = b["uncertain_idx"][i]  # (B, K)
      z_u = torch.gather(z_p, 1, idx[..., None].expand(-1, -1, z_p.shape[-1]))
      q_s = []
      for s in range(b["mte_x_t"].shape[0]):
        l_s = reduce(score(b["mte_x_t"][s, i], b["mte_x_prev"][s, i], z_u, b["j"][i])[0])
        q_s.append(torch.exp((l_s - l_s.detach()).clamp(-20, 20)) * adv)
      mte = torch.stack(q_s).mean(0)  # (k, B, K): 'replace', the official overwrite
      mine = torch.gather(b["uncertain"][i], 1, idx)[None]
      own = torch.gather(q, 2, idx[None].expand(q.shape[0], -1, -1))
      q = q.scatter(2, idx[None].expand(q.shape[0], -1, -1), torch.where(mine, mte, own))
    keep = b["keep"][i][None].expand_as(q).float()
    pol_sum, pol_cnt = pol_sum + (keep * q).sum(), pol_cnt + keep.sum()
    if lc.beta:
      d = b["ref_mean"][i] - mean
      kl = reduce(torch.exp(d) - d - 1.0)
      region = b["region"][i][None].expand_as(kl).float()
      kl_sum, kl_cnt = kl_sum + (region * kl).sum(), kl_cnt + region.sum()
  policy = pol_sum / max(float(pol_cnt), 1.0)
  kl = kl_sum / max(float(kl_cnt), 1.0) if lc.beta else 0.0
  return -(policy - lc.beta * kl)


def encoder_tokens(visible: np.ndarray, buffer: int, buckets: int) -> dict:
  """Encoder token-passes (rows x tokens, summed over the scored AR steps) of one loss forward: the official
  encoder's ``buffer + known`` per row; this project's ``buffer +`` the gathered size (``sampler.known_sizes``) or
  ``buffer + L`` without buckets. ``visible``: the batch's (M, B, L)."""
  m, b, seq_len = visible.shape
  known = visible.sum(-1)
  sizes = np.asarray(sampler_lib.known_sizes(seq_len, buckets) if buckets else (seq_len,))
  padded = sizes[np.searchsorted(sizes, known.max(-1))]  # (M,) each step's size
  return dict(jax=int(b * (buffer * m + padded.sum())), official=int(buffer * m * b + known.sum()))


def decay_split(model: TorchMAR):
  """AdamW's groups as ``optim.py`` masks them: decay on the backbone's matrices, not on biases, norms or the
  learned position embeddings; the head is frozen."""
  decay, no_decay = [], []
  for name, p in model.named_parameters():
    if name.startswith("diffloss."):
      p.requires_grad_(False)
    elif p.ndim >= 2 and not name.endswith("pos_embed_learned"):
      decay.append(p)
    else:
      no_decay.append(p)
  return decay, no_decay


def flat(tree) -> np.ndarray:
  return np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(tree)])


def agree(ref: TorchMAR, s, sd: dict, batch, tb: dict, model_cfg) -> None:
  """The two gradients (torch's mapped into the JAX tree by the converter) agree, else nothing is timed.

  A random-weight head's eps_hat is unrelated to x_t, so its chains drift to values ~1e3 while the last steps'
  std is ~1e-2: there ``(x_prev - mean) / std^2`` loses most float32 digits. So each float32 gradient (JAX's,
  PyTorch's) is compared with PyTorch's float64 one, on the whole batch and on the first scored (noisiest, better
  conditioned) diffusion step of each AR step: JAX's error must be of the size of PyTorch's own float32 error.
  """
  rel = lambda x, y: float(np.linalg.norm(x - y) / max(np.linalg.norm(y), 1e-300))

  def jax_grad(b):
    fn = lambda p: loss_lib.loss_fn(nnx.merge(s.graphdef, s.model_params(p)), s.diff, s.static.loss, b)[0]
    g = jax.jit(jax.grad(fn))(s.policy)
    return flat({k: g[k] for k in s.policy})

  def torch_grad(model, b):
    model.zero_grad(set_to_none=True)
    torch_loss(model, s.diff, s.static.loss, b).backward()
    g = {k: (p.grad.double().numpy() if p.grad is not None else np.zeros(p.shape)) for k, p in
         model.named_parameters()}
    model.zero_grad(set_to_none=True)
    tree = mar_convert.convert({k: g.get(k, np.zeros(sd[k].shape)) for k in sd}, "torch grads", model_cfg=model_cfg)[1]
    return flat({k: tree[k] for k in s.policy})

  first = lambda x, axis: x[(slice(None),) * axis + (slice(0, 1),)]
  ks = dict(j=1, x_t=1, x_prev=1, old_logp=1, ref_mean=1, ref_std=1, mte_x_t=2, mte_x_prev=2, mte_old_logp=2)
  ref64 = copy.deepcopy(ref).double()
  for name, b, t in (("whole batch", batch, tb),
                     (f"noisiest scored steps (j = {np.asarray(batch.j)[:, 0].tolist()})",
                      batch.replace(**{k: first(getattr(batch, k), ax) for k, ax in ks.items()}),
                      {**tb, **{k: first(tb[k], ax) for k, ax in ks.items()}})):
    g64 = torch_grad(ref64, {k: v.double() if v.is_floating_point() else v for k, v in t.items()})
    e_jax, e_torch = rel(jax_grad(b), g64), rel(torch_grad(ref, t), g64)
    print(f"gradient vs PyTorch float64, {name}: JAX float32 {e_jax:.1e}, PyTorch float32 {e_torch:.1e} "
          f"(|g| {np.linalg.norm(g64):.3e})")
    assert e_jax < 3 * e_torch + 1e-6, f"JAX's gradient ({name}) is further from float64 than PyTorch's float32 one"


def measure(a, seq_len: int = 256, sampling_steps: int | None = None, check: bool = True):
  """``(jax_rows, torch s / update)`` on a MAR of ``seq_len`` tokens whose rollout ran ``sampling_steps`` AR steps
  (``--sampling_steps``): ``jax_rows`` one ``(buckets, s / update, compile s, encoder token-passes)`` per
  ``--encoder_buckets``; with ``check`` the two gradients are compared first (:func:`agree`)."""
  ref, sd, model_cfg, graphdef, params = paired_models(a.size, a.threads, seq_len, a.depth)
  c = config_files.load("mar", "base")  # the paper's RL settings (overridden below where the flags say)
  c.mode = "rl"
  c.rl.fidelity = "official"
  c.rl.update(group_size=2, prompts_per_iter=a.batch // 2, num_ar_steps=a.ar_steps,
              num_diffusion_steps=a.diffusion_steps, mte_seeds=a.mte_seeds, remat=a.remat > 0,
              remat_ar_steps=a.remat == 1)
  c.sampling.update(num_steps=sampling_steps or a.sampling_steps, diffusion_steps=a.respacing)
  c.parallel.mesh.update(data=1, fsdp=1, tensor=1)
  rl_config.resolve_fidelity(c)
  s = rl_job.setup(c, (model_cfg, graphdef, params))
  buckets = [int(x) for x in a.encoder_buckets.split(",")]
  with_buckets = lambda n: dataclasses.replace(s.static, loss=dataclasses.replace(s.static.loss, encoder_buckets=n))
  sc = s.static = with_buckets(buckets[-1])
  check_official(sc.loss, sc.batch)
  labels = jnp.asarray(np.arange(a.batch, dtype=np.int32) * 97 % model_cfg.num_classes)
  final, rec = s.rollout_fn(s.model_params(s.policy), labels, jax.random.key(0))
  adv = jnp.asarray(np.random.default_rng(0).normal(size=a.batch).astype(np.float32))
  batch, _ = jax.jit(functools.partial(step_lib.build_batch, s.graphdef, s.diff, sc))(
      s.policy, s.frozen, s.ref, labels, adv, rec, final, jax.random.key(1))

  tb = {k: torch.from_numpy(np.array(v)) for k, v in vars(batch).items() if isinstance(v, jax.Array)}
  tb["ids"] = tb["ids"].long()
  for k in ("positions", "uncertain_idx"):
    tb[k] = tb[k].long()
  decay, no_decay = decay_split(ref)
  if check:
    print(f"MAR-{a.size}, {seq_len} tokens: {sum(v.size for v in sd.values()) / 1e6:.1f}M parameters; batch "
          f"{a.batch}, M = {a.ar_steps} AR steps x k = {a.diffusion_steps} diffusion steps scored, S = {a.mte_seeds}, "
          f"top {sc.batch.topk_fraction:.0%}, JAX remat {sc.loss.remat} (whole AR steps: {sc.loss.remat_ar_steps})")
    agree(ref, s, sd, batch, tb, model_cfg)

  fresh = lambda: jax.tree.map(jnp.copy, s.init_state())
  jax_rows = []
  for n in buckets:
    update = jax.jit(functools.partial(step_lib.update, s.graphdef, s.tx, s.diff, with_buckets(n)), donate_argnums=0)
    t0 = time.perf_counter()
    jax.block_until_ready(update(fresh(), s.frozen, batch))
    first = time.perf_counter() - t0
    times = []
    for _ in range(a.repeats):
      state = fresh()
      jax.block_until_ready(state)
      t0 = time.perf_counter()
      jax.block_until_ready(update(state, s.frozen, batch))
      times.append(time.perf_counter() - t0)
    jax_s = float(np.median(times))
    jax_rows.append((n, jax_s, first - jax_s, encoder_tokens(np.asarray(batch.visible), model_cfg.buffer_size, n)))

  oc = c.optim
  opt = torch.optim.AdamW([dict(params=decay, weight_decay=oc.weight_decay), dict(params=no_decay, weight_decay=0.0)],
                          lr=oc.lr, betas=(oc.b1, oc.b2), eps=oc.eps)
  trainable = decay + no_decay

  def torch_update():
    opt.zero_grad(set_to_none=True)
    torch_loss(ref, s.diff, sc.loss, tb).backward()
    torch.nn.utils.clip_grad_norm_(trainable, oc.grad_clip)
    opt.step()

  torch_update()  # warm-up
  times = []
  for _ in range(a.repeats):
    t0 = time.perf_counter()
    torch_update()
    times.append(time.perf_counter() - t0)
  return jax_rows, float(np.median(times))


def growth(a) -> None:
  """The cost-growth grid: s / update of both over image-token counts x the rollout's AR steps (the update scores
  ``--ar_steps`` of them), the gradients compared once per token count."""
  print(f"cost growth: MAR-{a.size}{f' ({a.depth} + {a.depth} blocks)' if a.depth else ''}, batch {a.batch}, "
        f"M = {a.ar_steps} x k = {a.diffusion_steps} scored, S = {a.mte_seeds}, encoder buckets "
        f"{a.encoder_buckets.split(',')[-1]}, {a.repeats} timed updates each (median)")
  rows, cells = [], []
  for seq_len in [int(x) for x in a.growth_tokens.split(",")]:
    checked = False
    for n in [int(x) for x in a.growth_steps.split(",")]:
      if n > seq_len:
        rows.append(f"| {seq_len} | {n} | - | - | - | - |")
        continue
      jax_rows, torch_s = measure(a, seq_len, n, check=not checked)
      checked = True
      _, jax_s, comp, _ = jax_rows[-1]
      cells.append(dict(tokens=seq_len, ar_steps=n, jax_s=round(jax_s, 3), compile_s=round(comp, 1),
                        torch_s=round(torch_s, 3), speedup=round(torch_s / jax_s, 3)))
      rows.append(f"| {seq_len} | {n} | {jax_s:.2f} | {comp:.1f} | {torch_s:.2f} | {torch_s / jax_s:.2f}x |")
      print(rows[-1], flush=True)
  print("| image tokens | rollout AR steps | margrpo_jax s / update | compile s | PyTorch s / update | speedup |\n"
        "|---|---|---|---|---|---|")
  print("\n".join(rows))
  print(json.dumps(dict(growth=cells, **conditions())))


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--size", default="base", choices=sorted(class_mar.SIZES))
  ap.add_argument("--batch", type=int, default=4, help="images per update (prompts x group size)")
  ap.add_argument("--ar_steps", type=int, default=2, help="scored AR steps M")
  ap.add_argument("--diffusion_steps", type=int, default=2, help="scored diffusion steps k per AR step")
  ap.add_argument("--mte_seeds", type=int, default=2, help="MTE trajectories S")
  ap.add_argument("--sampling_steps", type=int, default=8, help="AR steps of the rollout")
  ap.add_argument("--respacing", default="25", help="diffusion steps of the rollout")
  ap.add_argument("--remat", type=int, default=1, choices=(0, 1, 2), help="JAX: recompute each AR step, each block "
                  "and each diffusion step in the backward pass (1, rl.remat: the real-size configs' setting), only "
                  "each block and diffusion step (2, rl.remat_ar_steps=False) or keep every activation, as the "
                  "PyTorch structure does (0)")
  ap.add_argument("--encoder_buckets", default=str(loss_lib.LossConfig.encoder_buckets),
                  help="JAX: MAR's encoder on the known tokens, padded to this many static sizes (0: all positions); "
                       "comma-separated to time several (the last is checked against PyTorch and reported)")
  ap.add_argument("--repeats", type=int, default=2)
  ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
  growth_args(ap, "--encoder_buckets")
  a = ap.parse_args()
  if a.growth:
    return growth(a)
  jax_rows, torch_s = measure(a)
  print("conditions:", json.dumps(conditions()))
  print(f"{a.repeats} timed updates each (median), torch threads {torch.get_num_threads()}")
  print("| RL update (loss, backward, clip, AdamW) | s / update | compile s | encoder token-passes |\n|---|---|---|---|")
  for n, t, comp, enc in jax_rows:
    name = f"{n} known-token sizes" if n else "encoder on all positions"
    print(f"| margrpo_jax, {name} | {t:.2f} | {comp:.1f} | {enc['jax']} |")
  n, jax_s, comp, enc = jax_rows[-1]
  print(f"| PyTorch, official structure | {torch_s:.2f} | - | {enc['official']} |")
  print(f"speed-up: {torch_s / jax_s:.2f}x")
  print(json.dumps(dict(speedup_vs_torch=round(torch_s / jax_s, 3), jax_s=round(jax_s, 3), torch_s=round(torch_s, 3),
                        compile_s=round(comp, 1), size=a.size, batch=a.batch, encoder_buckets=n,
                        encoder_tokens=enc, **conditions())))


if __name__ == "__main__":
  main()
