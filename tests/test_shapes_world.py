"""Tests of the shapes world: grammar, metadata, renderer, splits, tokens and both verifiers."""

import functools
import json

import numpy as np
import pytest

from margrpo_jax.data import shapes as S
from margrpo_jax.rewards import shapes_verifier as V

RED, GREEN, BLUE = (np.array(S.PALETTE[c], np.uint8) for c in ("red", "green", "blue"))


def _blank():
  return np.zeros((32, 32, 3), np.uint8)


def _draw(img, shape, s, y0, x0, rgb):
  img[y0 : y0 + s, x0 : x0 + s][S.shape_mask(shape, s)] = rgb
  return img


def _md(prompt):
  md = S.parse_prompt(prompt)
  assert md is not None, prompt
  return md


@functools.lru_cache(maxsize=None)
def _rendered(n_per_task=100, seed=0):
  rng = np.random.default_rng(seed)
  mds = [S.sample_metadata(rng, t) for t in S.TASKS for _ in range(n_per_task)]
  return mds, S.render_batch(mds, rng)


# ----------------------------------------------------------------------------- grammar / metadata


def test_constants():
  assert len(S.CLASSES) == 18 and S.CLASSES[:4] == ("red circle", "red square", "red triangle", "green circle")
  assert S.PALETTE["blue"] == (50, 100, 240) and S.PALETTE["cyan"] == (40, 210, 220)
  assert (S.NUM_TOKENS, S.TOKEN_DIM, S.IMAGE_SIZE, S.PATCH) == (64, 48, 32, 4)


def test_enumerate_counts_and_uniqueness():
  sizes = {t: len(S.enumerate_prompts(t)) for t in S.TASKS}
  assert sizes == {"single_object": 18, "two_object": 306, "counting": 54, "position": 1224}
  texts = [m["prompt"] for t in S.TASKS for m in S.enumerate_prompts(t)]
  assert len(set(texts)) == len(texts)
  assert S.enumerate_prompts("position")[0] == {
    "tag": "position",
    "prompt": "a red circle to the left of a red square",
    "include": [{"class": "red circle", "count": 1}, {"class": "red square", "count": 1}],
    "position": ["to the left of", 0],
  }
  assert _md("three cyan triangles")["include"] == [{"class": "cyan triangle", "count": 3}]
  assert _md("a red circle and a blue square")["position"] is None


def test_parse_roundtrip_json_and_validate_all():
  for t in S.TASKS:
    for md in S.enumerate_prompts(t):
      assert S.parse_prompt(md["prompt"]) == md
      S.validate_metadata(md)
      assert S.metadata_from_json(S.metadata_to_json(md)) == md
      assert json.loads(json.dumps(md)) == md
  for bad in (
    "a red circle and a red circle",
    "a pink circle",
    "one red circle",
    "a red circles",
    "",
    None,
    "a red circle left of a blue square",
    "a red circle to the left of a red circle",
  ):
    assert S.parse_prompt(bad) is None


@pytest.mark.parametrize(
  "mutate, field",
  [
    (lambda m: m.pop("include"), "'include'"),
    (lambda m: m.update(tag="colors"), "'tag'"),
    (lambda m: m["include"][0].update({"class": "pink circle"}), "include[0].class"),
    (lambda m: m["include"][0].update(count=2), "include[0].count"),
    (lambda m: m["include"][0].update(count="1"), "include[0].count"),
    (lambda m: m["include"][1].update({"class": m["include"][0]["class"]}), "include[1].class"),
    (lambda m: m.update(position=["near", 0]), "'position'"),
    (lambda m: m.update(position=["above", 2]), "'position'"),
    (lambda m: m.update(prompt="a red circle above a red square"), "'prompt'"),
    (lambda m: m["include"].append({"class": "blue circle", "count": 1}), "'include'"),
  ],
)
def test_validate_rejects(mutate, field):
  md = _md("a red circle to the left of a red square")
  mutate(md)
  with pytest.raises(ValueError, match=field.replace("[", r"\[").replace("]", r"\]")):
    S.validate_metadata(md)


