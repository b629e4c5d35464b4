"""MAR as released: layer parity with timm / a torch SimpleMLPAdaLN, the MAR converter on a full-size synthetic
MAR-B checkpoint, parameter counts (docs/models.md section 1.7), and sampling a converted tiny MAR + KL-16 end to end.

Synthetic checkpoints are built from ``tests/fixtures/keys/keys_mar_base.txt`` / ``keys_kl16_vae.txt`` (every key
and shape; for the tiny ones every key with widths scaled down). Parity tolerance: atol 1e-4 in float32.
"""
from __future__ import annotations

import functools
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from margrpo_jax import checkpoint, config_files
from margrpo_jax.convert import core, mar as mar_convert
from margrpo_jax.convert.__main__ import run as convert_run
from margrpo_jax.models import class_mar, diffusion_head, families, layers

torch = pytest.importorskip("torch")
from conftest import KEYS, REPO  # noqa: E402
ATOL = 1e-4


def read_keys(name: str) -> list[tuple[str, tuple[int, ...]]]:
  out = []
  for line in (KEYS / name).read_text().splitlines():
    key, shape, _ = line.split("\t")
    out.append((key, tuple(int(s) for s in shape.strip("[]").split(",") if s.strip())))
  return out


def _randomize(module, seed: int = 0):
  """Random weights everywhere (the zero-initialised AdaLN / final layers included)."""
  g = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in module.named_parameters():
      if p.ndim == 1 and "weight" in name:  # norm scales around 1
        p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
      else:
        p.copy_(torch.randn(p.shape, generator=g) / max(1, p.shape[-1]) ** 0.5)
  return module.eval()


def _sd(module, prefix: str = "") -> dict[str, np.ndarray]:
  return {prefix + k: v.detach().numpy() for k, v in module.state_dict().items()}


def _merge(graphdef_model, tree):
  graphdef, _ = nnx.split(graphdef_model)
  return nnx.merge(graphdef, tree)


# ---------------------------------------------------------------- (a) timm Block, (b) SimpleMLPAdaLN


def test_block_matches_timm():
  from timm.models.vision_transformer import Block as TimmBlock
  ref = _randomize(TimmBlock(dim=32, num_heads=4, mlp_ratio=4.0, qkv_bias=True,
                             norm_layer=functools.partial(torch.nn.LayerNorm, eps=1e-6)))
  model = layers.Block(32, 4, 4.0, rngs=nnx.Rngs(0))
  conv = core.Converter(_sd(ref), nnx.to_pure_dict(nnx.state(model)), "timm Block")
  for n in ("norm1", "norm2"):
    conv.norm(n, n)
  for n in ("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2"):
    conv.dense(n.replace(".", "/"), n)
  ours = _merge(model, conv.result())
  x = np.random.default_rng(0).normal(size=(2, 7, 32)).astype(np.float32)
  want = ref(torch.from_numpy(x)).detach().numpy()
  np.testing.assert_allclose(np.asarray(ours(jnp.asarray(x))), want, atol=ATOL, rtol=0)


def _torch_head():
  """The PyTorch SimpleMLPAdaLN of benchmarks/peer_sampler.py (diffloss.net key names): the parity test below
  also proves the reference the sampler benchmark times."""
  import sys
  sys.path.insert(0, str(REPO / "benchmarks"))
  import peer_sampler
  return peer_sampler.Head


def test_diffusion_head_matches_torch_reference():
  ref = _randomize(_torch_head()(16, 48, 40, 2), seed=1)
  model = diffusion_head.SimpleMLPAdaLN(token_dim=16, cond_dim=40, width=48, depth=2, rngs=nnx.Rngs(0))
  conv = core.Converter(_sd(ref, "diffloss.net."), {"head": nnx.to_pure_dict(nnx.state(model))}, "torch head")
  mar_convert.convert_head(conv)
  ours = _merge(model, conv.result()["head"])
  rng = np.random.default_rng(1)
  x, c = rng.normal(size=(5, 16)).astype(np.float32), rng.normal(size=(5, 40)).astype(np.float32)
  t = np.array([0, 1, 250, 998, 999])
  want = ref(torch.from_numpy(x), torch.from_numpy(t), torch.from_numpy(c)).detach().numpy()
  got = np.asarray(ours(jnp.asarray(x), jnp.asarray(t), jnp.asarray(c)))
  np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)


