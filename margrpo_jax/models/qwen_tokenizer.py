"""The Qwen2.5 tokenizer (a Hugging Face ``tokenizer.json``: byte-level BPE plus the ``<|im_start|>`` /
``<|im_end|>`` special tokens) and Harmon's chat prompt (docs/models.md section 2.3).

A caption ``c`` becomes ``<|im_start|>user\\nGenerate an image: c<|im_end|>\\n<|im_start|>assistant\\n`` and the
CFG null prompt the same wrapping of ``Generate an image.``; both are tokenised as they are (the Qwen2 tokenizer
adds no BOS/EOS). Rows are right-padded with ``PAD = -1``, so that the ids alone carry the attention mask
(``ids >= 0``); Harmon pads with the EOS id plus a 0/1 mask, which is the same computation.

How to use::

    tok = qwen_tokenizer.load("/path/to/Qwen2.5-0.5B-Instruct")      # the folder or its tokenizer.json
    ids = qwen_tokenizer.encode(tok, qwen_tokenizer.harmon_prompts(["a red apple"]), max_len=128)

The ``tokenizers`` package (pinned in requirements.txt) does the BPE; nothing is downloaded.
"""
from __future__ import annotations

import functools
import os

import numpy as np

PAD = -1
TEMPLATE = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
CAPTION = "Generate an image: {}"
NULL_PROMPT = "Generate an image."


class TokenizerError(FileNotFoundError):
  """A tokenizer path that is not set or not readable, or a prompt that does not fit, in one sentence."""


def chat(text: str) -> str:
  return TEMPLATE.format(text)


def harmon_prompts(captions: list[str]) -> list[str]:
  """Harmon's conditional prompts (already wrapped in the chat template)."""
  return [chat(CAPTION.format(c)) for c in captions]


def null_prompt() -> str:
  return chat(NULL_PROMPT)


def resolve(path: str | None) -> str:
  """The ``tokenizer.json`` that ``path`` (the file or a folder holding it) names; one-sentence errors."""
  if not path:
    raise TokenizerError("model.tokenizer_path is not set: pass --config.model.tokenizer_path=DIR, the folder of "
                         "the Qwen2.5 tokenizer.json (e.g. a local copy of Qwen2.5-0.5B-Instruct).")
  full = os.path.abspath(os.path.expanduser(path))
  if os.path.isdir(full):
    full = os.path.join(full, "tokenizer.json")
  if not os.path.isfile(full):
    raise TokenizerError(f"model.tokenizer_path={path!r}: no tokenizer file {full} (expected a Hugging Face "
                         "tokenizer.json or a folder that holds one).")
  return full


@functools.lru_cache(maxsize=8)
def _load(full: str):
  from tokenizers import Tokenizer
  try:
    return Tokenizer.from_file(full)
  except Exception as e:  # noqa: BLE001 - a corrupt file: one sentence, not a Rust trace
    raise TokenizerError(f"tokenizer file {full} could not be read ({str(e).splitlines()[0] if str(e) else e}).")


def load(path: str | None):
  """The ``tokenizers.Tokenizer`` at ``path`` (loaded once per file)."""
  return _load(resolve(path))


def encode(tok, texts: list[str], max_len: int) -> np.ndarray:
  """Token ids (N, max_len) int32, right-padded with :data:`PAD`; a text longer than ``max_len`` tokens is an
  error (truncation would cut the assistant turn)."""
  out = np.full((len(texts), max_len), PAD, np.int32)
  for i, enc in enumerate(tok.encode_batch(list(texts), add_special_tokens=True)):
    if len(enc.ids) > max_len:
      raise TokenizerError(f"prompt {texts[i]!r} is {len(enc.ids)} tokens long, more than model.text.max_len="
                           f"{max_len}; raise model.text.max_len or shorten the prompt.")
    out[i, :len(enc.ids)] = enc.ids
  return out
