r"""The RL run's prompts: where the train and eval prompts come from, for any generator family.

Records are ``{"prompt", "category", "metadata", "shapes"}`` (``shapes``: the shapes-world metadata when the
prompt carries it, else None; the eval job's records). Sources, by ``config.rl.prompt_file``:

* ``''`` and a class-conditional family (MAR): the class labels ``0 .. num_classes - 1``, all of them for
  training; eval takes ``eval.num_prompts`` of them evenly spread.
* ``''`` otherwise: the shapes world (the TFDS ``shapes_world`` train split; eval: ``eval.num_prompts`` of the
  eval split, tasks in turn).
* a file (``data/prompt_files.py``: JSONL with a ``"prompt"`` per line, e.g. MAR-GRPO's T2I-R1 training prompts
  or GenEval's metadata; or text, one prompt per line; class labels such as ``207`` for MAR): its prompts for
  training; eval: the first ``eval.num_prompts`` prompts of ``eval.prompt_file``, or of the same file.
"""
from __future__ import annotations

import os

import numpy as np

from margrpo_jax.data import prompt_files, shapes, tfds_builders


def _record(prompt: str, category: str = "-", metadata: dict | None = None) -> dict:
  md = metadata if metadata is not None else {"prompt": prompt}
  return dict(prompt=prompt, category=category or "-", metadata=md, shapes=shapes.verifiable(md))


def from_metadata(mds: list[dict]) -> list[dict]:
  """Records of shapes-world metadata dicts (each has ``prompt`` and ``tag``)."""
  return [_record(m["prompt"], m["tag"], m) for m in mds]


def read_file(path: str) -> list[dict]:
  """The records of a prompt file (raises ``prompt_files.PromptFileError`` naming the file and line)."""
  return [_record(r["prompt"], r.get("tag") or "-", r.get("metadata")) for r in
          prompt_files.read_prompt_file(os.path.expanduser(path))]


def class_labels(num_classes: int) -> list[dict]:
  return [_record(str(i), "class") for i in range(num_classes)]


def source(config, model_cfg) -> str:
  """What the prompts are, in a few words (for logs and the report)."""
  if config.rl.prompt_file:
    return config.rl.prompt_file
  return "class labels" if model_cfg.get("num_classes") and model_cfg.family == "mar" else "shapes world"


def load(config, model_cfg, data_dir: str) -> tuple[list[dict], list[dict]]:
  """``(train, eval)`` records of the run (module docstring)."""
  n_eval = config.eval.num_prompts
  file = config.rl.prompt_file
  if file:
    train = read_file(file)
    eval_recs = read_file(config.eval.prompt_file) if config.eval.get("prompt_file") else train
    return train, eval_recs[:n_eval]
  if source(config, model_cfg) == "class labels":
    train = class_labels(model_cfg.num_classes)
    idx = np.linspace(0, len(train) - 1, min(n_eval, len(train))).round().astype(int)
    return train, [train[i] for i in idx]
  mds = lambda split: [r["metadata"] for r in tfds_builders.load_split("shapes_world", split, data_dir)]
  return from_metadata(mds("train")), from_metadata(shapes.stratified_subset(mds("eval"), n_eval))


def all_shapes(recs: list[dict]) -> bool:
  """Whether every record carries shapes-world metadata (the verifier rewards and strict pass apply)."""
  return bool(recs) and all(r["shapes"] is not None for r in recs)
