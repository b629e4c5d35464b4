"""Advantages, token selection (MAR-GRPO's stabilisers) and image augmentation on small hand-checked cases."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from margrpo_jax import metrics
from margrpo_jax.data import shapes
from margrpo_jax.rewards import shapes_verifier
from margrpo_jax.rl import advantages, augment, selection


def test_constant_rewards_give_zero_advantages():
  for kind in advantages.KINDS:
    a = advantages.group_advantages(jnp.full((8,), 0.7), 4, kind)
    assert np.all(np.isfinite(a)) and np.all(np.asarray(a) == 0.0)


def test_advantages_by_hand():
  r = jnp.array([1.0, 0.0, 0.0, 1.0, 3.0, 1.0, 2.0, 2.0])
  std1 = np.std([1, 0, 0, 1], ddof=1)  # 0.57735
  np.testing.assert_allclose(advantages.group_advantages(r, 4, "grpo")[:4],
                             np.array([0.5, -0.5, -0.5, 0.5]) / (std1 + 1e-4), rtol=1e-6)
  np.testing.assert_allclose(advantages.group_advantages(r, 4, "drgrpo")[4:], [1.0, -1.0, 0.0, 0.0])
  # RLOO: r_i - mean of the other three.
  np.testing.assert_allclose(advantages.group_advantages(r, 4, "rloo")[4:], [3 - 5 / 3, 1 - 7 / 3, 2 - 2, 2 - 2],
                             rtol=1e-6)
  np.testing.assert_allclose(advantages.group_advantages(r, 4, "sign"), [1, -1, -1, 1, 1, -1, 0, 0])
  with pytest.raises(ValueError):
    advantages.group_advantages(r, 4, "ppo")


def test_uncertainty_is_channel_mean_of_population_std():
  s = jnp.array([[[[0.0, 2.0]]], [[[2.0, 2.0]]]])  # S=2, B=1, L=1, C=2
  np.testing.assert_allclose(selection.uncertainty(s), [[0.5]])  # std over S: (1, 0) -> mean 0.5


def test_pixel_uncertainty_reads_channel_fastest_patches_and_random_pixels_fill_the_rest():
  """A token of 2 pixels x 2 channels laid out (pixel, channel): pixel 0 varies over the seeds, pixel 1 does not;
  the token's uncertainty is the mean of its pixels'. ``add_random`` adds ``count`` new eligible entries."""
  s = jnp.array([[[[0.0, 2.0, 5.0, 5.0]]], [[[2.0, 2.0, 5.0, 5.0]]]])  # S=2, B=1, L=1, C=4
  np.testing.assert_allclose(selection.pixel_uncertainty(s, 2), [[[0.5, 0.0]]])
  np.testing.assert_allclose(selection.uncertainty(s), [[0.25]])
  mask = jnp.zeros((3, 10), bool).at[:, :3].set(True)
  eligible = jnp.ones((3, 10), bool).at[2, 3:].set(False)  # row 2: nothing left to add
  for seed in range(5):
    out = np.asarray(selection.add_random(mask, eligible, jax.random.key(seed), 2))
    assert (out[:, :3]).all() and list(out.sum(-1)) == [5, 5, 3] and not out[2, 3:].any()


@pytest.mark.parametrize("frac,k", [(0.3, 19), (0.25, 16), (0.0, 0), (1.0, 64)])
def test_topk_selects_exactly_floor_fraction_with_ties(frac, k):
  assert selection.topk_count(64, frac) == k
  assert selection.topk_count(1024, 0.3) == 307  # the official int(0.3 * 1024)
  u = jnp.concatenate([jnp.zeros((2, 32)), jnp.ones((2, 32))], axis=1)  # many ties
  u = u.at[1].set(jnp.arange(64.0)[::-1])
  m = np.asarray(selection.topk_mask(u, frac))
  assert (m.sum(1) == k).all()
  if 0 < k <= 32:
    assert m[0, 32:32 + k].all()  # ties: the lowest positions among the largest values
    assert m[1, :k].all()          # strictly ordered row: the k largest


def test_consistency_filter_by_hand():
  final = jnp.array([[[1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]])
  prev = jnp.array([[[0.0, 1.0], [1.0, 0.0], [0.0, 1.0], [1.0, 0.0]]])
  pred = jnp.array([[[1.0, 1.0], [0.0, 1.0], [0.0, 1.0], [1.0, 1.0]]])
  moved = selection.moved_closer(pred, prev, final)
  np.testing.assert_array_equal(moved, [[True, False, False, True]])  # closer, farther, equal, closer
  region = jnp.array([[True, True, True, False]])     # still undecoded before the step
  decoded = jnp.array([[False, False, True, False]])  # decoded at this step: always kept
  np.testing.assert_array_equal(selection.consistency_filter(region, decoded, moved, 3), [[True, False, True, False]])
  np.testing.assert_array_equal(selection.consistency_filter(region, decoded, moved, 1), region)


def test_the_step_config_dataclass_defaults_are_the_margrpo_preset():
  """``BatchConfig`` / ``LossConfig`` defaults agree with ``configs/shapes_rl.py:margrpo`` (the one set of
  defaults a reader sees), so code that builds them directly runs what the config would."""
  import dataclasses
  from margrpo_jax import config_files
  from margrpo_jax.rl import batch as batch_lib, config as rl_config, loss as loss_lib
  sc = rl_config.step_config(config_files.load("shapes_rl", "margrpo"))
  for got, cls in ((sc.batch, batch_lib.BatchConfig), (sc.loss, loss_lib.LossConfig)):
    differ = {f.name: (getattr(cls(), f.name), getattr(got, f.name)) for f in dataclasses.fields(cls)
              if getattr(cls(), f.name) != getattr(got, f.name)}
    assert not differ, (cls.__name__, differ)


def test_distinctness_bonus_ranks_the_passing_images_by_how_much_they_differ():
  """``rl.diversity_bonus``: in a group of 4 passing images where one differs from three alike, the odd one gains,
  the bonus sums to 0 over the group and failing images (reward 0) get none."""
  z = np.zeros((8, 3, 2))
  z[0] += 1.0  # group 0: image 0 far from images 1-3
  z[5] += 2.0  # group 1: image 5 differs but fails
  r = np.array([1, 1, 1, 1, 0, 0, 1, 1], np.float32)
  out = advantages.with_distinctness(r, z, 4, 0.5)
  assert out[0] > 1.0 and np.all(out[1:4] < 1.0) and abs(out[:4].sum() - 4.0) < 1e-5
  np.testing.assert_array_equal(out[4:6], 0.0)
  assert out[6] == out[7]
  np.testing.assert_array_equal(advantages.with_distinctness(r, z, 4, 0.0), r)


def test_informative_groups_keeps_the_most_mixed_groups_in_draw_order():
  r = np.array([1, 1, 1, 1,  1, 0, 1, 1,  0, 0, 0, 0,  1, 0, 1, 0,  0, 0, 0, 1], np.float32)  # 5 groups of 4
  np.testing.assert_array_equal(advantages.informative_groups(r, 4, 2), np.r_[4:8, 12:16])  # std .43, .5 > 0
  rows = advantages.informative_groups(r, 4, 4)  # 3 mixed groups, then the first uniform one drawn (group 0)
  np.testing.assert_array_equal(rows, np.r_[0:8, 12:20])
  np.testing.assert_array_equal(advantages.informative_groups(r, 4, 5), np.arange(20))
  with pytest.raises(ValueError):
    advantages.informative_groups(r, 4, 6)


def test_shift_augmentation_keeps_every_object_and_the_reward():
  """``rl.augment='shift'``: each rendered scene moves (most by a nonzero offset), nothing is cut or wrapped, and the
  verifier finds the same objects moved by one offset, so strict pass and partial score are unchanged."""
  recs = shapes.split_records("val")[::16][:32]
  images = shapes.render_batch(recs, 0)
  moved = augment.apply("shift", images, np.random.default_rng(0))
  assert moved.shape == images.shape and moved.dtype == images.dtype
  assert np.mean([np.any(a != b) for a, b in zip(images, moved)]) > 0.8
  for a, b, r in zip(images, moved, recs):
    assert np.sum(a) == np.sum(b)  # a roll: the same pixels
    va, vb = shapes_verifier.verify(a, r), shapes_verifier.verify(b, r)
    assert (va["strict"], va["partial"]) == (vb["strict"], vb["partial"])
    oa, ob = shapes_verifier.find_objects(a)[0], shapes_verifier.find_objects(b)[0]
    assert sorted((o["class"], o["area"]) for o in oa) == sorted((o["class"], o["area"]) for o in ob)
    shift = {tuple(np.subtract(q["centroid"], p["centroid"]).round(6)) for p, q in
             zip(sorted(oa, key=lambda o: o["class"]), sorted(ob, key=lambda o: o["class"]))}
    assert len(shift) <= 1
  assert np.array_equal(augment.apply("none", images, np.random.default_rng(0)), images)
  blank = np.zeros((1, 32, 32, 3), np.uint8)
  assert np.array_equal(augment.apply("shift", blank, np.random.default_rng(0)), blank)


def test_latent_spread_is_the_mean_pairwise_distance_per_prompt():
  """The study's diversity: per prompt the mean distance over ordered pairs of distinct images, averaged."""
  z = np.array([[[0.0, 0.0], [3.0, 4.0], [0.0, 0.0]],    # distances 5, 0, 5 -> mean 10 / 3
                [[1.0, 1.0], [1.0, 1.0], [1.0, 1.0]]])   # identical images -> 0
  assert metrics.latent_spread(z) == pytest.approx((10 / 3 + 0) / 2)
