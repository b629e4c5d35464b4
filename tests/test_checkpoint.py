"""Checkpoints never hold what is broken, a damaged newest one falls back to the newest intact one, files are
written atomically, and a resumed run is the same run."""
import json
import os

import jax
import jax.numpy as jnp
import pytest

from margrpo_jax import checkpoint, config_files, fileio, validate


def _state(v: float):
  return dict(step=jnp.int32(int(v)), params=dict(w=jnp.full((4, 3), v), b=jnp.arange(3.0) + v))


def _saved(tmp_path, steps=(1, 2, 3)):
  mngr = checkpoint.manager(str(tmp_path / "ckpt"), keep=5, async_save=False)
  for s in steps:
    checkpoint.save_state(mngr, s, _state(s))
  return mngr


def _largest_file(folder):
  files = [os.path.join(d, f) for d, _, fs in os.walk(folder) for f in fs]
  return max(files, key=os.path.getsize)


@pytest.mark.parametrize("damage", ["truncate", "no_metadata", "garbage"])
def test_a_damaged_newest_checkpoint_is_set_aside_and_the_newest_intact_one_restored(tmp_path, damage, caplog):
  mngr = _saved(tmp_path)
  step3 = tmp_path / "ckpt" / "3"
  if damage == "truncate":
    path = _largest_file(step3)
    with open(path, "r+b") as f:
      f.truncate(os.path.getsize(path) // 3)
  elif damage == "no_metadata":
    for d, _, fs in os.walk(step3):
      for f in fs:
        if "METADATA" in f.upper() or f.endswith("_sharding"):
          os.remove(os.path.join(d, f))
  else:
    for d, _, fs in os.walk(step3):
      for f in fs:
        open(os.path.join(d, f), "wb").write(os.urandom(64))
  step, state = checkpoint.restore_latest(checkpoint.manager(str(tmp_path / "ckpt"), keep=5), _state(0))
  assert float(state["params"]["w"][0, 0]) == step and float(state["params"]["b"][2]) == step + 2
  if damage == "no_metadata" and step == 3:
    return  # the arrays were intact: Orbax reads them without the metadata files
  assert step == 2 and (tmp_path / "ckpt" / "3.unreadable").is_dir() and not step3.exists()
  del mngr


def test_non_finite_state_and_params_are_never_written(tmp_path, small_model):
  mngr = _saved(tmp_path, steps=(1,))
  bad = _state(2.0)
  bad["params"]["w"] = bad["params"]["w"].at[1, 2].set(jnp.nan)
  with pytest.raises(checkpoint.NonFiniteError, match=r"step 2 .*NaN or Inf.*step 1"):
    checkpoint.save_state(mngr, 2, bad)
  assert mngr.latest_step() == 1 and sorted(mngr.all_steps()) == [1]
  cfg, _, params = small_model
  leaves, treedef = jax.tree.flatten(params)
  params = jax.tree.unflatten(treedef, [jnp.full_like(leaves[0], jnp.inf)] + leaves[1:])
  with pytest.raises(checkpoint.NonFiniteError, match="nothing was written"):
    checkpoint.save_model(str(tmp_path / "export"), params, cfg)
  assert not (tmp_path / "export").exists()


def test_atomic_writes_leave_the_old_file_when_a_write_fails(tmp_path):
  path = str(tmp_path / "report.json")
  fileio.write_json(path, {"a": 1})

  class Boom:
    def __iter__(self):
      raise RuntimeError("killed mid-write")
  with pytest.raises(TypeError):
    fileio.write_json(path, {"a": Boom()})
  assert json.loads(open(path).read()) == {"a": 1}
  assert os.listdir(tmp_path) == ["report.json"]  # no temp file left behind


def test_damaged_derived_files_are_recovered_with_a_warning(tmp_path):
  rows = tmp_path / "metrics.jsonl"
  rows.write_text('{"iter": 0, "loss": 1.0}\n{"iter": 1, "loss": 0.5}\n{"iter": 2, "lo')
  assert fileio.read_jsonl(str(rows)) == [{"iter": 0, "loss": 1.0}, {"iter": 1, "loss": 0.5}]
  (tmp_path / "base_eval.json").write_text('{"strict_pass": 0.5, "per')
  assert fileio.read_json(str(tmp_path / "base_eval.json")) is None


def test_resume_means_the_same_run(tmp_path):
  wd = str(tmp_path / "w")
  config = config_files.load("shapes_rl", "smoke")
  validate.begin_run(config, wd)
  recorded = (tmp_path / "w" / "config.json").read_text()
  os.makedirs(os.path.join(wd, "checkpoints"))
  validate.begin_run(config, wd)  # the same config: fine
  config.num_iters += 10
  with pytest.raises(config_files.ConfigError, match=r"num_iters \(\d+ -> \d+\).*--allow_changes"):
    validate.begin_run(config, wd)
  assert (tmp_path / "w" / "config.json").read_text() == recorded
  validate.begin_run(config, wd, allow_changes=True)  # extending a run is a safe change
  assert json.loads((tmp_path / "w" / "config.json").read_text())["num_iters"] == config.num_iters
  old = json.loads((tmp_path / "w" / "config.json").read_text())  # recorded before rl.microbatch and rl.lora
  del old["rl"]["microbatch"], old["rl"]["lora"]
  (tmp_path / "w" / "config.json").write_text(json.dumps(old))
  validate.begin_run(config, wd)  # the keys keep the values that compute what that run did
  config.rl.microbatch = 2
  with pytest.raises(config_files.ConfigError, match=r"rl.microbatch \('<absent>' -> 2\)"):
    validate.begin_run(config, wd)
  config.rl.microbatch = 0
  config.rl.lora.rank = 4
  with pytest.raises(config_files.ConfigError, match=r"rl.lora.rank \('<absent>' -> 4\)"):
    validate.begin_run(config, wd)
  config.rl.lora.rank = 0
  old["rl"]["debug_nan_iter"] = -1  # a key since removed, at the value that computes what the code does today
  (tmp_path / "w" / "config.json").write_text(json.dumps(old))
  validate.begin_run(config, wd)
  old["rl"]["debug_nan_iter"] = 3
  (tmp_path / "w" / "config.json").write_text(json.dumps(old))
  with pytest.raises(config_files.ConfigError, match=r"rl.debug_nan_iter \(3 -> '<absent>'\)"):
    validate.begin_run(config, wd)
  old["rl"]["debug_nan_iter"] = -1
  old["rl"].update(old["rl"].pop("official"))  # recorded before the official switches moved into rl.official
  (tmp_path / "w" / "config.json").write_text(json.dumps(old))
  validate.begin_run(config, wd)
  config.rl.official.sequential_updates = True
  with pytest.raises(config_files.ConfigError, match=r"rl.official.sequential_updates \(False -> True\)"):
    validate.begin_run(config, wd)
  config.rl.official.sequential_updates = False
  config.optim.lr *= 2
  config.rl.group_size = 4
  with pytest.raises(config_files.ConfigError, match=r"optim.lr .*rl.group_size \(\d+ -> 4\)"):
    validate.begin_run(config, wd, allow_changes=True)  # what the run computes may not change


def test_a_pretraining_run_recorded_under_the_old_key_names_resumes(tmp_path):
  """``checkpoint.every / keep`` and ``data.tfds_dir`` (recorded before they took the RL job's names ``save.*`` and
  ``tfds_dir``) are read under their new names: the same run resumes, a changed value is still refused."""
  config = config_files.load("shapes_pretrain", "smoke")
  wd = str(tmp_path / "w")
  os.makedirs(os.path.join(wd, "checkpoints", "2"))
  old = json.loads(config.to_json())
  old["checkpoint"], old["data"] = old.pop("save"), dict(tfds_dir=old.pop("tfds_dir"))
  (tmp_path / "w" / "config.json").write_text(json.dumps(old))
  validate.begin_run(config, wd)
  config.save.keep += 1
  with pytest.raises(config_files.ConfigError, match=r"save.keep \(3 -> 4\)"):
    validate.begin_run(config, wd)


def test_an_export_whose_params_do_not_fit_its_model_json_is_one_sentence(tmp_path, small_model):
  cfg, _, params = small_model
  out = checkpoint.save_model(str(tmp_path / "export"), params, cfg)
  meta = json.loads(open(os.path.join(out, "model.json")).read())
  meta["head"]["width"] *= 2
  fileio.write_json(os.path.join(out, "model.json"), meta)
  with pytest.raises(checkpoint.CheckpointError, match=r"model.json does not build \(.* has shape .*, not"):
    checkpoint.load_model(out)
  meta["head"]["width"] //= 2
  meta["backbone"]["encoder_depth"] += 1
  fileio.write_json(os.path.join(out, "model.json"), meta)
  with pytest.raises(checkpoint.CheckpointError, match="missing .*key"):
    checkpoint.check_export(out)


def test_a_save_that_cannot_fit_on_the_disk_is_refused_before_writing(tmp_path, monkeypatch):
  import shutil
  mngr = _saved(tmp_path, steps=(1,))
  usage = shutil.disk_usage(str(tmp_path))
  monkeypatch.setattr(shutil, "disk_usage", lambda p: usage._replace(free=40))  # 40 bytes left
  with pytest.raises(checkpoint.StorageError, match=r"less than the .* MiB the checkpoint of step 2 needs"):
    checkpoint.save_state(mngr, 2, _state(2.0))
  assert sorted(mngr.all_steps()) == [1] and sorted(os.listdir(tmp_path / "ckpt")) == ["1"]


def test_another_models_checkpoints_are_refused_and_left_alone(tmp_path):
  _saved(tmp_path)
  other = dict(step=jnp.int32(0), params=dict(w=jnp.zeros((5, 3)), b=jnp.zeros(3)))
  with pytest.raises(checkpoint.CheckpointError, match=r"step 3 .*params/w has shape \(4, 3\), not \(5, 3\)"):
    checkpoint.restore_latest(checkpoint.manager(str(tmp_path / "ckpt"), keep=5), other)
  assert sorted(os.listdir(tmp_path / "ckpt")) == ["1", "2", "3"]


def test_when_no_checkpoint_can_be_read_all_are_left_as_they_are(tmp_path):
  _saved(tmp_path, steps=(1, 2))
  for step in ("1", "2"):
    path = _largest_file(tmp_path / "ckpt" / step)
    with open(path, "r+b") as f:
      f.truncate(8)
  with pytest.raises(checkpoint.CheckpointError, match="no checkpoint .* can be read .*step 2"):
    checkpoint.restore_latest(checkpoint.manager(str(tmp_path / "ckpt"), keep=5), _state(0))
  assert sorted(os.listdir(tmp_path / "ckpt")) == ["1", "2"]
