"""The KL autoencoders: KL-16 (LDM layout) against a torch reference written from docs/models.md section 1.5, the
SD / SDXL VAE against ``diffusers.AutoencoderKL``, both through their converter CLIs, and the official key lists
converting with full coverage and the parameter counts of docs/models.md (KL-16 66.46 M, SD / SDXL VAE 83.65 M).

Parity: posterior mean / logvar and decoded images, atol 1e-4 in float32 (values are O(1)).
"""
from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from margrpo_jax.convert import core, kl16, sdvae
from margrpo_jax.convert.__main__ import run as convert_run
from margrpo_jax.models import vae

torch = pytest.importorskip("torch")
nn, F = torch.nn, torch.nn.functional
from conftest import KEYS  # noqa: E402
ATOL = 1e-4


def keys_dict(name: str) -> dict[str, np.ndarray]:
  """Every key of a keys/ file at its shape (zeros: only names and shapes matter)."""
  out = {}
  for line in (KEYS / name).read_text().splitlines():
    key, shape, _ = line.split("\t")
    out[key] = np.zeros([int(s) for s in shape.strip("[]").split(",")], np.float32)
  return out


def _randomize(module, seed: int):
  g = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in module.named_parameters():
      if p.ndim == 1:  # norm scales around 1, biases around 0
        p.copy_(float("weight" in name) + 0.1 * torch.randn(p.shape, generator=g))
      else:
        p.copy_(torch.randn(p.shape, generator=g) / np.sqrt(np.prod(p.shape[1:])))
  return module.eval()


# -------------------------------------------------------------------------- KL-16 torch reference (docs/models.md 1.5)


def _gn(c):
  return nn.GroupNorm(32, c, eps=1e-6)


class _Res(nn.Module):
  def __init__(self, cin, cout):
    super().__init__()
    self.norm1, self.conv1 = _gn(cin), nn.Conv2d(cin, cout, 3, padding=1)
    self.norm2, self.conv2 = _gn(cout), nn.Conv2d(cout, cout, 3, padding=1)
    if cin != cout:
      self.nin_shortcut = nn.Conv2d(cin, cout, 1)

  def forward(self, x):
    h = self.conv2(F.silu(self.norm2(self.conv1(F.silu(self.norm1(x))))))
    return (self.nin_shortcut(x) if hasattr(self, "nin_shortcut") else x) + h


class _Attn(nn.Module):
  def __init__(self, c):
    super().__init__()
    self.norm = _gn(c)
    self.q, self.k, self.v, self.proj_out = (nn.Conv2d(c, c, 1) for _ in range(4))

  def forward(self, x):
    b, c, h, w = x.shape
    y = self.norm(x)
    q, k, v = (m(y).reshape(b, c, h * w) for m in (self.q, self.k, self.v))
    att = torch.softmax(torch.bmm(q.transpose(1, 2), k) * c ** -0.5, dim=-1)  # (b, query, key)
    return x + self.proj_out(torch.bmm(v, att.transpose(1, 2)).reshape(b, c, h, w))


class _Level(nn.Module):
  def __init__(self, cin, cout, blocks, attn, resample):
    super().__init__()
    self.block = nn.ModuleList([_Res(cin if j == 0 else cout, cout) for j in range(blocks)])
    self.attn = nn.ModuleList([_Attn(cout) for _ in range(blocks)] if attn else [])
    if resample == "down":
      self.downsample = nn.Module()
      self.downsample.conv = nn.Conv2d(cout, cout, 3, stride=2)
    elif resample == "up":
      self.upsample = nn.Module()
      self.upsample.conv = nn.Conv2d(cout, cout, 3, padding=1)

  def forward(self, x):
    for j, blk in enumerate(self.block):
      x = blk(x)
      if len(self.attn):
        x = self.attn[j](x)
    if hasattr(self, "downsample"):
      x = self.downsample.conv(F.pad(x, (0, 1, 0, 1)))
    if hasattr(self, "upsample"):
      x = self.upsample.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))
    return x


def _mid(c):
  m = nn.Module()
  m.block_1, m.attn_1, m.block_2 = _Res(c, c), _Attn(c), _Res(c, c)
  return m