def test_validate_more():
  with pytest.raises(ValueError, match="'position'"):
    S.validate_metadata({**_md("a red circle"), "position": ["above", 0]})
  with pytest.raises(ValueError, match="include\\[0\\].count"):
    S.validate_metadata({**_md("two red circles"), "include": [{"class": "red circle", "count": 5}]})
  with pytest.raises(ValueError, match="dict"):
    S.validate_metadata("a red circle")
  # position index 1 is allowed: include[1] stands <relation> include[0]
  md = _md("a red circle above a blue square")
  flipped = {**md, "include": md["include"][::-1], "position": ["above", 1]}
  S.validate_metadata(flipped)


def test_sample_metadata():
  rng = np.random.default_rng(0)
  tags = [S.sample_metadata(rng)["tag"] for _ in range(400)]
  assert set(tags) == set(S.TASKS)
  pool = S.task_pools("eval")
  for _ in range(50):
    md = S.sample_metadata(rng, pool=pool)
    assert md in pool[md["tag"]]
  assert S.sample_metadata(rng, "counting")["tag"] == "counting"
  md = S.sample_metadata(rng, "single_object", pool=pool["single_object"])
  md["include"][0]["count"] = 99  # returned copies never alias the cached pools
  assert all(m["include"][0]["count"] == 1 for m in S.task_pools("eval")["single_object"])


# ----------------------------------------------------------------------------- renderer


def test_render_properties():
  mds, imgs = _rendered()
  pal = {tuple(v) for v in S.PALETTE.values()}
  for md, img in zip(mds, imgs):
    assert img.dtype == np.uint8 and img.shape == (32, 32, 3)
    nz = img.any(-1)
    assert {tuple(p) for p in img[nz]} <= pal
    assert not nz[0].any() and not nz[-1].any() and not nz[:, 0].any() and not nz[:, -1].any()
    objs = V.verify(img, md)["objects"]
    assert len(objs) == sum(e["count"] for e in md["include"])
    for a in range(len(objs)):
      (r0, c0, r1, c1) = objs[a]["bbox"]
      assert 8 <= r1 - r0 + 1 <= 10 and r1 - r0 == c1 - c0
      for b in range(a):
        (q0, d0, q1, d1) = objs[b]["bbox"]
        gap = max(q0 - r1 - 1, r0 - q1 - 1, d0 - c1 - 1, c0 - d1 - 1)
        assert gap >= 2
    if md["position"] is not None:
      sub = objs[0] if objs[0]["class"] == md["include"][0]["class"] else objs[1]
      oth = objs[1] if sub is objs[0] else objs[0]
      dy = sub["centroid"][0] - oth["centroid"][0]
      dx = sub["centroid"][1] - oth["centroid"][1]
      along, across = (dx, dy) if "left" in md["position"][0] or "right" in md["position"][0] else (dy, dx)
      assert abs(along) >= 6 and abs(along) > abs(across)


def test_render_deterministic_and_batch():
  md = _md("four purple triangles")
  a = S.render(md, np.random.default_rng(5))
  b = S.render(md, np.random.default_rng(5))
  assert np.array_equal(a, b)
  batch = S.render_batch([md] * 3, 7)
  assert batch.shape == (3, 32, 32, 3) and np.array_equal(batch, S.render_batch([md] * 3, 7))


def test_fallback_layouts_pass(monkeypatch):
  orig = S._layout
  monkeypatch.setattr(S, "_layout", lambda md, objs, rng: orig(md, objs, rng, max_tries=0))
  rng = np.random.default_rng(0)
  mds = [_md(p) for p in ("four red circles", "three blue triangles", "a green square and a cyan triangle")]
  mds += [_md(f"a red triangle {r} a yellow circle") for r in S.RELATIONS]
  mds += [_md(f"a blue circle {r} a purple triangle") for r in S.RELATIONS]
  for md in mds:
    assert V.verify(S.render(md, rng), md)["strict"], md["prompt"]


