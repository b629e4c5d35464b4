"""CLIP in Flax against its PyTorch oracles, and the open_clip / OpenAI / HF converters.

* open_clip layout: a tiny ``open_clip.model.CLIP`` (gelu, and quick_gelu as OpenAI's models) with every parameter
  randomised, converted with ``clip_openclip``: image / text embeddings (raw and normalised) and logits equal the
  oracle's within atol 2e-5 (float32).
* HF layout: a tiny ``transformers.CLIPModel`` (gelu), converted with ``clip_hf``: same quantities, atol 2e-5.
* Official layouts at full size: the state-dict keys and shapes of open_clip ViT-H-14 (HPS v2.1), ViT-L-14 and
  ViT-B-32 (OpenAI, + its metadata keys), and HF ``CLIPModel`` ViT-H-14 (PickScore) and ViT-L/14 (openai) built on
  torch's meta device, converted by the real mapping with a shape-only store: no missing or unused key, every shape
  equal, the size (heads, act) recognised from the weights, and our parameter count equal to the oracle's.
"""
from __future__ import annotations

import numpy as np
import pytest

from margrpo_jax.convert import clip_hf, clip_openclip
from margrpo_jax.convert.core import ConversionError, Converter
from margrpo_jax.models import clip

ATOL = 2e-5
TINY = "vision_heads=2,text_heads=2,act={act}"


def randomize(module, seed=0):
  """Every float parameter of a torch module ~ N(0, 0.1^2) (LayerNorm weights around 1, logit_scale log 50)."""
  import torch
  g = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in module.named_parameters():
      noise = 0.1 * torch.randn(p.shape, generator=g)
      if name.endswith("logit_scale"):
        p.copy_(torch.tensor(np.log(50.0)) + noise)
      elif ("ln" in name or "norm" in name) and name.endswith("weight"):
        p.copy_(1 + noise)
      else:
        p.copy_(noise)
  return module.eval()


def tiny_openclip(act: str):
  import open_clip
  torch_model = open_clip.model.CLIP(
      embed_dim=24, quick_gelu=act == "quick_gelu",
      vision_cfg=dict(layers=2, width=32, head_width=16, patch_size=8, image_size=32),
      text_cfg=dict(context_length=16, vocab_size=100, width=32, heads=2, layers=2))
  return randomize(torch_model)


def tiny_hf():
  from transformers import CLIPConfig, CLIPModel
  config = CLIPConfig(
      text_config=dict(vocab_size=100, hidden_size=32, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=2, max_position_embeddings=16, hidden_act="gelu", eos_token_id=99),
      vision_config=dict(hidden_size=32, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                         image_size=32, patch_size=8, hidden_act="gelu"),
      projection_dim=24)
  return randomize(CLIPModel(config))


def inputs(seed=0, vocab=100, ctx=16):
  """Random NCHW pixels and ids ``<sot=vocab-2> tokens <eot=vocab-1> 0...`` of varied lengths."""
  rng = np.random.default_rng(seed)
  pixels = rng.normal(size=(3, 3, 32, 32)).astype(np.float32)
  ids = np.zeros((3, ctx), np.int64)
  for row, n in enumerate((3, 9, ctx - 2)):
    ids[row, :n + 2] = [vocab - 2, *rng.integers(1, vocab - 2, n), vocab - 1]
  return pixels, ids


def flax_model(cfg, params):
  from flax import nnx
  graphdef, _ = nnx.split(nnx.eval_shape(lambda: clip.CLIP(cfg, rngs=nnx.Rngs(0))))
  return nnx.merge(graphdef, params)


def sd_numpy(torch_model):
  return {k: v.detach().numpy() for k, v in torch_model.state_dict().items()}


def forward(model, pixels, ids):
  """Jitted ``(image_emb, text_emb, logits, raw image features)`` of NCHW pixels and ids."""
  from flax import nnx

  @nnx.jit
  def f(m, x, t):
    return *m(x, t), m.encode_image(x, normalize=False)
  return [np.asarray(a) for a in f(model, pixels.transpose(0, 2, 3, 1), ids.astype(np.int32))]


def check_against(model, pixels, ids, want_img, want_txt, want_logits):
  img, txt, logits, raw = forward(model, pixels, ids)
  np.testing.assert_allclose(img, want_img, atol=ATOL)
  np.testing.assert_allclose(txt, want_txt, atol=ATOL)
  np.testing.assert_allclose(np.asarray(logits), want_logits, atol=ATOL * 50)  # logits ~ 50 * cos
  return raw


@pytest.mark.parametrize("act", ["gelu", "quick_gelu"])
def test_openclip_layout_matches_open_clip(act):
  import torch
  oracle = tiny_openclip(act)
  cfg, params, report = clip_openclip.convert(sd_numpy(oracle), size=TINY.format(act=act))
  assert (cfg.vision.image_size, cfg.vision.patch_size, cfg.text.context_length, cfg.embed_dim) == (32, 8, 16, 24)
  model = flax_model(cfg, params)
  pixels, ids = inputs()
  with torch.no_grad():
    img = oracle.encode_image(torch.from_numpy(pixels), normalize=True).numpy()
    txt = oracle.encode_text(torch.from_numpy(ids), normalize=True).numpy()
    raw = oracle.encode_image(torch.from_numpy(pixels)).numpy()
    logits = (oracle.logit_scale.exp() * torch.from_numpy(img) @ torch.from_numpy(txt).T).numpy()
  np.testing.assert_allclose(check_against(model, pixels, ids, img, txt, logits), raw, atol=ATOL * 10)
  assert report["used"] == report["source_keys"]


