"""Shapes-world verifier (numpy reference and a jittable JAX twin that agrees bit-for-bit).

Contract: docs/shapes_world.md, the prompts and renders of :mod:`margrpo_jax.data.shapes`; the rules are written out
below. Every threshold uses exact integer arithmetic, so both implementations (and any checker written from the
contract) agree.

1. Pixel class: nearest of (black, *PALETTE in COLORS order) by squared RGB distance
   d2 = sum (p - c)^2 (integers; ties go to the earlier entry); min d2 > 60^2 = 3600 -> unknown.
2. Objects: 4-connected components of one palette class with area >= 12. Smaller components and
   unknown pixels are noise.
3. Shape, from the bbox (h rows, w cols), area A, k = floor(h / 2), and the component's pixel
   counts T in the top k rows and B in the bottom k rows of the box:
     w/h in [0.6, 1.6]            <=> 10 w >= 6 h and 10 w <= 16 h   (else unknown)
     triangle  a = (B - T)/(k w) >= 0.25 <=> k >= 1 and 4 (B - T) >= k w
     square    f = A / (h w) >= 0.92     <=> 100 A >= 92 h w
     circle    f >= 0.65                 <=> 100 A >= 65 h w
     else unknown (an unknown object is still an extra object).
4. Relation between objects a (subject) and b, centroids (row, col) = (Sr/A, Sc/A):
   DX = Sc_a A_b - Sc_b A_a = dx A_a A_b (dx = col_a - col_b), DY likewise on rows.
     left of:  DX <= -3 A_a A_b and |DX| > |DY|     right of: DX >= 3 A_a A_b and |DX| > |DY|
     above:    DY <= -3 A_a A_b and |DY| > |DX|     below:    DY >= 3 A_a A_b and |DY| > |DX|
   (rows grow downwards, so "above" means a smaller row).
5. strict: detected multiset of (colour, shape) == include (unknown shapes never match), and for
   position prompts the relation holds between the (then unique) subject and other object.
6. partial = mean of clauses: per include entry min(found, wanted) / max(found, wanted);
   position (if any): 1 if the relation holds for SOME (subject-class object, other-class object)
   pair, else 0; no-extra: 1 / (1 + extra), extra = sum over detected classes (incl. unknown shapes)
   of max(0, found - wanted).
   dense (the RL reward ``shapes_dense``) = mean(include clauses, position clause) / (1 + extra): the same
   clauses without the no-extra one, scaled down by every extra object instead. 1 exactly when strict; an empty
   canvas scores 0 (partial pays it 1 / (number of clauses), more than a ragged object gets).
7. noise = (#non-black-class pixels not in an object) / (#non-black-class pixels), 0 if none.
   "Non-black" means classified as a palette colour or unknown.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from margrpo_jax.data.shapes import CLASS_INDEX, CLASSES, COLORS, IMAGE_SIZE, PALETTE, RELATIONS

REFS = np.array([(0, 0, 0)] + [PALETTE[c] for c in COLORS], dtype=np.int32)  # (7, 3): black, palette
UNKNOWN_D2 = 60 * 60
MIN_AREA = 12
UNKNOWN_PIXEL = len(REFS)  # class id 7
SHAPE_UNKNOWN = "unknown"
NUM_CLASSES = len(CLASSES)  # 18 known (colour, shape) classes
NUM_DETECT_CLASSES = NUM_CLASSES + len(COLORS)  # + 6 "(colour, unknown)" classes
MAX_OBJECTS = (IMAGE_SIZE * IMAGE_SIZE) // MIN_AREA  # 85: bound on objects in one image
_NPIX = IMAGE_SIZE * IMAGE_SIZE


# ----------------------------------------------------------------------------- shared rules


def classify_pixels(image: np.ndarray) -> np.ndarray:
  """(32, 32, 3) uint8 -> (32, 32) int32: 0 black, 1..6 palette (COLORS order), 7 unknown."""
  x = np.asarray(image).astype(np.int32)
  d2 = ((x[..., None, :] - REFS) ** 2).sum(-1)  # (..., 7)
  cls = d2.argmin(-1).astype(np.int32)  # first minimum wins ties
  return np.where(d2.min(-1) > UNKNOWN_D2, UNKNOWN_PIXEL, cls).astype(np.int32)


def shape_of(h: int, w: int, area: int, top: int, bottom: int) -> str:
  """Shape rule of docs/shapes_world.md section 6 in exact integer arithmetic (see module docstring)."""
  if not (10 * w >= 6 * h and 10 * w <= 16 * h):
    return SHAPE_UNKNOWN
  k = h // 2
  if k >= 1 and 4 * (bottom - top) >= k * w:
    return "triangle"
  if 100 * area >= 92 * h * w:
    return "square"
  if 100 * area >= 65 * h * w:
    return "circle"
  return SHAPE_UNKNOWN


def relation_holds(rel: str, a: dict, b: dict) -> bool:
  """Does object a stand <rel> object b? (objects carry integer 'area', 'sum_row', 'sum_col')."""
  aa, ab = a["area"], b["area"]
  DX = a["sum_col"] * ab - b["sum_col"] * aa
  DY = a["sum_row"] * ab - b["sum_row"] * aa
  m = 3 * aa * ab
  if rel == "to the left of":
    return DX <= -m and abs(DX) > abs(DY)
  if rel == "to the right of":
    return DX >= m and abs(DX) > abs(DY)
  if rel == "above":
    return DY <= -m and abs(DY) > abs(DX)
  if rel == "below":
    return DY >= m and abs(DY) > abs(DX)
  raise ValueError(f"relation must be one of {RELATIONS}, got {rel!r}.")


def _targets(metadata: dict):
  """(wanted: {class: count}, relation or None, subject class, other class) from metadata."""
  inc = metadata.get("include")
  if not isinstance(inc, (list, tuple)) or not inc:
    raise ValueError("metadata field 'include' must be a non-empty list.")
  wanted: dict[str, int] = {}
  for k, e in enumerate(inc):
    c = e.get("class") if isinstance(e, dict) else None
    if c not in CLASS_INDEX:
      raise ValueError(f"metadata field 'include[{k}].class' must be one of the 18 classes, got {c!r}.")
    if c in wanted:
      raise ValueError(f"metadata field 'include[{k}].class' repeats {c!r}; the classes must differ.")
    n = e.get("count")
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
      raise ValueError(f"metadata field 'include[{k}].count' must be an int >= 1, got {n!r}.")
    wanted[c] = int(n)
  pos = metadata.get("position")
  if pos is None:
    return wanted, None, None, None
  if (
    not isinstance(pos, (list, tuple))
    or len(pos) != 2
    or pos[0] not in RELATIONS
    or pos[1] not in (0, 1)
    or len(inc) != 2
  ):
    raise ValueError(f"metadata field 'position' must be [relation, 0 or 1] with two include entries, got {pos!r}.")
  i = int(pos[1])
  return wanted, pos[0], inc[i]["class"], inc[1 - i]["class"]


# ----------------------------------------------------------------------------- numpy reference


def find_objects(image: np.ndarray):
  """Connected components (4-neighbour flood fill, pure Python on the palette pixels).

  Returns (objects, n_nonblack, n_in_objects); each object a dict with colour, shape, class
  (e.g. 'red circle' or 'red unknown'), area, bbox (row0, col0, row1, col1) inclusive,
  centroid (row, col) floats, and the integer sums sum_row / sum_col.
  """
  cls = classify_pixels(image)
  flat = cls.ravel().tolist()
  n = IMAGE_SIZE
  seen = [False] * _NPIX
  objects = []
  in_obj = 0
  for start in range(_NPIX):
    c = flat[start]
    if seen[start] or c == 0 or c == UNKNOWN_PIXEL:
      continue
    seen[start] = True
    stack = [start]
    pix = []
    while stack:
      p = stack.pop()
      pix.append(p)
      r, q = divmod(p, n)
      for nb, ok in ((p - n, r > 0), (p + n, r < n - 1), (p - 1, q > 0), (p + 1, q < n - 1)):
        if ok and not seen[nb] and flat[nb] == c:
          seen[nb] = True
          stack.append(nb)
    if len(pix) < MIN_AREA:
      continue
    rows = [p // n for p in pix]
    cols = [p % n for p in pix]
    r0, r1, c0, c1 = min(rows), max(rows), min(cols), max(cols)
    h, w, area = r1 - r0 + 1, c1 - c0 + 1, len(pix)
    k = h // 2
    top = sum(1 for r in rows if r < r0 + k)
    bottom = sum(1 for r in rows if r > r1 - k)
    shape = shape_of(h, w, area, top, bottom)
    colour = COLORS[c - 1]
    sr, sc = sum(rows), sum(cols)
    objects.append(
      {
        "colour": colour,
        "shape": shape,
        "class": f"{colour} {shape}",
        "area": area,
        "bbox": (r0, c0, r1, c1),
        "centroid": (sr / area, sc / area),
        "sum_row": sr,
        "sum_col": sc,
      }
    )
    in_obj += area
  n_nonblack = int((cls != 0).sum())
  return objects, n_nonblack, in_obj


def verify(image: np.ndarray, metadata: dict) -> dict:
  """Verify one (32, 32, 3) uint8 image against shapes-world metadata (numpy reference).

  Returns {"strict": bool, "partial": float in [0, 1], "noise": float, "objects": [...],
  "extra": int, "position_ok": bool | None}; see the module docstring for the rules.
  """
  image = np.asarray(image)
  if image.shape != (IMAGE_SIZE, IMAGE_SIZE, 3):
    raise ValueError(f"image must have shape (32, 32, 3), got {image.shape}.")
  wanted, rel, subj, other = _targets(metadata)
  objects, n_nonblack, in_obj = find_objects(image)
  found: dict[str, int] = {}
  for o in objects:
    found[o["class"]] = found.get(o["class"], 0) + 1
  clauses = [min(found.get(c, 0), n) / max(found.get(c, 0), n) for c, n in wanted.items()]
  pos_ok = None
  if rel is not None:
    sa = [o for o in objects if o["class"] == subj]
    sb = [o for o in objects if o["class"] == other]
    pos_ok = any(relation_holds(rel, a, b) for a in sa for b in sb)
    clauses.append(1.0 if pos_ok else 0.0)
  extra = sum(max(0, n - wanted.get(c, 0)) for c, n in found.items())
  clauses.append(1.0 / (1.0 + extra))
  multiset_ok = found == wanted
  strict = bool(multiset_ok and (pos_ok is None or pos_ok))
  noise = (n_nonblack - in_obj) / n_nonblack if n_nonblack else 0.0
  return {
    "strict": strict,
    "partial": float(sum(clauses) / len(clauses)),
    "dense": float(sum(clauses[:-1]) / (len(clauses) - 1) / (1.0 + extra)),
    "noise": float(noise),
    "objects": objects,
    "extra": int(extra),
    "position_ok": pos_ok,
  }


# ----------------------------------------------------------------------------- JAX twin


def encode_metadata(metadatas: Sequence[dict]) -> dict:
  """Metadata list -> static-shape numpy arrays for ``verify_jax``.

  wanted (B, 18) int32 counts per class (CLASSES order); relation (B,) int32 index into
  RELATIONS, -1 for none; subject / other (B,) int32 class indices, -1 for none.
  """
  B = len(metadatas)
  wanted = np.zeros((B, NUM_CLASSES), np.int32)
  relation = np.full((B,), -1, np.int32)
  subject = np.full((B,), -1, np.int32)
  other = np.full((B,), -1, np.int32)
  for k, md in enumerate(metadatas):
    w, rel, s, o = _targets(md)
    for c, n in w.items():
      wanted[k, CLASS_INDEX[c]] = n
    if rel is not None:
      relation[k] = RELATIONS.index(rel)
      subject[k] = CLASS_INDEX[s]
      other[k] = CLASS_INDEX[o]
  return {"wanted": wanted, "relation": relation, "subject": subject, "other": other}


def _verify_one_jax(image, wanted, relation, subject, other):
  import jax
  import jax.numpy as jnp

  n = IMAGE_SIZE
  NP = _NPIX
  # 1. pixel classes
  x = image.astype(jnp.int32)
  d2 = ((x[:, :, None, :] - jnp.asarray(REFS)[None, None]) ** 2).sum(-1)  # (32, 32, 7)
  cls = jnp.where(d2.min(-1) > UNKNOWN_D2, UNKNOWN_PIXEL, jnp.argmin(d2, -1)).astype(jnp.int32)
  fg = (cls >= 1) & (cls <= len(COLORS))
  idx = jnp.arange(NP, dtype=jnp.int32).reshape(n, n)
  BIG = jnp.int32(NP)
  lab0 = jnp.where(fg, idx, BIG)

  # neighbour validity: same palette class (both foreground)
  def same(sl_a, sl_b):
    return fg[sl_a] & (cls[sl_a] == cls[sl_b])

  s_up = same((slice(1, None), slice(None)), (slice(None, -1), slice(None)))  # pixel (r, c) with (r-1, c)
  s_left = same((slice(None), slice(1, None)), (slice(None), slice(None, -1)))  # (r, c) with (r, c-1)
  pad_r = jnp.zeros((1, n), bool)
  pad_c = jnp.zeros((n, 1), bool)
  e_up = jnp.concatenate([pad_r, s_up], 0)  # edge to the row above
  e_down = jnp.concatenate([s_up, pad_r], 0)  # edge to the row below
  e_left = jnp.concatenate([pad_c, s_left], 1)
  e_right = jnp.concatenate([s_left, pad_c], 1)

  def step(lab):
    big_r = jnp.full((1, n), BIG)
    big_c = jnp.full((n, 1), BIG)
    up = jnp.where(e_up, jnp.concatenate([big_r, lab[:-1]], 0), BIG)
    down = jnp.where(e_down, jnp.concatenate([lab[1:], big_r], 0), BIG)
    left = jnp.where(e_left, jnp.concatenate([big_c, lab[:, :-1]], 1), BIG)
    right = jnp.where(e_right, jnp.concatenate([lab[:, 1:], big_c], 1), BIG)
    new = jnp.minimum(jnp.minimum(lab, up), jnp.minimum(down, jnp.minimum(left, right)))
    # pointer jumping: a label is a pixel index of the same component whose own label is <= it
    for _ in range(2):
      flat = jnp.concatenate([new.ravel(), jnp.array([NP], jnp.int32)])
      new = jnp.where(fg, flat[new], BIG)
    return new

  def cond(state):
    return state[1]

  def body(state):
    lab, _ = state
    new = step(lab)
    return new, jnp.any(new != lab)

  lab, _ = jax.lax.while_loop(cond, body, (lab0, jnp.bool_(True)))

  # 2. per-component statistics (segment = min pixel index; non-foreground -> segment NP)
  seg = lab.ravel()
  rows = (idx // n).ravel()
  cols = (idx % n).ravel()
  ns = NP + 1
  ones = jnp.ones((NP,), jnp.int32)
  area = jax.ops.segment_sum(ones, seg, ns)[:NP]
  present = area > 0
  r0 = jnp.where(present, jax.ops.segment_min(rows, seg, ns)[:NP], 0)
  r1 = jnp.where(present, jax.ops.segment_max(rows, seg, ns)[:NP], 0)
  c0 = jnp.where(present, jax.ops.segment_min(cols, seg, ns)[:NP], 0)
  c1 = jnp.where(present, jax.ops.segment_max(cols, seg, ns)[:NP], 0)
  sr = jax.ops.segment_sum(rows, seg, ns)[:NP]
  sc = jax.ops.segment_sum(cols, seg, ns)[:NP]
  colour = jnp.where(present, jax.ops.segment_max(cls.ravel(), seg, ns)[:NP], 1) - 1  # 0..5
  h = r1 - r0 + 1
  w = c1 - c0 + 1
  k = h // 2
  segc = jnp.minimum(seg, NP - 1)
  is_fg = fg.ravel()
  top_px = is_fg & (rows < (r0 + k)[segc])
  bot_px = is_fg & (rows > (r1 - k)[segc])
  top = jax.ops.segment_sum(top_px.astype(jnp.int32), seg, ns)[:NP]
  bot = jax.ops.segment_sum(bot_px.astype(jnp.int32), seg, ns)[:NP]

  obj = area >= MIN_AREA
  ratio_ok = (10 * w >= 6 * h) & (10 * w <= 16 * h)
  tri = ratio_ok & (k >= 1) & (4 * (bot - top) >= k * w)
  sq = ratio_ok & ~tri & (100 * area >= 92 * h * w)
  circ = ratio_ok & ~tri & ~sq & (100 * area >= 65 * h * w)
  shape = jnp.where(tri, 2, jnp.where(sq, 1, jnp.where(circ, 0, 3)))
  cid = jnp.where(shape < 3, colour * 3 + shape, NUM_CLASSES + colour)  # (NP,) in [0, 24)
  found = jax.ops.segment_sum(obj.astype(jnp.int32), cid, NUM_DETECT_CLASSES)  # (24,)

  # 3. noise
  n_nonblack = (cls != 0).sum()
  in_obj = jnp.where(obj, area, 0).sum()
  noise = jnp.where(n_nonblack > 0, (n_nonblack - in_obj) / jnp.maximum(n_nonblack, 1), 0.0)

  # 4. position: any (subject-class object, other-class object) pair satisfying the relation
  def members(c):
    m = obj & (cid == c)
    (ix,) = jnp.nonzero(m, size=MAX_OBJECTS, fill_value=0)
    valid = jnp.arange(MAX_OBJECTS) < m.sum()
    return ix, valid

  ia, va = members(subject)
  ib, vb = members(other)
  Aa, Ab = area[ia][:, None], area[ib][None, :]
  DX = sc[ia][:, None] * Ab - sc[ib][None, :] * Aa
  DY = sr[ia][:, None] * Ab - sr[ib][None, :] * Aa
  m = 3 * Aa * Ab
  hx = jnp.abs(DX) > jnp.abs(DY)
  hy = jnp.abs(DY) > jnp.abs(DX)
  conds = jnp.stack([(DX <= -m) & hx, (DX >= m) & hx, (DY <= -m) & hy, (DY >= m) & hy])
  rel_ok = conds[jnp.clip(relation, 0, 3)]
  has_pos = relation >= 0
  pos_ok = has_pos & jnp.any(rel_ok & va[:, None] & vb[None, :])

  # 5. strict and partial
  wanted_ext = jnp.concatenate([wanted, jnp.zeros((len(COLORS),), jnp.int32)])
  multiset_ok = jnp.all(found == wanted_ext)
  strict = multiset_ok & (pos_ok | ~has_pos)
  f18 = found[:NUM_CLASSES].astype(jnp.float32)
  w18 = wanted.astype(jnp.float32)
  inc = wanted > 0
  terms = jnp.where(inc, jnp.minimum(f18, w18) / jnp.maximum(jnp.maximum(f18, w18), 1.0), 0.0)
  extra = jnp.maximum(found - wanted_ext, 0).sum()
  total = terms.sum() + pos_ok.astype(jnp.float32) + 1.0 / (1.0 + extra.astype(jnp.float32))
  count = inc.sum() + has_pos.astype(jnp.int32) + 1
  partial = total / count.astype(jnp.float32)
  wanted_clauses = terms.sum() + pos_ok.astype(jnp.float32)
  dense = wanted_clauses / jnp.maximum(count - 1, 1).astype(jnp.float32) / (1.0 + extra.astype(jnp.float32))
  return {"strict": strict, "partial": partial.astype(jnp.float32), "dense": dense.astype(jnp.float32),
          "noise": noise.astype(jnp.float32)}


_VERIFY_JIT = None


def verify_jax(images, encoded: dict) -> dict:
  """Batched JAX verifier: images (B, 32, 32, 3) uint8, ``encoded`` from ``encode_metadata``.

  Returns {"strict": (B,) bool, "partial", "dense", "noise": (B,) float32}; jitted and
  vmapped (static shapes). Components: min-label propagation over equal-class 4-neighbours
  with pointer jumping inside ``lax.while_loop`` until no label changes; labels converge to the
  smallest pixel index of each component, which then serves as the segment id for
  ``jax.ops.segment_*`` statistics over 1024 (+1 background) segments.
  Also usable inside a user's own jit (it is a pure function of arrays).
  """
  global _VERIFY_JIT
  if _VERIFY_JIT is None:
    import jax

    _VERIFY_JIT = jax.jit(jax.vmap(_verify_one_jax))
  return _VERIFY_JIT(images, encoded["wanted"], encoded["relation"], encoded["subject"], encoded["other"])


def verify_jax_fn():
  """The un-jitted batched function ``f(images, wanted, relation, subject, other)`` (vmapped),
  for composing inside a larger jitted step."""
  import jax

  return jax.vmap(_verify_one_jax)


def score_images(images, metadatas: Sequence[dict]) -> dict:
  """Score a batch with the JAX verifier (batch padded to a power of two >= 8 to limit recompiles).

  Returns {"per_image": [{"strict": bool, "partial": float, "dense": float, "noise": float}, ...],
  "strict_mean", "partial_mean", "noise_mean"} (plain Python floats).
  """
  images = np.asarray(images)
  if images.ndim != 4 or images.shape[1:] != (IMAGE_SIZE, IMAGE_SIZE, 3):
    raise ValueError(f"images must have shape (B, 32, 32, 3), got {images.shape}.")
  if len(metadatas) != images.shape[0]:
    raise ValueError(f"got {images.shape[0]} images but {len(metadatas)} metadata records.")
  if images.shape[0] == 0:
    return {"per_image": [], "strict_mean": 0.0, "partial_mean": 0.0, "noise_mean": 0.0}
  B = images.shape[0]
  Bp = max(8, 1 << (B - 1).bit_length())  # pad to a power of two: few distinct compiled shapes
  enc = encode_metadata(metadatas)
  pad = Bp - B
  imgs = np.concatenate([images.astype(np.uint8), np.zeros((pad,) + images.shape[1:], np.uint8)])
  enc = {
    k: np.concatenate([v, np.full((pad,) + v.shape[1:], 0 if k == "wanted" else -1, v.dtype)]) for k, v in enc.items()
  }
  out = verify_jax(imgs, enc)
  strict = np.asarray(out["strict"])[:B]
  partial = np.asarray(out["partial"])[:B]
  dense = np.asarray(out["dense"])[:B]
  noise = np.asarray(out["noise"])[:B]
  per = [{"strict": bool(s), "partial": float(p), "dense": float(d), "noise": float(z)}
         for s, p, d, z in zip(strict, partial, dense, noise)]
  return {
    "per_image": per,
    "strict_mean": float(strict.mean()),
    "partial_mean": float(partial.mean()),
    "noise_mean": float(noise.mean()),
  }
