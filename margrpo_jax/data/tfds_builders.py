"""TFDS builders for the shapes world and for user-supplied prompt files.

Datasets (every example: ``prompt`` Text, ``tag`` Text, ``metadata`` Text holding
``json.dumps(metadata, sort_keys=True)``, ``index`` int32 = position in the source file/list;
examples are stored unshuffled, in source order):

* ``shapes_world`` (1.1.0): splits ``train``, ``val`` and ``eval`` from ``shapes.split_records``. No downloads.
* ``prompt_files/<config>`` (1.0.0), read from the manual dir
  (``download_config.manual_dir``, default ``<data_dir>/downloads/manual``):

  ==============  =================================================  ==========================
  config          files expected in the manual dir                   splits
  ==============  =================================================  ==========================
  geneval         ``evaluation_metadata.jsonl``                      ``test``
  t2i_compbench   T2I-CompBench ``*.txt`` (e.g. ``color_val.txt``)    one per file stem, e.g.
                                                                     ``color_val``; tag = stem
  margrpo         ``train_prompts.jsonl`` or                         ``train``
                  ``geneval_and_t2i_data_final.json`` (JSON Lines)
  jsonl           any ``*.jsonl`` / ``*.json`` (JSON Lines)           one per file stem
  txt             any ``*.txt``                                       one per file stem
  ==============  =================================================  ==========================

  Split names are file stems with characters outside ``[A-Za-z0-9_]`` replaced by ``_``.
  A prepared dataset is not rebuilt when the manual files change: use a fresh ``data_dir`` or
  ``load_split(..., overwrite=True)``.

Only this module of the package imports TensorFlow (through TFDS, lazily).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
from pathlib import Path
from typing import Iterator

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
from absl import logging as absl_logging  # noqa: E402
from etils import epath  # noqa: E402
import tensorflow_datasets as tfds  # noqa: E402

from margrpo_jax.data import prompt_files, shapes  # noqa: E402
from margrpo_jax.parallel import hosts  # noqa: E402

__all__ = [
  "ShapesWorld",
  "PromptFiles",
  "PromptFilesConfig",
  "prepare",
  "load_split",
  "shapes_eval_records",
]


def _features() -> tfds.features.FeaturesDict:
  return tfds.features.FeaturesDict(
    {
      "prompt": tfds.features.Text(),
      "tag": tfds.features.Text(),
      "metadata": tfds.features.Text(),
      "index": tfds.features.Scalar(dtype=np.int32),
    }
  )


class _BuilderMixin:
  """Shared fixes for TFDS 4.9.10.

  * ``code_path``: TFDS imports ``importlib_resources`` (not installed on Python >= 3.9) when
    locating a builder's source file; point it straight at this module instead.
  * The "Downloading and preparing ..." banners go to absl INFO logs instead of stdout.
  """

  @tfds.core.utils.classproperty
  @classmethod
  def code_path(cls) -> epath.Path:
    return epath.Path(__file__)

  def _log_download_bytes(self) -> None:
    absl_logging.info("Preparing %s to %s.", self.name, self.data_dir)

  def _log_download_done(self) -> None:
    absl_logging.info("Prepared %s in %s.", self.name, self.data_dir)


def _example(index: int, prompt: str, tag: str, metadata: dict) -> dict:
  return {
    "prompt": prompt,
    "tag": tag,
    "metadata": json.dumps(metadata, sort_keys=True),
    "index": index,
  }


class ShapesWorld(_BuilderMixin, tfds.core.GeneratorBasedBuilder):
  """The offline shapes-world prompts (train, 512-prompt val and eval), with GenEval-style metadata."""

  VERSION = tfds.core.Version("1.1.0")
  RELEASE_NOTES = {"1.0.0": "Initial release.", "1.1.0": "A 'val' split held out from train and eval."}

  def _info(self) -> tfds.core.DatasetInfo:
    return tfds.core.DatasetInfo(
      builder=self,
      description=(
        "Shapes-world text-to-image prompts with machine-checkable metadata "
        "(see docs/shapes_world.md). 'metadata' is the JSON of the metadata dict."
      ),
      features=_features(),
      disable_shuffling=True,
    )

  def _split_generators(self, dl_manager):
    del dl_manager  # Generated offline.
    return {split: self._generate_examples(split) for split in ("train", "val", "eval")}

  def _generate_examples(self, split: str):
    for i, md in enumerate(shapes.split_records(split)):
      yield i, _example(i, md["prompt"], md["tag"], md)


@dataclasses.dataclass(eq=False)
class PromptFilesConfig(tfds.core.BuilderConfig):
  """Which manual files a ``PromptFiles`` config reads.

  Attributes:
    fmt: prompt file format ('auto', 'jsonl', 'txt').
    files: alternative file names; the first present one becomes the single split ``split``.
    split: split name used with ``files``.
    patterns: globs; every matching file becomes its own split named after its stem.
  """

  fmt: str = "auto"
  files: tuple[str, ...] = ()
  split: str = "test"
  patterns: tuple[str, ...] = ()

  def expected(self) -> str:
    if self.files:
      return " or ".join(self.files)
    return " / ".join(self.patterns) + " files"


class PromptFiles(_BuilderMixin, tfds.core.GeneratorBasedBuilder):
  """Prompt sets the user brings (GenEval, T2I-CompBench, MAR-GRPO, generic JSONL/TXT)."""

  VERSION = tfds.core.Version("1.0.0")
  RELEASE_NOTES = {"1.0.0": "Initial release."}
  BUILDER_CONFIGS = [
    PromptFilesConfig(
      name="geneval",
      fmt="jsonl",
      files=("evaluation_metadata.jsonl",),
      split="test",
      description="GenEval evaluation metadata (553 prompts), split 'test'.",
    ),
    PromptFilesConfig(
      name="t2i_compbench",
      fmt="txt",
      patterns=("*.txt",),
      description="T2I-CompBench prompt lists; one split per file stem, tag = stem.",
    ),
    PromptFilesConfig(
      name="margrpo",
      fmt="jsonl",
      files=("train_prompts.jsonl", "geneval_and_t2i_data_final.json"),
      split="train",
      description="MAR-GRPO / T2I-R1 training prompts (JSON Lines), split 'train'.",
    ),
    PromptFilesConfig(
      name="jsonl",
      fmt="jsonl",
      patterns=("*.jsonl", "*.json"),
      description="Any JSON Lines prompt files; one split per file stem.",
    ),
    PromptFilesConfig(
      name="txt",
      fmt="txt",
      patterns=("*.txt",),
      description="Any one-prompt-per-line text files; one split per file stem.",
    ),
  ]
  MANUAL_DOWNLOAD_INSTRUCTIONS = """\
