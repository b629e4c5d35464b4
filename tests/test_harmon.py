"""Harmon: forward parity with a PyTorch reference written here from docs/models.md section 2.2 (timm MAR blocks,
HF Qwen2, gathered visible tokens, buffer reordering, 16^2 -> 32^2-style bilinear position tables), converter coverage on
the exact keys of keys_Harmon-0.5B.txt (scaled-down shapes) and on the full-size key lists (shapes only), plan
parameter counts (docs/models.md section 2.7), the config, and sampling a converted tiny checkpoint through the MAR
sampler."""
from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from margrpo_jax import checkpoint, config_files
from margrpo_jax.convert import core, harmon as convert_harmon
from margrpo_jax.models import harmon, qwen_tokenizer
from test_qwen2 import build_tokenizer

from conftest import KEYS  # noqa: E402
ATOL = 5e-5  # float32 parity of the whole backbone (encoder, 2-layer LLM, decoder); measured 3.6e-6, |z| <= 3.7


@pytest.fixture(scope="module", autouse=True)
def _fast_abstract_builds():
  """Building a model under ``nnx.eval_shape`` is quadratic in its parameter count with jax 0.10.2 + flax 0.12.8:
  flax's ``Variable.set_value`` probes ``getattr(tracer, 'sharding', None)``, and jax builds that AttributeError's
  message by scanning the whole jaxpr (``find_progenitors``). Skipping only the message text makes the full-size
  1.5B build ~15x faster (39 s -> 2.6 s measured); results are unchanged."""
  from jax._src.interpreters import partial_eval as pe
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(pe.DynamicJaxprTracer, "_origin_msg", lambda self: "")
    yield


def read_keys(name: str) -> dict[str, tuple]:
  out = {}
  with open(os.path.join(KEYS, name)) as f:
    for line in f:
      if line.strip():
        key, shape = line.split("\t")[:2]
        out[key] = tuple(int(d) for d in shape.strip("[] \n").split(",") if d.strip())
  return out


def tiny_config(full_depth: bool):
  """Scaled-down widths; ``full_depth``: Harmon-0.5B's depths (24 LLM layers, 12 + 12 MAR blocks, 6 head blocks)
  so that the key names are exactly the released ones. 128 px: an 8 x 8 token grid from 4 x 4 learned tables."""
  cfg = harmon.harmon_config("0.5b", image_size=128, text_len=24)
  cfg.update(pos_seq_len=16, buffer_size=4)
  cfg.llm.update(vocab_size=320, hidden_size=32, num_heads=2, num_kv_heads=1, head_dim=16, intermediate_size=48,
                 num_layers=24 if full_depth else 2)
  cfg.mar.update(width=32, num_heads=2, num_classes=10, encoder_depth=12 if full_depth else 1,
                 decoder_depth=12 if full_depth else 1)
  cfg.head.update(width=32, depth=6 if full_depth else 1)
  return cfg


@functools.lru_cache(maxsize=None)
def _abstract_json(cfg_json: str):
  import json
  import ml_collections
  cfg = ml_collections.ConfigDict(json.loads(cfg_json))
  return core.abstract_params(cfg, lambda c: harmon.Harmon(c, rngs=nnx.Rngs(0)))


def _abstract(cfg):
  """``abstract_params`` of a Harmon config (each architecture built once per session: it takes seconds)."""
  return _abstract_json(cfg.to_json(sort_keys=True))


class _Probe(core.Converter):
  """Records the source shape every mapped key must have for ``target`` (Harmon's maps only transpose)."""

  def copy(self, path, key, fn=None):
    self.get(key)
    want = self.want[path].shape
    self.shapes[key] = fn(np.empty(want)).shape if fn else tuple(want)
    self.filled[path] = None


class _ShapeOnly(core.Converter):
  """Checks the mapped shapes without materialising the (full-size) values."""

  def put(self, path, value, key=""):
    assert path in self.want, (key, path)
    assert tuple(value.shape) == tuple(self.want[path].shape), (key, value.shape, path, self.want[path].shape)
    assert path not in self.filled, path
    self.filled[path] = value


def synthetic(keys, cfg, seed=0):
  """A state dict with exactly ``keys``, each shaped for the (tiny) ``cfg``."""
  probe = _Probe({k: None for k in keys}, _abstract(cfg))
  probe.shapes = {}
  convert_harmon.fill(probe)
  assert not probe.unused() and set(probe.filled) == set(probe.want)
  rng = np.random.default_rng(seed)
  shapes = dict(probe.shapes, **{"llm.lm_head.weight": probe.shapes["llm.model.embed_tokens.weight"]})
  return {k: rng.standard_normal(shapes[k]).astype(np.float32) * 0.1 for k in keys}


