"""A broken source checkpoint or a bad command line ends the converter in one sentence and exit code 2, with
nothing written (the aesthetic head: the smallest family, so every case is cheap)."""
import subprocess
import sys

import pytest
import torch

from margrpo_jax.convert import core
from margrpo_jax.convert.__main__ import run as convert_run


def _v1(**over):
  sd = {"weight": torch.randn(1, 768), "bias": torch.randn(1)}
  sd.update(over)
  return sd


def _nan():
  w = torch.randn(1, 768)
  w[0, 5] = float("nan")
  return w


CASES = {  # name -> (what torch.save writes, or None for an empty file; the sentence expected)
    "empty file": (None, "not a readable PyTorch checkpoint"),
    "empty dict": ({}, "holds no tensors"),
    "a list": ([1, 2], "holds a list, not a state dict"),
    "wrong rank": (_v1(weight=torch.randn(768)), "not a checkpoint of --family=aesthetic"),
    "extra axis": (_v1(weight=torch.randn(1, 768, 2)), "key 'weight' has shape"),
    "NaN weight": (_v1(weight=_nan()), "key 'weight' holds 1 NaN or Inf"),
    "int8 weight": (_v1(weight=torch.ones(1, 768, dtype=torch.int8)), "holds int8 values"),
    "bool weight": (_v1(weight=torch.ones(1, 768, dtype=torch.bool)), "holds bool values"),
    "complex weight": (_v1(weight=torch.randn(1, 768, dtype=torch.complex64)), "holds complex64 values"),
    "missing bias": ({"weight": torch.randn(1, 768)}, "has no key 'bias'"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_a_broken_checkpoint_is_one_sentence_and_nothing_is_written(tmp_path, name):
  obj, sentence = CASES[name]
  src = tmp_path / "w.pth"
  if obj is None:
    src.write_bytes(b"")
  else:
    torch.save(obj, src)
  with pytest.raises(core.ConversionError, match=sentence):
    convert_run("aesthetic", str(src), str(tmp_path / "out"))
  assert not (tmp_path / "out").exists()


def test_half_precision_weights_convert(tmp_path):
  torch.save(_v1(weight=torch.randn(1, 768, dtype=torch.bfloat16)), tmp_path / "w.pth")
  report = convert_run("aesthetic", str(tmp_path / "w.pth"), str(tmp_path / "out"))
  assert report["used"] == 2 and (tmp_path / "out" / "model.json").exists()


def test_the_cli_refuses_an_existing_out_and_stray_arguments(tmp_path):
  torch.save(_v1(), tmp_path / "w.pth")
  (tmp_path / "taken").mkdir()
  (tmp_path / "taken" / "keep").write_text("x")
  cases = [(["--out=" + str(tmp_path / "taken")], "already exists"),
           (["--out=" + str(tmp_path / "new"), "stray"], "unexpected arguments: stray"),
           (["--out=" + str(tmp_path / "new"), "--dtype=int8"], "--dtype=int8"),
           (["--out="], "--out is required")]
  for extra, sentence in cases:
    r = subprocess.run([sys.executable, "-m", "margrpo_jax.convert", "--family=aesthetic",
                        f"--src={tmp_path / 'w.pth'}", *extra], capture_output=True, text=True, timeout=300)
    last = r.stderr.strip().splitlines()[-1]
    assert r.returncode == 2 and last.startswith("error: ") and sentence in last, (extra, r.stderr[-500:])
    assert "Traceback" not in r.stderr
  assert (tmp_path / "taken" / "keep").read_text() == "x" and not (tmp_path / "new").exists()
