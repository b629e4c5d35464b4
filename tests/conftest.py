"""Shared fixtures: CPU-only JAX and a tiny model config so every compile takes seconds."""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# XLA:CPU without LLVM's optimisation passes: the suite's tiny programs are compiled far more than they run
# (test_rl_loss.py + test_estimators.py: 17.5 min against over 34 with the default passes, run side by side on 2
# busy cores; the full suite from a clean clone went from 28.7 to 20.8 min). The programs
# compute the same functions (float rounding aside, within every test's stated tolerance); the jobs, benchmarks
# and the study run with XLA's defaults. The subprocess tests pass these flags on (plus their device counts).
XLA_TEST_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
if XLA_TEST_FLAGS not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {XLA_TEST_FLAGS}".strip()
import gc  # noqa: E402

import jax  # noqa: E402  imported before the cache variable is set: this process keeps no persistent cache
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:  # one persistent compilation cache for the subprocesses this
  import atexit  # noqa: E402  session starts (CLI runs, process pairs): a program compiled by one is loaded by
  import shutil  # noqa: E402  the next that builds the same one
  import tempfile  # noqa: E402
  os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="margrpo_jax_cache_")
  atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], True)

import pathlib  # noqa: E402

try:  # the torch oracles must be loaded before TensorFlow: the other order segfaults (TF 2.21 + torch 2.14)
  import torch  # noqa: E402, F401
  import torchvision  # noqa: E402, F401
except ImportError:
  pass

import pytest  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures"
SHARED_DATA = FIXTURES / "data"  # vendored prompt sets (each with its LICENSE) and the CLIP BPE vocabulary
KEYS = FIXTURES / "keys"          # parameter-name lists of the official checkpoints (facts, one name a line)


def small_model_config():
  """The shapes-world architecture at test widths (same code path as the shipped model)."""
  from margrpo_jax.models import tiny
  c = tiny.tiny_config()
  c.text.update(width=32, depth=1, num_heads=2)
  c.backbone.update(width=32, encoder_depth=1, decoder_depth=1, num_heads=2)
  c.head.update(width=32, depth=2)
  return c


def smoke_config():
  """The pretraining config at test size (``configs/shapes_pretrain.py:smoke`` with the test model)."""
  from margrpo_jax import config_files
  c = config_files.load("shapes_pretrain", "smoke")
  c.model = small_model_config()
  return c


@pytest.fixture(scope="session")
def small_model():
  """``(model_cfg, graphdef, params)``: the small model after 40 quick pretraining steps.

  Briefly trained rather than random: MAR zero-initialises the head (eps_hat = 0), and a random head's
  eps_hat is unrelated to x_t, which blows the first posterior means up to ~1e4; a few steps make
  eps_hat track the noise, so samples, guidance and log-probs are in a realistic range.
  """
  from margrpo_jax.data import shapes
  from margrpo_jax.jobs import pretrain
  config = smoke_config()
  config.num_steps = 40
  config.optim.update(lr=3e-3, warmup_steps=1, decay="constant")
  graphdef, tx, ts = pretrain.init_state(config)
  step = pretrain.make_step_fn(graphdef, tx, config)
  recs = shapes.split_records("train", num_train=400)
  for i in range(40):
    ts, _ = step(ts, pretrain.make_batch(recs, i, 16, 0, config.model))
  return config.model, graphdef, ts["params"]


@pytest.fixture(scope="session")
def shapes_tfds(tmp_path_factory):
  """A folder with the shapes-world TFDS prepared once per session (jobs given it as ``tfds_dir`` read it only)."""
  from margrpo_jax.data import tfds_builders
  folder = tmp_path_factory.mktemp("shapes_tfds")
  tfds_builders.prepare("shapes_world", str(folder))
  return str(folder)


@pytest.fixture(scope="module", autouse=True)
def _release_compiled_programs():
  """Drop every test module's compiled programs when it ends. XLA:CPU maps each executable's code into the process;
  a whole-suite session that kept them all reached the kernel's limit of 65,530 memory maps (vm.max_map_count)
  and died inside the compiler (a segfault or abort ~35 minutes in). Session fixtures keep theirs; the rest are
  compiled again by the module that needs them."""
  yield
  jax.clear_caches()
  gc.collect()


# The files that take longest (minutes each on 2 cores), longest first. With `-n 2 --dist loadfile` the two workers
# take whole files in collection order, so these start first and the short files fill in around them (longest-
# processing-time-first), instead of a long file started last running alone at the end.
LONGEST_FIRST = ("test_parallel.py", "test_rl_loss.py", "test_multihost.py", "test_interrupt_and_lock.py",
                 "test_rl_train.py", "test_rl_families.py", "test_bad_inputs.py", "test_estimators.py")


def pytest_collection_modifyitems(config, items):
  del config
  rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
  items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the order inside a file is kept