def test_exact_official_keys_convert_with_full_coverage():
  keys = read_keys("keys_Harmon-0.5B.txt")
  cfg = tiny_config(full_depth=True)
  sd = synthetic(keys, cfg)
  conv = core.Converter(sd, _abstract(cfg), "synthetic")
  convert_harmon.fill(conv)
  params = conv.result()  # raises on any missing target or unused key
  report = conv.report()
  assert report["used"] == report["target_parameters"] == len(keys) - 1
  assert report["ignored"]["tied to llm.model.embed_tokens; text-to-image uses no LM head"] == 1
  np.testing.assert_array_equal(params["llm"]["embed_tokens"]["embedding"], sd["llm.model.embed_tokens.weight"])
  np.testing.assert_array_equal(params["proj_out"]["fc2"]["kernel"], sd["proj_out.2.weight"].T)
  np.testing.assert_array_equal(params["head"]["res_blocks"][5]["ada_ln"]["kernel"],
                                sd["mar.diffloss.net.res_blocks.5.adaLN_modulation.1.weight"].T)
  np.testing.assert_array_equal(params["mar"]["encoder_pos_embed_learned"], sd["mar.encoder_pos_embed_learned"])
  bad = dict(sd, **{"mar.decoder_blocks.3.mlp.fc1.weight": sd["mar.decoder_blocks.3.mlp.fc1.weight"][:, :5]})
  with pytest.raises(core.ConversionError, match=r"mar\.decoder_blocks\.3\.mlp\.fc1\.weight"):
    convert_harmon.fill(core.Converter(bad, _abstract(cfg), "synthetic"))


# docs/models.md section 2.7 (millions): LLM (tied head once), MAR backbone (with class_emb), head, projectors, total
COUNTS = {"0.5b": (494.03, 172.17, 35.75, 2.99, 704.94), "1.5b": (1543.71, 791.20, 151.21, 8.66, 2494.77)}


@pytest.mark.parametrize("size,keys_file", [("0.5b", "keys_Harmon-0.5B.txt"), ("1.5b", "keys_Harmon-1.5B.txt")])
def test_full_size_keys_map_one_to_one_and_counts(size, keys_file):
  """Every official key maps onto the abstract full-size model with equal shapes (nothing allocated), and the
  per-component counts (what plan mode prints: the same sum over the same abstract tree) equal docs/models.md
  section 2.7."""
  keys = read_keys(keys_file)
  sd = {k: np.broadcast_to(np.float32(0), s) for k, s in keys.items()}  # no memory
  assert convert_harmon.infer_size(sd) == size
  target = _abstract(config_files.load("harmon", size).model)
  conv = _ShapeOnly(sd, target, keys_file)
  convert_harmon.fill(conv)
  assert not conv.unused() and set(conv.filled) == set(conv.want)
  assert len(conv.used) == len(keys) - 1  # all but the tied llm.lm_head.weight
  n = {k: sum(int(np.prod(x.shape)) for x in jax.tree.leaves(v)) for k, v in target.items()}
  got = (n["llm"], n["mar"], n["head"], n["proj_in"] + n["proj_out"], sum(n.values()))
  np.testing.assert_allclose(np.array(got) / 1e6, COUNTS[size], atol=0.005)
  assert sum(n.values()) == {"0.5b": 704_942_880, "1.5b": 2_494_774_048}[size]


def test_config_has_the_paper_settings():
  c = config_files.load("harmon", "1.5b")
  assert (c.model.family, c.model.seq_len, c.model.pos_seq_len, c.model.mar.width) == ("harmon", 1024, 256, 1280)
  assert (c.sampling.num_steps, c.sampling.diffusion_steps, c.sampling.cfg_scale, c.sampling.cfg_schedule,
          c.sampling.temperature) == (64, "100", 3.0, "constant", 1.0)
  assert (c.rl.group_size, c.rl.num_ar_steps, c.rl.num_diffusion_steps, c.rl.mte_seeds, c.rl.topk_fraction,
          c.rl.beta, c.optim.lr, c.optim.grad_clip, c.num_iters) == (4, 12, 10, 5, 0.3, 0.01, 1e-6, 1.0, 1200)
  assert harmon.Harmon.policy_components == ("mar",)
  assert c.model.tokenizer_path == "" and c.model.vae_checkpoint == "" and c.checkpoint == ""
  with pytest.raises(ValueError, match="unknown config arg"):
    config_files.load("harmon", "7b")


