"""Sharded vs single-device checks on 8 simulated CPU devices, run by ``test_parallel.py`` in a subprocess
(the device count must be fixed before JAX starts). Prints one JSON object of measured differences."""
import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import json  # noqa: E402
import tempfile  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402

jax.config.update("jax_threefry_partitionable", True)

from conftest import smoke_config  # noqa: E402
from margrpo_jax import config_files, rng  # noqa: E402
from margrpo_jax.data import shapes  # noqa: E402
from margrpo_jax.jobs import pretrain  # noqa: E402
from margrpo_jax.parallel import mesh as mesh_lib, sharding  # noqa: E402
from margrpo_jax.jobs import rl as rl_job  # noqa: E402
from margrpo_jax.rl import prompts as rl_prompts  # noqa: E402
from margrpo_jax.rl import advantages, step as step_lib  # noqa: E402

MESHES = {"8x1": dict(data=8, fsdp=1, tensor=1), "2x4": dict(data=2, fsdp=4, tensor=1),
          "1x8": dict(data=1, fsdp=8, tensor=1), "2x2x2": dict(data=2, fsdp=2, tensor=2)}
RL_MESHES = ("2x4", "2x2x2")  # the RL step (the costliest compile): data x fsdp, and all three axes


def max_diff(a, b) -> float:
  return max((float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))))
              for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))), default=0.0)


def host(tree):
  return jax.tree.map(np.asarray, tree)


def pretrain_checks(config, recs, out):
  """One pretraining step (fixed batch and key) on each mesh against the plain single-device step."""
  graphdef, tx, state = pretrain.init_state(config)
  batch = pretrain.make_batch(recs, 0, 16, 0, config.model)
  ref_state, ref_m = pretrain.make_step_fn(graphdef, tx, config)(jax.tree.map(jnp.copy, state), batch)
  ref_state = host(ref_state)
  for name, shape in MESHES.items():
    mesh = mesh_lib.make_mesh(shape)
    st = jax.device_put(jax.tree.map(jnp.copy, state),
                        pretrain.state_shardings(mesh, tx, state, config.parallel.rules))
    fn = pretrain.make_step_fn(graphdef, tx, config, mesh, st)
    b = sharding.to_global(batch, dict(ids=sharding.batch_sharding(mesh, 2), tokens=sharding.batch_sharding(mesh, 3)))
    new, m = fn(st, b)
    sharded = sum(1 for x in jax.tree.leaves(new["params"]) if not x.sharding.is_fully_replicated)
    out[f"pretrain/{name}"] = dict(loss=abs(float(m["loss"]) - float(ref_m["loss"])),
                                   params=max_diff(new["params"], ref_state["params"]),
                                   opt=max_diff(new["opt"], ref_state["opt"]), sharded_leaves=sharded)
  return host(state["params"])


def rl_checks(params, model_cfg, graphdef, out, meshes=RL_MESHES, lora_rank: int = 0, prefix: str = "rl"):
  """One MAR-GRPO update (MTE over 2 seeds, top-k, consistency) on each of ``meshes`` against one device; with
  ``lora_rank`` the policy is LoRA adapters (sharded like their kernels, the reference the base)."""
  c = config_files.load("shapes_rl", "margrpo,smoke")
  c.rl.update(group_size=2, prompts_per_iter=8, mte_seeds=2, topk_fraction=0.5)
  c.rl.lora.rank = lora_rank
  c.rl.rewards.update(shapes_partial=0.0, jpeg_compressibility=1.0)
  c.optim.update(lr=1.0, eps=1.0)  # update ~ g / (|g| + 1): parameter differences track gradient differences
  recs = rl_prompts.from_metadata(shapes.split_records("train", num_train=400))
  results = {}
  for name, shape in [("1", dict(data=1, fsdp=1, tensor=1))] + [(m, MESHES[m]) for m in meshes]:
    c.parallel.mesh.update(shape)
    devices = jax.devices()[:1] if name == "1" else None
    if devices:  # the single-device reference: a 1-device mesh
      orig = mesh_lib.make_mesh
      mesh_lib.make_mesh = lambda cfg, devices=devices: orig(cfg, devices)
    s = rl_job.setup(c, (model_cfg, graphdef, params))
    if devices:
      mesh_lib.make_mesh = orig
    if name == "1":
      ro = rl_job.rollout(c, s, s.policy, recs, 0)
      adv = np.asarray(advantages.group_advantages(ro["reward"], c.rl.group_size, c.rl.advantage))
      inputs = host(dict(ids=ro["ids"], rec=ro["rec"], final=ro["final"]))
    put = lambda x, sh: jax.device_put(x, sh)
    ins = step_lib.step_shardings(s.mesh, sharding.hashable_rules(c.parallel.rules), s.tx, s.policy, s.frozen,
                                  lora=bool(lora_rank))
    sh = ins["in_shardings"]
    frozen_before, ref_before = host(s.frozen), host(s.ref)
    state, m = s.step_fn(s.init_state(), s.frozen, s.ref, put(inputs["ids"], sh[3]), put(adv, sh[4]),
                         jax.tree.map(put, inputs["rec"], sh[5]), put(inputs["final"], sh[6]),
                         rng.stream(ro["key"], "train"))
    results[name] = host(dict(policy=state["policy"], loss=m["loss"], kl=m["kl"], keep=m["keep_frac"]))
    results[name]["sharded"] = sum(1 for x in jax.tree.leaves(state["policy"]) if not x.sharding.is_fully_replicated)
    out.setdefault(f"{prefix}/untouched", []).append(
        max_diff(s.frozen, frozen_before) == 0.0 and max_diff(s.ref, ref_before) == 0.0)
    out.setdefault(f"{prefix}/policy_moved", []).append(max_diff(state["policy"], s.policy))
  for name in meshes:
    r, one = results[name], results["1"]
    out[f"{prefix}/{name}"] = dict(loss=abs(float(r["loss"]) - float(one["loss"])),
                                   kl=abs(float(r["kl"] - one["kl"])), keep=abs(float(r["keep"] - one["keep"])),
                                   params=max_diff(r["policy"], one["policy"]), sharded_leaves=r["sharded"])


