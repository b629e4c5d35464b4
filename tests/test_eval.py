"""The eval job: on the shapes world it reproduces the sample job's strict pass exactly (same prompts, seed and
sampling settings) and writes eval.json / eval.md / grids with the interface's fields, one column per checkpoint;
on a GenEval subset it runs a tiny random-weight learned reward (ImageReward) and reports per-category rows."""
from __future__ import annotations

import json

import ml_collections
import numpy as np
import pytest
from conftest import SHARED_DATA

from margrpo_jax import checkpoint, config_files
from margrpo_jax.jobs import eval as eval_job
from margrpo_jax.jobs import sample
from margrpo_jax.data import shapes
from margrpo_jax.models import blip, families

FAST = dict(num_steps=4, diffusion_steps="5")  # few AR / diffusion steps: a CPU-sized check, same for both jobs


def _config(tfds_dir, **kw):
  c = config_files.load("shapes_eval")
  c.sampling.update(FAST)
  c.tfds_dir, c.batch_size, c.grid_size = str(tfds_dir), 16, 16
  for k, v in kw.items():
    c[k] = v
  return c


@pytest.fixture(scope="module")
def shapes_eval(tmp_path_factory):
  """16 shapes eval-split prompts (4 per task; written as a JSONL file: building the TFDS split with its 20k train
  records would dominate the test), two columns (the same checkpoint twice)."""
  d = tmp_path_factory.mktemp("eval")
  prompts = d / "prompts.jsonl"
  prompts.write_text("".join(json.dumps(md) + "\n" for md in shapes.split_records("eval")))
  cfg = _config(d / "tfds", prompt_file=str(prompts), per_category=4, checkpoints="base,base")
  return d, cfg, eval_job.run(cfg, str(d / "w"))


def test_strict_pass_equals_sample_job(shapes_eval):
  d, cfg, report = shapes_eval
  recs, source = eval_job.load_records(cfg, str(d / "w"))
  assert len(recs) == 16 and len({r["category"] for r in recs}) == 4 and source == cfg.prompt_file
  prompts = d / "subset.jsonl"
  prompts.write_text("".join(json.dumps(r["metadata"]) + "\n" for r in recs))
  s = ml_collections.ConfigDict(config_files.load("shapes_sample"))
  s.sampling.update(FAST)
  s.prompt_file, s.batch_size, s.tfds_dir = str(prompts), cfg.batch_size, cfg.tfds_dir
  scores = sample.run(s, str(d / "sample"))
  res = report["results"]["base"]
  assert scores["num_scored"] == 16
  assert res["rewards"]["shapes_strict"]["all"]["mean"] == scores["strict_pass"]
  assert res["rewards"]["shapes_partial"]["all"]["mean"] == pytest.approx(scores["partial"], abs=1e-6)
  assert res["geneval"]["per_task"] == scores["per_task"]
  assert res["geneval"]["overall"] == pytest.approx(np.mean(list(scores["per_task"].values())))


def test_eval_outputs_have_the_interface_fields(shapes_eval):
  d, _, report = shapes_eval
  on_disk = json.loads((d / "w" / "eval.json").read_text())
  assert on_disk == json.loads(json.dumps(report))
  assert list(on_disk["checkpoints"]) == ["base", "base_1"]
  assert on_disk["results"]["base"] == on_disk["results"]["base_1"]  # same prompts and seeds -> same images
  for name in ("shapes_strict", "shapes_partial", "jpeg_compressibility"):
    rows = on_disk["results"]["base"]["rewards"][name]
    assert set(rows) == {"all", "single_object", "two_object", "counting", "position"}
    assert all(set(v) == {"mean", "std", "count"} for v in rows.values())
    assert rows["all"]["count"] == 16 and rows["counting"]["count"] == 4
  assert on_disk["results"]["base"]["num_images"] == 16
  md = (d / "w" / "eval.md").read_text()
  assert "| shapes_strict | counting |" in md and "| base | base_1 |" in md and "**overall**" in md
  assert (d / "w" / "grid_base.png").is_file() and (d / "w" / "grid_base_1.png").is_file()


@pytest.mark.slow
def test_geneval_subset_with_a_tiny_learned_reward(tmp_path):
  """GenEval's metadata file, 1 prompt per task x 2 images, scored by a random-weight ImageReward export."""
  cfg_ir = blip.imagereward_config(**{
      "image_size": 48, "patch_size": 16, "vision.width": 64, "vision.depth": 1, "vision.num_heads": 2,
      "text.vocab_size": 40, "text.width": 64, "text.depth": 1, "text.num_heads": 2, "text.intermediate": 128,
      "text.max_positions": 40})
  cfg_ir.head_dims = [16, 8, 8, 4]
  from flax import nnx
  checkpoint.save_model(str(tmp_path / "ir"), nnx.to_pure_dict(nnx.state(families.build(cfg_ir))), cfg_ir)
  words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a", "photo", "of", "an", "and", "two", "red", "blue"]
  (tmp_path / "vocab.txt").write_text("\n".join(words) + "\n")
  cfg = _config(tmp_path / "tfds", prompt_file=str(SHARED_DATA / "geneval" / "evaluation_metadata.jsonl"),
                per_category=1, images_per_prompt=2, reward_names="shapes_strict,jpeg_compressibility")
  cfg.rewards.imagereward.checkpoint = str(tmp_path / "ir")
  cfg.rewards.imagereward.vocab = str(tmp_path / "vocab.txt")
  report = eval_job.run(cfg, str(tmp_path / "w"))
  res = report["results"]["base"]
  tasks = {"single_object", "two_object", "counting", "colors", "position", "color_attr"}
  assert report["rewards"] == ["shapes_strict", "jpeg_compressibility", "imagereward"]
  assert res["num_images"] == 12 and "geneval" not in res  # GenEval's COCO prompts are not shapes-verifiable
  rows = res["rewards"]["imagereward"]
  assert set(rows) == tasks | {"all"} and all(rows[t]["count"] == 2 for t in tasks)
  assert np.isfinite(rows["all"]["mean"]) and rows["all"]["std"] > 0
  assert res["rewards"]["shapes_strict"]["all"]["count"] == 0
  md = (tmp_path / "w" / "eval.md").read_text()
  assert "| imagereward | color_attr |" in md and "| shapes_strict |" not in md and "applicable" in md
