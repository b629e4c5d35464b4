"""MAR-GRPO end to end on every real family, on the few-layer random-weight instances of
``configs/{mar,harmon,nova}.py:random`` (their own code paths and VAEs, nothing downloaded): the RL job runs, the
policy moves, the frozen parts (diffusion head, text encoder / LLM, ...) stay bit-identical, the first update's
ratio is 1 (every recorded transition rescored exactly: with CFG as sampled, and for NOVA through the flow SDE),
report.json has the base and final reward means on the same prompts, and rerunning the same command resumes."""
import json

import jax
import numpy as np
import pytest

from margrpo_jax import checkpoint, config_files
from margrpo_jax.jobs import rl as rl_job
from margrpo_jax.models import families, random_instance
from margrpo_jax.rl import config as rl_config


def _leaves(tree):
  return {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(tree)}


@pytest.mark.parametrize("family,fidelity", [("mar", "intended"), ("harmon", "intended"), ("nova", "intended"),
                                             ("nova", "official")])
@pytest.mark.slow
def test_random_instance_rl_end_to_end(family, fidelity, tmp_path):
  config = config_files.load(family, "random")
  config.eval.update(num_prompts=2, batch_size=2)
  config.rl.fidelity = fidelity  # official NOVA: per-pixel U + 1 random pixel, unguided commit-time MTE, bf16 ...
  rl_config.resolve_fidelity(config)  # as the entry point does
  wd = str(tmp_path / "w")
  resume = family == "nova" and fidelity == "intended"
  iters = 2 if resume else 1
  config.num_iters = iters
  if resume:  # killed after its first iteration, then the same command resumes
    rl_job.run(config, wd, max_iters_this_run=1)
    assert not (tmp_path / "w" / "report.json").exists()
  rl_job.run(config, wd)
  report = json.loads((tmp_path / "w" / "report.json").read_text())
  assert report["family"] == family and report["iterations"] == iters
  means = report["reward_means"]["jpeg_compressibility"]
  assert np.isfinite([means["base"], means["final"]]).all()

  history = [json.loads(line) for line in (tmp_path / "w" / "metrics.jsonl").read_text().splitlines()]
  assert [h["iter"] for h in history] == list(range(iters))
  # |log rho| at the first update: the rollout rescored exactly. The official code scores other transitions than
  # it sampled (post-step visibility B1, no guidance in the loss; its ratio is 1 by construction, 'none').
  assert history[0]["logp_diff"] < 1e-5 or (fidelity == "official" and np.isfinite(history[0]["logp_diff"]))
  assert history[0]["grad_norm"] > 0

  _, _, base = checkpoint.load_model(str(tmp_path / "w" / "random_base" / "model"))
  _, _, tuned = checkpoint.load_model(report["checkpoint"])
  policy = families.get(family).policy_components
  assert set(policy) < set(base)
  for name in base:
    b, t = _leaves(base[name]), _leaves(tuned[name])
    diff = max(float(np.max(np.abs(b[k] - t[k]))) for k in b)
    if name in policy:
      assert diff > 0, f"{family}: the policy component {name} did not move"
    else:
      assert diff == 0, f"{family}: the frozen component {name} changed by {diff}"


def test_official_fidelity_on_nova_sets_the_official_nova_switches():
  """``rl.fidelity=official`` on a flow-head model writes the official NOVA values (the pre-step mask, unguided
  commit-time MTE, channel mean, diffusion steps drawn per AR step, bfloat16 log-probs, U per latent pixel + 1
  random pixel) on top of the shared official switches; on Harmon the post-step mask (B1)."""
  c = config_files.load("nova", "random")
  c.rl.fidelity = "official"
  rl_config.resolve_fidelity(c)
  assert {k: rl_config.block_of(c.rl, k)[k] for k in rl_config.OFFICIAL_NOVA} == rl_config.OFFICIAL_NOVA
  sc = rl_config.step_config(c, c.model)
  assert sc.batch.diffusion_per_ar_step and sc.loss.logp_bf16 and sc.loss.channel_reduction == "mean"
  assert not sc.batch.mte_commit_guided and sc.flow == (0.7, 1.0) and sc.sampler.mask_schedule == "cos_round"
  assert not sc.batch.mask_after_step  # NOVA: visibility = known before step i, region includes its decoded tokens
  assert (sc.batch.uncertainty_unit, sc.batch.pixel_channels, sc.batch.topk_random) == ("pixel", 4, 1)
  h = config_files.load("harmon", "random")
  h.rl.fidelity = "official"
  rl_config.resolve_fidelity(h)
  assert {k: rl_config.block_of(h.rl, k)[k] for k in rl_config.OFFICIAL} == rl_config.OFFICIAL
  assert h.rl.official.mask_after_step and not h.rl.official.logp_bf16  # Harmon's post-step mask (B1)


@pytest.mark.slow
def test_random_configs_sample_from_their_random_base(tmp_path):
  """``mode=sample`` on a ``:random`` config needs no checkpoint: the random-weight base is written once into
  ``W/random_base`` and reused (the same export RL starts from)."""
  from margrpo_jax.jobs import sample
  c = config_files.load("mar", "random")
  ckpt, model_cfg, _, _ = sample.load_for_sampling(c, str(tmp_path))
  assert ckpt == str(tmp_path / "random_base" / "model") and model_cfg.family == "mar"
  assert model_cfg.vae_checkpoint == str(tmp_path / "random_base" / "vae")
  stamp = (tmp_path / "random_base" / "model" / "model.json").stat().st_mtime_ns
  assert random_instance.materialize(c.model, str(tmp_path / "random_base")) == ckpt  # kept, not rewritten
  assert (tmp_path / "random_base" / "model" / "model.json").stat().st_mtime_ns == stamp
