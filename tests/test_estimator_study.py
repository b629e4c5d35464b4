"""Every cell of the estimator study (benchmarks/estimator_study.py) is a run the job accepts.

A cell is a preset of configs/shapes_rl.py plus overrides; a misspelt key or an out-of-range value would only surface
when its run starts, minutes into a sweep. Here each cell's config, real and shuffled, passes the job's own checks
(``validate.check``: keys, ranges, options, the base, the prompts) and spends exactly the study's image budget.
"""

from __future__ import annotations

import pathlib
import sys

import pytest

from margrpo_jax import validate

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
import estimator_study  # noqa: E402


@pytest.mark.parametrize("name", sorted(estimator_study.CELLS))
def test_every_cell_is_a_valid_run(name, tmp_path):
  for control in (False, True):
    c = estimator_study.run_config(name, 0, control, str(tmp_path))  # a misspelt key raises here
    static = validate.check(c, str(tmp_path / f"run_{control}"))
    assert static is not None
    assert c.num_iters > 0 and c.rl.shuffle_advantages == control
    assert c.rl.prompts_per_iter * c.rl.group_size * c.num_iters == estimator_study.BUDGET


def test_chain_ppo_clip_cell_sets_the_clip(tmp_path):
  """The tight trust region: the only difference from ``chain_ppo`` is the ratio's clip."""
  a = estimator_study.run_config("chain_ppo", 0, False, str(tmp_path))
  b = estimator_study.run_config("chain_ppo_clip05", 0, False, str(tmp_path))
  assert (a.rl.clip_eps, b.rl.clip_eps) == (0.2, 0.05)
  b.rl.clip_eps = a.rl.clip_eps
  assert a.to_dict() == b.to_dict()