# ---------------------------------------------------------------- (c) a full-size MAR-B checkpoint


def _const(i: int, shape) -> "torch.Tensor":
  """A stride-0 tensor of value c_i: the .pth stores one number per key, not the full array."""
  return torch.full((1,), _value(i)).expand(shape)


def _value(i: int) -> float:
  return 0.01 * (1 + i % 97)


@pytest.fixture(scope="module")
def mar_b_converted(tmp_path_factory):
  """The full-size conversion through the CLI's ``run``; the export writer is replaced by a capture (writing and
  re-reading 0.8 GB would dominate the test; the tiny end-to-end test below writes and loads real exports)."""
  tmp = tmp_path_factory.mktemp("mar_b")
  keys = read_keys("keys_mar_base.txt")
  ema = {k: _const(i, s) for i, (k, s) in enumerate(keys)}
  raw = {k: torch.full((1,), -1.0).expand(s) for k, s in keys}  # the non-EMA copy: never used
  torch.save({"model": raw, "model_ema": ema, "epoch": 399}, tmp / "checkpoint-last.pth")
  saved = {}
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(checkpoint, "save_model", lambda out, params, cfg, dtype=None, source=None:
               saved.update(params=params, cfg=cfg))
    report = convert_run("mar", str(tmp / "checkpoint-last.pth"), str(tmp / "export"))
  return saved["cfg"], saved["params"], keys, report


def test_mar_b_converts_with_full_coverage_from_the_ema_copy(mar_b_converted):
  cfg, params, keys, report = mar_b_converted
  assert report["source_keys"] == report["used"] == len(keys) == 364 and report["ignored"] == {}
  assert cfg.family == "mar" and cfg.size == "base"
  index, flat = {k: i for i, (k, _) in enumerate(keys)}, core.flat_paths(params)
  for path, key in [("backbone/z_proj/kernel", "z_proj.weight"), ("backbone/class_emb/embedding", "class_emb.weight"),
                    ("backbone/encoder_blocks/11/attn/qkv/bias", "encoder_blocks.11.attn.qkv.bias"),
                    ("backbone/decoder_blocks/3/mlp/fc2/kernel", "decoder_blocks.3.mlp.fc2.weight"),
                    ("head/res_blocks/5/ada_ln/bias", "diffloss.net.res_blocks.5.adaLN_modulation.1.bias"),
                    ("head/final_layer/linear/kernel", "diffloss.net.final_layer.linear.weight")]:
    np.testing.assert_array_equal(np.unique(np.asarray(flat[path])), np.float32(_value(index[key])))
  counts = {c: sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params[c])) for c in ("backbone", "head")}
  assert sum(counts.values()) == sum(int(np.prod(s)) for _, s in keys)
  assert (round(counts["backbone"] / 1e6, 2), round(counts["head"] / 1e6, 2)) == (172.17, 35.75)  # docs/models.md 1.7


def test_converted_mar_b_runs_a_forward_pass(mar_b_converted):
  cfg, params, _, _ = mar_b_converted
  graphdef, _ = nnx.split(nnx.eval_shape(lambda: families.build(cfg)))

  @jax.jit  # one compile: faster than MAR-B's ops compiled one by one in eager mode
  def forward(params, labels):
    model = nnx.merge(graphdef, params)
    mask = jnp.ones((1, 256), bool).at[:, :8].set(False)
    z = model.backbone(jnp.zeros((1, 256, 16)), mask, model.condition(labels))
    return z, model.head(jnp.zeros((1, 4, 16)), jnp.full((1, 4), 999), z[:, :4])

  z, out = forward(params, jnp.asarray(class_mar.ClassMAR.prompt_ids(cfg, ["class 207"])))
  assert z.shape == (1, 256, 768) and out.shape == (1, 4, 32)
  assert np.isfinite(np.asarray(z)).all() and np.isfinite(np.asarray(out)).all()