Put the prompt files in the manual dir (download_config.manual_dir, default
<data_dir>/downloads/manual), depending on the config:
  geneval:       evaluation_metadata.jsonl (GenEval's prompts/evaluation_metadata.jsonl)
  t2i_compbench: the T2I-CompBench *.txt prompt lists (examples/dataset/*.txt), e.g. color_val.txt
  margrpo:       train_prompts.jsonl or geneval_and_t2i_data_final.json (T2I-R1 / MAR-GRPO data)
  jsonl:         any *.jsonl / *.json JSON Lines files with a "prompt" key per line
  txt:           any *.txt files with one prompt per line
"""

  def _info(self) -> tfds.core.DatasetInfo:
    return tfds.core.DatasetInfo(
      builder=self,
      description=(
        "User-supplied text-to-image prompts. 'metadata' is the JSON of the "
        "record's metadata (GenEval include lists, T2I-R1 nouns, shapes-world "
        "metadata, or {'prompt': ...})."
      ),
      features=_features(),
      disable_shuffling=True,
    )

  def _manual_dir(self, dl_manager) -> Path:
    cfg = self.builder_config
    try:
      return Path(dl_manager.manual_dir)
    except AssertionError:
      where = getattr(dl_manager, "_manual_dir", None)
      raise FileNotFoundError(
        f"prompt_files/{cfg.name}: the manual dir {where} does not exist or is empty; put {cfg.expected()} there."
      ) from None

  def _split_generators(self, dl_manager):
    cfg = self.builder_config
    root = self._manual_dir(dl_manager)
    if cfg.files:
      for name in cfg.files:
        if (root / name).is_file():
          return {cfg.split: self._generate_examples(root / name)}
      raise FileNotFoundError(
        f"prompt_files/{cfg.name}: expected {' or '.join(str(root / n) for n in cfg.files)}, but it is not there."
      )
    files = sorted({p for pat in cfg.patterns for p in root.glob(pat) if p.is_file()}, key=lambda p: p.name)
    if not files:
      raise FileNotFoundError(f"prompt_files/{cfg.name}: no {cfg.expected()} in the manual dir {root}.")
    splits = {}
    for f in files:
      split = _split_name(f.stem)
      if split in splits:
        raise ValueError(
          f"prompt_files/{cfg.name}: two files in {root} map to the split name {split!r}; rename one of them."
        )
      splits[split] = self._generate_examples(f)
    return splits

  def _generate_examples(self, path: Path):
    records = prompt_files.read_prompt_file(path, self.builder_config.fmt)
    for i, r in enumerate(records):
      yield i, _example(i, r["prompt"], r["tag"], r["metadata"])


def _split_name(stem: str) -> str:
  name = re.sub(r"[^A-Za-z0-9_]", "_", stem)
  return name or "_"


_CONFIG_NAMES = tuple(c.name for c in PromptFiles.BUILDER_CONFIGS)
# every name load_split / prepare accept
NAMES = ("shapes_world", *_CONFIG_NAMES, *(f"prompt_files/{c}" for c in _CONFIG_NAMES))


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
  """Silences TFDS/absl info logs and progress bars while building/reading."""
  old = absl_logging.get_verbosity()
  absl_logging.set_verbosity(absl_logging.WARNING)
  tfds.disable_progress_bar()
  try:
    yield
  finally:
    absl_logging.set_verbosity(old)


def _builder(name: str, data_dir) -> tfds.core.DatasetBuilder:
  base, _, config = name.partition("/")
  if base == "shapes_world" and not config:
    return ShapesWorld(data_dir=os.fspath(data_dir))
  if base == "prompt_files" and config in _CONFIG_NAMES:
    return PromptFiles(config=config, data_dir=os.fspath(data_dir))
  if base in _CONFIG_NAMES and not config:
    return PromptFiles(config=base, data_dir=os.fspath(data_dir))
  raise ValueError(
    f"unknown dataset {name!r}; expected 'shapes_world' or 'prompt_files/<config>' with config in {_CONFIG_NAMES}."
  )


def prepare(name: str, data_dir, manual_dir=None, overwrite: bool = False):
  """Builds (if needed) and returns the TFDS builder.

  Args:
    name: 'shapes_world' or 'prompt_files/<config>' (or just '<config>'), config in
      geneval, t2i_compbench, margrpo, jsonl, txt.
    data_dir: TFDS data dir.
    manual_dir: where the prompt files are (prompt_files only); default
      ``<data_dir>/downloads/manual``.
    overwrite: rebuild even if prepared already.
  """
  def make():
    builder = _builder(name, data_dir)  # made after the barrier on the other processes: it sees the data
    gen = tfds.download.GenerateMode
    mode = gen.FORCE_REDOWNLOAD if overwrite and hosts.is_main() else gen.REUSE_DATASET_IF_EXISTS
    config = tfds.download.DownloadConfig(manual_dir=os.fspath(manual_dir) if manual_dir is not None else None,
                                          download_mode=mode)
    with _quiet():
      builder.download_and_prepare(download_config=config)
    return builder
  return hosts.main_first(make, f"tfds:{name}")  # several processes: process 0 writes the data, the others read it


def load_split(name: str, split: str, data_dir, manual_dir=None, overwrite: bool = False) -> list[dict]:
  """Builds ``name`` if needed and returns one split as Python records, in source order.

  Returns:
    ``[{"prompt": str, "tag": str, "metadata": dict, "index": int}, ...]`` sorted by ``index``.
    ``split`` may use TFDS slicing (``'train[:100]'``).
  """
  builder = prepare(name, data_dir, manual_dir, overwrite)
  base_split = re.split(r"[\[+]", split, maxsplit=1)[0].strip()
  if base_split not in builder.info.splits:
    raise ValueError(f"{name} has no split {split!r}; available: {sorted(builder.info.splits.keys())}.")
  with _quiet():
    arrays = tfds.as_numpy(builder.as_dataset(split=split, batch_size=-1, shuffle_files=False))
  records = [
    {
      "prompt": p.decode("utf-8"),
      "tag": t.decode("utf-8"),
      "metadata": json.loads(m.decode("utf-8")),
      "index": int(i),
    }
    for p, t, m, i in zip(arrays["prompt"], arrays["tag"], arrays["metadata"], arrays["index"])
  ]
  if "+" not in split:
    records.sort(key=lambda r: r["index"])
  return records


def shapes_eval_records(data_dir) -> list[dict]:
  """The 512 shapes-world eval records (128 per task) via TFDS, in ``split_records`` order."""
  return load_split("shapes_world", "eval", data_dir)
