"""NOVA: parity of the post-norm ViT blocks, the MAE-split image encoder, the video-encoder condition and the
DiffusionMLP against small PyTorch references written here from docs/models.md sections 3.1-3.4 (weights moved by the
nova converter, so its key names are exercised too); converter coverage on the exact key names of
keys_nova-d48w1024-sdxl1024.txt (scaled-down shapes) and, shape-only, on all five full-size key lists;
docs/models.md section 3.7 parameter counts; the family hooks and config errors."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_phi2 import read_keys, synthetic

from margrpo_jax.convert import core, nova as nova_convert, phi2 as phi2_convert
from margrpo_jax.diffusion import flow
from margrpo_jax.models import families, nova, phi2

D, HEADS, W, TOK = 32, 2, 24, 48        # tiny widths: transformer, heads, head MLP, text feature dim
GRID, VGRID, T = (4, 6), (2, 3), 8      # image tokens 4 x 6, video tokens 2 x 3, text length 8


def tiny_config(**kw):
  cfg = nova.nova_config("d48w1024-sdxl1024", width=D, num_heads=HEADS, video_depth=2, image_depth=4,
                         encoder_depth=2, image_base_size=list(GRID), video_base_size=[1, *VGRID],
                         seq_len=GRID[0] * GRID[1])
  cfg.text.update(max_len=T, token_dim=TOK, null_rows=12, pad_id=0)
  cfg.head.update(width=W, depth=2)
  cfg.text_encoder.update(vocab_size=40, width=TOK, depth=1, num_heads=6, mlp_dim=64)
  cfg.update(kw)
  return cfg


def torch_reference(torch, cfg):
  """NOVATransformer3DModel's T2I forward as docs/models.md section 3 describes it, with the official module names."""
  nn, F = torch.nn, torch.nn.functional

  class Attention(nn.Module):
    def __init__(self, d, h):
      super().__init__()
      self.h, self.qkv, self.proj = h, nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x):
      b, n, d = x.shape
      q, k, v = self.qkv(x).view(b, n, 3, self.h, d // self.h).permute(2, 0, 3, 1, 4)
      return self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2))

  class Mlp(nn.Module):
    def __init__(self, d):
      super().__init__()
      self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
      return self.fc2(F.gelu(self.fc1(x)))

  class Block(nn.Module):  # post-norm
    def __init__(self, d, h):
      super().__init__()
      self.norm1, self.attn, self.norm2, self.mlp = nn.LayerNorm(d), Attention(d, h), nn.LayerNorm(d), Mlp(d)

    def forward(self, x):
      x = x + self.norm1(self.attn(x))
      return x + self.norm2(self.mlp(x))

  class PatchEmbed(nn.Module):
    def __init__(self, c, d, p):
      super().__init__()
      self.proj = nn.Conv2d(c, d, p, p)

    def forward(self, x):  # NCHW latent -> (B, h w, D) raster order
      return self.proj(x).flatten(2).transpose(1, 2)

  class ViT(nn.Module):
    def __init__(self, d, depth, h, p, enc):
      super().__init__()
      self.patch_embed, self.enc = PatchEmbed(4, d, p), enc
      self.blocks, self.norm = nn.ModuleList(Block(d, h) for _ in range(depth)), nn.LayerNorm(d)

    def forward(self, x, c, prev_ids=None):  # gather the known tokens for the first half, scatter them back
      x_full, n = x, c.shape[1]
      if prev_ids is not None:
        idx = prev_ids[..., None].expand(-1, -1, x.shape[-1])
        x = x.gather(1, idx)
      x = torch.cat([c, x], 1)
      for blk in self.blocks[:self.enc] if prev_ids is not None else self.blocks:
        x = blk(x)
      if prev_ids is not None:
        c, x = x[:, :n], x[:, n:]
        x = torch.cat([c, x_full.scatter(1, idx, x)], 1)
        for blk in self.blocks[self.enc:]:
          x = blk(x)
      return self.norm(x[:, n:])

  class Projector(nn.Module):
    def __init__(self, din, d):
      super().__init__()
      self.fc1, self.fc2 = nn.Linear(din, d), nn.Linear(d, d)

    def forward(self, x):
      return self.fc2(F.silu(self.fc1(x)))

  class AdaLNZero(nn.Module):
    def __init__(self, d, num):
      super().__init__()
      self.num, self.proj, self.norm = num, nn.Linear(d, num * d), nn.LayerNorm(d, 1e-6, elementwise_affine=False)

    def forward(self, x, z):
      s = self.proj(F.silu(z)).chunk(self.num, -1)
      return self.norm(x) * (1 + s[0]) + s[1], s[2:]

  class DiffusionBlock(nn.Module):
    def __init__(self, d):
      super().__init__()
      self.norm1, self.proj, self.norm2 = AdaLNZero(d, 3), Projector(d, d), nn.LayerNorm(d)

    def forward(self, x, z):
      h, (gate,) = self.norm1(x, z)
      return x + gate * self.norm2(self.proj(h))

  class TimeCondEmbed(nn.Module):
    def __init__(self, cond, d):
      super().__init__()
      self.timestep_proj, self.condition_proj = Projector(256, d), Projector(cond, d)

    def forward(self, t, z):
      f = torch.exp(-math.log(1e4) * torch.arange(128, dtype=torch.float32) / 128)
      a = t[..., None].float() * f
      return self.condition_proj(z) + self.timestep_proj(torch.cat([a.cos(), a.sin()], -1))[:, None]

  class DiffusionMLP(nn.Module):
    def __init__(self, d, depth, cond):
      super().__init__()
      self.patch_embed, self.time_cond_embed = PatchEmbed(4, d, 2), TimeCondEmbed(cond, d)
      self.blocks, self.norm = nn.ModuleList(DiffusionBlock(d) for _ in range(depth)), AdaLNZero(d, 2)
      self.head = nn.Linear(d, 16)

    def forward(self, x, t, z):  # x: NCHW latent; output tokens (B, L, 16) in (ph, pw, c) order
      x, z = self.patch_embed(x), self.time_cond_embed(t, z)
      for blk in self.blocks:
        x = blk(x, z)
      return self.head(self.norm(x, z)[0])

  class TextEmbed(nn.Module):
    def __init__(self, tok, d, rows):
      super().__init__()
      self.proj, self.norm = nn.Linear(tok, d), nn.LayerNorm(d)
      self.register_buffer("weight", torch.randn(rows, tok) * 0.02)

  class VideoPosEmbed(nn.Module):
    def __init__(self, d):
      super().__init__()
      self.time_proj, self.norm = nn.Sequential(nn.Linear(256, d), nn.SiLU(), nn.Linear(d, d)), nn.LayerNorm(d)

  class MaskEmbed(nn.Module):
    def __init__(self, d):
      super().__init__()
      self.bos_token, self.mask_token = nn.Parameter(torch.randn(1, d)), nn.Parameter(torch.randn(1, d))

  def sincos2d(h, w, d):
    f = 1.0 / 10000 ** (torch.arange(d // 4, dtype=torch.float64) / (d // 4))
    gw, gh = torch.meshgrid(torch.arange(w, dtype=torch.float64), torch.arange(h, dtype=torch.float64),
                            indexing="xy")
    fw, fh = gw.reshape(-1, 1) * f, gh.reshape(-1, 1) * f
    return torch.cat([fw.sin(), fw.cos(), fh.sin(), fh.cos()], -1).float()

  class Ref(nn.Module):
    def __init__(self):
      super().__init__()
      self.video_encoder = ViT(D, cfg.video_depth, HEADS, 4, cfg.video_depth)
      self.image_encoder = ViT(D, cfg.image_depth, HEADS, 2, cfg.encoder_depth)
      self.image_decoder = DiffusionMLP(W, cfg.head.depth, D)
      self.mask_embed, self.text_embed = MaskEmbed(D), TextEmbed(TOK, D, cfg.text.null_rows)
      self.video_pos_embed = VideoPosEmbed(D)

    def condition(self, text):
      t0 = torch.cat([torch.zeros(128), torch.ones(128)])  # sincos_t(0) = [sin | cos]
      grid = self.mask_embed.bos_token + self.video_pos_embed.norm(self.video_pos_embed.time_proj(t0))
      grid = (grid + sincos2d(*VGRID, D)).expand(text.shape[0], -1, -1)
      return self.video_encoder(grid, self.text_embed.norm(self.text_embed.proj(text)))

    def backbone(self, latent, unknown, prev_ids, c):
      x = self.image_encoder.patch_embed(latent)
      m = unknown[..., None].float()
      x = x * (1 - m) + self.mask_embed.mask_token * m + sincos2d(*GRID, D)
      return self.image_encoder(x, c, prev_ids)

  return Ref().eval()


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
  """(torch, torch reference, model_cfg, converted NOVA with a random Phi)."""
  torch = pytest.importorskip("torch")
  torch.manual_seed(0)
  cfg = tiny_config()
  ref = torch_reference(torch, cfg)
  sd = {k: v.detach().numpy() for k, v in ref.state_dict().items()}
  text_sd = {k: 0.1 * v for k, v in synthetic(phi_layer0_keys(), {2560: TOK, 10240: 64, 51200: 40}, 1).items()}
  folder = tmp_path_factory.mktemp("pipeline")  # a pipeline layout: Phi-2 is read from ../text_encoder
  (folder / "text_encoder").mkdir()
  from safetensors.numpy import save_file
  save_file(text_sd, str(folder / "text_encoder" / "model.safetensors"))
  model_cfg, params, report = nova_convert.convert(sd, origin=str(folder / "transformer"), model_cfg=cfg)
  assert report["ignored"][phi2_convert.LM_HEAD[1]] == 2
  model = nnx.eval_shape(lambda: nova.NOVA(cfg, rngs=nnx.Rngs(0)))
  graphdef, state = nnx.split(model)
  nnx.replace_by_pure_dict(state, params)
  return torch, ref, cfg, Jitted(graphdef, state)


class Jitted:
  """``m.call("backbone.encode_text", x)``: one jitted program per method (eager NNX dispatch is slow on CPU)."""

  def __init__(self, graphdef, state):
    self.graphdef, self.state, self.fns = graphdef, state, {}

  def call(self, name: str, *args):
    if name not in self.fns:
      def fn(state, *a):
        obj = nnx.merge(self.graphdef, state)
        for part in name.split("."):
          obj = getattr(obj, part)
        return obj(*a)
      self.fns[name] = jax.jit(fn, static_argnums=tuple(i + 1 for i, a in enumerate(args) if isinstance(a, int)))
    return np.asarray(self.fns[name](self.state, *args))


def phi_layer0_keys():
  """keys_phi2_text_encoder.txt without layers 1..31 (a 1-layer Phi under the real names)."""
  return {k: s for k, s in read_keys("keys_phi2_text_encoder.txt").items() if ".layers." not in k or ".layers.0." in k}


def _latent(rng, b=2):
  return rng.standard_normal((b, 4, 2 * GRID[0], 2 * GRID[1])).astype(np.float32)


def test_condition_and_backbone_parity(pair):
  """Video-encoder condition c and image-encoder latents z (MAE split: known tokens gathered for the first half,
  scattered back for the second) equal the reference within atol 1e-4 (float32); the key-mask implementation
  equals the gather / scatter one."""
  torch, ref, cfg, model = pair
  rng = np.random.default_rng(0)
  text = rng.standard_normal((2, T, TOK)).astype(np.float32)
  latent = _latent(rng)
  n_known, seq = 9, GRID[0] * GRID[1]
  prev_ids = np.stack([rng.permutation(seq)[:n_known] for _ in range(2)])
  unknown = np.ones((2, seq), bool)
  np.put_along_axis(unknown, prev_ids, False, axis=1)
  with torch.no_grad():
    c_ref = ref.condition(torch.from_numpy(text))
    z_ref = ref.backbone(torch.from_numpy(latent), torch.from_numpy(unknown), torch.from_numpy(prev_ids), c_ref)
  c = model.call("backbone.encode_text", jnp.asarray(text))
  np.testing.assert_allclose(c, c_ref.numpy(), atol=1e-4, rtol=1e-4)
  tokens = nova.patchify(cfg, latent.transpose(0, 2, 3, 1))
  z = model.call("backbone", jnp.asarray(tokens), jnp.asarray(unknown), jnp.asarray(c))
  np.testing.assert_allclose(z, z_ref.numpy(), atol=1e-4, rtol=1e-4)


def test_diffusion_mlp_parity(pair):
  """DiffusionMLP on (ph, pw, c) tokens equals the reference's conv patch-embed on the NCHW latent, (scale, shift,
  gate) AdaLN with the extra post-LN, float timesteps; atol 1e-4 (float32)."""
  torch, ref, cfg, model = pair
  rng = np.random.default_rng(1)
  latent = _latent(rng)
  z = rng.standard_normal((2, GRID[0] * GRID[1], D)).astype(np.float32)
  t = np.array([1000.0, 412.5], np.float32)
  with torch.no_grad():
    want = ref.image_decoder(torch.from_numpy(latent), torch.from_numpy(t), torch.from_numpy(z)).numpy()
  x = nova.patchify(cfg, latent.transpose(0, 2, 3, 1))
  got = model.call("head", jnp.asarray(x), jnp.asarray(t)[:, None], jnp.asarray(z))
  np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)
  np.testing.assert_array_equal(nova.unpatchify(cfg, x), latent.transpose(0, 2, 3, 1))


def test_text_features_null_rows_and_hooks(pair, tmp_path):
  """Prompt rows come from Phi-2, padding (-1) rows from the null table; the empty prompt is the null condition;
  the hooks fail in one sentence when tokenizer / VAE paths are unset."""
  _, _, cfg, model = pair
  ids = np.full((2, T), -1, np.int32)
  ids[0, :3] = [5, 7, 9]
  def parts(state, ids):
    m = nnx.merge(model.graphdef, state)
    return (m.text_features(ids), m.text_encoder(jnp.where(ids >= 0, ids, 0)), m.condition(ids[1:]),
            m.null_condition(1))
  feats, phi, cond, null_cond = map(np.asarray, jax.jit(parts)(model.state, jnp.asarray(ids)))
  null = np.asarray(model.state["null_text"][...])[:T]
  np.testing.assert_allclose(feats[0, :3], phi[0, :3], atol=1e-6)
  np.testing.assert_array_equal(feats[0, 3:], null[3:])
  np.testing.assert_array_equal(feats[1], null)
  np.testing.assert_allclose(cond, null_cond, atol=1e-5)
  with pytest.raises(phi2.TokenizerError, match="tokenizer_path is not set"):
    nova.NOVA.prompt_ids(cfg, ["a cat"])
  from margrpo_jax.checkpoint import CheckpointError
  with pytest.raises(CheckpointError, match="vae_checkpoint is not set"):
    nova.NOVA.decode_images(cfg, np.zeros((1, GRID[0] * GRID[1], 16), np.float32))


def abstract_nova(cfg):
  """Abstract params of NOVA(cfg) without tracing every block (``nnx.eval_shape`` is quadratic in the number of
  parameters here): build one block per stack at full width, then repeat it (the stacks are homogeneous lists)."""
  small = nova.nova_config(cfg.variant)
  small.update(cfg)
  small.update(video_depth=1, image_depth=2, encoder_depth=1)
  small.head.depth = 1
  small.text_encoder.depth = min(1, cfg.text_encoder.depth)
  tree = core.abstract_params(small, lambda c: nova.NOVA(c, rngs=nnx.Rngs(0)))
  rep = lambda blocks, n: {i: blocks[0] for i in range(n)}
  bb = tree["backbone"]
  bb["video_encoder"]["blocks"] = rep(bb["video_encoder"]["blocks"], cfg.video_depth)
  bb["image_encoder"]["blocks"] = rep(bb["image_encoder"]["blocks"], cfg.image_depth)
  tree["head"]["blocks"] = rep(tree["head"]["blocks"], cfg.head.depth)
  if cfg.text_encoder.depth:
    tree["text_encoder"]["layers"] = rep(tree["text_encoder"]["layers"], cfg.text_encoder.depth)
  return tree


def test_abstract_nova_equals_the_traced_model():
  """The repeated-block shortcut gives exactly the tree of the traced model (tiny depths 3 / 4 / 3 / 2)."""
  cfg = tiny_config(video_depth=3, image_depth=4, encoder_depth=2)
  cfg.head.depth = 3
  cfg.text_encoder.depth = 2
  want = core.abstract_params(cfg, lambda c: nova.NOVA(c, rngs=nnx.Rngs(0)))
  got = abstract_nova(cfg)
  assert jax.tree.map(lambda x: (x.shape, x.dtype), core.flat_paths(got)) == \
      jax.tree.map(lambda x: (x.shape, x.dtype), core.flat_paths(want))


def test_converter_exact_key_names():
  """Every key of keys_nova-d48w1024-sdxl1024.txt (1024->32, 2560->48, 512->16 null rows; all 16 + 32 + 6 blocks)
  is used and every target leaf filled, with a 1-layer Phi under the real key names (test_phi2 covers all 453 Phi
  keys); lm_head is ignored with its reason; a missing key is named."""
  keys = read_keys("keys_nova-d48w1024-sdxl1024.txt")
  assert len(keys) == 659
  sd = synthetic(keys, {1024: 32, 2048: 64, 3072: 96, 4096: 128, 2560: 48, 512: 16})
  phi_keys = phi_layer0_keys()
  text_sd = synthetic(phi_keys, {2560: 48, 10240: 64, 51200: 60}, 1)
  cfg = tiny_config(image_depth=32, video_depth=16, encoder_depth=16)
  cfg.head.update(width=32, depth=6)
  cfg.text.update(null_rows=16)
  cfg.text_encoder.update(depth=1, vocab_size=60)
  target = abstract_nova(cfg)
  conv = nova_convert.converter(sd, text_sd, cfg, "synthetic", target)
  params, report = conv.result(), conv.report()
  assert report["source_keys"] == 659 + len(phi_keys) and report["used"] == 659 + len(phi_keys) - 2
  assert report["ignored"][phi2_convert.LM_HEAD[1]] == 2
  np.testing.assert_array_equal(params["null_text"], sd["text_embed.weight"])
  np.testing.assert_array_equal(params["head"]["blocks"][5]["norm1"]["proj"]["kernel"],
                                sd["image_decoder.blocks.5.norm1.proj.weight"].T)
  np.testing.assert_array_equal(params["backbone"]["image_encoder"]["patch_embed"]["proj"]["kernel"],
                                sd["image_encoder.patch_embed.proj.weight"].transpose(2, 3, 1, 0))
  del sd["image_encoder.blocks.17.attn.qkv.bias"]
  with pytest.raises(core.ConversionError, match=r"image_encoder\.blocks\.17\.attn\.qkv\.bias"):
    nova_convert.converter(sd, text_sd, cfg, "synthetic", target).result()


class _ShapeConverter(core.Converter):
  """Checks shapes only (the sources are zero-stride views): nothing of full size is allocated."""

  def put(self, path, value, key=""):
    if path not in self.want:
      raise core.ConversionError(f"target has no parameter {path!r} (mapping {key}).")
    if tuple(value.shape) != tuple(self.want[path].shape):
      raise core.ConversionError(f"{key} -> {path}: {value.shape} != {self.want[path].shape}")
    if path in self.filled:
      raise core.ConversionError(f"{path} filled twice")
    self.filled[path] = value


# docs/models.md section 3.7 (M): video encoder, image encoder, diffusion MLP, embeddings / misc, transformer total
COUNTS = {"d48w768-sdxl1024": (113.46, 226.83, 20.90, 2.76, 363.95),
          "d48w1024-sdxl1024": (201.61, 403.10, 37.05, 3.94, 645.69),
          "d48w1536-sdxl1024": (453.41, 906.64, 83.09, 6.70, 1449.84),
          "d48w1024-sd512": (201.61, 403.10, 37.05, 3.94, 645.69),
          "d48w1024-osp480": (201.61, 403.10, 32.84, 6.57, 644.12)}


def test_full_size_key_lists_map_one_to_one():
  """For each released variant, every key of keys_nova-<variant>.txt maps onto the abstract full-size model with
  equal shapes and fills every transformer leaf (Phi-2 is checked in test_phi2); per-part parameter counts equal
  docs/models.md section 3.7 (the 1.31 M null-text buffer is counted apart, as there)."""
  n = lambda tree: sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree))
  for variant, want in COUNTS.items():
    cfg = nova.nova_config(variant)
    cfg.text_encoder.update(depth=0)  # the transformer at full size; Phi-2 itself is test_phi2's
    target = abstract_nova(cfg)
    sd = {k: np.broadcast_to(np.float32(0), s) for k, s in read_keys(f"keys_nova-{variant}.txt").items()}
    conv = _ShapeConverter(sd, {k: v for k, v in target.items() if k != "text_encoder"}, variant)
    nova_convert.convert_transformer(conv)
    assert not conv.unused() and set(conv.filled) == set(conv.want), variant
    bb = target["backbone"]
    misc = n(bb) - n(bb["video_encoder"]) - n(bb["image_encoder"])
    got = (n(bb["video_encoder"]), n(bb["image_encoder"]), n(target["head"]), misc, n(bb) + n(target["head"]))
    np.testing.assert_allclose(np.array(got) / 1e6, want, atol=0.006, err_msg=variant)
    assert n(target["null_text"]) == 512 * 2560