class TorchKL(nn.Module):
  """The LDM ``AutoencoderKL`` of docs/models.md section 1.5 with configurable widths / levels / attention levels."""

  def __init__(self, ch, mult, blocks, enc_attn, dec_attn, z):
    super().__init__()
    chans, n = [ch * m for m in mult], len(mult)
    self.encoder, self.decoder = nn.Module(), nn.Module()
    e, d = self.encoder, self.decoder
    e.conv_in = nn.Conv2d(3, ch, 3, padding=1)
    e.down = nn.ModuleList([_Level(([ch] + chans)[i], chans[i], blocks, i in enc_attn, "down" if i < n - 1 else None)
                            for i in range(n)])
    e.mid, e.norm_out, e.conv_out = _mid(chans[-1]), _gn(chans[-1]), nn.Conv2d(chans[-1], 2 * z, 3, padding=1)
    d.conv_in, d.mid = nn.Conv2d(z, chans[-1], 3, padding=1), _mid(chans[-1])
    d.up = nn.ModuleList([_Level((chans + [chans[-1]])[i + 1], chans[i], blocks + 1, i in dec_attn,
                                 "up" if i > 0 else None) for i in range(n)])
    d.norm_out, d.conv_out = _gn(chans[0]), nn.Conv2d(chans[0], 3, 3, padding=1)
    self.quant_conv, self.post_quant_conv = nn.Conv2d(2 * z, 2 * z, 1), nn.Conv2d(z, z, 1)

  def posterior(self, x):
    e = self.encoder
    h = e.conv_in(x)
    for lvl in e.down:
      h = lvl(h)
    m = e.mid
    h = e.conv_out(F.silu(e.norm_out(m.block_2(m.attn_1(m.block_1(h))))))
    mean, logvar = self.quant_conv(h).chunk(2, dim=1)
    return mean, logvar.clamp(-30.0, 20.0)

  def decode(self, z):
    d = self.decoder
    m = d.mid
    h = m.block_2(m.attn_1(m.block_1(d.conv_in(self.post_quant_conv(z)))))
    for lvl in reversed(d.up):
      h = lvl(h)
    return d.conv_out(F.silu(d.norm_out(h)))


def _nchw(x):
  return torch.from_numpy(np.ascontiguousarray(np.asarray(x).transpose(0, 3, 1, 2)))


def _nhwc(t):
  return t.detach().numpy().transpose(0, 2, 3, 1)


def _check_parity(export: str, posterior, decode, scale: float, shift: float, uint8: bool = False):
  """Our export at ``export`` vs torch ``posterior(x) -> (mean, logvar)`` / ``decode(unscaled z)`` (NCHW)."""
  from flax import nnx
  cfg, graphdef, params, _ = vae.load(export)  # cached: decode_latents below reuses it
  assert (cfg.scale, cfg.shift) == (scale, shift)
  x = np.random.default_rng(0).uniform(-1, 1, size=(2, 16, 16, 3)).astype(np.float32)
  with torch.no_grad():
    mean, logvar = posterior(_nchw(x))
    images = decode(mean)

  @jax.jit  # one compile instead of an eager compile per op
  def ours(params, x):
    model = nnx.merge(graphdef, params)
    latents = model.encode(x)
    return model.posterior(x) + (latents, model.decode(latents))

  got_mean, got_logvar, latents, got_images = ours(params, jnp.asarray(x))
  np.testing.assert_allclose(np.asarray(got_mean), _nhwc(mean), atol=ATOL, rtol=0)
  np.testing.assert_allclose(np.asarray(got_logvar), _nhwc(logvar), atol=ATOL, rtol=0)
  np.testing.assert_allclose(np.asarray(latents), (_nhwc(mean) - shift) * scale, atol=ATOL, rtol=0)
  np.testing.assert_allclose(np.asarray(got_images), _nhwc(images), atol=ATOL, rtol=0)
  if uint8:  # the cached, jitted path the family hooks use
    out = vae.decode_latents(export, np.asarray(latents))
    assert out.dtype == np.uint8 and out.shape == (2, 16, 16, 3)
    assert np.abs(out.astype(int) - vae.to_uint8(_nhwc(images)).astype(int)).max() <= 1


def test_kl16_matches_the_ldm_reference(tmp_path):
  ref = _randomize(TorchKL(ch=32, mult=(1, 2, 2), blocks=1, enc_attn=(2,), dec_attn=(1,), z=4), seed=0)
  torch.save({"model": ref.state_dict()}, tmp_path / "kl16.ckpt")
  report = convert_run("kl16", str(tmp_path / "kl16.ckpt"), str(tmp_path / "kl16"))
  assert report["used"] == report["source_keys"] == len(ref.state_dict())
  _check_parity(str(tmp_path / "kl16"), ref.posterior, ref.decode, scale=0.2325, shift=0.0, uint8=True)


def _count(tree) -> int:
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree))


