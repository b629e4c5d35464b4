"""CLIP rewards against their torch oracles, on tiny random models converted through the CLI path.

* preprocessing: ``resize='pil'`` equals open_clip's eval transform (PIL bicubic ``Resize(224)``, ``CenterCrop``,
  ``ToTensor``, ``Normalize``) to atol 1e-6 (PIL's uint8 arithmetic is reproduced exactly); ``resize='tensor'``
  equals hpsv2's transform (``ToTensor`` then torchvision tensor ``Resize(224, bicubic, antialias)``) to atol 2e-4
  (float32 weights in torch), and ``'tensor_noaa'`` the same transform with ``antialias=False`` to atol 2e-4, on
  square, non-square, up- and down-scaled random images.
* rewards: each builder's scores on random uint8 images equal the oracle model + the formula written here
  (hps: raw cos and 100 cos on open_clip gelu with the hpsv2 transform; pickscore: ``transformers.CLIPModel``
  ``logits_per_image`` diagonal and raw cos, PIL transform; clip_score: raw, ``100 max(cos, 0)``,
  ``2.5 max(cos, 0)`` with the CLIPScore prefix on an OpenAI-style quick_gelu open_clip; aesthetic v1 and v2: the
  official head modules on the normalised image embedding), within atol 2e-4 on cosines (scaled with the score).
  Text ids come from open_clip's tokenizer in the oracle and from the project's tokenizer in the reward.
"""
from __future__ import annotations

import ml_collections
import numpy as np
import pytest
from conftest import SHARED_DATA

from margrpo_jax.convert.__main__ import run as convert_run
from margrpo_jax.rewards import clip_rewards

VOCAB = str(SHARED_DATA / "clip_bpe" / "bpe_simple_vocab_16e6.txt.gz")
PROMPTS = ["a photo of a red circle", "two blue squares above a green triangle", "A café — naïve &amp; ﬁne"]
ATOL = 2e-4
SIZE = "vision_heads=2,text_heads=2,act={}"


def random_images(h, w, n=3, seed=0):
  return np.random.default_rng(seed).integers(0, 256, (n, h, w, 3), dtype=np.uint8)


def transforms():
  from open_clip.transform import image_transform
  from torchvision import transforms as T
  m, s = clip_rewards.OPENAI_MEAN, clip_rewards.OPENAI_STD
  pil = image_transform(224, is_train=False, mean=m, std=s)
  tensor = T.Compose([T.ToTensor(), T.Resize(224, interpolation=T.InterpolationMode.BICUBIC), T.CenterCrop(224),
                      T.Normalize(m, s)])
  tensor_noaa = T.Compose([T.ToTensor(), T.Resize(224, interpolation=T.InterpolationMode.BICUBIC, antialias=False),
                           T.CenterCrop(224), T.Normalize(m, s)])
  return {"pil": pil, "tensor": tensor, "tensor_noaa": tensor_noaa}


def oracle_pixels(images, how):
  import torch
  from PIL import Image
  return torch.stack([transforms()[how](Image.fromarray(im)) for im in images])


@pytest.mark.parametrize("hw", [(64, 64), (250, 300), (301, 227)])
def test_preprocess_matches_oracle_transforms(hw):
  import jax
  images = random_images(*hw, n=2)
  hows = ("pil", "tensor", "tensor_noaa")
  got = jax.jit(lambda x: [clip_rewards.preprocess(x, 224, how) for how in hows])(images)
  for how, got, atol in zip(hows, got, (1e-6, ATOL, ATOL)):
    np.testing.assert_allclose(np.asarray(got), oracle_pixels(images, how).numpy().transpose(0, 2, 3, 1), atol=atol)


def _tiny_openclip(act, seed):
  import open_clip
  from test_clip import randomize
  return randomize(open_clip.model.CLIP(
      embed_dim=24, quick_gelu=act == "quick_gelu",
      vision_cfg=dict(layers=2, width=32, head_width=16, patch_size=56, image_size=224),
      text_cfg=dict(context_length=77, vocab_size=49408, width=32, heads=2, layers=2)), seed)