# ---- forward parity against a PyTorch reference ------------------------------------------------------------------

@pytest.fixture(scope="module")
def torch_harmon():
  """Tiny random Harmon in PyTorch with the official module names (state dict keys as in the .pth)."""
  import torch
  import transformers
  from functools import partial
  from timm.models.vision_transformer import Block
  cfg = tiny_config(full_depth=False)
  d, h, nb = cfg.mar.width, cfg.llm.hidden_size, cfg.buffer_size
  torch.manual_seed(0)

  def blocks(n):
    return torch.nn.ModuleList([Block(d, cfg.mar.num_heads, 4.0, qkv_bias=True,
                                      norm_layer=partial(torch.nn.LayerNorm, eps=1e-6)) for _ in range(n)])

  mar = torch.nn.Module()
  P = lambda *s: torch.nn.Parameter(torch.zeros(*s))  # noqa: E731
  mar.fake_latent, mar.mask_token = P(1, d), P(1, 1, d)
  mar.encoder_pos_embed_learned, mar.decoder_pos_embed_learned = P(1, nb + 16, d), P(1, nb + 16, d)
  mar.diffusion_pos_embed_learned = P(1, 16, d)
  mar.class_emb = torch.nn.Embedding(cfg.mar.num_classes, d)
  mar.z_proj, mar.z_proj_ln = torch.nn.Linear(16, d), torch.nn.LayerNorm(d, eps=1e-6)
  mar.encoder_blocks, mar.encoder_norm = blocks(1), torch.nn.LayerNorm(d, eps=1e-6)
  mar.decoder_embed, mar.decoder_blocks = torch.nn.Linear(d, d), blocks(1)
  mar.decoder_norm = torch.nn.LayerNorm(d, eps=1e-6)
  llm = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
      vocab_size=320, hidden_size=h, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
      num_key_value_heads=1, rope_parameters={"rope_type": "default", "rope_theta": 1e6}, rms_norm_eps=1e-6,
      tie_word_embeddings=True, attn_implementation="eager"))
  top = torch.nn.Module()
  top.llm, top.mar = llm, mar
  top.proj_in = torch.nn.Sequential(torch.nn.Linear(d, h), torch.nn.SiLU(), torch.nn.Linear(h, h))
  top.proj_out = torch.nn.Sequential(torch.nn.Linear(h, h), torch.nn.SiLU(), torch.nn.Linear(h, d))
  with torch.no_grad():
    for name, p in top.named_parameters():
      p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name or "_ln" in name else 0.3 * torch.randn_like(p))
      p.copy_(p.bfloat16().float())  # bf16-exact, so that the bf16 .pth below is lossless
  top.eval()
  sd = {k: v.numpy() for k, v in top.state_dict().items()}
  head = synthetic([k for k in read_keys("keys_Harmon-0.5B.txt") if k.startswith("mar.diffloss.net.")
                    and ("res_blocks.0." in k or "res_blocks" not in k)] + list(sd), cfg)
  sd.update({k: v for k, v in head.items() if k.startswith("mar.diffloss.net.")})
  return cfg, top, sd


def reference_z(top, cfg, tokens, mask, ids, text_valid, pad_id=0):
  """docs/models.md section 2.2 literally: gather the visible tokens, [text ; visible ; buffer] through the LLM with the
  padding mask and positions cumsum - 1, residual, MAR decoder with mask tokens (all in PyTorch)."""
  import torch
  import torch.nn.functional as F
  m, nb, d = top.mar, cfg.buffer_size, cfg.mar.width
  b = tokens.shape[0]

  def pos(table, buf):
    img = table[:, buf:].reshape(1, 4, 4, d).permute(0, 3, 1, 2)
    img = F.interpolate(img, size=(8, 8), mode="bilinear", align_corners=False).permute(0, 2, 3, 1)
    return torch.cat([table[:, :buf], img.reshape(1, 64, d)], 1)

  with torch.no_grad():
    tokens, mask = torch.tensor(tokens), torch.tensor(mask)
    x = torch.cat([m.fake_latent.expand(b, nb, d), m.z_proj(tokens)], 1)
    x = m.z_proj_ln(x + pos(m.encoder_pos_embed_learned, nb))
    keep = torch.cat([torch.ones(b, nb, dtype=torch.bool), ~mask], 1)
    x = x[keep].reshape(b, -1, d)
    for blk in m.encoder_blocks:
      x = blk(x)
    x = m.encoder_norm(x)
    z = top.proj_in(x)
    z = torch.cat([z[:, nb:], z[:, :nb]], 1)
    text = top.llm.model.embed_tokens(torch.tensor(np.where(text_valid, ids, pad_id)))
    attn = torch.cat([torch.tensor(text_valid), torch.ones(b, z.shape[1], dtype=torch.bool)], 1).long()
    positions = (torch.cumsum(attn, 1) - 1).clamp(min=0)
    out = top.llm.model(inputs_embeds=torch.cat([text, z], 1), attention_mask=attn,
                        position_ids=positions).last_hidden_state[:, -z.shape[1]:]
    out = torch.cat([out[:, -nb:], out[:, :-nb]], 1)
    x = m.decoder_embed(x + top.proj_out(out))
    full = m.mask_token.repeat(b, keep.shape[1], 1)
    full[keep] = x.reshape(-1, d)
    x = full + pos(m.decoder_pos_embed_learned, nb)
    for blk in m.decoder_blocks:
      x = blk(x)
    return (m.decoder_norm(x)[:, nb:] + pos(m.diffusion_pos_embed_learned, 0)).numpy()