def test_kl16_official_keys_convert_with_full_coverage():
  sd = keys_dict("keys_kl16_vae.txt")
  cfg, params, report = kl16.convert(sd, origin="keys_kl16_vae.txt")
  assert report["used"] == report["source_keys"] == len(sd) == 312
  assert (tuple(cfg.ch_mult), cfg.num_res_blocks, tuple(cfg.enc_attn_levels), tuple(cfg.dec_attn_levels),
          cfg.z_channels, cfg.scale) == ((1, 1, 2, 2, 4), 2, (4,), (), 16, 0.2325)
  assert _count(params) == 66_456_019  # docs/models.md 1.5: 66.46 M (encoder 28.27 M, decoder 38.19 M)
  assert round((_count(params["encoder"]) + _count(params["quant_conv"])) / 1e6, 2) == 28.27
  assert round((_count(params["decoder"]) + _count(params["post_quant_conv"])) / 1e6, 2) == 38.19
  del sd["encoder.down.4.attn.1.proj_out.weight"]
  with pytest.raises(core.ConversionError, match=r"encoder\.down\.4\.attn\.1\.proj_out\.weight"):
    kl16.convert(sd, origin="keys_kl16_vae.txt")


# ----------------------------------------------------------------------------- SD / SDXL VAE (diffusers layout)


def test_sd_vae_matches_diffusers(tmp_path):
  from diffusers import AutoencoderKL
  ref = _randomize(AutoencoderKL(down_block_types=("DownEncoderBlock2D",) * 3, up_block_types=("UpDecoderBlock2D",) * 3,
                                 block_out_channels=(16, 32, 32), layers_per_block=1, latent_channels=4,
                                 norm_num_groups=8, scaling_factor=0.13025, shift_factor=0.0625), seed=1)
  ref.save_pretrained(tmp_path / "vae", safe_serialization=True)
  assert json.loads((tmp_path / "vae" / "config.json").read_text())["norm_num_groups"] == 8
  report = convert_run("sdvae", str(tmp_path / "vae"), str(tmp_path / "out"))
  assert report["used"] == report["source_keys"] == len(ref.state_dict())

  def posterior(x):
    dist = ref.encode(x).latent_dist
    return dist.mean, dist.logvar

  _check_parity(str(tmp_path / "out"), posterior, lambda z: ref.decode(z).sample, scale=0.13025, shift=0.0625)


def test_sd_sdxl_official_keys_convert_with_full_coverage(tmp_path):
  sd = keys_dict("keys_sd_sdxl_vae_diffusers.txt")  # names carry NOVA's 'vae.' prefix
  with pytest.raises(core.ConversionError, match="--size=sd"):
    sdvae.convert(sd, origin=str(tmp_path / "w.safetensors"))
  cfg, params, report = sdvae.convert(sd, origin=str(tmp_path / "w.safetensors"), size="sd")
  assert report["used"] == report["source_keys"] == len(sd) == 248
  assert (tuple(cfg.ch_mult), cfg.num_res_blocks, cfg.z_channels, cfg.scale) == ((1, 2, 4, 4), 2, 4, 0.18215)
  assert _count(params) == 83_653_863  # docs/models.md 3.5: 83.65 M
  sd["vae.decoder.up_blocks.3.resnets.2.conv2.weight"] = np.zeros((128, 128, 3, 1), np.float32)
  with pytest.raises(core.ConversionError, match=r"decoder\.up_blocks\.3\.resnets\.2\.conv2\.weight.*shape"):
    sdvae.convert(sd, origin=str(tmp_path / "w.safetensors"), size="sdxl")


def test_vae_paths_fail_in_one_sentence(tmp_path):
  from margrpo_jax.checkpoint import CheckpointError
  with pytest.raises(CheckpointError, match="model.vae_checkpoint is not set"):
    vae.decode_latents("", np.zeros((1, 2, 2, 4), np.float32))
  with pytest.raises(CheckpointError, match="not a converted VAE export"):
    vae.decode_latents(str(tmp_path), np.zeros((1, 2, 2, 4), np.float32))
  tokens = np.arange(2 * 4 * 16, dtype=np.float32).reshape(2, 4, 16)  # 2 x 2 grid of 4-channel 2 x 2 patches
  lat = vae.unpatchify_latents(tokens, 4)
  assert lat.shape == (2, 4, 4, 4)
  np.testing.assert_array_equal(lat[0, 0, 1], tokens[0, 0].reshape(4, 2, 2)[:, 0, 1])  # (c, ph, pw) in a token
  np.testing.assert_array_equal(lat[1, 2, 3], tokens[1, 3].reshape(4, 2, 2)[:, 0, 1])