def test_every_render_passes_strict():
  mds, imgs = _rendered()
  for md, img in zip(mds, imgs):
    r = V.verify(img, md)
    assert r["strict"] and r["partial"] == 1.0 and r["noise"] == 0.0, md["prompt"]
  # and every prompt of the small tasks, plus every position relation/shape combination
  rng = np.random.default_rng(1)
  mds = S.enumerate_prompts("single_object") + S.enumerate_prompts("counting") + S.enumerate_prompts("position")[::7]
  imgs = S.render_batch(mds, rng)
  out = V.verify_jax(imgs, V.encode_metadata(mds))
  assert np.asarray(out["strict"]).all() and np.all(np.asarray(out["partial"]) == 1.0)


def test_other_prompt_rejected():
  rng = np.random.default_rng(3)
  for t in S.TASKS:
    pool = S.enumerate_prompts(t)
    mds, others = [], []
    for _ in range(300):
      i, j = rng.choice(len(pool), 2, replace=False)
      mds.append(pool[i])
      others.append(pool[j])
    imgs = S.render_batch(mds, rng)
    out = np.asarray(V.verify_jax(imgs, V.encode_metadata(others))["strict"])
    assert out.mean() <= 0.01, (t, out.mean())


# ----------------------------------------------------------------------------- verifier by hand


def test_pixel_classes():
  img = _blank()
  img[0, 0] = RED
  img[0, 1] = (170, 40, 40)  # d2 to red = 3600: still red
  img[0, 2] = (169, 40, 40)  # 3721 > 3600: unknown
  img[0, 3] = (128, 128, 128)  # far from everything: unknown
  img[0, 4] = (20, 20, 20)  # near black: background
  img[0, 5] = S.PALETTE["cyan"]
  cls = V.classify_pixels(img)
  assert list(cls[0, :6]) == [1, 1, 7, 7, 0, 6]


@pytest.mark.parametrize("shape", S.SHAPES)
@pytest.mark.parametrize("s", S.SIZES)
def test_rendered_shapes_recognised(shape, s):
  img = _draw(_blank(), shape, s, 5, 7, BLUE)
  r = V.verify(img, _md(f"a blue {shape}"))
  (o,) = r["objects"]
  assert o["shape"] == shape and o["colour"] == "blue" and r["strict"]
  assert o["bbox"] == (5, 7, 5 + s - 1, 7 + s - 1)
  assert o["centroid"][1] == 7 + (s - 1) / 2


def test_known_square():
  img = _blank()
  img[4:12, 10:18] = RED  # 8 x 8
  (o,) = V.verify(img, _md("a red square"))["objects"]
  assert (o["shape"], o["area"], o["bbox"], o["centroid"]) == ("square", 64, (4, 10, 11, 17), (7.5, 13.5))


def test_unknown_shapes_and_noise():
  img = _draw(_blank(), "circle", 8, 2, 2, RED)  # 52 px
  img[20, 20:23] = GREEN  # 3 px blob -> noise
  img[25, 5] = (128, 128, 128)  # unknown pixel -> noise
  r = V.verify(img, _md("a red circle"))
  assert r["strict"] and r["partial"] == 1.0 and len(r["objects"]) == 1
  assert r["noise"] == pytest.approx(4 / 56)
  # a 3 x 12 bar is an object of unknown shape: an extra object
  img[26:29, 14:26] = BLUE
  r = V.verify(img, _md("a red circle"))
  assert not r["strict"] and {o["class"] for o in r["objects"]} == {"red circle", "blue unknown"}
  assert r["partial"] == pytest.approx((1 + 1 / 2) / 2)
  # an inverted (apex-down) triangle has a < 0 and f < 0.65: unknown
  img = _blank()
  img[2:12, 2:12][S.shape_mask("triangle", 10)[::-1]] = RED
  (o,) = V.verify(img, _md("a red triangle"))["objects"]
  assert o["shape"] == "unknown"