def test_variant_inference():
  keys = read_keys("keys_nova-d48w1536-sdxl1024.txt")
  sd = {k: np.broadcast_to(np.float32(0), s) for k, s in keys.items()}
  assert nova_convert.infer_variant(sd, "x") == "d48w1536-sdxl1024"
  sd = {k: np.broadcast_to(np.float32(0), s) for k, s in read_keys("keys_nova-d48w1024-sd512.txt").items()}
  with pytest.raises(core.ConversionError, match="d48w1024-sdxl1024, d48w1024-sd512"):
    nova_convert.infer_variant(sd, "x")


def test_nova_mask_schedule():
  """cos / round / zero steps skipped: the 63 counts of docs/algorithm.md section 3.3 for 1024 tokens, 1, 4, 6, 9
  (docs/models.md section 3.3) for 4096."""
  from margrpo_jax.sampling import schedule
  want = [1, 2, 2, 3, 3, 4, 5, 5, 6, 6, 7, 8, 8, 9, 9, 10, 10, 11, 12, 12, 13, 13, 14, 14, 15, 15, 15, 17, 16, 17,
          18, 18, 18, 19, 19, 20, 20, 20, 21, 21, 22, 21, 22, 23, 22, 23, 23, 23, 24, 24, 24, 24, 24, 25, 24, 25, 25,
          25, 25, 25, 25, 25, 25]
  s = schedule.rounded_cosine_schedule(1024, 64)
  np.testing.assert_array_equal(s.counts, want)
  assert s.counts.sum() == 1024 and s.starts[-1] + s.counts[-1] == 1024
  np.testing.assert_array_equal(schedule.rounded_cosine_schedule(4096, 64).counts[:4], [1, 4, 6, 9])


