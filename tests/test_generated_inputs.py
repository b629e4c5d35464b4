"""Generated bad input: every leaf key of every shipped config, set on the command line to a wrong type, NaN,
+-inf, a huge value, a negative value and an empty string, goes through the entry point's parsing and every
check of its mode (``main.prepare``: ``validate.check`` and the job's own ``check``), in one process.

Each case is either refused (a flag error or one of ``main.user_errors()``: one line that names the key, its
block or the file; ``main`` prints it as ``error:`` with exit code 2) or accepted. An accepted case must be one
that runs: it matches a row of :data:`HARMLESS`, which says why that value is a working one. No case may raise
anything else (a traceback) or create the workdir. A new config key, or a check that stops refusing, shows up
here as an unexplained acceptance. The hand-written cases of ``test_bad_inputs.py`` run the real command line.
"""
import os
import re

import pytest
from absl import flags
from ml_collections import config_flags

from conftest import REPO
from margrpo_jax import cli, config_files, validate
from margrpo_jax import main as entry

pytestmark = pytest.mark.slow  # about two minutes: every model config is traced once per distinct value

CONFIGS = [("shapes_rl", "smoke"), ("shapes_pretrain", "smoke"), ("shapes_sample", None), ("shapes_eval", None),
           ("shapes_ablation", None), ("shapes_tokenizer", "smoke"), ("mar", "random"), ("harmon", "random"),
           ("nova", "random")]
MUTATIONS = {"wrong_type": "not_a_value", "nan": "nan", "inf": "inf", "-inf": "-inf", "huge": "1e12",
             "negative": "-1", "empty": ""}
ANY = frozenset(MUTATIONS)

# (key pattern, mutations, why the value runs). Keys are full dotted paths; patterns match the whole key.
HARMLESS = [
    (r"(data\.)?tfds_dir|export\.dir|manual_dir", ANY, "a folder the job creates or reads; '' = its default"),
    (r"checkpoints?|init|(eval\.|rl\.)?prompt_file|model\.(tokenizer_path|vae_checkpoint)|plan\.dtypes|reward_names"
     r"|rl\.official_except|rl_config|rewards\.\w+\.(resize|mode|convention)", {"empty"},
     "'' is the default (the shipped base, the built-in prompts, the builder's option)"),
    (r"rewards\.\w+\.(checkpoint|vocab|head|variant|prefix)", ANY,
     "read only when that learned reward is used (then checked: check_learned_rewards)"),
    (r"variant|prompts|plan\.variants|model\.(size|variant|text_encoder\.family|diffusion\.sampling_steps)", ANY,
     "a label or a setting of another mode: never read by this config's job (plan.variants: plan mode's, checked "
     "there before any compile)"),
    (r"rl\.lora\.targets", ANY, "read only with rl.lora.rank > 0 (then every regex must match a trained kernel)"),
    (r"optim\.(lr|eps|grad_clip|weight_decay)|beta|rl\.(beta|clip_eps|adv_clip|pretrain_mix|diversity_bonus"
     r"|lora\.alpha)"
     r"|rl\.rollout_(cfg_scale|temperature)|sampling\.(cfg_scale|temperature|clip_denoised|flow_noise_level)|mar\.mask_ratio_std"
     r"|model\.(.*mlp_ratio|llm\.(rms_eps|rope_theta)|text_encoder\.(eps|rope_theta)|diffusion\.shift|scale|shift"
     r"|vae_scale)", {"huge"},
     "a finite value with no upper bound; a run it makes diverge stops at the first non-finite value, unsaved"),
    (r"rl\.rewards\.\w+|rewards\.(hps|pickscore)\.scale", {"huge", "negative"},
     "a signed weight or scale (negative: minimise that reward)"),
    (r"parallel\.mesh\.\w+", {"negative"}, "-1 = the devices the other axes leave"),
]


def _harmless(key: str, mutation: str) -> bool:
  return any(mutation in muts and re.fullmatch(pattern, key) for pattern, muts, _ in HARMLESS)


def _parse(spec: str, key: str, value: str):
  """The config as ``--config=spec --config.key=value`` gives it (the entry point's flags, locked)."""
  argv = ["main", f"--config={spec}", f"--config.{key}={value}"]
  fv = flags.FlagValues()
  config_flags.DEFINE_config_file("config", None, "", flag_values=fv, lock_config=True, sys_argv=argv)
  fv(argv)
  _ = fv.config.mode
  return fv.config


@pytest.mark.parametrize("name,arg", CONFIGS, ids=[n if a is None else f"{n}:{a}" for n, a in CONFIGS])
def test_every_key_every_bad_value(name, arg, tmp_path):
  spec = str(REPO / "configs" / f"{name}.py") + (f":{arg}" if arg else "")
  leaves = validate.flatten(config_files.load(name, arg).to_dict())
  workdir = str(tmp_path / "never_created")
  unexplained, traced, vague = [], [], []
  for key in leaves:
    for mutation, value in MUTATIONS.items():
      try:
        config = _parse(spec, key, value)
      except flags.Error as e:
        message = cli.flag_error(e)
      else:
        try:
          entry.prepare(config, workdir)
        except entry.user_errors() as e:
          message = cli.sentence(e)
        except Exception as e:  # noqa: BLE001 - the failure this test exists to find
          traced.append(f"{key}={value!r}: {type(e).__name__}: {e}")
          continue
        else:
          if not _harmless(key, mutation):
            unexplained.append(f"{key}={value!r}")
          continue
      named = {key, *key.split(".")} | {"config", "--config", "model.json", "checkpoint"}
      if "\n" in message or not any(part in message for part in named):
        vague.append(f"{key}={value!r}: {message}")
      assert not os.path.exists(workdir), f"{key}={value!r} created the workdir"
  assert not traced, "raised instead of one sentence:\n" + "\n".join(traced[:20])
  assert not unexplained, ("accepted, and not in HARMLESS (refuse it, or add the reason it runs):\n"
                           + "\n".join(unexplained[:40]))
  assert not vague, "refused without naming the key:\n" + "\n".join(vague[:20])