def test_partial_by_hand():
  two_red = _draw(_draw(_blank(), "circle", 9, 2, 2, RED), "circle", 9, 18, 18, RED)
  r = V.verify(two_red, _md("a red circle"))
  # include: min(2,1)/max(2,1) = 1/2; extra = 1 -> 1/2; mean = 1/2
  assert not r["strict"] and r["partial"] == pytest.approx(0.5)
  r = V.verify(two_red, _md("three red circles"))
  # include 2/3, no extra -> 1; mean (2/3 + 1) / 2; dense: 2/3 / (1 + 0)
  assert r["partial"] == pytest.approx((2 / 3 + 1) / 2) and r["dense"] == pytest.approx(2 / 3)
  assert V.verify(two_red, _md("a red circle"))["dense"] == pytest.approx(1 / 2 / 2)  # 1/2 / (1 + 1 extra)
  assert V.verify(_blank(), _md("a red circle"))["dense"] == 0.0  # partial pays the empty canvas 1/2
  r = V.verify(two_red, _md("a red circle and a blue square"))
  # red 1/2, blue 0/1, extra 1 -> 1/2: (1/2 + 0 + 1/2) / 3
  assert r["partial"] == pytest.approx(1 / 3)


def test_position_by_hand():
  img = _draw(_draw(_blank(), "circle", 9, 2, 10, RED), "square", 9, 18, 12, BLUE)  # red above blue
  r = V.verify(img, _md("a red circle above a blue square"))
  assert r["strict"] and r["partial"] == 1.0
  r = V.verify(img, _md("a blue square below a red circle"))
  assert r["strict"]
  for rel in ("to the left of", "to the right of", "below"):
    r = V.verify(img, _md(f"a red circle {rel} a blue square"))
    assert not r["strict"] and r["partial"] == pytest.approx(3 / 4)  # 1 + 1 + 0 + 1
  # |dx| must exceed |dy|: diagonal placement with dx == dy fails left/right and above/below
  img = _draw(_draw(_blank(), "square", 8, 2, 2, RED), "square", 8, 14, 14, BLUE)
  for rel in S.RELATIONS:
    assert not V.verify(img, _md(f"a red square {rel} a blue square"))["strict"]
  # "some pair": two red circles, only one of them left of the blue square
  img = _draw(_draw(_draw(_blank(), "circle", 8, 12, 1, RED), "circle", 8, 1, 22, RED), "square", 8, 12, 12, BLUE)
  r = V.verify(img, _md("a red circle to the left of a blue square"))
  # red 1/2, blue 1, position 1 (some pair), extra 1 -> 1/2: 3/4
  assert not r["strict"] and r["position_ok"] and r["partial"] == pytest.approx(0.75)


def test_relation_thresholds_exact():
  a = {"area": 1, "sum_row": 10, "sum_col": 10}
  for dx, ok in ((-3, True), (-2, False)):
    b = {"area": 1, "sum_row": 10, "sum_col": 10 - dx}
    assert V.relation_holds("to the left of", a, b) is ok
  b = {"area": 1, "sum_row": 14, "sum_col": 14}  # dx == dy: neither axis dominates
  assert not any(V.relation_holds(r, a, b) for r in S.RELATIONS)
  b = {"area": 1, "sum_row": 5, "sum_col": 10}  # a is 5 rows lower: below
  assert V.relation_holds("below", a, b) and not V.relation_holds("above", a, b)


# ----------------------------------------------------------------------------- numpy == JAX