def _tiny_hf(seed):
  from test_clip import randomize
  from transformers import CLIPConfig, CLIPModel
  return randomize(CLIPModel(CLIPConfig(
      text_config=dict(vocab_size=49408, hidden_size=32, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=2, max_position_embeddings=77, hidden_act="gelu", eos_token_id=49407),
      vision_config=dict(hidden_size=32, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                         image_size=224, patch_size=56, hidden_act="gelu"),
      projection_dim=24)), seed)


def _heads(seed):
  import torch
  torch.manual_seed(seed)
  v2 = torch.nn.Module()  # improved-aesthetic-predictor's MLP: Linears at 0, 2, 4, 6, 7 with Dropouts between
  v2.layers = torch.nn.Sequential(torch.nn.Linear(24, 1024), torch.nn.Dropout(0.2), torch.nn.Linear(1024, 128),
                                  torch.nn.Dropout(0.2), torch.nn.Linear(128, 64), torch.nn.Dropout(0.1),
                                  torch.nn.Linear(64, 16), torch.nn.Linear(16, 1))
  return {"v1": torch.nn.Linear(24, 1).eval(), "v2": v2.eval()}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
  """Oracles and their exports, written by the converter CLI: HPS-style {'state_dict'} .pt, an OpenAI-style state
  dict with its metadata keys, HF safetensors, and aesthetic head .pth files."""
  import torch
  from safetensors.torch import save_file
  d = tmp_path_factory.mktemp("clip_rewards")
  hps, openai, hf, heads = _tiny_openclip("gelu", 1), _tiny_openclip("quick_gelu", 2), _tiny_hf(3), _heads(4)
  torch.save({"state_dict": hps.state_dict()}, d / "hps.pt")
  torch.save({**openai.state_dict(), "input_resolution": torch.tensor(224), "context_length": torch.tensor(77),
              "vocab_size": torch.tensor(49408)}, d / "openai.pt")
  save_file({k: v.contiguous() for k, v in hf.state_dict().items()}, str(d / "pick.safetensors"))
  for v, head in heads.items():
    torch.save(head.state_dict(), d / f"aes_{v}.pth")
  for family, src, size in (("clip_openclip", "hps.pt", "gelu"), ("clip_openclip", "openai.pt", "quick_gelu"),
                            ("clip_hf", "pick.safetensors", "gelu"), ("aesthetic", "aes_v1.pth", None),
                            ("aesthetic", "aes_v2.pth", None)):
    report = convert_run(family, str(d / src), str(d / src.split(".")[0]), size and SIZE.format(size))
    assert report["used"] + sum(report["ignored"].values()) == report["source_keys"]
  return d, {"hps": hps, "openai": openai, "hf": hf, **heads}


def cfg(**kw):
  return ml_collections.ConfigDict(dict(vocab=VOCAB, batch_size=2, **kw))


def open_clip_cos(model, images, prompts, how):
  import torch
  from open_clip.tokenizer import SimpleTokenizer
  with torch.no_grad():
    img = model.encode_image(oracle_pixels(images, how), normalize=True)
    txt = model.encode_text(SimpleTokenizer(VOCAB)(prompts), normalize=True)
  return (img * txt).sum(-1).numpy()


def test_hps(setup):
  d, oracle = setup
  images = random_images(64, 64)
  cos = open_clip_cos(oracle["hps"], images, PROMPTS, "tensor")
  np.testing.assert_allclose(clip_rewards.hps(cfg(checkpoint=str(d / "hps")))(images, PROMPTS), cos, atol=ATOL)
  np.testing.assert_allclose(clip_rewards.hps(cfg(checkpoint=str(d / "hps"), scale=100.0))(images, PROMPTS),
                             100 * cos, atol=100 * ATOL)


