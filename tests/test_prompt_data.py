"""Prompt-file readers and TFDS builders (shapes world, GenEval, T2I-CompBench, MAR-GRPO)."""

import collections
import json
import shutil
from pathlib import Path

import pytest

from margrpo_jax.data import shapes
from margrpo_jax.data import prompt_files as pf
from margrpo_jax.data import tfds_builders as tb

SHARED = Path(__file__).resolve().parent / "fixtures" / "data"  # vendored prompt sets
needs_shared = pytest.mark.skipif(
  not SHARED.is_dir(), reason=f"vendored prompt sets not found at {SHARED}"
)

GENEVAL = SHARED / "geneval" / "evaluation_metadata.jsonl"
MARGRPO = SHARED / "t2i_r1" / "train_prompts.jsonl"
COMPBENCH = SHARED / "t2i_compbench"


def _lines(path):
  """Non-blank lines, with any line ending."""
  text = path.read_bytes().decode("utf-8-sig").replace("\r\n", "\n").replace("\r", "\n")
  return [s for s in text.split("\n") if s.strip()]


def _write(path, text):
  path.write_text(text, encoding="utf-8")
  return path


# ----------------------------------------------------------------------------- readers


@needs_shared
def test_geneval_jsonl_reads_every_prompt():
  lines = _lines(GENEVAL)
  recs = pf.read_prompt_file(GENEVAL)
  assert len(recs) == len(lines) == 553
  assert [r["metadata"] for r in recs] == [json.loads(s) for s in lines]
  assert recs[0] == {
    "prompt": "a photo of a bench",
    "tag": "single_object",
    "metadata": {"tag": "single_object", "prompt": "a photo of a bench", "include": [{"class": "bench", "count": 1}]},
  }
  tags = collections.Counter(r["tag"] for r in recs)
  assert set(tags) == {"single_object", "two_object", "counting", "colors", "position", "color_attr"}
  # GenEval's position lives on include[1] and its tags overlap the shapes tasks: untouched.
  pos = next(r for r in recs if r["tag"] == "position")
  assert pos["metadata"]["include"][1]["position"][0] in ("left of", "right of", "above", "below")


@needs_shared
def test_margrpo_jsonl_reads_every_prompt(tmp_path):
  lines = _lines(MARGRPO)
  recs = pf.read_prompt_file(MARGRPO)
  assert len(recs) == len(lines) == 7223
  assert collections.Counter(r["tag"] for r in recs) == {
    "spatial": 2195,
    "numeracy": 1172,
    "color": 879,
    "shape": 682,
    "texture": 695,
    "complex": 700,
    "non": 700,
    "object": 200,
  }
  assert recs[0]["prompt"] == "a photo of a car below a zebra"
  assert recs[0]["metadata"]["spatial_info"] == {"obj1": "car", "obj2": "zebra", "locality": "below"}
  assert all(r["metadata"] == json.loads(s) for r, s in zip(recs, lines))
  # MAR-GRPO's original name: JSON Lines despite ".json".
  orig = tmp_path / "geneval_and_t2i_data_final.json"
  shutil.copy(MARGRPO, orig)
  assert pf.read_prompt_file(orig) == recs


@needs_shared
def test_t2i_compbench_txt_reads_every_prompt():
  files = sorted(COMPBENCH.glob("*.txt"))
  assert len(files) >= 30
  total = 0
  for f in files:
    lines = _lines(f)
    recs = pf.read_prompt_file(f)
    assert [r["prompt"] for r in recs] == [s.strip() for s in lines], f.name
    assert {r["tag"] for r in recs} == {f.stem}
    total += len(recs)
  assert len(pf.read_prompt_dir(COMPBENCH)) == total
  assert len(pf.read_prompt_dir(COMPBENCH, fmt="txt")) == total
  val = pf.read_prompt_file(COMPBENCH / "color_val.txt")
  assert len(val) == 300 and "\r" not in "".join(r["prompt"] for r in val)  # CRLF file
  assert val[0] == {
    "prompt": "a green bench and a blue bowl",
    "tag": "color_val",
    "metadata": {"prompt": "a green bench and a blue bowl"},
  }
  assert any("é" in r["prompt"] for r in pf.read_prompt_file(COMPBENCH / "non_spatial.txt"))


def test_auto_format_sniffs_unknown_extensions(tmp_path):
  j = _write(tmp_path / "a.prompts", '\n{"prompt": "x y", "task_type": "t"}\n')
  t = _write(tmp_path / "b.prompts", "x y\n")
  assert pf.read_prompt_file(j) == [{"prompt": "x y", "tag": "t", "metadata": {"prompt": "x y", "task_type": "t"}}]
  assert pf.read_prompt_file(t) == [{"prompt": "x y", "tag": "b", "metadata": {"prompt": "x y"}}]
  with pytest.raises(ValueError, match="unknown prompt file format"):
    pf.read_prompt_file(t, fmt="csv")


