"""The shapes world: the project's offline, verifiable text-to-image task.

This module is the task's definition: grammar, renderer and splits as written out below.

Images
    32 x 32 RGB uint8, background exactly (0, 0, 0); objects are filled squares, circles and
    apex-up triangles in an s x s box, s in {8, 9, 10}, drawn in one of six exact palette colours.
    With (i, j) the row/column inside the box a pixel is filled when
    square: always; circle: (i + .5 - s/2)^2 + (j + .5 - s/2)^2 <= (s/2)^2;
    triangle: |j + .5 - s/2| <= (i + 1) / 2.
    Bounding boxes keep >= 2 background pixels between each other and >= 1 from the border.

Metadata (GenEval's shape)
    ``{"tag": task, "prompt": text, "include": [{"class": "red circle", "count": 1}, ...],
    "position": [relation, i] or None}``.
    Position convention: ``position = [relation, i]`` means *include[i] stands <relation>
    include[1 - i]*. Prompts of the grammar always use ``i = 0``: "a red circle to the left of a
    blue square" -> include = [red circle, blue square], position = ["to the left of", 0].
    (GenEval itself hangs the position on the second object; we keep it top-level.)
    Counting "{n} {color} {shape}s" -> one include entry with count n. In two_object and position
    prompts the two (colour, shape) pairs differ, so include classes are always distinct.

Tokens
    ``patchify``: an 8 x 8 grid of 4 x 4 patches in raster order, each flattened in
    (row, col, channel) order -> (..., 64, 48), values x / 255 * 2 - 1 in [-1, 1].
    ``unpatchify`` inverts it: clip to [-1, 1], round((x + 1) / 2 * 255).

Splits (hold-out scheme)
    Eval prompts are held out *by prompt*, so eval and train are disjoint in prompt text.
      * single_object: 6 of 18 held out, the "Latin" diagonal colour k -> shape k mod 3
        (red circle, green square, blue triangle, yellow circle, purple square, cyan triangle):
        each colour once, each shape twice, so every colour and every shape stays in train.
      * counting: 18 of 54 held out, one per (colour c, shape s) with n = (2, 3, 4)[(c + s) % 3]:
        each colour 3x, each shape 6x, each n 6x; every (colour, shape) keeps 2 numbers in train.
      * two_object: 64 unordered pairs {A, B} held out *with both orders* (128 prompts), so the
        scene "A and B" is unseen in train in either wording.
      * position: 64 spatial arrangements held out (A left of B, or A above B), each with both of
        its wordings ("A to the left of B" and "B to the right of A"): 128 prompts, 32 per relation.
      Pairs/arrangements are ranked by a version-stable SHA-256 of their text and picked greedily
      with caps (each class used <= 8 times; position: 32 per axis), so the choice is balanced
      over colours and shapes and never depends on numpy's RNG.
    The eval split has 512 records, 128 per task, task-major (single, two, counting, position);
    pools smaller than 128 are cycled in order (single 6 prompts -> ~21 repeats each; counting
    18 -> ~7), each repeat being a separate sample (use the record index as the sample seed).
    The train split draws ``num_train`` records from the remaining prompts with tasks interleaved
    (record k has task TASKS[k % 4]); within a task it walks successive seeded permutations of
    the train pool, so every train prompt is used about equally often.
"""

from __future__ import annotations

import functools
import hashlib
import json
from typing import Any, Sequence

import numpy as np

# ----------------------------------------------------------------------------- constants

COLORS: tuple[str, ...] = ("red", "green", "blue", "yellow", "purple", "cyan")
PALETTE: dict[str, tuple[int, int, int]] = {
  "red": (230, 40, 40),
  "green": (40, 190, 70),
  "blue": (50, 100, 240),
  "yellow": (240, 220, 50),
  "purple": (170, 70, 220),
  "cyan": (40, 210, 220),
}
SHAPES: tuple[str, ...] = ("circle", "square", "triangle")
TASKS: tuple[str, ...] = ("single_object", "two_object", "counting", "position")
RELATIONS: tuple[str, ...] = ("to the left of", "to the right of", "above", "below")
NUMBERS: dict[str, int] = {"two": 2, "three": 3, "four": 4}
IMAGE_SIZE = 32
PATCH = 4
GRID = IMAGE_SIZE // PATCH  # 8
NUM_TOKENS = GRID * GRID  # 64
TOKEN_DIM = PATCH * PATCH * 3  # 48
CLASSES: tuple[str, ...] = tuple(f"{c} {s}" for c in COLORS for s in SHAPES)  # colour-major, 18
CLASS_INDEX: dict[str, int] = {c: k for k, c in enumerate(CLASSES)}
SIZES: tuple[int, ...] = (8, 9, 10)
MIN_GAP = 2  # background pixels between bounding boxes
BORDER = 1  # background pixels between a box and the image border
MIN_POS_OFFSET = 6  # rendered centre offset along the relation axis

