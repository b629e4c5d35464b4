r"""Plan a run before paying for it (``config.mode = 'plan'``): no parameter is ever allocated.

1. The model is built abstractly (``nnx.eval_shape``); one line ``params/<component> = <count>`` per
   component and ``params/total = <count>``.
2. On the mesh of ``config.parallel`` (simulate a pod on CPU with
   ``XLA_FLAGS=--xla_force_host_platform_device_count=N``), the sharded rollout and RL step are lowered
   and compiled from ``ShapeDtypeStruct`` inputs carrying their shardings, and XLA's per-device memory
   analysis (arguments, outputs, temporaries, code) and cost analysis (FLOPs) are printed, once per compute
   dtype of ``plan.dtypes`` (default: ``rl.compute_dtype``; the real-size configs: ``'float32,bfloat16'``,
   whose bfloat16 lines are named ``rollout_bfloat16`` / ``rl_step_bfloat16``).
3. Each ``rl.<key>=<value>`` of ``plan.variants`` (e.g. ``rl.remat=False,rl.microbatch=8,rl.lora.rank=16,
   rl.frozen_dtype=bfloat16``, several joined by ``+``) plans the RL step once more with those values changed (first
   compute dtype):
   ``memory/rl_step_<key>=<value>/per_device_peak_gib``, the peak with and without each memory measure in one run
   (``benchmarks/plan_table.py`` runs every family so and writes the README's table).
"""
from __future__ import annotations

import copy

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from margrpo_jax import config_files
from margrpo_jax.models import families, precision
from margrpo_jax.parallel import mesh as mesh_lib, sharding
from margrpo_jax.rl import config as rl_config, step as step_lib
from margrpo_jax.sampling import sampler as sampler_lib

GIB = 2.0 ** 30


def param_counts(model_cfg) -> dict[str, int]:
  """Parameters per top-level component, from abstract shapes."""
  state = nnx.to_pure_dict(nnx.state(families.abstract(model_cfg)))
  return {k: sum(int(np.prod(x.shape)) for x in jax.tree.leaves(v)) for k, v in state.items()}


def _abstract(tree, shardings):
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def _memory_lines(name: str, compiled) -> list[str]:
  m = compiled.memory_analysis()
  fields = ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes", "alias_size_in_bytes",
            "generated_code_size_in_bytes")
  vals = {f: int(getattr(m, f, 0) or 0) for f in fields}
  peak = vals["argument_size_in_bytes"] + vals["output_size_in_bytes"] + vals["temp_size_in_bytes"] \
      - vals["alias_size_in_bytes"]
  lines = [f"memory/{name}/{f.replace('_in_bytes', '')} = {v}" for f, v in vals.items()]
  lines.append(f"memory/{name}/per_device_peak_gib = {peak / GIB:.3f}")
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  if cost and "flops" in cost:
    lines.append(f"flops/{name}/per_device = {int(cost['flops'])}")
  return lines


class _Lines(list):
  """The plan's lines, each also handed to ``emit`` as soon as it is known."""

  def __init__(self, emit):
    super().__init__()
    self.emit = emit

  def __iadd__(self, lines):
    for line in lines:
      self.append(line)
      self.emit(line)
    return self


def _assign(config, spec: str, key: str, value: str) -> None:
  """``config.<key> = value`` in place, ``value`` parsed as the type of the value it replaces."""
  *path, leaf = key.split(".")
  node = config
  for k in path:
    node = node.get(k) if hasattr(node, "get") else None
  if path[:1] != ["rl"] or node is None or not hasattr(node, "get") or leaf not in node or hasattr(node[leaf], "get"):
    raise config_files.ConfigError(f"plan.variants={spec!r}: {key!r} is not a setting of the rl block (e.g. "
                                   "rl.remat=False, rl.lora.rank=16)")
  old = node[leaf]
  try:
    node[leaf] = ({"true": True, "1": True, "false": False, "0": False}[value.lower()] if isinstance(old, bool)
                  else type(old)(value))
  except (KeyError, ValueError):
    raise config_files.ConfigError(f"plan.variants={spec!r}: {key}={value!r} is not a {type(old).__name__} like "
                                   f"{key}={old!r}") from None


def variants(config) -> list[tuple[str, object]]:
  """``(name, config)`` of each entry of ``plan.variants``: comma-separated settings ``rl.<key>=<value>``, several
  joined by ``+`` (e.g. ``rl.remat=False,rl.microbatch=8,rl.lora.rank=16+rl.frozen_dtype=bfloat16``), each a copy
  of ``config`` with those values changed, whose RL step is planned beside the configured one as
  ``rl_step_<key>=<value>[+...]``. A key that is not an ``rl`` setting, or a value of the wrong type, is a
  :class:`config_files.ConfigError` naming it."""
  spec, out = str(config.get("plan", {}).get("variants", "")), []
  for item in (x.strip() for x in spec.split(",") if x.strip()):
    c = copy.deepcopy(config)
    pairs = [tuple(t.strip() for t in a.partition("=")[::2]) for a in item.split("+")]
    for key, value in pairs:
      _assign(c, spec, key, value)
    out.append(("+".join(f"{k[len('rl.'):]}={v}" for k, v in pairs), c))
  return out


