"""Loading ``configs/NAME.py[:arg]`` files outside absl flags (jobs that run other configs, benchmarks, tests)."""
from __future__ import annotations

import importlib.util
import math
import os

import ml_collections

from margrpo_jax.errors import UserError
from margrpo_jax.models import random_instance


class ConfigError(UserError, ValueError):
  """A config value or combination that cannot work, in one sentence (the entry point exits with code 2)."""


def check_ranges(block, ranges: dict, prefix: str) -> None:
  """Each ``key -> (low, high, low included, high included)`` of ``ranges`` that ``block`` (a config block) has
  must be a finite number inside that span; a value outside is refused naming ``prefix + key``. The owners' tables:
  ``optim.RANGES``, ``sampler.RANGES``, ``rl/config.py: RANGES``, ``registry.SETTING_RANGES``, the pretrain and
  tokenizer jobs' ``RANGES``."""
  for key, (lo, hi, lo_in, hi_in) in ranges.items():
    v = block.get(key) if hasattr(block, "get") else None
    if v is None or isinstance(v, bool) or not isinstance(v, (int, float)):
      continue
    if math.isfinite(v) and (v >= lo if lo_in else v > lo) and (v <= hi if hi_in else v < hi):
      continue
    if isinstance(v, int) and lo_in and hi == math.inf:
      raise ConfigError(f"{prefix}{key}={v} must be at least {lo}")
    span = f"{'[' if lo_in else '('}{lo}, {hi}{']' if hi_in else ')'}"
    raise ConfigError(f"{prefix}{key}={v} must be a finite number in {span}")


# The repository's configs/ folder (the package is installed editable, next to it).
CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")


def load(path: str, arg: str | None = None) -> ml_collections.ConfigDict:
  """``get_config(arg)`` of a config file; a bare name like ``'shapes_rl'`` means ``configs/shapes_rl.py``."""
  if os.sep not in path and not path.endswith(".py"):
    path = os.path.join(CONFIGS, path + ".py")
  spec = importlib.util.spec_from_file_location(os.path.splitext(os.path.basename(path))[0], path)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod.get_config(arg) if arg is not None else mod.get_config()


def override(config: ml_collections.ConfigDict, assignment: str) -> None:
  """Apply ``'block.key=value'`` (nested blocks allowed), cast to the type of the current value (scripts' --set)."""
  key, value = assignment.split("=", 1)
  *blocks, name = key.split(".")
  node = config
  for b in blocks:
    node = node[b]
  old = node[name]
  node[name] = (value.lower() in ("1", "true")) if isinstance(old, bool) else type(old)(value)


CAPTIONS = "a photo of a red apple on a wooden table,a cat sitting on a sofa"  # text-to-image sample default


def real_size(model_cfg: ml_collections.ConfigDict, prompts: str = CAPTIONS, batch_size: int = 4,
              grid_size: int = 16) -> ml_collections.ConfigDict:
  """The shared schema of a real-size family's config (MAR, Harmon, NOVA): MAR-GRPO's RL block
  (``shapes_rl:margrpo``), plan mode by default, sample-mode prompt fields (a prompt file or a comma-separated
  list), FSDP over every device, and ``plan.compile`` (False: parameter counts only)."""
  c = load("shapes_rl", "margrpo")
  c.mode = "plan"
  c.model = model_cfg
  c.prompt_file = ""
  c.prompts = prompts
  c.max_prompts = 0
  c.batch_size = batch_size
  c.grid_size = grid_size
  c.parallel.mesh.update(data=1, fsdp=-1, tensor=1)  # FSDP over every device: optimizer states are large
  c.plan = dict(compile=True, dtypes="float32,bfloat16",  # the memory of both compute dtypes
                variants="")  # e.g. "rl.remat=False,rl.lora.rank=16": each also planned (jobs/plan.py)
  c.rl.rewards.update({k: 0.0 for k in c.rl.rewards})  # the family's config names its reward
  return c


CAPTIONS_FILE = os.path.join(CONFIGS, "prompts", "captions.txt")  # the random instances' prompts


def random_weights(c: ml_collections.ConfigDict, family: str) -> ml_collections.ConfigDict:
  """A family's ``random`` config: its few-layer random-weight instance (``models/random_instance.py``) and
  MAR-GRPO settings sized for a CPU (two prompts of two images, 4 AR steps of which 2 scored, 2 MTE seeds), on a
  reward that needs no download (JPEG compressibility) and the shipped captions (class labels for MAR)."""
  c.mode = "rl"
  c.init = "random"
  c.model = random_instance.model_config(family)
  c.num_iters = 2
  c.sampling.update(num_steps=4, diffusion_steps="10", clip_denoised=3.0)  # untrained eps: keep x0_hat bounded
  c.rl.update(group_size=2, prompts_per_iter=2, num_ar_steps=2, num_diffusion_steps=2, mte_seeds=2, remat=False,
              prompt_file="" if family == "mar" else CAPTIONS_FILE)
  c.rl.rewards.update({k: 0.0 for k in c.rl.rewards})
  c.rl.rewards.jpeg_compressibility = 1.0
  c.optim.update(lr=1e-3)
  c.eval.update(num_prompts=4, batch_size=4)
  c.save.every = 1
  c.batch_size = 2
  c.prompts = "1,2" if family == "mar" else "a red apple,a cat on a sofa"
  return c
