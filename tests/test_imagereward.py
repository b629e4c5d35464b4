"""ImageReward: WordPiece vs transformers' BertTokenizer, preprocessing vs torchvision/PIL, the Flax model vs a
PyTorch oracle (timm ViT + transformers' BlipTextModel, whose state dicts carry BLIP's official key names) on
random weights, the converter CLI path, and official-size key coverage / parameter count."""
from __future__ import annotations

import re

import numpy as np
import pytest

torch = pytest.importorskip("torch")
timm = pytest.importorskip("timm")
transformers = pytest.importorskip("transformers")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_collections  # noqa: E402
from flax import nnx  # noqa: E402

from margrpo_jax import checkpoint  # noqa: E402
from margrpo_jax.convert import __main__ as convert_cli  # noqa: E402
from margrpo_jax.convert import core, imagereward as conv_ir  # noqa: E402
from margrpo_jax.models import blip  # noqa: E402
from margrpo_jax.rewards import imagereward, registry, wordpiece  # noqa: E402

WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a", "photo", "of", "red", "blue", "circle", "square",
         "cafe", "the", "un", "##aff", "##able", "##s", ",", ".", "!", "'", "-", "dog", "cat", "和", "中", "##ing",
         "play", "two", "an", "orange", "##e", "x", "and", "green", "triangle"]
TEXTS = ["A photo of a RED circle.", "unaffable cats, playing!", "Café  and\tthe\u00a0dog", "中和国 x", "x" * 120,
         "a [SEP] b [MASK] [ENC]", "two-orange squares's", "don't\x00 stop\u200b", "", "zzz a dog " * 12,
         "a green triangle and two blue squares"]
TINY = dict(img=32, patch=8, vw=128, vdepth=2, vheads=2, tw=192, tdepth=2, theads=3, inter=256, pos=40)
HEAD = (16, 8, 8, 4)


def _vit(img, patch, width, depth, heads):
  from timm.models.vision_transformer import VisionTransformer
  return VisionTransformer(img_size=img, patch_size=patch, embed_dim=width, depth=depth, num_heads=heads,
                           mlp_ratio=4.0, qkv_bias=True, num_classes=0, global_pool="")


def _text(vocab, width, depth, heads, inter, pos, enc):
  from transformers import BlipTextConfig, BlipTextModel
  cfg = BlipTextConfig(vocab_size=vocab, hidden_size=width, encoder_hidden_size=enc, intermediate_size=inter,
                       num_hidden_layers=depth, num_attention_heads=heads, max_position_embeddings=pos)
  return BlipTextModel(cfg, add_pooling_layer=False)


def _head(width, dims):
  d = [width, *dims, 1]
  lin = [torch.nn.Linear(a, b) for a, b in zip(d[:-1], d[1:])]
  return torch.nn.Sequential(lin[0], torch.nn.Dropout(), lin[1], torch.nn.Dropout(), lin[2], torch.nn.Dropout(),
                             lin[3], lin[4])


def _official_sd(vit, text, head, embed_dim, max_pos):
  """The ImageReward.pt layout: BLIP_Pretrain under ``blip.`` (med.py keeps the position_ids buffer), then the
  head under ``mlp.layers``."""
  sd = {f"blip.visual_encoder.{k}": v for k, v in vit.state_dict().items()}
  sd.update({f"blip.text_encoder.{k}": v for k, v in text.state_dict().items()})
  sd["blip.text_encoder.embeddings.position_ids"] = torch.arange(max_pos)[None]
  vw, tw = vit.embed_dim, text.config.hidden_size
  for name, w in (("vision_proj", vw), ("text_proj", tw)):
    lin = torch.nn.Linear(w, embed_dim, device=vit.cls_token.device)
    sd.update({f"blip.{name}.{k}": v for k, v in lin.state_dict().items()})
  sd.update({f"mlp.layers.{k}": v for k, v in head.state_dict().items()})
  return sd


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  d = tmp_path_factory.mktemp("imagereward")
  (d / "vocab.txt").write_text("\n".join(WORDS) + "\n", encoding="utf-8")
  torch.manual_seed(0)
  t = TINY
  vit = _vit(t["img"], t["patch"], t["vw"], t["vdepth"], t["vheads"]).eval()
  text = _text(len(WORDS) + 2, t["tw"], t["tdepth"], t["theads"], t["inter"], t["pos"], t["vw"]).eval()
  head = _head(t["tw"], HEAD).eval()
  with torch.no_grad():  # move every weight (LayerNorms included) off its init so the mapping is exercised
    for m in (vit, text, head):
      for p in m.parameters():
        p.add_(0.05 * torch.randn_like(p))
  sd = _official_sd(vit, text, head, 32, t["pos"])
  torch.save(sd, d / "ImageReward.pt")
  report = convert_cli.run("imagereward", str(d / "ImageReward.pt"), str(d / "ckpt"))

  def oracle(pixels_nchw, ids, mask):
    with torch.no_grad():
      img = vit.forward_features(pixels_nchw)
      h = text(input_ids=ids, attention_mask=mask, encoder_hidden_states=img, is_decoder=False).last_hidden_state
      r = head(h[:, 0])[:, 0]
    return ((r - blip.IMAGEREWARD_MEAN) / blip.IMAGEREWARD_STD).numpy()
  return dict(dir=d, sd=sd, report=report, oracle=oracle)