_NUMBER_WORD = {v: k for k, v in NUMBERS.items()}
_INVERSE_REL = {
  "to the left of": "to the right of",
  "to the right of": "to the left of",
  "above": "below",
  "below": "above",
}
_PALETTE_ARR = np.array([PALETTE[c] for c in COLORS], dtype=np.uint8)  # (6, 3)
_METADATA_KEYS = ("tag", "prompt", "include", "position")


# ----------------------------------------------------------------------------- grammar


def _class_text(cls: str, count: int) -> str:
  return f"a {cls}" if count == 1 else f"{_NUMBER_WORD[count]} {cls}s"


def prompt_text(tag: str, include: Sequence[dict], position: Sequence | None) -> str:
  """Canonical prompt text of a (tag, include, position) triple (position index must be 0)."""
  if tag == "single_object":
    return f"a {include[0]['class']}"
  if tag == "two_object":
    return f"a {include[0]['class']} and a {include[1]['class']}"
  if tag == "counting":
    return _class_text(include[0]["class"], include[0]["count"])
  if tag == "position":
    return f"a {include[0]['class']} {position[0]} a {include[1]['class']}"
  raise ValueError(f"tag must be one of {TASKS}, got {tag!r}.")


def make_metadata(tag: str, classes: Sequence[str], count: int = 1, relation: str | None = None) -> dict:
  """Build one metadata dict (include classes in order; ``relation`` only for position)."""
  include = [{"class": c, "count": int(count)} for c in classes]
  position = [relation, 0] if tag == "position" else None
  return {"tag": tag, "prompt": prompt_text(tag, include, position), "include": include, "position": position}


def _copy_md(md: dict) -> dict:
  return {
    "tag": md["tag"],
    "prompt": md["prompt"],
    "include": [dict(e) for e in md["include"]],
    "position": None if md["position"] is None else list(md["position"]),
  }


@functools.lru_cache(maxsize=None)
def _enumerate_cached(task: str) -> tuple[dict, ...]:
  out: list[dict] = []
  if task == "single_object":
    out = [make_metadata(task, [c]) for c in CLASSES]
  elif task == "two_object":
    out = [make_metadata(task, [a, b]) for a in CLASSES for b in CLASSES if a != b]
  elif task == "counting":
    out = [make_metadata(task, [c], n) for c in CLASSES for n in NUMBERS.values()]
  elif task == "position":
    out = [make_metadata(task, [a, b], 1, r) for a in CLASSES for r in RELATIONS for b in CLASSES if a != b]
  else:
    raise ValueError(f"task must be one of {TASKS}, got {task!r}.")
  return tuple(out)


def enumerate_prompts(task: str) -> list[dict]:
  """All unique metadata of ``task`` in a fixed order (18 / 306 / 54 / 1224 records).

  Orders: single: CLASSES; two_object: (a, b) over CLASSES x CLASSES, a != b; counting: class
  then n in (2, 3, 4); position: subject class, relation (RELATIONS order), other class.
  """
  return [_copy_md(m) for m in _enumerate_cached(task)]


@functools.lru_cache(maxsize=None)
def _prompt_lookup() -> dict[str, dict]:
  return {m["prompt"]: m for t in TASKS for m in _enumerate_cached(t)}


def parse_prompt(text: str) -> dict | None:
  """Parse a shapes-world prompt back to its metadata; ``None`` if ``text`` is not one.

  The grammar is finite (1602 prompts), so parsing is an exact lookup of the canonical text
  (leading/trailing whitespace ignored, otherwise case- and space-sensitive).
  """
  if not isinstance(text, str):
    return None
  md = _prompt_lookup().get(text.strip())
  return None if md is None else _copy_md(md)


