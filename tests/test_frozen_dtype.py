"""Frozen parts held cheaply (``rl.frozen_dtype='bfloat16'``, ``rl/step.py``'s ``halves``): the parts no optimizer
sees and the reference are stored in bfloat16 (half their bytes), the policy starts at the same rounded values (so
the KL to the reference is 0 at the start), every layer still computes in float32, the optimizer holds
float32 policy leaves only, the export is float32; LoRA merges its adapters in float32 over a bfloat16 base; plan
mode prints the RL step's memory with and without each measure of ``plan.variants``."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from margrpo_jax import config_files
from margrpo_jax.data import shapes
from margrpo_jax.jobs import plan, rl as rl_job
from margrpo_jax.models import precision
from margrpo_jax.rl import lora, prompts as rl_prompts


def _config(frozen_dtype: str):
  c = config_files.load("shapes_rl", "margrpo,smoke")  # the head frozen: a frozen part besides the reference
  c.rl.update(mte_seeds=0, consistency=False, frozen_dtype=frozen_dtype, beta=0.04)
  c.rl.rewards.update(shapes_partial=0.0, jpeg_compressibility=1.0)  # varies within a group: non-zero advantages
  return c


def _floats(tree):
  return [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)]


def _nbytes(tree) -> int:
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


@pytest.mark.slow  # two setups and an RL iteration
def test_frozen_parts_and_reference_in_bfloat16_start_the_policy_at_its_reference(small_model):
  model_cfg, graphdef, params = small_model
  recs = rl_prompts.from_metadata(shapes.split_records("train", num_train=64))
  full = rl_job.setup(_config("float32"), (model_cfg, graphdef, params))
  s = rl_job.setup(_config("bfloat16"), (model_cfg, graphdef, params))
  assert "head" in s.frozen and "head" not in s.policy
  assert all(x.dtype == jnp.bfloat16 for x in _floats(s.frozen) + _floats(s.ref))
  assert all(x.dtype == jnp.float32 for x in _floats(s.policy))
  assert 2 * _nbytes(s.ref) == _nbytes(full.ref) and _nbytes(s.frozen) < 0.51 * _nbytes(full.frozen)
  rounded = lambda t: jax.tree.map(lambda x: np.asarray(x.astype(jnp.bfloat16).astype(jnp.float32)), t)
  for a, b in zip(jax.tree.leaves(s.policy), jax.tree.leaves(rounded(full.policy))):
    np.testing.assert_array_equal(np.asarray(a), b)  # the policy starts at the rounded base ...
  for a, b in zip(jax.tree.leaves(s.ref), jax.tree.leaves(s.policy)):
    np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)), np.asarray(b))  # ... which is the reference
  state, m, _ = rl_job.iteration(_config("bfloat16"), s, s.init_state(), recs, 0)
  # the same weights in float32 on both sides: 0 up to the summation order XLA picks for bf16 operands
  assert abs(float(m["kl"])) < 1e-5 and np.isfinite(float(m["loss"])) and float(m["grad_norm"]) > 0
  moments = [x for x in jax.tree.leaves(state["opt"]) if np.ndim(x)]
  assert moments and all(x.dtype == jnp.float32 for x in moments)
  assert {x.shape for x in moments} <= {x.shape for x in jax.tree.leaves(s.policy)}  # no frozen part in Adam
  exported = s.trained_params(state)
  assert all(x.dtype == jnp.float32 for x in _floats(exported))
  for a, b in zip(jax.tree.leaves(exported["head"]), jax.tree.leaves(rounded(params["head"]))):
    np.testing.assert_array_equal(np.asarray(a), b)  # the frozen head exported at its rounded values


def test_layers_compute_in_float32_on_bfloat16_weights(small_model):
  """An ``Embed`` table and a ``Linear`` kernel stored in bf16 give float32 outputs under ``held='bfloat16'``."""
  _, graphdef, params = small_model
  g = precision.with_compute(graphdef, params, "float32", "bfloat16")
  from flax import nnx
  model = nnx.merge(g, precision.stored(params, "bfloat16"))
  layers = [m for _, m in nnx.iter_modules(model) if isinstance(m, (nnx.Embed, nnx.Linear))]
  assert layers and all(m.dtype == jnp.float32 for m in layers)
  embed = next(m for m in layers if isinstance(m, nnx.Embed))
  assert embed(jnp.zeros((2,), jnp.int32)).dtype == jnp.float32


def test_lora_merges_in_float32_over_a_bfloat16_base():
  base = {"w": jnp.ones((4, 3), jnp.bfloat16)}
  adapters = {"w": dict(lora_a=jnp.full((4, 2), 1e-3), lora_b=jnp.full((2, 3), 1e-3))}
  merged = lora.merge(base, adapters, 1.0)["w"]
  assert merged.dtype == jnp.float32  # 1 + 2e-6 survives; in bfloat16 it would round back to 1
  np.testing.assert_allclose(np.asarray(merged), 1.0 + 2e-6, rtol=1e-7)


@pytest.mark.slow  # compiles the RL step six times
def test_plan_prints_the_rl_step_with_and_without_each_measure(small_model):
  """One plan prints the step's memory per variant. The frozen parts in bf16 shrink its arguments; under
  ``rl.remat`` the scored AR steps are accumulated one at a time (the backward of the loss's scan over them carries
  the gradient sum), so four scored steps add to the temporaries only their batch tensors, while without it every
  step's activations are held at once."""
  from conftest import smoke_config
  c = config_files.load("shapes_rl", "margrpo,smoke")
  c.model = smoke_config().model
  c.rl.update(remat=True, num_ar_steps=1)
  c.plan = dict(compile=True, dtypes="float32", variants="rl.frozen_dtype=bfloat16, rl.lora.rank=2, "
                "rl.num_ar_steps=4, rl.remat=False, rl.num_ar_steps=4+rl.remat=False")
  lines = plan.plan(c)
  value = lambda name: float(next(l for l in lines if l.startswith(f"memory/{name} = ")).split(" = ")[1])
  for name in ("rl_step", "rl_step_frozen_dtype=bfloat16", "rl_step_lora.rank=2"):
    assert value(f"{name}/per_device_peak_gib") > 0
  assert value("rl_step_frozen_dtype=bfloat16/argument_size") < value("rl_step/argument_size")
  assert sum(l.startswith("memory/rollout") and "/per_device_peak_gib" in l for l in lines) == 1  # variants: the step
  grown = value("rl_step_num_ar_steps=4/temp_size") - value("rl_step/temp_size")
  grown_plain = value("rl_step_num_ar_steps=4+remat=False/temp_size") - value("rl_step_remat=False/temp_size")
  assert 0 < grown < 0.3 * grown_plain  # measured: 7.3 MB vs 49.2 MB


def test_a_bad_plan_variant_is_one_sentence_before_any_compile():
  c = config_files.load("mar", "base")  # refused before the model is even built
  for bad, match in [("rl.nothing=1", "'rl.nothing' is not a setting of the rl block"),
                     ("optim.lr=1", "'optim.lr' is not a setting of the rl block"),
                     ("rl.remat=maybe", "rl.remat='maybe' is not a bool"),
                     ("rl.lora=2", "'rl.lora' is not a setting")]:
    c.plan.variants = bad
    with pytest.raises(config_files.ConfigError, match=match):
      plan.plan(c)
  c.plan.variants = "rl.remat=False, rl.lora.rank=16+rl.frozen_dtype=bfloat16"
  (a, ca), (b, cb) = plan.variants(c)
  assert a == "remat=False" and ca.rl.remat is False and c.rl.remat is True  # copies: the config is untouched
  assert b == "lora.rank=16+frozen_dtype=bfloat16" and (cb.rl.lora.rank, cb.rl.frozen_dtype) == (16, "bfloat16")
