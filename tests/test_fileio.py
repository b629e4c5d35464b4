"""The file-system layer (``fileio.py``): the same calls on local paths and on a bucket (``tests/fake_gcs.py``),
and only process 0 writes. The jobs on a bucket: ``test_rl_train.py``."""
import os

import numpy as np
import pytest
from PIL import Image

import fake_gcs
from margrpo_jax import fileio
from margrpo_jax.parallel import hosts


@pytest.fixture(params=["local", "gs"])
def root(request, tmp_path, monkeypatch):
  if request.param == "local":
    yield str(tmp_path / "w")
  else:
    with fake_gcs.bucket(monkeypatch):
      yield "gs://fake-bucket/w"


def test_write_read_list_and_move_on_local_paths_and_urls(root, tmp_path):
  fileio.write_json(os.path.join(root, "a", "x.json"), {"k": [1, 2]})
  fileio.write_jsonl(os.path.join(root, "m.jsonl"), [{"i": 0}, {"i": 1}])
  fileio.save_npy(os.path.join(root, "z.npy"), np.arange(6, dtype=np.uint8).reshape(2, 3))
  fileio.save_image(os.path.join(root, "p.png"), Image.new("RGB", (4, 4)))
  assert fileio.read_json(os.path.join(root, "a", "x.json")) == {"k": [1, 2]}
  assert fileio.read_jsonl(os.path.join(root, "m.jsonl")) == [{"i": 0}, {"i": 1}]
  np.testing.assert_array_equal(fileio.load_npy(os.path.join(root, "z.npy")), np.arange(6).reshape(2, 3))
  assert sorted(fileio.listdir(root)) == ["a", "m.jsonl", "p.png", "z.npy"]
  assert fileio.isdir(os.path.join(root, "a")) and fileio.isfile(os.path.join(root, "p.png"))
  assert fileio.read_json(os.path.join(root, "missing.json")) is None
  fileio.rename(os.path.join(root, "p.png"), os.path.join(root, "q.png"))
  assert not fileio.exists(os.path.join(root, "p.png")) and fileio.exists(os.path.join(root, "q.png"))
  assert not os.path.exists("gs:") and not os.path.exists(tmp_path / "gs:")  # nothing local named after the URL


def test_only_process_0_writes(root, monkeypatch):
  monkeypatch.setattr(hosts, "is_main", lambda: False)
  fileio.write_json(os.path.join(root, "x.json"), {})
  fileio.makedirs(os.path.join(root, "d"))
  assert not fileio.exists(root)


def test_paths_resolve_and_unsupported_schemes_are_one_sentence():
  assert fileio.resolve("gs://b/run") == "gs://b/run" and fileio.resolve("~/x") == os.path.expanduser("~/x")
  assert fileio.resolve("rel") == os.path.abspath("rel")
  fileio.check_scheme("gs://b/run")
  fileio.check_scheme("/local/run")
  with pytest.raises(fileio.UnsupportedPath, match="--workdir s3://b/run: the s3:// scheme is not supported"):
    fileio.check_scheme("s3://b/run", "--workdir")