def plan(config, emit=lambda line: None) -> list[str]:
  """The plan's lines; ``emit`` receives each one as soon as it is computed (compiles take minutes)."""
  rl_config.resolve_fidelity(config)
  runs = [("", config)] + variants(config)  # each checked (step_config) before anything is compiled
  statics = [rl_config.step_config(c, c.model) for _, c in runs]
  counts = param_counts(config.model)
  lines = _Lines(emit)
  lines += [f"params/{k} = {v}" for k, v in counts.items()] + [f"params/total = {sum(counts.values())}"]
  mesh = mesh_lib.make_mesh(config.parallel.mesh)
  lines += [f"mesh = {dict(mesh.shape)} over {mesh.devices.size} {jax.devices()[0].platform} devices"]
  if not config.plan.compile:
    return list(lines)
  if config.model.family == "harmon" and not config.model.text.null_ids:  # the tokenizer's; only shapes matter here
    config.model.text.null_ids = [0]
    lines += ["harmon: model.text.null_ids is empty (no tokenizer given); a stand-in id is used (shapes only)"]
  rules = sharding.hashable_rules(config.parallel.rules)
  graphdef, state = nnx.split(families.abstract(config.model))
  params = nnx.to_pure_dict(state)
  params = _abstract(params, sharding.param_shardings(mesh, params, rules))
  batch = config.rl.group_size * config.rl.prompts_per_iter
  divisor = mesh.shape["data"] * mesh.shape["fsdp"]
  if batch % divisor:
    raise ValueError(f"rl.group_size x rl.prompts_per_iter = {batch} images is not divisible by the batch axes "
                     f"data x fsdp = {divisor}.")
  ids_shape = (batch,) if statics[0].ids_ndim == 1 else (batch, config.model.text.max_len)  # labels or token ids
  ids = jax.ShapeDtypeStruct(ids_shape, jnp.int32, sharding=sharding.batch_sharding(mesh, len(ids_shape)))
  key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype, sharding=sharding.replicated(mesh))
  dtypes = [d.strip() for d in (config.plan.dtypes or config.rl.compute_dtype).split(",")]
  for dtype in dtypes:  # the memory of each compute dtype (models/precision.py): 'rollout', 'rollout_bfloat16', ...
    tag = "" if dtype == "float32" else f"_{dtype}"
    for (name, _), static in zip(runs, statics if dtype == dtypes[0] else statics[:1]):  # variants: first dtype
      g = precision.with_compute(graphdef, params, dtype, static.frozen_dtype)
      policy, frozen, ref = step_lib.halves(params, static, jax.random.key(0))  # LoRA: adapters, base, {}
      policy = _abstract(policy, sharding.param_shardings(mesh, policy, rules))
      ref = _abstract(ref, sharding.param_shardings(mesh, ref, rules))
      held = {**frozen, **policy} if not static.lora.rank else frozen  # what the rollout samples with
      rollout = sampler_lib.make_sample_fn(g, step_lib.make_chain(static), static.sampler,
                                           record=static.reads_chains, mesh=mesh, rules=rules, params=params,
                                           ids_ndim=len(ids_shape))
      if not name:
        lines += _memory_lines(f"rollout{tag}", rollout.lower(held, ids, key).compile())
      final, rec = jax.eval_shape(rollout, held, ids, key)
      tx, step = step_lib.compiled_step(g, static, mesh, rules, (sharding.signature(policy),
                                                                 sharding.signature(frozen)))
      sh = step_lib.step_shardings(mesh, rules, tx, policy, frozen, len(ids_shape), ema=bool(static.ema_decay),
                                   records=static.reads_chains, lora=bool(static.lora.rank))["in_shardings"]
      state = dict(step=jax.ShapeDtypeStruct((), jnp.int32), policy=policy, opt=jax.eval_shape(tx.init, policy))
      if static.ema_decay:
        state["ema"] = policy
      args = (state, frozen, ref, ids, jax.ShapeDtypeStruct((batch,), jnp.float32), rec, final, key)
      lines += _memory_lines(f"rl_step{tag}{'_' + name if name else ''}", step.lower(*_abstract(args, sh)).compile())
  return list(lines)


def run(config, workdir: str) -> list[str]:
  del workdir  # nothing is written
  return plan(config, emit=lambda line: print(line, flush=True))