def verifiable(md: Any) -> dict | None:
  """``md`` when it is valid shapes-world metadata of one of :data:`TASKS` (the verifier can score its image),
  else None: the one rule the sample, eval and RL jobs apply to a prompt record's metadata."""
  try:
    validate_metadata(md)
  except ValueError:
    return None
  return md


def validate_metadata(md: Any) -> None:
  """Raise ``ValueError`` (one sentence naming the bad field) unless ``md`` is valid metadata.

  Valid: a dict with keys tag, prompt, include, position (extra keys are ignored); tag in TASKS;
  include a list of {"class": one of CLASSES, "count": int} with distinct classes, of the task's
  arity (1 entry for single/counting, 2 for two_object/position) and counts (1, or 2..4 for
  counting); position None except for position prompts, where it is [relation, 0 or 1]; and the
  prompt equals the canonical text of those fields (position index 0), i.e. parse_prompt agrees.
  """
  if not isinstance(md, dict):
    raise ValueError(f"metadata must be a dict, got {type(md).__name__}.")
  for k in _METADATA_KEYS:
    if k not in md:
      raise ValueError(f"metadata is missing the field {k!r}.")
  tag = md["tag"]
  if tag not in TASKS:
    raise ValueError(f"metadata field 'tag' must be one of {TASKS}, got {tag!r}.")
  if not isinstance(md["prompt"], str):
    raise ValueError(f"metadata field 'prompt' must be a string, got {type(md['prompt']).__name__}.")
  inc = md["include"]
  if not isinstance(inc, (list, tuple)):
    raise ValueError(f"metadata field 'include' must be a list, got {type(inc).__name__}.")
  arity = 2 if tag in ("two_object", "position") else 1
  if len(inc) != arity:
    raise ValueError(
      f"metadata field 'include' must have {arity} entr{'ies' if arity > 1 else 'y'} for tag {tag!r}, got {len(inc)}."
    )
  seen = set()
  for k, e in enumerate(inc):
    if not isinstance(e, dict) or "class" not in e or "count" not in e:
      raise ValueError(f"metadata field 'include[{k}]' must be a dict with keys 'class' and 'count', got {e!r}.")
    if e["class"] not in CLASS_INDEX:
      raise ValueError(
        f"metadata field 'include[{k}].class' must be one of the 18 'colour shape' classes, got {e['class']!r}."
      )
    cnt = e["count"]
    if isinstance(cnt, bool) or not isinstance(cnt, (int, np.integer)):
      raise ValueError(f"metadata field 'include[{k}].count' must be an int, got {cnt!r}.")
    ok = (2 <= cnt <= 4) if tag == "counting" else cnt == 1
    if not ok:
      raise ValueError(
        f"metadata field 'include[{k}].count' must be {'2, 3 or 4' if tag == 'counting' else '1'} for tag {tag!r}, got {cnt}."
      )
    if e["class"] in seen:
      raise ValueError(f"metadata field 'include[{k}].class' repeats {e['class']!r}; the classes must differ.")
    seen.add(e["class"])
  pos = md["position"]
  if tag == "position":
    if (
      not isinstance(pos, (list, tuple))
      or len(pos) != 2
      or pos[0] not in RELATIONS
      or isinstance(pos[1], bool)
      or pos[1] not in (0, 1)
    ):
      raise ValueError(
        f"metadata field 'position' must be [relation, 0 or 1] with relation in {RELATIONS}, got {pos!r}."
      )
  elif pos is not None:
    raise ValueError(f"metadata field 'position' must be None for tag {tag!r}, got {pos!r}.")
  if tag == "position" and pos[1] == 1:  # canonical wording puts the subject first
    inc_c, pos_c = [inc[1], inc[0]], [pos[0], 0]
  else:
    inc_c, pos_c = list(inc), pos
  expected = prompt_text(tag, inc_c, pos_c)
  if md["prompt"] != expected:
    raise ValueError(f"metadata field 'prompt' is {md['prompt']!r} but include/position say {expected!r}.")


def metadata_from_json(obj: str | bytes | dict) -> dict:
  """Load metadata from a JSON string (or an already-decoded dict), validate and normalise it
  (lists for include/position, plain ints; extra keys are dropped)."""
  md = json.loads(obj) if isinstance(obj, (str, bytes)) else obj
  validate_metadata(md)
  return {
    "tag": md["tag"],
    "prompt": md["prompt"],
    "include": [{"class": e["class"], "count": int(e["count"])} for e in md["include"]],
    "position": None if md["position"] is None else [md["position"][0], int(md["position"][1])],
  }