def test_hf_layout_matches_transformers():
  import torch
  oracle = tiny_hf()
  cfg, params, _ = clip_hf.convert(sd_numpy(oracle), size=TINY.format(act="gelu"))
  pixels, ids = inputs()
  with torch.no_grad():
    out = oracle(input_ids=torch.from_numpy(ids), pixel_values=torch.from_numpy(pixels))
  check_against(flax_model(cfg, params), pixels, ids, out.image_embeds.numpy(), out.text_embeds.numpy(),
                out.logits_per_image.numpy())


class ShapeOnly(Converter):
  """The real mapping with a store that checks shapes but keeps no data (full-size models in no memory)."""

  def put(self, path, value, key=""):
    want = self.want.get(path)
    if want is not None and path not in self.filled and tuple(np.shape(value)) == tuple(want.shape):
      self.filled[path] = want
      return
    super().put(path, np.zeros(np.shape(value), np.float32), key)  # raises the converter's own error


def meta_state(build):
  """``({key: zero-stride array of the real shape}, parameter count)`` of a torch model built on the meta device."""
  import torch
  with torch.device("meta"):
    m = build()
  sd = {k: np.broadcast_to(np.float32(0), tuple(v.shape)) for k, v in m.state_dict().items()}
  return sd, sum(p.numel() for p in m.parameters())


def _openclip(name):
  import open_clip
  return lambda: open_clip.model.CLIP(**open_clip.get_model_config(name))


def _hf(vision, text, proj, act):
  from transformers import CLIPConfig, CLIPModel
  (vw, vl, vh), (tw, tl, th) = vision, text
  return lambda: CLIPModel(CLIPConfig(
      vision_config=dict(hidden_size=vw, num_hidden_layers=vl, num_attention_heads=vh, intermediate_size=4 * vw,
                         patch_size=14, image_size=224, hidden_act=act),
      text_config=dict(hidden_size=tw, num_hidden_layers=tl, num_attention_heads=th, intermediate_size=4 * tw,
                       hidden_act=act), projection_dim=proj))


OFFICIAL = {  # our size name, layout, oracle builder, extra keys found in real files
    "hps_v2.1 (open_clip ViT-H-14)": ("ViT-H-14", clip_openclip, _openclip("ViT-H-14"), {}),
    "openai ViT-L/14": ("ViT-L-14", clip_openclip, _openclip("ViT-L-14-quickgelu"),
                        {"input_resolution": (), "context_length": (), "vocab_size": ()}),
    "openai ViT-B/32": ("ViT-B-32", clip_openclip, _openclip("ViT-B-32-quickgelu"), {}),
    "pickscore (HF ViT-H-14)": ("ViT-H-14", clip_hf, _hf((1280, 32, 16), (1024, 24, 16), 1024, "gelu"),
                                {"text_model.embeddings.position_ids": (1, 77),
                                 "vision_model.embeddings.position_ids": (1, 257)}),
    "openai/clip-vit-large-patch14 (HF)": ("ViT-L-14", clip_hf, _hf((1024, 24, 16), (768, 12, 12), 768, "quick_gelu"),
                                           {}),
}


def shape_only_stack(arrays):
  assert len({a.shape for a in arrays}) == 1
  return np.broadcast_to(np.float32(0), (len(arrays), *arrays[0].shape))


@pytest.mark.parametrize("name", list(OFFICIAL))
def test_official_layouts_convert_with_full_coverage(name, monkeypatch):
  monkeypatch.setattr(clip_openclip, "stack_layers", shape_only_stack)
  size, module, build, extra = OFFICIAL[name]
  sd, oracle_count = meta_state(build)
  sd.update({k: np.zeros(s, np.float32) for k, s in extra.items()})
  cfg = clip_openclip.infer_config(sd, "openclip" if module is clip_openclip else "hf")
  assert cfg.to_dict() == clip.clip_config(size).to_dict()
  target = clip_openclip.target(cfg)
  conv = ShapeOnly(sd, target, name)
  module.fill(conv)
  conv.result()  # raises on any missing target leaf or unused source key
  ours = sum(int(np.prod(x.shape)) for x in conv.want.values())
  assert ours == oracle_count, (ours, oracle_count)


def test_errors_name_the_key():
  sd = sd_numpy(tiny_openclip("gelu"))
  with pytest.raises(ConversionError, match="not a known size"):
    clip_openclip.convert(dict(sd))
  del sd["transformer.resblocks.1.mlp.c_proj.bias"]
  with pytest.raises(ConversionError, match="transformer.resblocks.1.mlp.c_proj.bias"):
    clip_openclip.convert(sd, size=TINY.format(act="gelu"))
  with pytest.raises(ConversionError, match="'visual.positional_embedding'"):
    clip_openclip.convert({"visual.conv1.weight": np.zeros((8, 3, 4, 4))}, size=TINY.format(act="gelu"))
  sd["transformer.resblocks.1.mlp.c_proj.bias"] = np.zeros(3, np.float32)
  with pytest.raises(ConversionError, match=r"resblocks.1. gives text/blocks/mlp/fc2/bias the shape \(3,\)"):
    clip_openclip.convert(sd, size=TINY.format(act="gelu"))
