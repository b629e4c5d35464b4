"""Sharded steps on 8 simulated CPU devices equal the single-device steps; restores cross meshes; plan mode.

The sharded checks run once in a subprocess (``parallel_checks.py``: the device count is fixed when JAX
starts). Tolerances: losses within 1e-5, parameters after one update (optimizer eps = 1, so an update is
~ g / (|g| + 1) and tracks the gradient) within 1e-5 absolute.
"""
import json
import os
import pathlib
import subprocess
import sys

import pytest

from conftest import XLA_TEST_FLAGS
from margrpo_jax.jobs import plan
from margrpo_jax.models import class_mar, families
from margrpo_jax.parallel import mesh as mesh_lib, sharding

HERE = pathlib.Path(__file__).resolve().parent
KEYS = HERE / "fixtures" / "keys"
MESHES = ("8x1", "2x4", "1x8", "2x2x2")
TOL = 1e-5


@pytest.fixture(scope="module")
def checks():
  env = dict(os.environ, XLA_FLAGS=XLA_TEST_FLAGS, TF_CPP_MIN_LOG_LEVEL="2")  # + 8 devices (parallel_checks.py)
  proc = subprocess.run([sys.executable, str(HERE / "parallel_checks.py")], capture_output=True, text=True,
                        env=env, timeout=3600)  # ~10 min beside another test worker on 2 cores
  assert proc.returncode == 0, proc.stderr[-4000:]
  return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # the 8-device subprocess
def test_eight_simulated_devices(checks):
  assert checks["devices"] == 8


@pytest.mark.slow  # the 8-device subprocess
@pytest.mark.parametrize("mesh", MESHES)
def test_sharded_pretrain_step_equals_one_device(checks, mesh):
  r = checks[f"pretrain/{mesh}"]
  assert r["loss"] < TOL and r["params"] < TOL and r["opt"] < TOL, r
  if mesh != "8x1":  # pure data parallelism replicates parameters; fsdp / tensor axes shard them
    assert r["sharded_leaves"] > 0


@pytest.mark.slow  # the 8-device subprocess
@pytest.mark.parametrize("mesh", ("2x4", "2x2x2"))  # parallel_checks.RL_MESHES: the RL step compiles slowest
def test_sharded_rl_step_equals_one_device_with_mte_and_topk(checks, mesh):
  r = checks[f"rl/{mesh}"]
  assert r["loss"] < TOL and r["kl"] < TOL and r["keep"] == 0.0 and r["params"] < TOL, r


@pytest.mark.slow  # the 8-device subprocess
def test_rl_step_leaves_head_and_reference_alone_and_moves_the_policy(checks):
  assert all(checks["rl/untouched"])  # not donated (still readable) and bitwise unchanged
  assert min(checks["rl/policy_moved"]) > 1e-3


@pytest.mark.slow  # the 8-device subprocess
def test_sharded_lora_step_equals_one_device_and_shards_the_adapters(checks):
  """rl.lora.rank=4: the adapters (A on its kernel's input axis, B on its output axis) are the only state; the base
  (frozen, never donated) is untouched; the 2 x 4 step equals one device."""
  r = checks["rl_lora/2x4"]
  assert r["loss"] < TOL and r["kl"] < TOL and r["keep"] == 0.0 and r["params"] < TOL and r["sharded_leaves"] > 0, r
  assert all(checks["rl_lora/untouched"]) and min(checks["rl_lora/policy_moved"]) > 1e-3


@pytest.mark.slow  # the 8-device subprocess
@pytest.mark.parametrize("target", ["1x8", "one"])
def test_restore_onto_another_mesh(checks, target):
  r = checks[f"restore/{target}"]
  assert r["diff"] == 0.0 and r["shardings_match"]


@pytest.mark.slow  # the 8-device subprocess
def test_activations_stay_split_over_the_batch_axes(checks):
  """On FSDP-sharded parameters the partitioner, left alone, follows the ``embed`` split and holds every image's
  activations on every device; traced on the mesh (``sharding.constrain_batch`` on each block's output) a device
  holds its own images' only: the forward's temporaries at most half (measured: 0.35x on the small model)."""
  assert checks["activations/temp_traced_on_mesh"] <= 0.5 * checks["activations/temp_plain"]


@pytest.mark.slow  # the 8-device subprocess
@pytest.mark.parametrize("model", ["shapes", "harmon", "nova"])
def test_plan_compiles_the_sharded_steps(checks, model):
  """The sharded rollout and RL step compile on a 2 x 4 mesh: the shapes model (bfloat16 compute), and the tiny
  Harmon (Qwen2.5 rules) and NOVA (Phi-2 and NOVA transformer rules, flow SDE rollouts)."""
  text = "\n".join(checks[f"plan/{model}"])
  for name in ("rollout_bfloat16", "rl_step_bfloat16") if model == "shapes" else ("rollout", "rl_step"):
    assert f"memory/{name}/per_device_peak_gib = " in text
    assert f"memory/{name}/temp_size = " in text
  assert "mesh = {'data': 2, 'fsdp': 4, 'tensor': 1}" in text


def _keys_counts(name):
  backbone = head = 0
  for line in (KEYS / f"keys_{name}.txt").read_text().splitlines():
    key, _, n = line.split("\t")
    if key.startswith("diffloss."):
      head += int(n)
    else:
      backbone += int(n)
  return backbone, head


@pytest.mark.parametrize("size", ["base", "large", "huge"])
def test_plan_parameter_counts_equal_the_official_key_lists(size):
  from margrpo_jax import config_files
  c = config_files.load("mar", size)
  c.plan.compile = False
  lines = plan.plan(c)
  backbone, head = _keys_counts(f"mar_{size}")
  assert f"params/backbone = {backbone}" in lines and f"params/head = {head}" in lines
  assert f"params/total = {backbone + head}" in lines
  assert {"base": 207_924_768, "large": 478_326_304, "huge": 942_403_104}[size] == backbone + head


def test_every_parameter_has_a_sharding_rule():
  import jax
  from flax import nnx
  from conftest import small_model_config
  from margrpo_jax.models import random_instance  # the real families' parameter trees at tiny widths
  for cfg in (small_model_config(), class_mar.mar_config("base"),
              *(random_instance.model_config(f) for f in random_instance.FAMILIES)):
    params = nnx.to_pure_dict(nnx.state(nnx.eval_shape(lambda cfg=cfg: families.build(cfg))))
    for path, x in jax.tree_util.tree_leaves_with_path(params):
      axes = sharding.logical_axes(sharding.path_str(path), len(x.shape))  # raises when no rule matches
      assert len(axes) == len(x.shape)


def test_mesh_sizes_resolve_and_bad_meshes_name_the_problem():
  assert mesh_lib.resolve_shape(dict(data=-1, fsdp=2, tensor=1), 8) == (4, 2, 1)
  with pytest.raises(ValueError, match="multiplies to 4, but there are 8 devices"):
    mesh_lib.resolve_shape(dict(data=2, fsdp=2, tensor=1), 8)
  with pytest.raises(ValueError, match="at most one -1"):
    mesh_lib.resolve_shape(dict(data=-1, fsdp=-1, tensor=1), 8)
