"""The shipped base checkpoint (the README's main job samples it) loads and follows the prompt's colour.

It is an interim model: colours are right, shapes are still fragmented (strict pass 2.7% on the eval split,
README). The test pins what it does: on single-object eval prompts, the dominant palette colour of the image
is the prompt's colour for most images (measured when it was shipped: 32 of 32).
"""
import numpy as np

from margrpo_jax import checkpoint, config_files, generate
from margrpo_jax.data import shapes
from margrpo_jax.jobs import sample
from margrpo_jax.rewards import shapes_verifier



def _sample_config():
  return config_files.load("shapes_sample")


def test_shipped_base_follows_the_prompt_colour():
  cfg, graphdef, params = checkpoint.load_model(sample.SHIPPED_BASE)
  n = sum(int(np.prod(x.shape)) for x in __import__("jax").tree.leaves(params))
  assert 1_000_000 < n < 5_000_000
  recs = [r for r in shapes.split_records("eval") if r["tag"] == "single_object"][:32]
  images = generate.generate(graphdef, params, cfg, [r["prompt"] for r in recs], _sample_config().sampling,
                             seed=0, batch_size=32)
  hits = 0
  for im, r in zip(images, recs):
    cls = shapes_verifier.classify_pixels(im)  # 0 black, 1..6 palette (COLORS order), 7 unknown
    counts = np.bincount(cls[(cls > 0) & (cls < 7)].ravel(), minlength=7)[1:]
    hits += counts.sum() > 0 and shapes.COLORS[int(np.argmax(counts))] == r["include"][0]["class"].split()[0]
  rate = hits / len(recs)
  print("dominant colour matches the prompt:", rate)
  assert rate >= 0.75, rate