@pytest.mark.slow
def test_sample_tiny_image_from_converted_checkpoint(pair, tmp_path):
  """The converted tiny checkpoint (the fixture's) samples through the family hooks: prompt ids
  from a tokenizer.json, NOVA's sampler (4 AR steps, 3 flow steps, CFG 5, Flow-GRPO SDE noise 0.7 with a record),
  a tiny SD-layout VAE export; every token is decoded once, the same key gives the same image, and every recorded
  transition's log-prob recomputed from the record (score_step: backbone on the recorded canvas / mask, guided
  head) equals the rollout's (rtol 1e-3, float32; the last step's std is ~3e-2 here)."""
  import ml_collections
  tokenizers = pytest.importorskip("tokenizers")
  from margrpo_jax import checkpoint
  from margrpo_jax.models import vae
  from margrpo_jax.sampling import nova as nova_sampling
  _, _, cfg, model = pair
  model_cfg, graphdef, params = ml_collections.ConfigDict(cfg.to_dict()), model.graphdef, model.state
  tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({"[UNK]": 0, "a": 1, "red": 2, "cat": 3}, unk_token="[UNK]"))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
  tok.save(str(tmp_path / "tokenizer.json"))
  vcfg = vae.vae_config("sd", ch=8, ch_mult=(1, 2), num_res_blocks=1, norm_groups=4)
  vae_model = nnx.eval_shape(lambda: vae.AutoencoderKL(vcfg, rngs=nnx.Rngs(0)))
  vparams = jax.tree.map(lambda x: np.full(x.shape, 0.01, x.dtype), nnx.to_pure_dict(nnx.state(vae_model)))
  checkpoint.save_model(str(tmp_path / "vae"), vparams, vcfg)
  model_cfg.update(tokenizer_path=str(tmp_path), vae_checkpoint=str(tmp_path / "vae"))
  family = families.get(model_cfg.family)
  ids = family.prompt_ids(model_cfg, ["a red cat", ""])
  sampling = ml_collections.ConfigDict(dict(num_steps=4, diffusion_steps="3", cfg_scale=5.0, flow_noise_level=0.7))
  fn = family.make_sample_fn(graphdef, model_cfg, sampling, record=True)
  tokens, rec = fn(params, jnp.asarray(ids), jax.random.key(0))
  tokens2, _ = fn(params, jnp.asarray(ids), jax.random.key(0))
  np.testing.assert_array_equal(np.asarray(tokens), np.asarray(tokens2))
  n_tok = GRID[0] * GRID[1]
  counts = np.asarray(rec.valid).sum(-1)[:, 0]
  assert counts.sum() == n_tok and np.all(np.asarray(rec.mask)[0])
  assert np.all(np.isfinite(np.asarray(tokens)))
  scfg = nova_sampling.sampler_config(sampling)

  def rescore(state, ids, rec):
    m = nnx.merge(graphdef, state)
    return nova_sampling.score_step(m, scfg, rec, 1, m.condition(ids), m.null_condition(ids.shape[0]))

  logp, std = jax.jit(rescore)(params, jnp.asarray(ids), rec)
  v = np.asarray(rec.valid[1])[None]  # rows past the step's own count are padding
  np.testing.assert_allclose(np.where(v, logp, 0), np.where(v, rec.logp[1], 0), rtol=1e-3, atol=1e-3)
  np.testing.assert_allclose(np.asarray(std)[:, 0, 0, 0], flow.make_flow(3, 0.7).std, rtol=1e-5)
  images = family.decode_images(model_cfg, np.asarray(tokens))
  assert images.shape == (2, 2 * GRID[0] * 2, 2 * GRID[1] * 2, 3) and images.dtype == np.uint8
  # The sample / eval jobs' path: generate.generate dispatches to NOVA's own sampler (batch 0 uses fold_in(key, 0)).
  from margrpo_jax import generate
  got = generate.generate(graphdef, params, model_cfg, ["a red cat", ""], sampling, seed=0, batch_size=2)
  want, _ = family.make_sample_fn(graphdef, model_cfg, sampling)(params, jnp.asarray(ids),
                                                                 jax.random.fold_in(jax.random.key(0), 0))
  np.testing.assert_array_equal(got, family.decode_images(model_cfg, np.asarray(want)))