def _corrupt(img, rng):
  img = img.copy()
  kind = rng.integers(9)
  if kind == 0:  # scattered palette pixels
    n = rng.integers(1, 40)
    ys, xs = rng.integers(0, 32, n), rng.integers(0, 32, n)
    img[ys, xs] = np.array(list(S.PALETTE.values()), np.uint8)[rng.integers(0, 6, n)]
  elif kind == 1:  # erase a random rectangle
    y, x = rng.integers(0, 28, 2)
    h, w = rng.integers(2, 10, 2)
    img[y : y + h, x : x + w] = 0
  elif kind == 2:  # recolour one colour to another palette colour
    cols = list(S.PALETTE.values())
    src, dst = rng.choice(6, 2, replace=False)
    m = np.all(img == cols[src], -1)
    img[m] = cols[dst]
  elif kind == 3:  # off-palette tint on a region
    y, x = rng.integers(0, 24, 2)
    img[y : y + 8, x : x + 8] = np.clip(img[y : y + 8, x : x + 8].astype(int) + rng.integers(-90, 90, 3), 0, 255)
  elif kind == 4:  # random pixel noise everywhere
    img = np.clip(img.astype(int) + rng.integers(-50, 50, img.shape), 0, 255).astype(np.uint8)
  elif kind == 5:  # random palette image (many components)
    pal = np.concatenate([np.zeros((1, 3), np.uint8), np.array(list(S.PALETTE.values()), np.uint8)])
    img = pal[rng.integers(0, 7, (32, 32)) * (rng.random((32, 32)) < 0.7)]
  elif kind == 6:  # random blocks of colour: large/odd components
    for _ in range(rng.integers(1, 6)):
      y, x = rng.integers(0, 30, 2)
      h, w = rng.integers(1, 16, 2)
      img[y : y + h, x : x + w] = list(S.PALETTE.values())[rng.integers(6)]
  elif kind == 7:  # shift the image (may break the relation or clip objects)
    img = np.roll(img, tuple(rng.integers(-12, 12, 2)), axis=(0, 1))
  else:  # flip vertically (apex-down triangles, swapped above/below)
    img = img[::-1]
  return np.ascontiguousarray(img)


def _spiral():
  img = _blank()
  img[1:31:2, 1:31] = RED  # rows of a serpentine
  for k, r in enumerate(range(2, 30, 2)):
    img[r, 30 if k % 2 == 0 else 1] = RED
  return img


def test_numpy_jax_agree():
  rng = np.random.default_rng(11)
  mds, imgs = _rendered()
  sel = rng.choice(len(mds), 200, replace=False)
  images, metas = [], []
  for k in sel:
    images.append(imgs[k])
    metas.append(mds[k])
    images.append(_corrupt(imgs[k], rng))
    metas.append(mds[k] if rng.random() < 0.7 else S.sample_metadata(rng, mds[k]["tag"]))
  images.append(_spiral())  # one snake component of ~500 px: long label propagation
  metas.append(_md("a red square"))
  images.append(_blank())
  metas.append(_md("a red circle above a blue square"))
  images = np.stack(images)
  out = V.verify_jax(images, V.encode_metadata(metas))
  js, jp, jd, jn = (np.asarray(out[k]) for k in ("strict", "partial", "dense", "noise"))
  ref = [V.verify(i, m) for i, m in zip(images, metas)]
  assert np.array_equal(js, [r["strict"] for r in ref])
  np.testing.assert_allclose(jp, [r["partial"] for r in ref], atol=1e-6, rtol=0)
  np.testing.assert_allclose(jd, [r["dense"] for r in ref], atol=1e-6, rtol=0)
  assert np.array_equal(jd == 1.0, js)  # dense is 1 exactly when strict passes
  np.testing.assert_allclose(jn, [r["noise"] for r in ref], atol=1e-6, rtol=0)
  # the corruptions exercised failing branches
  assert 0 < js.mean() < 1 and (jn > 0).any() and ((jp > 0) & (jp < 1)).any()
  assert V.verify(images[-2], metas[-2])["objects"][0]["shape"] == "unknown"
  # empty image, position prompt: include 0 + 0, position 0, no extra 1 -> 1/4
  assert not ref[-1]["strict"] and ref[-1]["noise"] == 0.0 and ref[-1]["partial"] == pytest.approx(1 / 4)


def test_score_images():
  mds, imgs = _rendered()
  out = V.score_images(imgs[:16], mds[:16])
  assert out["strict_mean"] == 1.0 and out["partial_mean"] == 1.0 and len(out["per_image"]) == 16
  with pytest.raises(ValueError):
    V.score_images(imgs[:4], mds[:3])


# ----------------------------------------------------------------------------- splits


