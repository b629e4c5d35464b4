"""BERT's uncased WordPiece tokenizer from a local ``vocab.txt`` (one token per line, id = line number).

Pipeline (as ``BertTokenizer(do_lower_case=True)``): special tokens written in the text (``[CLS]``, ``[SEP]``,
... and any ``extra`` ones) are kept whole; the rest is cleaned (NUL / U+FFFD / control characters dropped,
whitespace -> space), CJK ideographs are spaced out, NFC-normalised, split on whitespace, lower-cased,
accent-stripped (NFD, combining marks dropped) and split at punctuation; each word becomes the greedy
longest-match-first sub-words (continuations prefixed ``##``), or ``[UNK]`` when it cannot be covered or is
longer than 100 characters. :meth:`WordPiece.encode` gives ``[CLS] pieces [SEP]`` truncated and ``[PAD]``-padded
to a fixed length, with the attention mask.

ImageReward's BLIP tokenizer is bert-base-uncased plus ``[DEC]`` (bos) and ``[ENC]``, appended as ids 30522 and
30523: ``WordPiece.from_file(vocab, extra=("[DEC]", "[ENC]"))``.
"""
from __future__ import annotations

import os
import re
import unicodedata

import numpy as np

SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
MAX_WORD_CHARS = 100


def _is_control(ch: str) -> bool:
  return ch not in "\t\n\r" and unicodedata.category(ch).startswith("C")


def _is_whitespace(ch: str) -> bool:
  return ch in " \t\n\r" or unicodedata.category(ch) == "Zs"


def _is_punctuation(ch: str) -> bool:
  cp = ord(ch)
  return 33 <= cp <= 47 or 58 <= cp <= 64 or 91 <= cp <= 96 or 123 <= cp <= 126 or \
      unicodedata.category(ch).startswith("P")


def _is_cjk(cp: int) -> bool:
  return any(lo <= cp <= hi for lo, hi in ((0x4E00, 0x9FFF), (0x3400, 0x4DBF), (0x20000, 0x2A6DF),
                                            (0x2A700, 0x2B73F), (0x2B740, 0x2B81F), (0x2B820, 0x2CEAF),
                                            (0xF900, 0xFAFF), (0x2F800, 0x2FA1F)))


def basic_tokens(text: str) -> list[str]:
  """Clean, space CJK, lower-case, strip accents and split at whitespace and punctuation."""
  text = "".join(" " if _is_whitespace(c) else c for c in text
                 if not (ord(c) in (0, 0xFFFD) or _is_control(c)))
  text = "".join(f" {c} " if _is_cjk(ord(c)) else c for c in text)
  out = []
  for word in unicodedata.normalize("NFC", text).split():
    word = "".join(c for c in unicodedata.normalize("NFD", word.lower()) if unicodedata.category(c) != "Mn")
    piece = ""
    for c in word:
      if _is_punctuation(c):
        out += [piece, c] if piece else [c]
        piece = ""
      else:
        piece += c
    if piece:
      out.append(piece)
  return out


class WordPiece:
  """``tokenize(text) -> list[str]``, ``encode(texts, max_len) -> (ids, mask)`` int32 (B, max_len)."""

  def __init__(self, vocab: dict[str, int]):
    self.vocab = vocab
    missing = [t for t in SPECIALS if t not in vocab]
    if missing:
      raise ValueError(f"the vocabulary lacks the special token(s) {', '.join(missing)}.")
    specials = sorted((t for t in vocab if re.fullmatch(r"\[[A-Z]+\]", t)), key=len, reverse=True)
    self._special_re = re.compile("(" + "|".join(map(re.escape, specials)) + ")")

  @classmethod
  def from_file(cls, path: str, extra: tuple[str, ...] = ()) -> "WordPiece":
    """Reads ``vocab.txt``; ``extra`` tokens get the ids after the last line."""
    path = os.path.expanduser(path)
    if not os.path.isfile(path):
      raise FileNotFoundError(f"the WordPiece vocabulary {path} does not exist (BERT's vocab.txt is needed).")
    with open(path, encoding="utf-8") as f:
      tokens = [line.rstrip("\n").rstrip("\r") for line in f]
    while tokens and not tokens[-1]:
      tokens.pop()
    vocab = {t: i for i, t in enumerate(tokens)}
    for t in extra:
      vocab.setdefault(t, len(vocab))
    return cls(vocab)

  def _word(self, word: str) -> list[str]:
    if len(word) > MAX_WORD_CHARS:
      return ["[UNK]"]
    pieces, start = [], 0
    while start < len(word):
      end = len(word)
      while end > start:
        sub = word[start:end] if start == 0 else "##" + word[start:end]
        if sub in self.vocab:
          break
        end -= 1
      if end == start:
        return ["[UNK]"]
      pieces.append(sub)
      start = end
    return pieces

  def tokenize(self, text: str) -> list[str]:
    out = []
    for i, chunk in enumerate(self._special_re.split(text)):
      if i % 2:  # a special token written in the text
        out.append(chunk)
      else:
        out += [p for w in basic_tokens(chunk) for p in self._word(w)]
    return out

  def encode(self, texts: list[str], max_len: int) -> tuple[np.ndarray, np.ndarray]:
    """``[CLS] + pieces[:max_len - 2] + [SEP]``, padded with ``[PAD]``; mask 1 on real tokens."""
    ids = np.full((len(texts), max_len), self.vocab["[PAD]"], np.int32)
    mask = np.zeros((len(texts), max_len), np.int32)
    for r, text in enumerate(texts):
      toks = ["[CLS]", *self.tokenize(text)[:max_len - 2], "[SEP]"]
      ids[r, :len(toks)] = [self.vocab[t] for t in toks]
      mask[r, :len(toks)] = 1
    return ids, mask
