"""CLIP's byte-level BPE tokenizer (OpenAI CLIP / open_clip ``SimpleTokenizer``), written for this project.

    tok = ClipTokenizer("/path/to/bpe_simple_vocab_16e6.txt.gz")
    ids = tok(["a photo of a cat"])             # int32 (B, 77): <sot> bpe... <eot> 0 0 ...

Vocabulary (49,408 ids): the 256 byte symbols, the same 256 with ``</w>`` (end of word), the first
48,894 merges of the gzip file (lines 1..48894 after the header), then ``<start_of_text>`` = 49406 and
``<end_of_text>`` = 49407. Bytes map to printable unicode symbols as in GPT-2 (printable Latin-1 bytes
map to themselves and come first, the other 68 map to chr(256 + k) in byte order).

Text pipeline (open_clip's default ``clean='lower'``): clean -> collapse whitespace -> lower-case -> split
into pieces (the special tokens, the contractions ``'s 't 're 've 'm 'll 'd``, runs of letters, single
digits / numerals, runs of other non-space characters; letters = Unicode category L*, numerals = N*) ->
UTF-8 bytes -> symbols -> greedy lowest-rank pair merging -> ids. ``__call__`` adds ``<sot>``/``<eot>``,
truncates to the context as open_clip does (keep the first 77, the last becomes ``<eot>``) and pads with 0.

Cleaning without ftfy: HTML entities unescaped twice, NFC normalisation, curly quotes -> straight quotes,
Latin ligatures (U+FB00-FB06) expanded, full-width ASCII (U+FF01-FF5E) and the ideographic space -> ASCII,
control characters other than whitespace removed. Unlike ``ftfy.fix_text`` it does not repair mojibake
(text decoded with the wrong codec, e.g. ``Ã©`` for ``é``) nor the other rare fixes of ftfy; on every prompt
of GenEval, T2I-CompBench and MAR-GRPO's training set the ids equal open_clip's (tests/test_clip_tokenizer.py).
"""
from __future__ import annotations

import functools
import gzip
import html
import os
import unicodedata

import numpy as np

CONTEXT_LENGTH = 77
NUM_MERGES = 49152 - 256 - 2
SOT, EOT = "<start_of_text>", "<end_of_text>"
_CONTRACTIONS = ("'s", "'t", "'re", "'ve", "'m", "'ll", "'d")
_QUOTES = {"\u2018": "'", "\u2019": "'", "\u201a": "'", "\u201b": "'", "\u2032": "'",
           "\u201c": '"', "\u201d": '"', "\u201e": '"', "\u201f": '"', "\u2033": '"'}
_LIGATURES = {"\ufb00": "ff", "\ufb01": "fi", "\ufb02": "fl", "\ufb03": "ffi", "\ufb04": "ffl", "\ufb05": "st",
              "\ufb06": "st"}
_FULL_WIDTH = {chr(c): chr(c - 0xFEE0) for c in range(0xFF01, 0xFF5F)}
_FIX = str.maketrans({**_QUOTES, **_LIGATURES, **_FULL_WIDTH, "\u3000": " "})


class TokenizerError(ValueError):
  """A missing or malformed vocabulary file, in one sentence naming the path."""


def bytes_to_unicode() -> dict[int, str]:
  """Byte -> printable symbol, in vocabulary order: the printable Latin-1 bytes (themselves) first, then the
  other 68 bytes as chr(256 + k) in byte order."""
  keep = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), ord("\xff") + 1)]
  rest = [b for b in range(256) if b not in keep]
  return {**{b: chr(b) for b in keep}, **{b: chr(256 + k) for k, b in enumerate(rest)}}


def clean(text: str) -> str:
  """ftfy-free version of open_clip's ``basic_clean`` + ``whitespace_clean`` + lower-casing (see module doc)."""
  text = html.unescape(html.unescape(unicodedata.normalize("NFC", text).translate(_FIX)))
  text = "".join(c for c in text if c.isspace() or unicodedata.category(c) != "Cc")
  return " ".join(text.split()).lower()


def _kind(c: str) -> str:
  if c.isspace():
    return " "
  cat = unicodedata.category(c)[0]
  return cat if cat in "LN" else "o"