def test_splits():
  ev = S.split_records("eval")
  assert len(ev) == 512 and ev == S.split_records("eval")
  assert [m["tag"] for m in ev] == [t for t in S.TASKS for _ in range(128)]
  tr = S.split_records("train", num_train=2000, seed=0)
  assert len(tr) == 2000 and tr == S.split_records("train", num_train=2000, seed=0)
  assert tr != S.split_records("train", num_train=2000, seed=1)
  assert [m["tag"] for m in tr[:8]] == list(S.TASKS) * 2
  assert not {m["prompt"] for m in ev} & {m["prompt"] for m in tr}
  ev_pool, tr_pool, va_pool = S.task_pools("eval"), S.task_pools("train"), S.task_pools("val")
  sizes = {t: (len(ev_pool[t]), len(tr_pool[t]), len(va_pool[t])) for t in S.TASKS}
  assert sizes == {"single_object": (6, 9, 3), "two_object": (128, 114, 64), "counting": (18, 27, 9),
                   "position": (128, 1032, 64)}
  va = S.split_records("val")  # held out by text from train and eval: every choice of settings is read there
  assert len(va) == 512 and va == S.split_records("val")
  assert not {m["prompt"] for m in va} & ({m["prompt"] for m in ev} | {m["prompt"] for m in tr})
  for t in S.TASKS:
    text = lambda pool: {m["prompt"] for m in pool}
    assert not text(va_pool[t]) & (text(tr_pool[t]) | text(ev_pool[t])), t
  for t in S.TASKS:
    assert not {m["prompt"] for m in ev_pool[t]} & {m["prompt"] for m in tr_pool[t]}
    assert {m["prompt"] for m in ev if m["tag"] == t} == {m["prompt"] for m in ev_pool[t]}
  single_train = [m["include"][0]["class"].split() for m in tr_pool["single_object"]]
  assert {c for c, _ in single_train} == set(S.COLORS) and {s for _, s in single_train} == set(S.SHAPES)
  # held-out scenes are unseen in train in either wording; position relations balanced
  for m in ev_pool["two_object"]:
    a, b = (e["class"] for e in m["include"])
    assert f"a {b} and a {a}" in {x["prompt"] for x in ev_pool["two_object"]}
  rels = [m["position"][0] for m in ev_pool["position"]]
  assert all(rels.count(r) == 32 for r in S.RELATIONS)
  # every train prompt used (the split walks permutations of the pool)
  assert {m["prompt"] for m in S.split_records("train", num_train=8000)} == {
    m["prompt"] for t in S.TASKS for m in tr_pool[t]
  }


# ----------------------------------------------------------------------------- tokens


def test_patchify_roundtrip_and_layout():
  rng = np.random.default_rng(0)
  imgs = rng.integers(0, 256, (3, 32, 32, 3), dtype=np.uint8)
  tok = S.patchify(imgs)
  assert tok.shape == (3, 64, 48) and tok.dtype == np.float32
  assert tok.min() >= -1 and tok.max() <= 1
  assert np.array_equal(S.unpatchify(tok), imgs)
  img = _blank()
  img[5, 9, 2] = 255
  t = S.patchify(img)
  assert t.shape == (64, 48)
  # row 5 col 9 -> patch (1, 2) -> token 10; inside: (1, 1) channel 2 -> 17
  assert t[10, 17] == 1.0 and (np.delete(t.ravel(), 10 * 48 + 17) == -1).all()
  allv = np.arange(256, dtype=np.uint8).repeat(12).reshape(1, 32, 32, 3)[:, :, :, :]
  assert np.array_equal(S.unpatchify(S.patchify(allv)), allv)
  assert np.array_equal(S.unpatchify(np.full((64, 48), 7.0, np.float32)), np.full((32, 32, 3), 255, np.uint8))


def test_patchify_jax():
  import jax.numpy as jnp

  rng = np.random.default_rng(1)
  imgs = rng.integers(0, 256, (2, 32, 32, 3), dtype=np.uint8)
  tj = S.patchify(jnp.asarray(imgs))
  assert isinstance(tj, jnp.ndarray)
  # XLA may turn /255 into *(1/255): equal to 1 ulp, and the round trip stays exact
  np.testing.assert_allclose(np.asarray(tj), S.patchify(imgs), atol=1e-6, rtol=0)
  np.testing.assert_array_equal(np.asarray(S.unpatchify(tj)), imgs)
