"""One writer per workdir (``workdir_lock.py``) and clean stops (``interrupt.py``).

Fast: the lock's rules (taken, refused while its holder lives, a dead holder's lock taken over, another host's
refused with the command that clears it, released only by its owner). Slow: the RL smoke job stopped by SIGTERM
and by SIGINT during its second iteration saves it (no periodic checkpoint was due), prints one line, exits
143 / 130 without a traceback, and the rerun of the same command ends with the export of an uninterrupted run; a
second run on the workdir while the first lives is refused in one sentence (exit 2).
"""
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from margrpo_jax import workdir_lock

REPO = pathlib.Path(__file__).resolve().parents[1]


def _dead_pid() -> int:
  p = subprocess.Popen([sys.executable, "-c", "pass"])
  p.wait()
  return p.pid


def test_the_lock_is_taken_refused_taken_over_and_released(tmp_path):
  w = str(tmp_path / "w")
  path = workdir_lock.acquire(w)
  assert json.load(open(path)) == dict(host=socket.gethostname(), pid=os.getpid())
  json.dump(dict(host=socket.gethostname(), pid=os.getppid()), open(path, "w"))  # a live holder
  with pytest.raises(workdir_lock.WorkdirInUse, match=f"in use by process {os.getppid()}"):
    workdir_lock.acquire(w)
  workdir_lock.release(path)  # not ours: kept
  assert os.path.exists(path)
  json.dump(dict(host=socket.gethostname(), pid=_dead_pid()), open(path, "w"))  # a dead holder
  assert workdir_lock.acquire(w) == path and json.load(open(path))["pid"] == os.getpid()
  json.dump(dict(host="elsewhere", pid=1), open(path, "w"))
  with pytest.raises(workdir_lock.WorkdirInUse, match=f"rm {path}"):
    workdir_lock.acquire(w)
  open(path, "w").write("{not json")  # unreadable: treated as another host's (never silently taken)
  with pytest.raises(workdir_lock.WorkdirInUse):
    workdir_lock.acquire(w)
  os.remove(path)
  workdir_lock.release(workdir_lock.acquire(w))
  assert not os.path.exists(path)


RL = ["--config=configs/shapes_rl.py:smoke", "--config.save.every=10"]  # 3 iterations, a checkpoint at the end


def _start(workdir, log, *extra):
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO))
  return subprocess.Popen([sys.executable, "-m", "margrpo_jax.main", *RL, *extra, f"--workdir={workdir}"],
                          cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)


def _wait_for(p, log: pathlib.Path, text: str):
  deadline = time.monotonic() + 900
  while text not in log.read_text():
    assert p.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
    time.sleep(0.05)


def _export(workdir):
  from margrpo_jax import checkpoint
  import jax
  return [np.asarray(x) for x in jax.tree.leaves(checkpoint.load_model(str(workdir / "export"))[2])]


@pytest.mark.slow
def test_a_second_run_on_a_workdir_in_use_is_refused_in_one_sentence(tmp_path):
  w, name = tmp_path / "w", tmp_path / "first.log"
  with open(name, "w") as log:
    p = _start(w, log, "--config.num_iters=1000")
    _wait_for(p, name, "iter 1/1000")
    second = subprocess.run([sys.executable, "-m", "margrpo_jax.main", *RL, "--config.num_iters=1000",
                             f"--workdir={w}"], cwd=REPO, env=dict(os.environ, JAX_PLATFORMS="cpu"),
                            capture_output=True, text=True, timeout=300)
    errors = [line for line in second.stderr.splitlines() if line.startswith("error:")]
    assert second.returncode == 2 and len(errors) == 1 and "is in use by process" in errors[0], second.stderr
    assert "Traceback" not in second.stderr
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=600) == 143
  assert "Traceback" not in name.read_text() and not (w / ".lock").exists()


@pytest.mark.slow
def test_sigterm_and_sigint_save_exit_cleanly_and_the_rerun_resumes_to_the_same_result(tmp_path):
  ref = tmp_path / "ref"
  with open(tmp_path / "ref.log", "w") as log:
    assert _start(ref, log).wait(timeout=900) == 0
  for sig, code in ((signal.SIGTERM, 143), (signal.SIGINT, 130)):
    w, name = tmp_path / sig.name, tmp_path / f"{sig.name}.log"
    with open(name, "w") as log:
      p = _start(w, log)
      _wait_for(p, name, "iter 1/3")
      p.send_signal(sig)  # during iteration 2: it finishes, is saved, and the job stops
      assert p.wait(timeout=600) == code, name.read_text()[-3000:]
    out = name.read_text()
    assert "Traceback" not in out and f"stopped by {sig.name}: the RL state after iteration" in out, out[-3000:]
    saved = sorted(int(s) for s in os.listdir(w / "checkpoints") if s.isdigit())
    assert saved and saved[-1] < 3 and not (w / "export").exists() and not (w / ".lock").exists()
    with open(tmp_path / f"{sig.name}.rerun.log", "w") as log:
      assert _start(w, log).wait(timeout=900) == 0
    rerun = (tmp_path / f"{sig.name}.rerun.log").read_text()
    assert f"RL iterations {saved[-1] + 1}..3 of 3" in rerun, rerun[-3000:]
    for a, b in zip(_export(ref), _export(w)):
      np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_the_tokenizer_job_stops_cleanly_on_sigterm_and_the_rerun_resumes(tmp_path):
  """The tokenizer loop polls too: SIGTERM mid-run saves at the next logged step, exits 143 without a traceback,
  and the same command resumes from that step."""
  w, name = tmp_path / "tok", tmp_path / "tok.log"
  cmd = [sys.executable, "-m", "margrpo_jax.main", "--config=configs/shapes_tokenizer.py:smoke",
         "--config.num_steps=400", "--config.eval.every=0", "--config.save.every=1000", f"--workdir={w}"]
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO))
  with open(name, "w") as log:
    p = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    _wait_for(p, name, "step 2/400")
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=600) == 143, name.read_text()[-3000:]
  out = name.read_text()
  assert "Traceback" not in out and "stopped by SIGTERM: the tokenizer state at step" in out, out[-3000:]
  saved = sorted(int(s) for s in os.listdir(w / "checkpoints") if s.isdigit())
  assert saved and saved[-1] < 400 and not (w / "export").exists()
  rerun = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
  assert rerun.returncode == 0 and f"at step {saved[-1]}" in rerun.stderr + rerun.stdout, rerun.stderr[-3000:]
  assert (w / "export").exists()