def test_pickscore(setup):
  import torch
  from open_clip.tokenizer import SimpleTokenizer
  d, oracle = setup
  images = random_images(250, 300)
  with torch.no_grad():
    out = oracle["hf"](input_ids=SimpleTokenizer(VOCAB)(PROMPTS), pixel_values=oracle_pixels(images, "pil"))
  logits = np.diag(out.logits_per_image.numpy())
  cos = (out.image_embeds * out.text_embeds).sum(-1).numpy()
  np.testing.assert_allclose(clip_rewards.pickscore(cfg(checkpoint=str(d / "pick")))(images, PROMPTS), logits,
                             atol=ATOL * 60)
  np.testing.assert_allclose(clip_rewards.pickscore(cfg(checkpoint=str(d / "pick"), mode="cosine"))(images, PROMPTS),
                             cos, atol=ATOL)


def test_clip_score_conventions(setup):
  d, oracle = setup
  images = random_images(96, 80, n=4, seed=1)
  prompts = PROMPTS + ["a yellow square"]
  raw = open_clip_cos(oracle["openai"], images, prompts, "pil")
  prefixed = open_clip_cos(oracle["openai"], images, ["A photo depicts " + p for p in prompts], "pil")
  ck = str(d / "openai")
  for conv, prefix, want in (("raw", "", raw), ("torchmetrics", "", 100 * np.maximum(raw, 0)),
                             ("clipscore", "A photo depicts ", 2.5 * np.maximum(prefixed, 0))):
    got = clip_rewards.clip_score(cfg(checkpoint=ck, convention=conv, prefix=prefix))(images, prompts)
    np.testing.assert_allclose(got, want, atol=ATOL * (100 if conv == "torchmetrics" else 2.5))


@pytest.mark.parametrize("variant", ["v1", "v2"])
def test_aesthetic(setup, variant):
  import torch
  d, oracle = setup
  images = random_images(96, 80, n=4, seed=2)  # the shape of test_clip_score_conventions: one compiled encoder
  with torch.no_grad():
    emb = oracle["openai"].encode_image(oracle_pixels(images, "pil"), normalize=True)
    want = (oracle[variant] if variant == "v1" else oracle[variant].layers)(emb)[:, 0].numpy()
  score = clip_rewards.aesthetic(cfg(checkpoint=str(d / "openai"), head=str(d / f"aes_{variant}"), variant=variant))
  np.testing.assert_allclose(score(images, PROMPTS), want, atol=ATOL)


def test_errors_name_the_path(setup, tmp_path):
  d, _ = setup
  with pytest.raises(FileNotFoundError, match="rewards.hps.checkpoint=.*nope.*does not exist"):
    clip_rewards.hps(cfg(checkpoint=str(tmp_path / "nope")))
  with pytest.raises(FileNotFoundError, match="rewards.pickscore.vocab="):
    clip_rewards.pickscore(ml_collections.ConfigDict(dict(checkpoint=str(d / "pick"), vocab="")))
  with pytest.raises(ValueError, match="holds a v1 head"):
    clip_rewards.aesthetic(cfg(checkpoint=str(d / "openai"), head=str(d / "aes_v1"), variant="v2"))
  with pytest.raises(ValueError, match="convention='x'"):
    clip_rewards.clip_score(cfg(checkpoint=str(d / "openai"), convention="x"))


def test_through_the_registry(setup):
  """The registry's locked ``config.rewards`` defaults ('' options) reach the builders: weighted sum of hps and
  clip_score equals the builders' own scores (same cached encoders, nothing recompiled)."""
  from margrpo_jax.rewards import registry
  d, _ = setup
  settings = registry.settings_config()
  settings.hps.update(checkpoint=str(d / "hps"), vocab=VOCAB, batch_size=2)
  settings.clip_score.update(checkpoint=str(d / "openai"), vocab=VOCAB, batch_size=2)
  settings.lock()
  images = random_images(64, 64)
  total, parts = registry.compute({"hps": 1.0, "clip_score": 0.5}, images, [{}] * 3, PROMPTS, settings)
  hps = clip_rewards.hps(cfg(checkpoint=str(d / "hps")))(images, PROMPTS)
  raw = clip_rewards.clip_score(cfg(checkpoint=str(d / "openai")))(images, PROMPTS)
  np.testing.assert_allclose(parts["hps"], hps, atol=1e-6)
  np.testing.assert_allclose(total, hps + 0.5 * raw, atol=1e-6)