def test_config_variants_and_hyper_parameters():
  """configs/nova.py: every variant name resolves; NOVA's generation defaults and the paper's RL settings."""
  from margrpo_jax import config_files
  for arg, variant in [("d48w1024", "d48w1024-sdxl1024"), ("sd512", "d48w1024-sd512"),
                       ("d48w1536-sdxl1024", "d48w1536-sdxl1024")]:
    c = config_files.load("nova", arg)
    assert c.model.variant == variant and c.model.family == "nova"
  s, rl = c.sampling, c.rl
  assert (s.num_steps, s.diffusion_steps, s.cfg_scale, s.cfg_schedule, s.flow_noise_level) == (64, "25", 5.0,
                                                                                               "constant", 0.0)
  assert (rl.group_size, rl.num_ar_steps, rl.num_diffusion_steps, rl.mte_seeds, rl.topk_fraction, rl.beta,
          rl.flow_noise_level, rl.channel_reduction) == (4, 12, 10, 3, 0.3, 0.01, 0.7, "mean")
  assert (c.optim.lr, c.optim.grad_clip, c.num_iters) == (2e-6, 1.0, 1200)
  assert (c.checkpoint, c.model.tokenizer_path, c.model.vae_checkpoint) == ("", "", "")
  with pytest.raises(ValueError, match="unknown config arg 'w9' for nova"):
    config_files.load("nova", "w9")


