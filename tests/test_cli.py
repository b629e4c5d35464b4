"""The CLI: a sample run writes what the interface promises; every user mistake is one sentence, exit 2."""
import json
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from conftest import REPO


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


@pytest.mark.parametrize("args,needle", [
    (["--config.nonexistent=1"], "'nonexistent'"),
    (["--config.sampling.num_stepz=3"], "did you mean 'num_steps'"),
    (["--config.seed=abc"], "--config.seed=abc"),
    (["--config.mode=fly"], "config.mode='fly'"),
    (["--config.checkpoint=/no/such/ckpt"], "/no/such/ckpt"),
    (["--config.prompt_file=BAD"], "line 2: not valid JSON"),
    (["--config.prompt_file=/no/such/prompts.jsonl"], "does not exist"),
])
def test_bad_input_is_one_clear_sentence(tmp_path, args, needle):
  bad = tmp_path / "bad.jsonl"
  bad.write_text('{"prompt": "a red circle"}\n{"prompt": "x",\n')
  args = [a.replace("BAD", str(bad)) for a in args]
  r = _main("--config=configs/shapes_sample.py", f"--workdir={tmp_path / 'w'}", *args)
  assert r.returncode == 2, (r.returncode, r.stderr[-1500:])
  err = [l for l in r.stderr.splitlines() if l.startswith("error: ")]
  assert len(err) == 1 and needle in err[0], r.stderr[-1500:]
  assert "Traceback" not in r.stderr


def test_missing_config_file(tmp_path):
  r = _main("--config=configs/no_such.py", f"--workdir={tmp_path}")
  assert r.returncode == 2 and "configs/no_such.py" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("args,needle", [
    (["--config.rl.diffusion_window=20:10"], "window 20:10 holds no diffusion step"),
    (["--config.rl.diffusion_window=1-3"], "rl.diffusion_window='1-3' is not 'lo:hi'"),
    (["--config.rl.num_diffusion_steps=30"], "does not fit the scored-step window 1:22"),
    (["--config.rl.mte_actual=drop"], "rl.mte_actual='drop' is not one of keep, include, replace"),
    (["--config.rl.kl=gausian"], "rl.kl='gausian' is not one of"),
    (["--config.rl.group_size=1"], "rl.group_size=1 must be >= 2"),
    (["--config.rl.topk_fraction=1.5"], "rl.topk_fraction=1.5"),
    (["--config.rl.num_ar_steps=40"], "rl.num_ar_steps=40 must lie in [0, sampling.num_steps="),
])
def test_bad_rl_options_are_one_sentence_before_anything_is_written(tmp_path, args, needle):
  r = _main("--config=configs/shapes_rl.py", f"--workdir={tmp_path / 'w'}", *args)
  assert r.returncode == 2, (r.returncode, r.stderr[-1500:])
  err = [l for l in r.stderr.splitlines() if l.startswith("error: ")]
  assert len(err) == 1 and needle in err[0], r.stderr[-1500:]
  assert "Traceback" not in r.stderr and not (tmp_path / "w").exists()  # nothing loaded, nothing written


def test_unknown_rl_preset(tmp_path):
  r = _main("--config=configs/shapes_rl.py:focussed", f"--workdir={tmp_path / 'w'}")
  assert r.returncode == 2 and "'focussed'" in r.stderr and "focused" in r.stderr and "Traceback" not in r.stderr