def metadata_to_json(md: dict) -> str:
  """One JSON line (GenEval's evaluation_metadata.jsonl format)."""
  return json.dumps({k: md[k] for k in _METADATA_KEYS})


def _as_task_list(pool, task):
  if isinstance(pool, dict):
    if task is None:
      return None
    return pool[task]
  if task is None:
    return pool
  return [m for m in pool if m["tag"] == task]


def sample_metadata(rng: np.random.Generator, task: str | None = None, pool=None) -> dict:
  """Draw one metadata dict uniformly from ``pool`` (a list of metadata, or a dict
  task -> list such as ``task_pools(split)``; default: every prompt of the grammar).

  ``task=None`` first draws a task uniformly from TASKS (from the dict's keys when ``pool`` is
  a dict), then a prompt uniformly within it. Returns a fresh copy.
  """
  if pool is None:
    pool = {t: _enumerate_cached(t) for t in TASKS}
  if isinstance(pool, dict) and task is None:
    keys = [t for t in TASKS if t in pool] or list(pool)
    task = keys[int(rng.integers(len(keys)))]
  if task is not None and task not in TASKS:
    raise ValueError(f"task must be one of {TASKS}, got {task!r}.")
  items = _as_task_list(pool, task)
  if not items:
    raise ValueError(f"pool has no prompts for task {task!r}.")
  return _copy_md(items[int(rng.integers(len(items)))])


# ----------------------------------------------------------------------------- renderer


def shape_mask(shape: str, s: int) -> np.ndarray:
  """Boolean (s, s) mask of a shape drawn in an s x s box (pixel rules of docs/shapes_world.md)."""
  i, j = np.mgrid[0:s, 0:s].astype(np.float64)
  if shape == "square":
    return np.ones((s, s), bool)
  if shape == "circle":
    return (i + 0.5 - s / 2) ** 2 + (j + 0.5 - s / 2) ** 2 <= (s / 2) ** 2
  if shape == "triangle":
    return np.abs(j + 0.5 - s / 2) <= (i + 1) / 2
  raise ValueError(f"shape must be one of {SHAPES}, got {shape!r}.")


_MASKS = {(sh, s): shape_mask(sh, s) for sh in SHAPES for s in SIZES}
# Row of the pixel centroid inside the box (columns are symmetric: centroid col = (s - 1) / 2).
_ROW_CENTROID = {k: float((m.sum(1) * np.arange(m.shape[0])).sum() / m.sum()) for k, m in _MASKS.items()}


def _objects_of(md: dict) -> list[tuple[int, int]]:
  """(colour index, shape index) of every object to draw, subject first for position."""
  out = []
  inc = md["include"]
  if md.get("position") is not None and md["position"][1] == 1:
    inc = [inc[1], inc[0]]
  for e in inc:
    col, sh = e["class"].split(" ")
    out += [(COLORS.index(col), SHAPES.index(sh))] * int(e["count"])
  return out


def _free_mask(s: int, boxes: list[tuple[int, int, int]]) -> np.ndarray:
  """Valid top-left corners (y0, x0) in [1, 31 - s]^2 for an s-box given placed (y0, x0, s) boxes."""
  coords = _corners(s)
  ok = np.ones((coords.size, coords.size), bool)
  for by, bx, bs in boxes:
    ok &= _separated(coords[:, None], coords[None, :], s, by, bx, bs)
  return ok


