"""LoRA adapters (``rl.lora``, ``margrpo_jax/rl/lora.py``): zero-initialised B starts exactly at the base (params,
rollout and RL loss), one update trains the adapters alone, the export merges them into ordinary weights, bad
options are one sentence naming the key, and rank 0 is full fine-tuning as before."""
import dataclasses

import jax
import numpy as np
import pytest

from margrpo_jax import config_files, metrics
from margrpo_jax.data import shapes
from margrpo_jax.jobs import rl as rl_job
from margrpo_jax.parallel import sharding
from margrpo_jax.rl import config as rl_config, lora, prompts as rl_prompts

RANK = 4


def _config(rank: int = 0):
  c = config_files.load("shapes_rl", "margrpo,smoke")
  c.rl.update(mte_seeds=0, consistency=False)  # the cheapest chain step: the loss, not the selection, is tested
  c.rl.rewards.update(shapes_partial=0.0, jpeg_compressibility=1.0)  # varies within a group: non-zero advantages
  c.rl.lora.rank = rank
  c.optim.lr = 1e-3
  return c


def _same(a, b) -> bool:
  return jax.tree.structure(a) == jax.tree.structure(b) and all(
      np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def _paths(tree) -> dict:
  return {sharding.path_str(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(tree)}


def test_zero_b_merges_to_the_base_and_only_targeted_kernels_take_an_update(small_model):
  """``W + (alpha / r) A B`` with ``B = 0`` is ``W`` bitwise; the default targets are the blocks' attention and MLP
  kernels of the trained components; a non-zero ``B`` moves exactly those, by ``scale A B``."""
  _, _, params = small_model
  policy = {k: params[k] for k in ("text_encoder", "backbone")}
  cfg = lora.LoraConfig(RANK, 8.0, (lora.DEFAULT_TARGETS,))
  adapters = lora.init(policy, cfg, jax.random.key(0))
  chosen = lora.targets(policy, cfg.targets)
  assert chosen and all(p.endswith("/kernel") and "blocks/" in p for p in chosen)
  assert {p.split("/")[0] for p in chosen} == {"text_encoder", "backbone"}
  assert set(_paths(adapters)) == {f"{p}/{f}" for p in chosen for f in lora.FACTORS}
  a = _paths(adapters)[f"{chosen[0]}/lora_a"]
  assert a.shape[1] == RANK and np.any(a != 0) and abs(a.std() * np.sqrt(a.shape[0]) - 1) < 0.5  # N(0, 1/in)
  assert cfg.scale == 2.0 and lora.LoraConfig(RANK).scale == 1.0  # alpha / r; alpha 0 = r
  assert _same(lora.merge(policy, adapters, cfg.scale), policy)
  assert _same(lora.assemble(params, adapters, cfg), params) and _same(lora.assemble(params, {}, cfg), params)
  moved = jax.tree_util.tree_map_with_path(
      lambda p, x: x + 1.0 if sharding.path_str(p).endswith("lora_b") else x, adapters)
  merged, base = _paths(lora.merge(policy, moved, cfg.scale)), _paths(policy)
  assert {k for k in base if not np.array_equal(merged[k], base[k])} == set(chosen)
  np.testing.assert_allclose(merged[chosen[0]] - base[chosen[0]], 2.0 * a @ np.ones((RANK, merged[chosen[0]].shape[1])),
                             rtol=1e-5, atol=1e-5)


def test_adapter_shardings_follow_their_kernels():
  """A (in, r) takes its kernel's input axis, B (r, out) its output axis; the head stays replicated."""
  assert sharding.logical_axes("backbone/encoder_blocks/0/attn/qkv/kernel/lora_a", 2) == ("embed", None)
  assert sharding.logical_axes("backbone/encoder_blocks/0/attn/qkv/kernel/lora_b", 2) == (None, "mlp")
  assert sharding.logical_axes("backbone/encoder_blocks/0/mlp/fc2/kernel/lora_a", 2) == ("mlp", None)
  assert sharding.logical_axes("head/res_blocks/0/fc1/kernel/lora_b", 2) == (None, None)


def test_bad_lora_options_are_one_sentence_naming_the_key(small_model):
  model_cfg = small_model[0]
  for key, value, match in [("rank", -1, r"rl\.lora\.rank=-1 must be >= 0"),
                            ("alpha", -2.0, r"rl\.lora\.alpha=-2\.0 must be a finite number >= 0"),
                            ("alpha", float("inf"), r"rl\.lora\.alpha=inf must be"),
                            ("targets", "attn/(qkv", r"rl\.lora\.targets='attn/\(qkv': .* not a regular expression"),
                            ("targets", "qkv/kernel$,nothing_like_this", r"rl\.lora\.targets=.*'nothing_like_this' "
                                                                          r"matches no 2-D parameter"),
                            ("targets", " , ", r"rl\.lora\.targets='' names no parameter")]:
    c = _config(RANK)
    c.rl.lora[key] = value
    with pytest.raises(config_files.ConfigError, match=match):
      rl_config.step_config(c, model_cfg)
  rl_config.step_config(_config(0), model_cfg)
  c = _config(0)
  c.rl.lora.targets = "nothing_like_this"  # rank 0 reads no target
  assert rl_config.step_config(c, model_cfg).lora == lora.LoraConfig(0, 0.0, ("nothing_like_this",))


@pytest.fixture(scope="module")
def one_update(small_model):
  """Iteration 0 (rollout, rewards, one jitted update) at rank 0 and at rank 4 from the same base."""
  model_cfg, graphdef, params = small_model
  recs = rl_prompts.from_metadata(shapes.split_records("train", num_train=64))
  out = {}
  for rank in (0, RANK):
    c = _config(rank)
    s = rl_job.setup(c, (model_cfg, graphdef, params))
    frozen_before = jax.tree.map(np.asarray, s.frozen)
    state, m, ro = rl_job.iteration(c, s, s.init_state(), recs, 0)
    out[rank] = dict(s=s, state=state, m=m, ro=ro, frozen_before=frozen_before)
  return out


@pytest.mark.slow  # two RL steps compile (about a minute each on a busy CPU)
def test_lora_starts_at_the_base_rollout_and_loss(one_update):
  full, low = one_update[0], one_update[RANK]
  assert _same(low["ro"]["final"], full["ro"]["final"])  # the rollout sampled the base itself
  np.testing.assert_array_equal(low["ro"]["reward"], full["ro"]["reward"])
  np.testing.assert_allclose(low["m"]["loss"], full["m"]["loss"], rtol=1e-6, atol=1e-9)  # the loss at the base
  np.testing.assert_allclose(low["m"]["kl"], full["m"]["kl"], atol=1e-9)
  assert low["m"]["grad_norm"] > 0


@pytest.mark.slow  # shares the compiles of the test above
def test_one_update_trains_only_the_adapters_and_the_export_merges_them(one_update):
  low = one_update[RANK]
  s, state = low["s"], low["state"]
  assert s.ref == {} and _same(s.frozen, s.params) and _same(s.frozen, low["frozen_before"])  # the base, untouched
  assert jax.tree.structure(state["policy"]) == jax.tree.structure(s.policy)
  new, old = _paths(state["policy"]), _paths(s.policy)
  assert all(np.array_equal(new[k], old[k]) for k in new if k.endswith("lora_a"))  # zero B: no gradient into A yet
  assert all(not np.array_equal(new[k], old[k]) for k in new if k.endswith("lora_b"))
  shapes_ = {x.shape for x in jax.tree.leaves(s.policy)}
  moments = [x for x in jax.tree.leaves(state["opt"]) if np.ndim(x)]
  assert moments and all(x.shape in shapes_ for x in moments)  # the optimizer holds adapter-shaped leaves only
  exported, base = _paths(s.trained_params(state)), _paths(s.params)
  assert jax.tree.structure(s.trained_params(state)) == jax.tree.structure(s.params)  # ordinary weights
  chosen = lora.targets(s.base_policy, s.static.lora.targets)
  assert {k for k in base if not np.array_equal(exported[k], base[k])} == set(chosen)
  wise = dataclasses.replace(s, static=dataclasses.replace(s.static, export_interpolation=0.25))
  half = _paths(wise.trained_params(state))  # WiSE-FT on the merged weights: W + 0.25 (W' - W)
  for k in chosen:
    np.testing.assert_allclose(half[k], base[k] + 0.25 * (exported[k] - base[k]), rtol=1e-6, atol=1e-7)
  assert metrics.drift(s.trained_policy(state), s.base_policy) > metrics.drift(wise.trained_policy(state),
                                                                                s.base_policy) > 0


@pytest.mark.slow  # shares the compiles of the tests above
def test_rank_zero_is_full_fine_tuning_as_before(one_update):
  full = one_update[0]
  s, state = full["s"], full["state"]
  assert set(s.policy) == set(s.static.trainable) == {"text_encoder", "backbone"}
  same_arrays = lambda a, b: all(x is y for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))
  assert same_arrays(s.policy, s.base_policy) and set(s.frozen) == {"head"}  # the base's own arrays
  assert _same(s.ref, s.policy) and not same_arrays(s.ref, s.policy)  # the reference: a frozen copy
  assert lora.assemble(s.frozen, s.policy, s.static.lora) == {**s.frozen, **s.policy}
  assert s.trained_policy(state) is state["policy"] and not _same(state["policy"], s.policy)


@pytest.mark.slow  # shares the compiles of the tests above
def test_rollouts_from_the_base_ignore_the_trained_policy(one_update):
  """``rl.rollout_policy='base'``: after an update the iteration's rollout is the base's (``s.ref``), not the
  trained policy's, at rank 0 and with LoRA alike."""
  recs = rl_prompts.from_metadata(shapes.split_records("train", num_train=64))
  for rank in (0, RANK):
    s, state = one_update[rank]["s"], one_update[rank]["state"]
    c = _config(rank)
    c.rl.rollout_policy = "base"
    _, _, ro = rl_job.iteration(c, s, jax.tree.map(np.array, state), recs, 1)  # a copy: the step donates its state
    base, own = (rl_job.rollout(c, s, p, recs, 1)["final"] for p in (s.ref, state["policy"]))
    assert _same(ro["final"], base) and not _same(ro["final"], own), rank