def test_export_official_round_trip(pair, tmp_path):
  """A NOVA pipeline's transformer/ -> convert -> export -> export_official: diffusion_pytorch_model.safetensors
  with the same keys and values bit for bit and the template's config.json; a changed backbone reads back
  exactly (Phi-2 stays in the pipeline's text_encoder/)."""
  from safetensors.numpy import load_file, save_file

  from margrpo_jax import checkpoint
  from margrpo_jax.convert import official
  from test_export_official import round_trip_checks
  _, ref, cfg, _ = pair
  sd = {k: v.detach().numpy().copy() for k, v in ref.state_dict().items()}
  (tmp_path / "text_encoder").mkdir()
  save_file({k: 0.1 * v for k, v in synthetic(phi_layer0_keys(), {2560: TOK, 10240: 64, 51200: 40}, 1).items()},
            str(tmp_path / "text_encoder" / "model.safetensors"))
  (tmp_path / "transformer").mkdir()
  save_file(sd, str(tmp_path / "transformer" / "diffusion_pytorch_model.safetensors"))
  (tmp_path / "transformer" / "config.json").write_text('{"_class_name": "NOVATransformer3DModel"}')

  def convert(folder):
    flat = core.state_dict(core.read_checkpoint(str(folder / "diffusion_pytorch_model.safetensors")))
    return nova_convert.convert(flat, origin=str(folder), model_cfg=cfg)[:2]
  export = checkpoint.save_model(str(tmp_path / "export"), *convert(tmp_path / "transformer")[::-1])
  official.export("nova", export, str(tmp_path / "transformer"), str(tmp_path / "out"))
  assert (tmp_path / "out" / "config.json").read_text() == (tmp_path / "transformer" / "config.json").read_text()
  written = load_file(str(tmp_path / "out" / "diffusion_pytorch_model.safetensors"))

  def convert_again(tuned_dir):
    official.export("nova", tuned_dir, str(tmp_path / "transformer"), str(tmp_path / "tuned"))
    return convert(tmp_path / "tuned")[1]
  round_trip_checks(sd, written, export, convert_again, tmp_path, "backbone")
