"""Runs many command lines of the project's entry points in one interpreter: the imports are paid once, then
each command runs in a forked child (its own flags, devices and exit code), as a fresh ``python -m`` would.

    python tests/cli_runner.py CASES.json RESULTS.json

CASES.json: ``[{"module": "margrpo_jax.main" | "margrpo_jax.convert", "argv": [...], "cwd": DIR, "env": {...}}]``
("env" optional: variables set in that child only);
RESULTS.json: ``[{"returncode": int, "output": stdout + stderr}]`` in the same order.
"""
import json
import os
import sys
import traceback


def run_case(case: dict) -> dict:
  read, write = os.pipe()
  pid = os.fork()
  if pid == 0:  # child: the entry point as `python -m module argv...`
    os.close(read)
    os.dup2(write, 1)
    os.dup2(write, 2)
    code = 1
    try:
      os.chdir(case["cwd"])
      os.environ.update(case.get("env", {}))
      from absl import app
      sys.argv = [case["module"]] + case["argv"]
      if case["module"] == "margrpo_jax.main":
        from margrpo_jax import main
        main.run()
      else:
        from margrpo_jax.convert import __main__ as convert_main
        app.run(convert_main.main)
      code = 0
    except SystemExit as e:
      code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 - reported like the interpreter would
      traceback.print_exc()
    finally:
      sys.stdout.flush()
      sys.stderr.flush()
      os._exit(code)
  os.close(write)
  chunks = []
  with os.fdopen(read, "rb") as f:
    while chunk := f.read(65536):
      chunks.append(chunk)
  _, status = os.waitpid(pid, 0)
  return dict(returncode=os.waitstatus_to_exitcode(status), output=b"".join(chunks).decode(errors="replace"))


if __name__ == "__main__":
  sys.path.insert(0, os.getcwd())
  import jax  # noqa: F401 - imported once, before any child initializes a backend
  from margrpo_jax import main as _main  # noqa: F401 - defines the entry point's flags
  from margrpo_jax.convert import __main__ as _convert  # noqa: F401
  from margrpo_jax.jobs import rl as _rl  # noqa: F401 - the heavy imports every job shares
  with open(sys.argv[1]) as f:
    cases = json.load(f)
  with open(sys.argv[2], "w") as f:
    json.dump([run_case(c) for c in cases], f)