def test_plain_text_shapes_prompts_get_metadata(tmp_path):
  prompts = [
    "a red circle",
    "three blue squares",
    "a red circle to the left of a blue square",
    "a yellow triangle and a cyan square",
    "a photo of a cat",
  ]
  f = _write(tmp_path / "mine.txt", "\r\n".join(prompts) + "\r\n\r\n")
  recs = pf.read_prompt_file(f)
  assert [r["prompt"] for r in recs] == prompts
  assert {r["tag"] for r in recs} == {"mine"}
  for r in recs[:4]:
    assert r["metadata"] == shapes.parse_prompt(r["prompt"])
    shapes.validate_metadata(r["metadata"])
  assert recs[2]["metadata"]["position"] == ["to the left of", 0]
  assert recs[4]["metadata"] == {"prompt": "a photo of a cat"}
  # JSONL lines without "include" are parsed too; the task becomes the tag when none is given.
  g = _write(tmp_path / "mine.jsonl", '{"prompt": "two green triangles"}\n')
  (r,) = pf.read_prompt_file(g)
  assert r["tag"] == "counting" and r["metadata"] == shapes.parse_prompt("two green triangles")


def test_shapes_metadata_jsonl_round_trip(tmp_path):
  mds = shapes.split_records("eval")[::37]
  f = _write(tmp_path / "shapes.jsonl", "".join(shapes.metadata_to_json(m) + "\n" for m in mds))
  recs = pf.read_prompt_file(f)
  assert [r["metadata"] for r in recs] == mds
  assert [r["tag"] for r in recs] == [m["tag"] for m in mds]


BAD_SHAPES = json.dumps(
  {"tag": "counting", "prompt": "three red circles", "include": [{"class": "red circle", "count": 5}], "position": None}
)


@pytest.mark.parametrize(
  "name, text, line, what",
  [
    ("prompts.jsonl", '{"prompt": "a"}\n{"prompt": "b"}\n{"prompt": "c",,}\n', 3, "not valid JSON"),
    ("prompts.jsonl", '{"prompt": "a"}\n\n{"nouns": ["b"]}\n', 3, "missing the 'prompt' key"),
    ("prompts.jsonl", '{"prompt": "a"}\n["a"]\n', 2, "expected a JSON object"),
    ("prompts.jsonl", '{"prompt": ""}\n', 1, "non-empty string"),
    ("prompts.jsonl", '[{"prompt": "a"}]\n', 1, "JSON array"),
    (
      "shapes.jsonl",
      shapes.metadata_to_json(shapes.parse_prompt("a red circle")) + "\n" + BAD_SHAPES + "\n",
      2,
      "invalid shapes-world metadata",
    ),
    (
      "shapes.jsonl",
      json.dumps(
        {
          "tag": "position",
          "prompt": "a red circle above a blue square",
          "include": [{"class": "red circle", "count": 1}, {"class": "blue square", "count": 1}],
          "position": ["below", 0],
        }
      )
      + "\n",
      1,
      "invalid shapes-world metadata",
    ),
    ("empty.txt", "\n  \n\r\n", None, "file is empty"),
    ("empty.jsonl", "", None, "file is empty"),
  ],
)
def test_malformed_files_name_file_and_line(tmp_path, name, text, line, what):
  f = _write(tmp_path / name, text)
  with pytest.raises(pf.PromptFileError) as e:
    pf.read_prompt_file(f)
  msg = str(e.value)
  assert isinstance(e.value, ValueError)
  assert name in msg and what in msg and msg.endswith(".")
  if line is not None:
    assert f"line {line}:" in msg
  assert "\n" not in msg


def test_missing_file_and_dir(tmp_path):
  with pytest.raises(pf.PromptFileError, match=r"nope\.jsonl: file does not exist\."):
    pf.read_prompt_file(tmp_path / "nope.jsonl")
  with pytest.raises(pf.PromptFileError, match="directory does not exist"):
    pf.read_prompt_dir(tmp_path / "nodir")
  with pytest.raises(pf.PromptFileError, match="no prompt files matching"):
    pf.read_prompt_dir(tmp_path)
  bad = tmp_path / "bad.txt"
  bad.write_bytes(b"ok\n\xff\xfe\n")
  with pytest.raises(pf.PromptFileError, match=r"bad\.txt line 2: not valid UTF-8"):
    pf.read_prompt_file(bad)


# ----------------------------------------------------------------------------- TFDS builders


@pytest.fixture(scope="module")
def shapes_dir(tmp_path_factory):
  return tmp_path_factory.mktemp("tfds_shapes")


def test_shapes_world_builder(shapes_dir):
  ev = tb.shapes_eval_records(shapes_dir)
  want = shapes.split_records("eval")
  assert len(ev) == 512
  assert collections.Counter(r["tag"] for r in ev) == {t: 128 for t in shapes.TASKS}
  assert [r["metadata"] for r in ev] == want
  assert [(r["prompt"], r["tag"], r["index"]) for r in ev] == [(m["prompt"], m["tag"], i) for i, m in enumerate(want)]
  train = tb.load_split("shapes_world", "train", shapes_dir)
  assert [r["metadata"] for r in train] == shapes.split_records("train")
  assert not {r["prompt"] for r in ev} & {r["prompt"] for r in train}
  builder = tb.prepare("shapes_world", shapes_dir)
  assert builder.info.version == "1.1.0" and set(builder.info.splits) == {"train", "val", "eval"}
  assert [r["metadata"] for r in tb.load_split("shapes_world", "val", shapes_dir)] == shapes.split_records("val")
  assert tb.load_split("shapes_world", "train[:8]", shapes_dir) == train[:8]
  with pytest.raises(ValueError, match="no split 'test'"):
    tb.load_split("shapes_world", "test", shapes_dir)