@pytest.fixture(scope="module")
def converted(torch_harmon, tmp_path_factory):
  """The torch model saved as the released files are (a flat bf16 state dict ``.pth``), read back, converted and
  exported; the tokenizer.json beside it gives the null prompt's ids."""
  import torch
  cfg, _, sd = torch_harmon
  folder = tmp_path_factory.mktemp("harmon_src")
  build_tokenizer(folder)
  path = str(folder / "harmon_tiny.pth")
  torch.save({k: torch.from_numpy(v).bfloat16() for k, v in sd.items()}, path)
  sd = core.state_dict(core.read_checkpoint(path), prefer=convert_harmon.PREFER, origin=path)
  cfg_out, params, _ = convert_harmon.convert(sd, origin=path, model_cfg=cfg.copy_and_resolve_references())
  assert cfg_out.text.null_ids and params["llm"]["norm"]["scale"].dtype == np.float32
  out = checkpoint.save_model(str(tmp_path_factory.mktemp("harmon_export")), params, cfg_out)
  model_cfg, graphdef, params = checkpoint.load_model(out)
  model_cfg.tokenizer_path = str(folder)
  return model_cfg, graphdef, params, out


def test_backbone_matches_pytorch_reference(torch_harmon, converted):
  cfg, top, _ = torch_harmon
  model_cfg, graphdef, params, _ = converted
  model = nnx.merge(graphdef, params)
  rng = np.random.default_rng(1)
  b, seq = 2, cfg.seq_len
  tokens = rng.standard_normal((b, seq, 16)).astype(np.float32)
  mask = np.zeros((b, seq), bool)
  for i in range(b):  # the same number of unknown tokens per row (MAR's gather needs it), different places
    mask[i, rng.permutation(seq)[:40]] = True
  ids = rng.integers(0, 320, (b, cfg.text.max_len)).astype(np.int32)
  text_valid = np.zeros_like(ids, bool)
  text_valid[0, :10], text_valid[1, :17] = True, True
  ours = model.backbone(jnp.asarray(tokens), jnp.asarray(mask), jnp.asarray(np.where(text_valid, ids, -1)))
  ref = reference_z(top, cfg, tokens, mask, ids, text_valid, pad_id=7)
  assert ours.shape == (b, seq, cfg.mar.width)
  np.testing.assert_allclose(np.asarray(ours), ref, atol=ATOL, rtol=0)


def test_prompt_ids_and_null_condition(converted):
  """Captions -> chat-template ids; the null condition is the tokenizer's null prompt."""
  model_cfg, graphdef, params, _ = converted
  ids = harmon.Harmon.prompt_ids(model_cfg, ["a red apple"])
  tok = qwen_tokenizer.load(model_cfg.tokenizer_path)
  assert ids.shape == (1, model_cfg.text.max_len) and ids.dtype == np.int32
  assert tok.decode(ids[0][ids[0] >= 0].tolist(), skip_special_tokens=False) == qwen_tokenizer.harmon_prompts(
      ["a red apple"])[0]
  model = nnx.merge(graphdef, params)
  null = np.asarray(model.null_condition(2))
  assert null.shape == (2, model_cfg.text.max_len) and (null[0] == null[1]).all()
  assert tok.decode(null[0][null[0] >= 0].tolist(), skip_special_tokens=False) == qwen_tokenizer.null_prompt()
  # the null ids must be the tokenizer's: a mismatch is one sentence that names the fix
  bad = model_cfg.copy_and_resolve_references()
  bad.text.null_ids = [1, 2, 3]
  with pytest.raises(checkpoint.CheckpointError, match="null_ids"):
    harmon.Harmon.prompt_ids(bad, ["x"])