def _pick(rng: np.random.Generator, ok: np.ndarray, s: int):
  flat = np.flatnonzero(ok)
  if flat.size == 0:
    return None
  k = int(flat[int(rng.integers(flat.size))])
  n = ok.shape[1]
  return (BORDER + k // n, BORDER + k % n, s)


def _separated(ay, ax, sa, by, bx, sb):
  """Boxes (corner, size) keep >= MIN_GAP background px apart (broadcasting)."""
  sep_y = (ay + sa + MIN_GAP <= by) | (by + sb + MIN_GAP <= ay)
  sep_x = (ax + sa + MIN_GAP <= bx) | (bx + sb + MIN_GAP <= ax)
  return sep_y | sep_x


def _relation_ok(rel, ay, ax, sa, sha, by, bx, sb, shb):
  """a (corner (ay, ax), size sa, shape index sha) stands <rel> b with a clear margin.

  With d = centre(b) - centre(a): along the relation axis |d| >= 6 and |d_along| > |d_across|
  for the box centres (docs/shapes_world.md), and for the pixel centroids |d_along| >= 6 and
  |d_along| >= |d_across| + 1. Column centroids equal box centres (the shapes are left-right
  symmetric); a triangle's row centroid sits below its box centre, hence the second check.
  Broadcasts over array corners.
  """
  dx = (bx + sb / 2) - (ax + sa / 2)
  dy_box = (by + sb / 2) - (ay + sa / 2)
  dy_cen = (by + _ROW_CENTROID[(SHAPES[shb], sb)]) - (ay + _ROW_CENTROID[(SHAPES[sha], sa)])
  if rel in ("to the left of", "to the right of"):
    along = dx if rel == "to the left of" else -dx  # a left of b -> b right of a: dx > 0
    return (along >= MIN_POS_OFFSET) & (along > np.abs(dy_box)) & (along >= np.abs(dy_cen) + 1)
  sgn = 1.0 if rel == "above" else -1.0  # a above b -> b has larger rows: dy > 0
  along_b, along_c = sgn * dy_box, sgn * dy_cen
  return (
    (along_b >= MIN_POS_OFFSET) & (along_b > np.abs(dx)) & (along_c >= MIN_POS_OFFSET) & (along_c >= np.abs(dx) + 1)
  )


def _corners(s: int) -> np.ndarray:
  return np.arange(BORDER, IMAGE_SIZE - BORDER - s + 1)


@functools.lru_cache(maxsize=None)
def _pair_cdf(rel: str, sa: int, sha: int, sb: int, shb: int) -> np.ndarray:
  """Cumulative count, over a's corners (raster), of b corners valid for 'a <rel> b'."""
  ca, cb = _corners(sa).astype(np.float64), _corners(sb).astype(np.float64)
  ay, ax = ca[:, None, None, None], ca[None, :, None, None]
  by, bx = cb[None, None, :, None], cb[None, None, None, :]
  ok = _separated(ay, ax, sa, by, bx, sb) & _relation_ok(rel, ay, ax, sa, sha, by, bx, sb, shb)
  return np.cumsum(ok.sum(axis=(2, 3)).ravel())


def _place_pair(rng, rel, sa, sha, sb, shb):
  """Draw (a, b) boxes uniformly among all valid pairs for 'a <rel> b' (None if there is none)."""
  cdf = _pair_cdf(rel, sa, sha, sb, shb)
  if cdf[-1] == 0:
    return None
  k = int(np.searchsorted(cdf, int(rng.integers(cdf[-1])), side="right"))
  ca, cb = _corners(sa), _corners(sb)
  ay, ax = int(ca[k // ca.size]), int(ca[k % ca.size])
  cbf = cb.astype(np.float64)
  ok = _separated(ay, ax, sa, cbf[:, None], cbf[None, :], sb) & _relation_ok(
    rel, ay, ax, sa, sha, cbf[:, None], cbf[None, :], sb, shb
  )
  b = _pick(rng, ok, sb)
  return (ay, ax, sa), b


def _fallback_layout(n: int, rel: str | None) -> list[tuple[int, int, int]]:
  """Deterministic always-valid layout of (y0, x0, s) boxes: a 2 x 2 grid of 10-px boxes for
  up to 4 objects (1 + 10 + 2 + 10 <= 31), or the two boxes of a relation on opposite sides."""
  if rel is None:
    if n > 4:
      raise ValueError(f"the shapes world draws at most 4 objects, got {n}.")
    corners = [(1, 1), (1, 13), (13, 1), (13, 13)]
    return [(y, x, 10) for y, x in corners[:n]]
  far = IMAGE_SIZE - BORDER - 10  # 21
  a, b = {
    "to the left of": ((11, 1), (11, far)),
    "to the right of": ((11, far), (11, 1)),
    "above": ((1, 11), (far, 11)),
    "below": ((far, 11), (1, 11)),
  }[rel]
  return [(a[0], a[1], 10), (b[0], b[1], 10)]


def _layout(md: dict, objs: list[tuple[int, int]], rng: np.random.Generator, max_tries: int = 50):
  n = len(objs)
  rel = md["position"][0] if md.get("position") is not None else None
  for _ in range(max_tries):
    sizes = [SIZES[int(v)] for v in rng.integers(len(SIZES), size=n)]
    if rel is None:
      boxes: list = []
      for s in sizes:
        b = _pick(rng, _free_mask(s, boxes), s)
        if b is None:
          break
        boxes.append(b)
      if len(boxes) == n:
        return boxes
    else:
      pair = _place_pair(rng, rel, sizes[0], objs[0][1], sizes[1], objs[1][1])
      if pair is not None:
        return list(pair)
  return _fallback_layout(n, rel)


def render(metadata: dict, rng: np.random.Generator) -> np.ndarray:
  """Draw one (32, 32, 3) uint8 image satisfying ``metadata`` (always succeeds).

  Sizes are uniform in {8, 9, 10}; corners are drawn sequentially, each uniformly among the
  corners that keep >= 2 background px to earlier boxes and >= 1 px to the border (position
  prompts: the two corners jointly uniform among pairs that also satisfy the relation with a
  clear margin, see ``_relation_ok``). Up to 50 fresh attempts, then a fixed fallback layout.
  """
  objs = _objects_of(metadata)
  boxes = _layout(metadata, objs, rng)
  img = np.zeros((IMAGE_SIZE, IMAGE_SIZE, 3), np.uint8)
  for (ci, si), (y0, x0, s) in zip(objs, boxes):
    img[y0 : y0 + s, x0 : x0 + s][_MASKS[(SHAPES[si], s)]] = _PALETTE_ARR[ci]
  return img


def render_batch(metadatas: Sequence[dict], seed_or_rng: int | np.random.Generator = 0) -> np.ndarray:
  """Render a list of metadata -> (B, 32, 32, 3) uint8 (one shared generator, in order)."""
  rng = seed_or_rng if isinstance(seed_or_rng, np.random.Generator) else np.random.default_rng(seed_or_rng)
  out = np.zeros((len(metadatas), IMAGE_SIZE, IMAGE_SIZE, 3), np.uint8)
  for k, md in enumerate(metadatas):
    out[k] = render(md, rng)
  return out


# ----------------------------------------------------------------------------- tokens


def patchify(images):
  """(..., 32, 32, 3) uint8 -> (..., 64, 48) float32 in [-1, 1] (numpy or jax arrays).

  token t = 8 * pr + pc holds pixels rows 4pr..4pr+3, cols 4pc..4pc+3; channel index
  inside the token is (r * 4 + c) * 3 + ch. Value = x / 255 * 2 - 1.
  """
  lead = tuple(images.shape[:-3])
  nd = len(lead)
  x = images.reshape(lead + (GRID, PATCH, GRID, PATCH, 3))
  perm = tuple(range(nd)) + (nd, nd + 2, nd + 1, nd + 3, nd + 4)
  x = x.transpose(perm).reshape(lead + (NUM_TOKENS, TOKEN_DIM))
  return x.astype(np.float32) / np.float32(255.0) * np.float32(2.0) - np.float32(1.0)


def unpatchify(tokens):
  """Inverse of ``patchify``: (..., 64, 48) -> (..., 32, 32, 3) uint8 (clip, round((x+1)/2*255))."""
  lead = tuple(tokens.shape[:-2])
  nd = len(lead)
  x = tokens.astype(np.float32).clip(-1.0, 1.0)
  x = ((x + np.float32(1.0)) / np.float32(2.0) * np.float32(255.0)).round().astype(np.uint8)
  x = x.reshape(lead + (GRID, GRID, PATCH, PATCH, 3))
  perm = tuple(range(nd)) + (nd, nd + 2, nd + 1, nd + 3, nd + 4)
  return x.transpose(perm).reshape(lead + (IMAGE_SIZE, IMAGE_SIZE, 3))


# ----------------------------------------------------------------------------- splits

_HOLDOUT_PAIRS = 64  # two_object unordered pairs / position arrangements held out
_CLASS_CAP = 8
_VAL_PAIRS = 32  # validation: two_object pairs / position arrangements
_VAL_CLASS_CAP = 4


def _stable_key(text: str) -> str:
  return hashlib.sha256(("shapes-world-holdout:" + text).encode()).hexdigest()


def _greedy(cands: list[tuple], n: int, cap_axis: int | None = None, cap: int = _CLASS_CAP,
            salt: str = "") -> list[tuple]:
  """Pick n candidates (classA, classB[, axis]) in stable-hash order (of ``salt`` + text) under usage caps."""
  cands = sorted(cands, key=lambda c: _stable_key(salt + "|".join(map(str, c))))
  use = {c: 0 for c in CLASSES}
  axis_use: dict = {}
  out = []
  for c in cands:
    a, b = c[0], c[1]
    if use[a] >= cap or use[b] >= cap:
      continue
    if cap_axis is not None and axis_use.get(c[2], 0) >= cap_axis:
      continue
    use[a] += 1
    use[b] += 1
    if cap_axis is not None:
      axis_use[c[2]] = axis_use.get(c[2], 0) + 1
    out.append(c)
    if len(out) == n:
      return out
  raise RuntimeError("hold-out selection could not reach its size")  # never happens (tested)


@functools.lru_cache(maxsize=None)
def _heldout_prompts() -> dict[str, frozenset]:
  single = {f"a {COLORS[k]} {SHAPES[k % 3]}" for k in range(len(COLORS))}
  counting = set()
  for ci, col in enumerate(COLORS):
    for si, sh in enumerate(SHAPES):
      n = (2, 3, 4)[(ci + si) % 3]
      counting.add(f"{_NUMBER_WORD[n]} {col} {sh}s")
  pairs = [(a, b) for i, a in enumerate(CLASSES) for b in CLASSES[i + 1 :]]
  two = set()
  for a, b in _greedy(pairs, _HOLDOUT_PAIRS):
    two |= {f"a {a} and a {b}", f"a {b} and a {a}"}
  arrangements = [(a, b, ax) for a in CLASSES for b in CLASSES if a != b for ax in ("h", "v")]
  pos = set()
  for a, b, ax in _greedy(arrangements, _HOLDOUT_PAIRS, cap_axis=_HOLDOUT_PAIRS // 2):
    pos |= set(_arrangement(a, b, ax))
  return {
    "single_object": frozenset(single),
    "two_object": frozenset(two),
    "counting": frozenset(counting),
    "position": frozenset(pos),
  }


@functools.lru_cache(maxsize=None)
def _val_prompts() -> dict[str, frozenset]:
  """The validation prompts: held out by text from the eval prompts and from train (module docstring)."""
  held = _heldout_prompts()
  single = {f"a {COLORS[k]} {SHAPES[(k + 1) % 3]}" for k in (0, 2, 4)}
  counting = {f"{_NUMBER_WORD[(2, 3, 4)[(ci + si + 1) % 3]]} {col} {sh}s"
              for ci, col in enumerate(COLORS) for si, sh in enumerate(SHAPES) if (ci + si) % 2 == 0}
  pairs = [(a, b) for i, a in enumerate(CLASSES) for b in CLASSES[i + 1 :]
           if f"a {a} and a {b}" not in held["two_object"]]
  two = set()
  for a, b in _greedy(pairs, _VAL_PAIRS, cap=_VAL_CLASS_CAP, salt="val:"):
    two |= {f"a {a} and a {b}", f"a {b} and a {a}"}
  arrangements = [(a, b, ax) for a in CLASSES for b in CLASSES if a != b for ax in ("h", "v")
                  if _arrangement(a, b, ax)[0] not in held["position"]]
  pos = set()
  for a, b, ax in _greedy(arrangements, _VAL_PAIRS, cap_axis=_VAL_PAIRS // 2, cap=_VAL_CLASS_CAP, salt="val:"):
    pos |= set(_arrangement(a, b, ax))
  return {"single_object": frozenset(single), "two_object": frozenset(two), "counting": frozenset(counting),
          "position": frozenset(pos)}


def _arrangement(a: str, b: str, axis: str) -> tuple[str, str]:
  """The two wordings of ``a`` left of (axis 'h') or above (axis 'v') ``b``."""
  if axis == "h":
    return f"a {a} to the left of a {b}", f"a {b} to the right of a {a}"
  return f"a {a} above a {b}", f"a {b} below a {a}"


@functools.lru_cache(maxsize=None)
def _pools_cached(split: str) -> dict[str, tuple[dict, ...]]:
  held, val = _heldout_prompts(), _val_prompts()
  out = {}
  for t in TASKS:
    allp = _enumerate_cached(t)
    if split == "eval":
      out[t] = tuple(m for m in allp if m["prompt"] in held[t])
    elif split == "val":
      out[t] = tuple(m for m in allp if m["prompt"] in val[t])
    elif split == "train":
      out[t] = tuple(m for m in allp if m["prompt"] not in held[t] and m["prompt"] not in val[t])
    elif split == "all":
      out[t] = allp
    else:
      raise ValueError(f"split must be 'train', 'val', 'eval' or 'all', got {split!r}.")
  return out


def task_pools(split: str) -> dict[str, list[dict]]:
  """Unique prompts per task of a split: 'eval' (6 / 128 / 18 / 128 held out), 'val' (3 / 64 / 9 / 64, held
  out from train too), 'train' (the rest: 9 / 114 / 27 / 1032) or 'all'. Lists keep enumerate_prompts order."""
  return {t: [_copy_md(m) for m in ms] for t, ms in _pools_cached(split).items()}


EVAL_PER_TASK = 128


SPLITS = ("train", "val", "eval")


def split_records(split: str, num_train: int = 20000, seed: int = 0) -> list[dict]:
  """Deterministic records of a split (see the module docstring for the scheme).

  'eval' and 'val': 512 records, 128 per task, task-major, the held-out pools cycled in order (``seed`` and
  ``num_train`` unused). 'train': ``num_train`` records, record k of task TASKS[k % 4], drawn by
  walking seeded permutations of that task's train pool.
  """
  pools = _pools_cached(split) if split in SPLITS else None
  if pools is None:
    raise ValueError(f"split must be 'train', 'val' or 'eval', got {split!r}.")
  if split != "train":
    return [_copy_md(pools[t][k % len(pools[t])]) for t in TASKS for k in range(EVAL_PER_TASK)]
  rng = np.random.default_rng(seed)
  per_task = [(num_train - k + len(TASKS) - 1) // len(TASKS) for k in range(len(TASKS))]
  streams = []
  for t, n in zip(TASKS, per_task):
    pool = pools[t]
    idx = np.concatenate([rng.permutation(len(pool)) for _ in range(-(-n // len(pool)))])[:n] if n else []
    streams.append([pool[int(i)] for i in idx])
  return [_copy_md(streams[k % len(TASKS)][k // len(TASKS)]) for k in range(num_train)]


def grammar_sample(per_task: int, seed: int) -> list[dict]:
  """``per_task`` prompts of each task drawn uniformly (with replacement) from the whole grammar, task-major: the
  prompts an outside check would draw, blind to the splits (most of them are train prompts)."""
  rng = np.random.default_rng(seed)
  out = []
  for t in TASKS:
    pool = _enumerate_cached(t)
    out += [_copy_md(pool[int(i)]) for i in rng.integers(len(pool), size=per_task)]
  return out


def stratified_subset(records: Sequence[dict], num: int) -> list[dict]:
  """``num`` records with the tasks in turn (TASKS order) and, inside a task, its distinct prompts spread evenly
  over their first-appearance order; a prompt repeats only once every distinct prompt of its task is in (a small
  pool such as the 6 held-out single-object prompts). Deterministic; each repeat is a separate sample."""
  by_task: dict[str, list[dict]] = {}
  for r in records:
    seen = by_task.setdefault(r["tag"], [])
    if all(r["prompt"] != s["prompt"] for s in seen):
      seen.append(r)
  tasks = [t for t in TASKS if t in by_task] + sorted(t for t in by_task if t not in TASKS)
  if not tasks:
    return []
  picks = []
  for i, t in enumerate(tasks):
    pool, n = by_task[t], num // len(tasks) + (i < num % len(tasks))
    k = min(n, len(pool))
    first = [pool[j] for j in np.linspace(0, len(pool) - 1, k).round().astype(int)] if k else []
    picks.append([first[j % len(first)] for j in range(n)] if first else [])
  out = [picks[q % len(tasks)][q // len(tasks)] for q in range(sum(len(p) for p in picks))]
  return [_copy_md(r) if "include" in r else dict(r) for r in out]