def test_shapes_world_is_deterministic(shapes_dir, tmp_path):
  first = tb.shapes_eval_records(shapes_dir)
  assert tb.shapes_eval_records(tmp_path) == first  # a fresh build
  assert tb.load_split("shapes_world", "eval", shapes_dir, overwrite=True) == first


def _strip_index(recs):
  return [{k: v for k, v in r.items() if k != "index"} for r in recs]


@needs_shared
def test_prompt_files_geneval(tmp_path):
  manual = tmp_path / "manual"
  manual.mkdir()
  shutil.copy(GENEVAL, manual)
  recs = tb.load_split("prompt_files/geneval", "test", tmp_path / "tfds", manual_dir=manual)
  assert _strip_index(recs) == pf.read_prompt_file(GENEVAL)
  assert [r["index"] for r in recs] == list(range(553))


@needs_shared
def test_prompt_files_t2i_compbench(tmp_path):
  manual = tmp_path / "manual"
  manual.mkdir()
  names = ["color_val.txt", "numeracy_val.txt", "3d_spatial_val.txt", "non_spatial_val.txt"]
  for n in names:
    shutil.copy(COMPBENCH / n, manual)
  shutil.copy(COMPBENCH / "LICENSE", manual)
  builder = tb.prepare("t2i_compbench", tmp_path / "tfds", manual_dir=manual)
  assert set(builder.info.splits) == {Path(n).stem for n in names}
  for n in names:
    recs = tb.load_split("prompt_files/t2i_compbench", Path(n).stem, tmp_path / "tfds", manual_dir=manual)
    assert _strip_index(recs) == pf.read_prompt_file(COMPBENCH / n), n


@needs_shared
def test_prompt_files_margrpo(tmp_path):
  manual = tmp_path / "manual"
  manual.mkdir()
  shutil.copy(MARGRPO, manual)
  recs = tb.load_split("prompt_files/margrpo", "train", tmp_path / "tfds", manual_dir=manual)
  assert len(recs) == 7223
  assert _strip_index(recs) == pf.read_prompt_file(MARGRPO)
  # The original T2I-R1 file name (JSON Lines despite ".json"); a subset keeps this fast.
  manual2 = tmp_path / "manual2"
  manual2.mkdir()
  _write(manual2 / "geneval_and_t2i_data_final.json", "\n".join(_lines(MARGRPO)[:40]) + "\n")
  recs2 = tb.load_split("margrpo", "train", tmp_path / "tfds2", manual_dir=manual2)
  assert recs2 == recs[:40]


@needs_shared
def test_prompt_files_generic_configs(tmp_path):
  manual = tmp_path / "manual"
  manual.mkdir()
  _write(manual / "geneval-part.jsonl", "\n".join(_lines(GENEVAL)[:25]) + "\n")
  mds = shapes.split_records("eval")[::64]
  _write(manual / "shapes.jsonl", "".join(shapes.metadata_to_json(m) + "\n" for m in mds))
  _write(manual / "mine.txt", "a red circle\na photo of a dog\n")
  got = {
    s: tb.load_split("prompt_files/jsonl", s, tmp_path / "tfds", manual_dir=manual) for s in ("geneval_part", "shapes")
  }
  assert _strip_index(got["geneval_part"]) == pf.read_prompt_file(GENEVAL)[:25]
  assert [r["metadata"] for r in got["shapes"]] == mds
  txt = tb.load_split("prompt_files/txt", "mine", tmp_path / "tfds", manual_dir=manual)
  assert txt[0]["metadata"] == shapes.parse_prompt("a red circle")
  assert txt[1]["metadata"] == {"prompt": "a photo of a dog"} and txt[1]["tag"] == "mine"


def test_prompt_files_missing_manual_data(tmp_path):
  with pytest.raises(FileNotFoundError, match="does not exist or is empty.*evaluation_metadata"):
    tb.prepare("prompt_files/geneval", tmp_path / "a", manual_dir=tmp_path / "nothing")
  manual = tmp_path / "manual"
  manual.mkdir()
  _write(manual / "other.txt", "a red circle\n")
  with pytest.raises(FileNotFoundError, match=r"manual/train_prompts\.jsonl or .*final\.json"):
    tb.prepare("prompt_files/margrpo", tmp_path / "b", manual_dir=manual)
  with pytest.raises(FileNotFoundError, match=r"no \*\.jsonl / \*\.json files"):
    tb.prepare("prompt_files/jsonl", tmp_path / "c", manual_dir=manual)
  with pytest.raises(ValueError, match="unknown dataset"):
    tb.prepare("prompt_files/nope", tmp_path / "d")
