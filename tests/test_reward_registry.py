"""The reward registry: weighted verifier rewards as before, learned rewards by name (built once per settings,
fed prompts), per-reward batch normalisation, clear errors, and the batched mesh runner learned rewards use."""
from __future__ import annotations

import ml_collections
import numpy as np
import pytest

from margrpo_jax.data import shapes
from margrpo_jax.rewards import registry, shapes_verifier

BUILT = []


def fake_builder(cfg):
  """A learned reward stand-in: score = scale * (mean pixel / 255) + len(prompt)."""
  BUILT.append(cfg.to_dict())
  return lambda images, prompts: (cfg.scale * np.asarray(images, np.float32).mean((1, 2, 3)) / 255
                                  + np.array([len(p) for p in prompts], np.float32))


@pytest.fixture()
def fake(monkeypatch):
  monkeypatch.setitem(registry.LEARNED, "fake", "test_reward_registry:fake_builder")
  monkeypatch.setattr(registry, "_BUILT", {})
  BUILT.clear()
  return ml_collections.ConfigDict(dict(fake=dict(checkpoint="x", vocab="y", scale=2.0)))


def _batch(n=6, seed=0):
  r = np.random.default_rng(seed)
  mds = [shapes.sample_metadata(r) for _ in range(n)]
  images = shapes.render_batch(mds, seed)
  images[n // 2:] = r.integers(0, 256, images[n // 2:].shape)  # half rendered (pass), half noise (fail)
  return images, mds


def test_verifier_rewards_unchanged():
  images, mds = _batch()
  total, parts = registry.compute(dict(shapes_partial=1.0, shapes_strict=0.0, jpeg_compressibility=0.5), images, mds)
  s = shapes_verifier.score_images(images, mds)
  np.testing.assert_array_equal(parts["shapes_partial"], [p["partial"] for p in s["per_image"]])
  np.testing.assert_allclose(total, parts["shapes_partial"] + 0.5 * parts["jpeg_compressibility"], rtol=1e-6)
  assert set(parts) == {"shapes_partial", "shapes_strict", "jpeg_compressibility"} and total.dtype == np.float32
  with pytest.raises(ValueError, match="nope not in the registry"):
    registry.compute(dict(nope=1.0), images, mds)


def test_learned_rewards_by_name_with_weights_and_normalisation(fake):
  images, mds = _batch()
  total, parts = registry.compute(dict(shapes_partial=1.0, fake=0.5), images, mds, settings=fake)
  want = 2.0 * images.astype(np.float32).mean((1, 2, 3)) / 255 + np.array([len(m["prompt"]) for m in mds])
  np.testing.assert_allclose(parts["fake"], want, rtol=1e-6)
  np.testing.assert_allclose(total, parts["shapes_partial"] + 0.5 * want, rtol=1e-6)
  prompts = ["ab"] * len(mds)  # explicit prompts win over metadata
  _, p2 = registry.compute(dict(fake=1.0), images, mds, prompts=prompts, settings=fake)
  np.testing.assert_allclose(p2["fake"], want - np.array([len(m["prompt"]) for m in mds]) + 2, rtol=1e-6)
  assert len(BUILT) == 1  # built once for these settings, reused
  for how, fn in (("std", lambda r: (r - r.mean()) / (r.std() + 1e-8)),
                  ("minmax", lambda r: (r - r.min()) / (r.max() - r.min() + 1e-8))):
    total, parts = registry.compute(dict(shapes_partial=1.0, fake=2.0), images, mds, settings=fake,
                                    normalize_each=how)
    np.testing.assert_allclose(total, fn(parts["shapes_partial"]) + 2.0 * fn(parts["fake"]), rtol=1e-5, atol=1e-6)
  with pytest.raises(ValueError, match="normalisation 'zz'"):
    registry.compute(dict(fake=1.0), images, mds, settings=fake, normalize_each="zz")


def test_learned_weight_zero_is_skipped_and_missing_settings_are_named(fake):
  images, mds = _batch(2)
  _, parts = registry.compute(dict(shapes_strict=1.0, imagereward=0.0, hps=0.0), images, mds)
  assert set(parts) == {"shapes_strict"}
  with pytest.raises(ValueError, match=r"config\.rewards\.imagereward"):
    registry.compute(dict(imagereward=1.0), images, mds)
  bad = ml_collections.ConfigDict(dict(imagereward=dict(checkpoint="/nonexistent/ir", vocab="")))
  with pytest.raises(FileNotFoundError, match=r"rewards\.imagereward\.checkpoint='/nonexistent/ir'"):
    registry.compute(dict(imagereward=1.0), images, mds, settings=bad)


def test_registry_names_and_settings():
  assert registry.LEARNED["hps"] == "margrpo_jax.rewards.clip_rewards:hps"
  assert {"hps", "pickscore", "clip_score", "aesthetic", "imagereward"} <= set(registry.names())
  s = registry.settings_config()
  assert registry.configured(s) == []
  s.imagereward.checkpoint = "ckpt"
  assert registry.configured(s) == ["imagereward"] and s.aesthetic.variant == "" and s.hps.scale == 1.0


def test_batched_on_mesh_pads_and_chunks():
  import jax.numpy as jnp
  calls = []

  def apply(p, x, y):
    calls.append(x.shape)
    return jnp.sum(x, axis=(1, 2)) * p["w"] + y

  run = registry.batched_on_mesh(apply, {"w": np.float32(2.0)}, batch_size=4)
  x = np.arange(5 * 2 * 3, dtype=np.float32).reshape(5, 2, 3)
  y = np.arange(5, dtype=np.float32)
  np.testing.assert_allclose(run(x, y), x.sum((1, 2)) * 2 + y)
  assert len(calls) == 1  # one trace: the last chunk is padded to the same shape