def restore_checks(params, out):
  """Save on a 2x4 mesh, restore onto 1x8 and onto one device."""
  rules = sharding.hashable_rules(mesh_lib.config().rules)
  m24 = mesh_lib.make_mesh(dict(data=2, fsdp=4, tensor=1))
  saved = jax.device_put(params, sharding.param_shardings(m24, params, rules))
  with tempfile.TemporaryDirectory() as d:
    with ocp.StandardCheckpointer() as ck:
      ck.save(os.path.join(d, "p"), saved)
    for name, mesh in [("1x8", mesh_lib.make_mesh(dict(data=1, fsdp=8, tensor=1))),
                       ("one", mesh_lib.make_mesh(dict(data=1, fsdp=1, tensor=1), jax.devices()[:1]))]:
      target = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), params,
                            sharding.param_shardings(mesh, params, rules))
      with ocp.StandardCheckpointer() as ck:
        got = ck.restore(os.path.join(d, "p"), target)
      ok = all(g.sharding == t.sharding for g, t in zip(jax.tree.leaves(got), jax.tree.leaves(target)))
      out[f"restore/{name}"] = dict(diff=max_diff(got, params), shardings_match=ok)


def plan_checks(out):
  """Plan mode compiles the sharded rollout and RL step on a 2x4 mesh: the small model in bfloat16 compute, tiny
  Harmon and NOVA in float32."""
  from margrpo_jax.jobs import plan
  c = config_files.load("shapes_rl", "margrpo,smoke")
  c.model = smoke_config().model
  c.rl.update(group_size=2, prompts_per_iter=4)
  c.parallel.mesh.update(data=2, fsdp=4, tensor=1)
  c.plan = dict(compile=True, dtypes="bfloat16")
  out["plan/shapes"] = plan.plan(c)
  for family in ("harmon", "nova"):  # the tiny instances: the real families' parameter trees and code paths
    c = config_files.load(family, "random")
    c.rl.update(prompts_per_iter=4)
    c.parallel.mesh.update(data=2, fsdp=4, tensor=1)
    c.plan = dict(compile=True, dtypes="float32")
    out[f"plan/{family}"] = plan.plan(c)


def activation_checks(out):
  """The temporaries of a backbone forward on FSDP-sharded parameters (1 x 8 mesh, 16 images), traced plainly and
  traced on the mesh (``sharding.traced_on``: every block's output pinned to the batch axes)."""
  from flax import nnx
  from margrpo_jax.models import families
  config = smoke_config()
  mesh = mesh_lib.make_mesh(dict(data=1, fsdp=8, tensor=1))
  graphdef, state = nnx.split(families.abstract(config.model))
  params = nnx.to_pure_dict(state)
  bb = nnx.merge(graphdef, state).backbone
  args = (jax.ShapeDtypeStruct((16, config.model.text.max_len), jnp.int32),
          jax.ShapeDtypeStruct((16, bb.seq_len, bb.token_dim), jnp.float32),
          jax.ShapeDtypeStruct((16, bb.seq_len), bool))

  def forward(p, ids, canvas, mask):
    m = nnx.merge(graphdef, p)
    return m.backbone(canvas, mask, m.condition(ids))

  shardings = (sharding.param_shardings(mesh, params, sharding.hashable_rules(config.parallel.rules)),
               sharding.batch_sharding(mesh, 2), sharding.batch_sharding(mesh, 3), sharding.batch_sharding(mesh, 2))
  temp = lambda f: int(jax.jit(f, in_shardings=shardings).lower(params, *args).compile()
                       .memory_analysis().temp_size_in_bytes)
  out["activations/temp_plain"] = temp(forward)
  out["activations/temp_traced_on_mesh"] = temp(sharding.traced_on(forward, mesh))


def main():
  out = {"devices": len(jax.devices())}
  activation_checks(out)
  plan_checks(out)
  config = smoke_config()
  config.model.update(dict(backbone=dict(width=32, encoder_depth=1, decoder_depth=1, num_heads=2)))
  config.optim.update(lr=1.0, eps=1.0, warmup_steps=1, decay="constant", grad_clip=1e9)
  recs = shapes.split_records("train", num_train=400)
  pretrain_checks(config, recs, out)  # update ~ g / (|g| + 1): parameter differences track gradient differences
  config.optim.update(lr=3e-3, eps=1e-8, grad_clip=3.0)
  # a briefly trained model for RL (a zero-initialised head gives degenerate log-probs)
  graphdef, tx, st = pretrain.init_state(config)
  step = pretrain.make_step_fn(graphdef, tx, config)
  for i in range(30):
    st, _ = step(st, pretrain.make_batch(recs, i, 16, 0, config.model))
  params = host(st["params"])
  rl_checks(params, config.model, graphdef, out)
  rl_checks(params, config.model, graphdef, out, meshes=("2x4",), lora_rank=4, prefix="rl_lora")
  restore_checks(params, out)
  print(json.dumps(out))


if __name__ == "__main__":
  main()