def test_sample_mode_names_each_missing_path(converted, tmp_path):
  """``configs/harmon.py`` in sample mode: an unset checkpoint, VAE or tokenizer path is one sentence (the sample
  job's check of a real family's model block); plan mode needs none of them (test above)."""
  from margrpo_jax.jobs import sample  # conftest imports torch / torchvision before TensorFlow
  c = config_files.load("harmon", "0.5b")
  c.mode = "sample"
  with pytest.raises(checkpoint.CheckpointError, match="config.checkpoint is not set"):
    sample.load_for_sampling(c)
  c.checkpoint = converted[3]
  c.model.tokenizer_path = converted[0].tokenizer_path
  with pytest.raises(checkpoint.CheckpointError, match="model.vae_checkpoint is not set"):
    sample.load_for_sampling(c)
  c.model.vae_checkpoint, c.model.tokenizer_path = str(tmp_path), ""
  with pytest.raises(checkpoint.CheckpointError, match="model.tokenizer_path is not set"):
    sample.load_for_sampling(c)
  with pytest.raises(qwen_tokenizer.TokenizerError, match="model.tokenizer_path is not set"):
    harmon.Harmon.prompt_ids(checkpoint.load_model(converted[3])[0], ["a cat"])


@pytest.mark.slow
def test_generate_decodes_through_a_vae_export(converted, tmp_path):
  """Prompts -> images through generate.generate: the family hooks (prompt_ids; decode_images through a tiny
  random KL-16-layout export with one downsampling level, 8 x 8 tokens -> 16 x 16 px) around the MAR sampler with
  CFG against the null prompt (4 AR steps x 2 diffusion steps)."""
  import ml_collections
  from margrpo_jax import generate
  from margrpo_jax.models import vae
  model_cfg, graphdef, params, _ = converted
  vcfg = vae.vae_config("kl16", ch=32, ch_mult=(1, 1), num_res_blocks=1, enc_attn_levels=(), norm_groups=8)
  vstate = nnx.state(vae.AutoencoderKL(vcfg, rngs=nnx.Rngs(0)))
  model_cfg = model_cfg.copy_and_resolve_references()
  model_cfg.vae_checkpoint = checkpoint.save_model(str(tmp_path / "vae"), nnx.to_pure_dict(vstate), vcfg)
  sampling = ml_collections.ConfigDict(dict(num_steps=4, diffusion_steps="2", cfg_scale=3.0, cfg_schedule="constant",
                                            temperature=1.0, clip_denoised=False))
  images = generate.generate(graphdef, params, model_cfg, ["a red apple", "a blue car"], sampling, seed=0,
                             batch_size=1)
  assert images.shape == (2, 16, 16, 3) and images.dtype == np.uint8


def test_export_official_round_trip(torch_harmon, tmp_path):
  """Harmon's flat .pth -> convert -> export -> export_official: the same keys and values bit for bit (the tied LM
  head and every key the converter ignores kept from the template), and a changed MAR reads back exactly."""
  import torch
  from margrpo_jax.convert import official
  from test_export_official import round_trip_checks
  cfg, _, sd = torch_harmon
  template = str(tmp_path / "harmon.pth")
  torch.save({k: torch.from_numpy(v) for k, v in sd.items()}, template)

  def convert(path):
    flat = core.state_dict(core.read_checkpoint(path), prefer=convert_harmon.PREFER, origin=path)
    cfg_out, params, _ = convert_harmon.convert(flat, origin=path, model_cfg=cfg.copy_and_resolve_references())
    return cfg_out, params
  export = checkpoint.save_model(str(tmp_path / "export"), *convert(template)[::-1])
  official.export("harmon", export, template, str(tmp_path / "out.pth"))
  written = {k: v.numpy() for k, v in torch.load(tmp_path / "out.pth", weights_only=True).items()}

  def convert_again(tuned_dir):
    official.export("harmon", tuned_dir, template, str(tmp_path / "tuned.pth"))
    return convert(str(tmp_path / "tuned.pth"))[1]
  round_trip_checks(sd, written, export, convert_again, tmp_path, "mar")
