"""Fine-tuned weights go back out in the official layouts: official-layout random weights -> convert -> export ->
export_official give the same keys, shapes and values bit for bit (fp32), and a changed policy reads back in
as exactly that change. (Harmon's and NOVA's round trips are in test_harmon.py / test_nova.py, beside their
official-layout fixtures.)"""
import argparse

import jax
import numpy as np
import pytest

from margrpo_jax import checkpoint
from margrpo_jax.convert import core, official
from margrpo_jax.convert.__main__ import run as convert_run
from margrpo_jax.models import class_mar

torch = pytest.importorskip("torch")
from test_convert_mar import TINY, tiny_mar_sd  # noqa: E402


def _load(path):
  with torch.serialization.safe_globals([argparse.Namespace]):
    return torch.load(path, map_location="cpu", weights_only=True)


def round_trip_checks(template_sd: dict, written: dict, export_dir: str, convert_again, tmp_path, policy: str):
  """``written`` (the exported state dict) equals the template bit for bit; after adding noise to ``policy``
  in the export, writing back and converting again gives exactly the changed parameters."""
  assert set(written) == set(template_sd)
  for k, v in template_sd.items():
    assert tuple(written[k].shape) == v.shape and np.array_equal(np.asarray(written[k]), v), k
  cfg, _, params = checkpoint.load_model(export_dir)
  rng = np.random.default_rng(0)
  tuned = dict(params, **{policy: jax.tree.map(lambda x: np.asarray(x) + rng.normal(size=x.shape).astype(np.float32)
                                               * 0.01, params[policy])})
  tuned_dir = checkpoint.save_model(str(tmp_path / "tuned"), tuned, cfg)
  again = convert_again(tuned_dir)
  same = jax.tree.map(lambda a, b: np.array_equal(np.asarray(a), np.asarray(b)), again, tuned)
  assert all(jax.tree.leaves(same))


def test_mar_round_trip_is_bit_exact_and_keeps_the_checkpoint_layout(tmp_path, monkeypatch):
  monkeypatch.setitem(class_mar.SIZES, "tiny", TINY)
  sd = tiny_mar_sd()
  weights = {k: torch.from_numpy(v) for k, v in sd.items()}
  template = tmp_path / "checkpoint-last.pth"
  torch.save({"model": weights, "model_ema": weights, "epoch": 399, "args": argparse.Namespace(model="mar_tiny"),
              "optimizer": {"state": {}, "param_groups": []}}, template)
  convert_run("mar", str(template), str(tmp_path / "export"))
  assert checkpoint.official_source(str(tmp_path / "export")) == str(template)  # recorded: no --template needed
  report = official.export("mar", str(tmp_path / "export"), None, str(tmp_path / "out.pth"))
  out = _load(tmp_path / "out.pth")
  assert set(out) == {"model", "model_ema", "epoch", "args"} and out["epoch"] == 399 and report["changed"] == 0
  assert {k: v.dtype for k, v in out["model_ema"].items()} == {k: torch.float32 for k in sd}

  def convert_again(tuned_dir):
    official.export("mar", tuned_dir, str(template), str(tmp_path / "tuned.pth"))
    convert_run("mar", str(tmp_path / "tuned.pth"), str(tmp_path / "again"))
    assert all(torch.equal(a, b) for a, b in zip(_load(tmp_path / "tuned.pth")["model"].values(),
                                                  _load(tmp_path / "tuned.pth")["model_ema"].values()))
    return checkpoint.load_model(str(tmp_path / "again"))[2]
  round_trip_checks(sd, {k: v.numpy() for k, v in out["model_ema"].items()}, str(tmp_path / "export"),
                    convert_again, tmp_path, "backbone")


def test_a_converter_that_computes_a_value_cannot_be_traced():
  conv = core.Converter({"w": np.arange(6, dtype=np.int64).reshape(2, 3)},
                        {"p": jax.ShapeDtypeStruct((3, 2), np.float32)})
  with core.tracing(), pytest.raises(core.ConversionError, match="computed from w"):
    conv.copy("p", "w", lambda w: w.T * 0.5)
  with core.tracing():
    conv.copy("p", "w", lambda w: w.T)
  assert conv.result()["p"].dtype == np.int64


def test_an_export_without_a_recorded_source_needs_a_template(tmp_path, small_model):
  cfg, _, params = small_model
  src = checkpoint.save_model(str(tmp_path / "export"), params, cfg, source=str(tmp_path / "moved.pth"))
  with pytest.raises(core.ConversionError, match=r"moved.pth, the official checkpoint .*source.json names, is gone"):
    official.template_of(src, None)
  assert official.template_of(src, "elsewhere.pth") == "elsewhere.pth"
  bare = checkpoint.save_model(str(tmp_path / "bare"), params, cfg)
  with pytest.raises(core.ConversionError, match="records no official checkpoint it descends from .* --template="):
    official.template_of(bare, None)


def test_the_cli_refuses_a_foreign_export_in_one_sentence(tmp_path):
  import subprocess
  import sys
  from conftest import REPO
  r = subprocess.run([sys.executable, "-m", "margrpo_jax.export_official", "--family=mar",
                      f"--src={REPO / 'margrpo_jax' / 'assets' / 'shapes_base'}", f"--template={tmp_path / 'x.pth'}",
                      f"--out={tmp_path / 'o.pth'}"], capture_output=True, text=True, cwd=REPO, timeout=300)
  assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith("error: ") and "family 'tiny'" in r.stderr
  assert "Traceback" not in r.stderr