def _hf_tokenizer(vocab):
  from transformers import BertTokenizer
  tok = BertTokenizer(str(vocab), do_lower_case=True)
  tok.add_special_tokens({"bos_token": "[DEC]"})  # BLIP's init_tokenizer
  tok.add_special_tokens({"additional_special_tokens": ["[ENC]"]})
  return tok


def test_wordpiece_matches_bert_tokenizer(tiny):
  hf = _hf_tokenizer(tiny["dir"] / "vocab.txt")
  ours = wordpiece.WordPiece.from_file(str(tiny["dir"] / "vocab.txt"), extra=("[DEC]", "[ENC]"))
  assert ours.vocab["[DEC]"] == len(WORDS) and ours.vocab["[ENC]"] == len(WORDS) + 1
  ref = hf(TEXTS, padding="max_length", truncation=True, max_length=35)
  ids, mask = ours.encode(TEXTS, 35)
  np.testing.assert_array_equal(ids, np.asarray(ref["input_ids"]))
  np.testing.assert_array_equal(mask, np.asarray(ref["attention_mask"]))
  with pytest.raises(FileNotFoundError, match="vocab"):
    wordpiece.WordPiece.from_file(str(tiny["dir"] / "nope.txt"))


def _torchvision_pixels(images, size):
  from PIL import Image
  from torchvision import transforms as T
  tf = T.Compose([T.Resize(size, interpolation=T.InterpolationMode.BICUBIC), T.CenterCrop(size), T.ToTensor(),
                  T.Normalize(imagereward.CLIP_MEAN, imagereward.CLIP_STD)])
  return torch.stack([tf(Image.fromarray(im)) for im in images])


