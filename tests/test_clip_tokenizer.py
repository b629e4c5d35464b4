"""The project's CLIP BPE tokenizer gives open_clip's ids (``SimpleTokenizer``, same vocab file) on every prompt of
the vendored prompt sets in tests/fixtures/data (GenEval, T2I-CompBench, MAR-GRPO's T2I-R1 prompts) and on hand-made edge cases: exact equality."""
from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import SHARED_DATA

from margrpo_jax.rewards.clip_tokenizer import ClipTokenizer, TokenizerError

VOCAB = SHARED_DATA / "clip_bpe" / "bpe_simple_vocab_16e6.txt.gz"
EDGE = ["Hello&amp;World!! it's", "\ufb01ne \u201cquoted\u201d \uff21\uff22\uff23\uff11\uff12\uff13",
        "caf\u00e9 3.14 l'\u00e9t\u00e9's  \t\n  tab", "<start_of_text>hi<end_of_text>",
        "emoji \U0001f642\U0001f642 \u65e5\u672c\u8a9e\u30c6\u30ad\u30b9\u30c8", "don't WON'T they'll I'M",
        "x" * 300, "a" + " word" * 100, "", "   ", "a  photo\u00a0of &lt;b&gt; 2 dogs, 10 cats; 3rd?!"]


def all_prompts() -> list[str]:
  prompts = set()
  for f in SHARED_DATA.glob("*/*.jsonl"):
    prompts.update(json.loads(line)["prompt"] for line in f.read_text(encoding="utf-8").splitlines() if line.strip())
  for f in (SHARED_DATA / "t2i_compbench").glob("*.txt"):
    prompts.update(f.read_text(encoding="utf-8").splitlines())
  return sorted(prompts)


@pytest.fixture(scope="module")
def tokenizers():
  from open_clip.tokenizer import SimpleTokenizer
  return ClipTokenizer(VOCAB), SimpleTokenizer(str(VOCAB))


def test_every_shared_prompt_matches_open_clip(tokenizers):
  mine, oracle = tokenizers
  prompts = all_prompts()
  assert len(prompts) > 10_000
  ours, theirs = mine(prompts), oracle(prompts).numpy()
  bad = [prompts[i] for i in np.flatnonzero((ours != theirs).any(1))]
  assert not bad, f"{len(bad)} prompts differ, e.g. {bad[:3]}"
  assert ours.dtype == np.int32 and ours.shape == (len(prompts), 77)


def test_edge_cases_match_open_clip(tokenizers):
  mine, oracle = tokenizers
  np.testing.assert_array_equal(mine(EDGE), oracle(EDGE).numpy())
  np.testing.assert_array_equal(mine(EDGE, context_length=8), oracle(EDGE, context_length=8).numpy())
  ids = mine.encode("a photo of a cat")
  assert mine.decode(ids) == oracle.decode(ids) == "a photo of a cat "
  assert (mine.sot_id, mine.eot_id, len(mine.encoder)) == (49406, 49407, 49408)


def test_missing_vocab_names_the_path(tmp_path):
  with pytest.raises(TokenizerError, match="nope.txt.gz does not exist"):
    ClipTokenizer(tmp_path / "nope.txt.gz")