def split(text: str) -> list[str]:
  """The pre-tokenisation pieces of cleaned text (open_clip's regex, alternatives tried in its order)."""
  out, i, n = [], 0, len(text)
  while i < n:
    for special in (SOT, EOT, *_CONTRACTIONS):
      if text.startswith(special, i):
        out.append(special)
        i += len(special)
        break
    else:
      kind = _kind(text[i])
      if kind == " ":
        i += 1
        continue
      j = i + 1
      if kind != "N":  # letters and "other" symbols form runs; each numeral is a piece of its own
        while j < n and _kind(text[j]) == kind:
          j += 1
      out.append(text[i:j])
      i = j
  return out


class ClipTokenizer:
  """Tokenizer over a CLIP ``bpe_simple_vocab_16e6.txt.gz`` file (see the module docstring)."""

  def __init__(self, vocab_path: str, context_length: int = CONTEXT_LENGTH):
    vocab_path = os.path.abspath(os.path.expanduser(str(vocab_path)))
    if not os.path.isfile(vocab_path):
      raise TokenizerError(f"CLIP vocabulary file {vocab_path} does not exist "
                           "(give the path of bpe_simple_vocab_16e6.txt.gz).")
    try:
      with gzip.open(vocab_path) as f:
        lines = f.read().decode("utf-8").split("\n")[1:NUM_MERGES + 1]
    except (OSError, UnicodeDecodeError) as e:
      raise TokenizerError(f"CLIP vocabulary file {vocab_path} is not a gzip BPE merges file ({e}).") from e
    merges = [tuple(line.split()) for line in lines]
    if len(merges) != NUM_MERGES or any(len(m) != 2 for m in merges):
      raise TokenizerError(f"CLIP vocabulary file {vocab_path} does not hold {NUM_MERGES} merge pairs.")
    self.byte_encoder = bytes_to_unicode()
    symbols = list(self.byte_encoder.values())
    vocab = symbols + [s + "</w>" for s in symbols] + ["".join(m) for m in merges] + [SOT, EOT]
    self.encoder = {s: i for i, s in enumerate(vocab)}
    self.decoder = dict(enumerate(vocab))
    self.ranks = {m: i for i, m in enumerate(merges)}
    self.sot_id, self.eot_id = self.encoder[SOT], self.encoder[EOT]
    self.context_length = context_length
    self.bpe = functools.lru_cache(maxsize=1 << 16)(self._bpe)

  def _bpe(self, piece: str) -> tuple[str, ...]:
    """Greedy merging: repeatedly fuse every occurrence of the adjacent pair with the lowest merge rank."""
    if piece in (SOT, EOT):
      return (piece,)
    word = tuple(piece[:-1]) + (piece[-1] + "</w>",)
    while len(word) > 1:
      pairs = set(zip(word[:-1], word[1:]))
      best = min(pairs, key=lambda p: self.ranks.get(p, float("inf")))
      if best not in self.ranks:
        break
      merged, i = [], 0
      while i < len(word):
        if i < len(word) - 1 and (word[i], word[i + 1]) == best:
          merged.append(word[i] + word[i + 1])
          i += 2
        else:
          merged.append(word[i])
          i += 1
      word = tuple(merged)
    return word

  def encode(self, text: str) -> list[int]:
    """BPE ids of one text, without ``<sot>``/``<eot>``."""
    ids = []
    for piece in split(clean(text)):
      symbols = "".join(self.byte_encoder[b] for b in piece.encode("utf-8"))
      ids.extend(self.encoder[s] for s in self.bpe(symbols))
    return ids

  def decode(self, ids) -> str:
    """Text of ids (``</w>`` becomes a space, as in open_clip)."""
    symbols = "".join(self.decoder[int(i)] for i in ids)
    inverse = {v: k for k, v in self.byte_encoder.items()}
    return bytes(inverse[c] for c in symbols).decode("utf-8", errors="replace").replace("</w>", " ")

  def __call__(self, texts: str | list[str], context_length: int | None = None) -> np.ndarray:
    """int32 (B, context): ``<sot> ids <eot>`` truncated (last kept id replaced by ``<eot>``), 0-padded."""
    texts = [texts] if isinstance(texts, str) else list(texts)
    n = context_length or self.context_length
    out = np.zeros((len(texts), n), np.int32)
    for row, text in enumerate(texts):
      ids = [self.sot_id] + self.encode(text) + [self.eot_id]
      if len(ids) > n:
        ids = ids[:n]
        ids[-1] = self.eot_id
      out[row, :len(ids)] = ids
    return out