def _images(shape, seed=0):
  r = np.random.default_rng(seed)
  smooth = r.integers(0, 256, (shape[0], shape[1] // 4 + 1, shape[2] // 4 + 1, 3)).repeat(4, 1).repeat(4, 2)
  return np.clip(smooth[:, :shape[1], :shape[2]] + r.integers(-20, 21, shape), 0, 255).astype(np.uint8)


@pytest.mark.parametrize("shape", [(3, 24, 40, 3), (2, 64, 48, 3)])
def test_preprocess_matches_pil_bicubic(shape):
  """Up- and down-sizing, non-square: within one uint8 level of PIL (its fixed-point rounding), rarely off."""
  images = _images(shape)
  ref = _torchvision_pixels(images, 32).permute(0, 2, 3, 1).numpy()
  ours = np.asarray(imagereward.preprocess(jnp.asarray(images), 32))
  levels = np.abs(ours - ref) * np.asarray(imagereward.CLIP_STD) * 255
  assert ours.shape == ref.shape and levels.max() <= 1.0 + 1e-3
  assert (levels > 0.5).mean() < 0.02


def test_model_matches_torch_oracle(tiny):
  """Same normalised pixels and tokens: Flax ImageReward == timm ViT + BlipTextModel + head (atol 1e-4)."""
  assert tiny["report"]["ignored"] == {"the position-index buffer (positions are 0..L-1)": 1,
                                       "BLIP's contrastive projections (not used by the score)": 4}
  cfg, graphdef, params = checkpoint.load_model(str(tiny["dir"] / "ckpt"))
  assert (cfg.vision.num_heads, cfg.text.num_heads, cfg.image_size, list(cfg.head_dims)) == (2, 3, 32, list(HEAD))
  pixels = _torchvision_pixels(_images((3, 32, 32, 3), 1), 32)
  tok = wordpiece.WordPiece.from_file(str(tiny["dir"] / "vocab.txt"), extra=("[DEC]", "[ENC]"))
  ids, mask = tok.encode(TEXTS[:3], 35)
  want = tiny["oracle"](pixels, torch.as_tensor(ids, dtype=torch.long), torch.as_tensor(mask, dtype=torch.long))
  fwd = jax.jit(lambda p, *a: nnx.merge(graphdef, p)(*a))
  got = np.asarray(fwd(params, jnp.asarray(pixels.permute(0, 2, 3, 1).numpy()), jnp.asarray(ids), jnp.asarray(mask)))
  np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
  assert np.std(want) > 1e-3  # the prompts/images actually change the score


def test_reward_builder_end_to_end(tiny):
  """registry -> imagereward.build (jitted, batched on the mesh) from uint8 images and strings vs the oracle on
  torchvision/PIL pixels; 5e-3 absorbs PIL's occasional one-level rounding differences."""
  settings = ml_collections.ConfigDict(dict(imagereward=dict(
      checkpoint=str(tiny["dir"] / "ckpt"), vocab=str(tiny["dir"] / "vocab.txt"), batch_size=4)))
  images = _images((5, 40, 48, 3), 2)
  prompts = TEXTS[:5]
  got = registry.reward("imagereward", images, [None] * 5, prompts, settings)
  tok = wordpiece.WordPiece.from_file(str(tiny["dir"] / "vocab.txt"), extra=("[DEC]", "[ENC]"))
  ids, mask = tok.encode(prompts, 35)
  want = tiny["oracle"](_torchvision_pixels(images, 32), torch.as_tensor(ids, dtype=torch.long),
                        torch.as_tensor(mask, dtype=torch.long))
  assert got.shape == (5,) and got.dtype == np.float32
  np.testing.assert_allclose(got, want, atol=5e-3, rtol=0)
  bad = ml_collections.ConfigDict(dict(checkpoint=str(tiny["dir"] / "missing"), vocab=""))
  with pytest.raises(FileNotFoundError, match=r"rewards\.imagereward\.checkpoint"):
    imagereward.build(bad)


def test_converter_names_missing_keys(tiny):
  sd = dict(tiny["sd"])
  del sd["blip.text_encoder.encoder.layer.1.crossattention.self.key.weight"]
  with pytest.raises(core.ConversionError, match=r"crossattention\.self\.key\.weight"):
    conv_ir.convert(core.state_dict(sd), origin="ImageReward.pt")
  sd = dict(tiny["sd"], **{"blip.itm_head.weight": torch.zeros(2, 192)})
  with pytest.raises(core.ConversionError, match=r"not used \(blip\.itm_head\.weight\)"):
    conv_ir.convert(core.state_dict(sd), origin="ImageReward.pt")


def _pattern(key: str) -> str:
  return re.sub(r"\.\d+\.", ".{i}.", key)


def test_official_size_keys_and_parameter_count(tiny):
  """ImageReward v1.0 at full size: key names and shapes from the oracle modules on the meta device (timm ViT-L/16
  @ 224 + BLIP BERT-base with 1024-wide cross-attention, vocab 30524, head 768-1024-128-64-16-1). The converter
  reads the official config from them; the tiny synthetic checkpoint (converted with no missing or unused key in
  the fixture) has exactly the official key-name patterns, and the full-size parameter count matches."""
  with torch.device("meta"):
    vit, text = _vit(224, 16, 1024, 24, 16), _text(30524, 768, 12, 12, 3072, 512, 1024)
    head = _head(768, (1024, 128, 64, 16))
    sd = _official_sd(vit, text, head, 256, 512)
  flat = {k: np.broadcast_to(np.float32(0), tuple(v.shape)) for k, v in sd.items()}
  cfg = conv_ir.infer_config(flat)
  assert cfg.to_dict() == blip.imagereward_config().to_dict()
  assert {_pattern(k) for k in sd} == {_pattern(k) for k in tiny["sd"]}
  assert tiny["report"]["source_keys"] == len(tiny["sd"]) == tiny["report"]["used"] + 5
  n_used = sum(v.numel() for k, v in sd.items() if not k.endswith("position_ids") and "_proj." not in k)

  def count(vd, td):  # abstract tracing time grows with the square of the parameter count: count per depth
    c = blip.imagereward_config(**{"vision.depth": vd, "text.depth": td})
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(core.abstract_params(
        c, lambda c: blip.ImageReward(c, rngs=nnx.Rngs(0)))))
  n11 = count(1, 1)
  n_params = n11 + 23 * (count(2, 1) - n11) + 11 * (count(1, 2) - n11)
  assert n_params == n_used == 446_206_689  # + 459,264 in the unused ITC projections: 1.787 GB fp32
