"""The CLI: a sample run writes what the interface promises (the bad-input table is tests/test_bad_inputs.py)."""
import json
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from conftest import REPO

pytestmark = pytest.mark.slow  # whole jobs end to end (the fast tier skips them)


def _main(*args, cwd=REPO):
  return subprocess.run([sys.executable, "-m", "margrpo_jax.main", *args], cwd=cwd, capture_output=True,
                        text=True, timeout=300)


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory, small_model):
  from margrpo_jax import checkpoint
  cfg, _, params = small_model
  return checkpoint.save_model(str(tmp_path_factory.mktemp("ckpt") / "export"), params, cfg)


def test_sample_on_a_prompt_file(tmp_path, export_dir):
  prompts = tmp_path / "prompts.jsonl"
  prompts.write_text('{"tag": "single_object", "prompt": "a red circle", "include": [{"class": "red circle", '
                     '"count": 1}], "position": null}\n{"prompt": "a photo of a bench"}\n')
  plain = tmp_path / "plain.txt"
  plain.write_text("two blue squares\n")
  r = _main("--config=configs/shapes_sample.py", f"--workdir={tmp_path / 'w'}", f"--config.prompt_file={prompts}",
            f"--config.checkpoint={export_dir}", "--config.seed=3", "--config.sampling.num_steps=4")
  assert r.returncode == 0, r.stderr[-2000:]
  assert "strict pass rate" in r.stdout
  for i in range(2):
    im = np.asarray(Image.open(tmp_path / "w" / "samples" / f"{i}.png"))
    assert im.shape == (32, 32, 3) and im.dtype == np.uint8
  scores = json.loads((tmp_path / "w" / "scores.json").read_text())
  assert scores["num_images"] == 2 and scores["num_scored"] == 1
  assert scores["per_image"][0]["strict"] in (True, False) and 0 <= scores["per_image"][0]["partial"] <= 1
  assert scores["per_image"][1]["strict"] is None  # not a shapes-world prompt: not scored
  assert scores["strict_pass"] == float(scores["per_image"][0]["strict"])
  assert (tmp_path / "w" / "grid.png").exists()
  r2 = _main("--config=configs/shapes_sample.py", f"--workdir={tmp_path / 'w2'}", f"--config.prompt_file={plain}",
             f"--config.checkpoint={export_dir}", "--config.sampling.num_steps=4")
  assert r2.returncode == 0 and json.loads((tmp_path / "w2" / "scores.json").read_text())["num_scored"] == 1