def test_class_prompts():
  cfg = class_mar.mar_config("base")
  np.testing.assert_array_equal(class_mar.ClassMAR.prompt_ids(cfg, ["207", "class 3", " Class 999 "]), [207, 3, 999])
  for bad in ("a goldfish", "1000", "class -1"):
    with pytest.raises(ValueError, match="not a class label"):
      class_mar.ClassMAR.prompt_ids(cfg, [bad])


# ---------------------------------------------------------------- tiny checkpoints with the exact key names

D, W, DEPTH = 64, 32, 2  # tiny MAR width, head width and depths (MAR-B: 768, 1024, 12 / 6 blocks)
TINY = (D, DEPTH, 4, DEPTH, W)  # a class_mar.SIZES entry: width, depth, heads, head depth, head width


def _kept(key: str) -> bool:
  m = re.search(r"(?:encoder_blocks|decoder_blocks|res_blocks)\.(\d+)\.", key)
  return m is None or int(m.group(1)) < DEPTH


def tiny_mar_sd(seed: int = 0) -> dict[str, np.ndarray]:
  """keys_mar_base.txt (the exact names) with widths D / W instead of 768 / 1024 and blocks 0..DEPTH-1."""
  rng = np.random.default_rng(seed)
  out = {}
  for key, shape in read_keys("keys_mar_base.txt"):
    if not _kept(key):
      continue
    w, big = (W, 1024) if key.startswith("diffloss") else (D, 768)
    shape = tuple(d // big * w if d % big == 0 else (D if d == 768 else d) for d in shape)
    norm = len(shape) == 1 and key.endswith(".weight")  # LayerNorm scales
    out[key] = (float(norm) + rng.normal(size=shape) * (0.1 if norm else 0.02)).astype(np.float32)
  return out


def tiny_kl16_sd(seed: int = 0) -> dict[str, np.ndarray]:
  """The KL-16 names of levels 0 and 1 only (stride 2, no level attention) at 32 channels (128 / 256 / 512)."""
  rng = np.random.default_rng(seed)
  out = {}
  for key, shape in read_keys("keys_kl16_vae.txt"):
    if re.search(r"(down|up)\.[2-4]\.|down\.1\.downsample|up\.1\.block\.0\.nin_shortcut", key):
      continue
    shape = tuple(32 if d in (128, 256, 512) else d for d in shape)
    fan_in = int(np.prod(shape[1:])) if len(shape) > 1 else 1
    norm = len(shape) == 1 and key.endswith(".weight")
    out[key] = (float(norm) + rng.normal(size=shape) * (fan_in ** -0.5 if len(shape) > 1 else 0.1)).astype(np.float32)
  return out


def test_corrupted_checkpoints_fail_naming_the_key(tmp_path, monkeypatch):
  monkeypatch.setitem(class_mar.SIZES, "tiny", TINY)
  sd = tiny_mar_sd()
  del sd["decoder_blocks.1.attn.proj.bias"]
  torch.save({"model_ema": {k: torch.from_numpy(v) for k, v in sd.items()}}, tmp_path / "bad.pth")
  with pytest.raises(core.ConversionError, match=r"decoder_blocks\.1\.attn\.proj\.bias"):
    convert_run("mar", str(tmp_path / "bad.pth"), str(tmp_path / "out"))
  sd = tiny_mar_sd()
  sd["diffloss.net.cond_embed.weight"] = sd["diffloss.net.cond_embed.weight"][:, :-1]
  with pytest.raises(core.ConversionError, match=r"diffloss\.net\.cond_embed\.weight.*shape"):
    mar_convert.convert(sd, origin="synthetic")
  sd = tiny_mar_sd()
  sd["extra.weight"] = np.zeros(3, np.float32)
  with pytest.raises(core.ConversionError, match=r"not used \(extra\.weight\)"):
    mar_convert.convert(sd, origin="synthetic")


@pytest.mark.slow
def test_sample_job_draws_class_images_through_kl16(tmp_path, monkeypatch):
  """Tiny MAR (.pth, {'model', 'model_ema'}) and KL-16 ({'model'}) checkpoints -> convert CLI -> sample job."""
  from margrpo_jax.jobs import sample
  monkeypatch.setitem(class_mar.SIZES, "tiny", TINY)
  mar_sd = {k: torch.from_numpy(v) for k, v in tiny_mar_sd().items()}
  torch.save({"model": mar_sd, "model_ema": mar_sd}, tmp_path / "mar.pth")
  torch.save({"model": {k: torch.from_numpy(v) for k, v in tiny_kl16_sd().items()}}, tmp_path / "kl16.ckpt")
  convert_run("mar", str(tmp_path / "mar.pth"), str(tmp_path / "mar"))
  rep = convert_run("kl16", str(tmp_path / "kl16.ckpt"), str(tmp_path / "kl16"))
  assert rep["used"] == rep["source_keys"] == len(tiny_kl16_sd())
  (tmp_path / "prompts.txt").write_text("207\nclass 88\n")
  config = config_files.load("mar", "base")
  assert (config.sampling.cfg_scale, config.sampling.num_steps, config.sampling.diffusion_steps) == (2.9, 64, "100")
  config.mode = "sample"
  config.prompt_file = str(tmp_path / "prompts.txt")
  with pytest.raises(checkpoint.CheckpointError, match="config.checkpoint is not set"):
    sample.run(config, str(tmp_path / "w0"))
  config.checkpoint = str(tmp_path / "mar")
  with pytest.raises(checkpoint.CheckpointError, match="model.vae_checkpoint is not set"):
    sample.run(config, str(tmp_path / "w0"))
  config.model.vae_checkpoint = str(tmp_path / "kl16")
  config.sampling.update(num_steps=2, diffusion_steps="2")
  config.batch_size = 2
  scores = sample.run(config, str(tmp_path / "w"))
  assert scores["num_images"] == 2 and scores["num_scored"] == 0
  from PIL import Image
  for i in range(2):
    im = np.asarray(Image.open(tmp_path / "w" / "samples" / f"{i}.png"))
    assert im.shape == (32, 32, 3) and im.dtype == np.uint8 and im.std() > 0
  assert os.path.isfile(tmp_path / "w" / "grid.png")


class _Payload:  # a class a checkpoint may pickle: loading it would run its code
  def __reduce__(self):
    return (print, ("unpickled",))


def test_torch_files_load_weights_only(tmp_path):
  """Tensors and MAR's pickled ``argparse.Namespace`` load; any other pickled object, or garbage bytes, is one
  sentence (``weights_only=True`` always: unpickling arbitrary objects can run code)."""
  import argparse

  import torch

  from margrpo_jax.convert import core
  torch.save({"model": {"w": torch.ones(2)}, "args": argparse.Namespace(model="mar_base")}, tmp_path / "ok.pth")
  assert np.asarray(core.read_checkpoint(str(tmp_path / "ok.pth"))["model"]["w"]).tolist() == [1.0, 1.0]
  torch.save({"model": {"w": torch.ones(2)}, "x": _Payload()}, tmp_path / "code.pth")
  with pytest.raises(core.ConversionError, match="re-save it as a state dict"):
    core.read_checkpoint(str(tmp_path / "code.pth"))
  (tmp_path / "junk.pth").write_bytes(np.random.default_rng(0).bytes(512))
  with pytest.raises(core.ConversionError, match="is not a readable PyTorch checkpoint"):
    core.read_checkpoint(str(tmp_path / "junk.pth"))
