r"""Where a fine-tuned export's diversity goes, per task: latent diversity, the spread of the objects' placement, their
size, the number found and strict pass, beside the base on the same prompts and sampling seeds.

    python benchmarks/layout_spread.py --export=RUN/export [--split=val] [--prompts=8] [--images=8] [--seeds=0,1]

For each task, ``prompts`` distinct prompts of the split x ``images`` images each, per sampling seed: the mean
pairwise distance of a prompt's images in the tokenizer's latent space (what the study's diversity averages), the
standard deviation over a prompt's images of the first-found object's centroid (pixels, rows and columns averaged),
the mean and spread of the objects' areas, the objects found per image, and strict pass. Prints a table and, last,
one JSON line.
"""
import argparse
import json
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402

from margrpo_jax import checkpoint, config_files, generate, metrics  # noqa: E402
from margrpo_jax.data import shapes  # noqa: E402
from margrpo_jax.models import families  # noqa: E402
from margrpo_jax.rewards import shapes_verifier  # noqa: E402


def spread(graphdef, params, model_cfg, recs, images, sampling, seeds) -> dict:
  """The figures of one model on ``recs`` (distinct prompts of one task)."""
  prompts = [r["prompt"] for r in recs for _ in range(images)]
  ims = np.concatenate([generate.generate(graphdef, params, model_cfg, prompts, sampling, seed=s, batch_size=64)
                        for s in seeds])
  groups = len(seeds) * len(recs)
  latent = metrics.latent_spread(np.asarray(families.get(model_cfg.family).encode_images(model_cfg, ims)).reshape(
      groups, images, -1))
  first, areas, found, strict = [], [], [], []
  for im, r in zip(ims, [r for _ in seeds for r in recs for _ in range(images)]):
    objs = shapes_verifier.find_objects(im)[0]
    first.append(objs[0]["centroid"] if objs else (np.nan, np.nan))
    areas += [o["area"] for o in objs]
    found.append(len(objs))
    strict.append(shapes_verifier.verify(im, r)["strict"])
  first = np.asarray(first, float).reshape(groups, images, 2)
  return dict(latent=latent, centroid_spread=float(np.nanmean(np.nanstd(first, axis=1))),
              area=float(np.mean(areas)), area_spread=float(np.std(areas)), objects=float(np.mean(found)),
              strict=float(np.mean(strict)))


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--export", required=True, help="a model export (an RL run's export/ folder)")
  ap.add_argument("--split", default="val", choices=("val", "eval", "train"))
  ap.add_argument("--prompts", type=int, default=8)
  ap.add_argument("--images", type=int, default=8)
  ap.add_argument("--seeds", default="0,1")
  args = ap.parse_args()
  seeds = [int(s) for s in args.seeds.split(",")]
  sampling = config_files.load("shapes_sample").sampling
  recs = shapes.split_records(args.split)
  models = {"base": checkpoint.load_model(checkpoint.resolve("shapes_base")),
            "export": checkpoint.load_model(args.export)}
  out = {}
  print(f"{'model':7s} {'task':14s} {'latent':>7s} {'centroid':>9s} {'area':>12s} {'objects':>8s} {'strict':>7s}")
  for task in shapes.TASKS:
    distinct = list({r["prompt"]: r for r in recs if r["tag"] == task}.values())[:args.prompts]
    for name, (model_cfg, graphdef, params) in models.items():
      f = out.setdefault(name, {})[task] = spread(graphdef, params, model_cfg, distinct, args.images, sampling, seeds)
      print(f"{name:7s} {task:14s} {f['latent']:7.2f} {f['centroid_spread']:9.2f} {f['area']:6.1f} +- "
            f"{f['area_spread']:4.1f} {f['objects']:8.2f} {f['strict']:7.2f}", flush=True)
  print(json.dumps(dict(path=args.export, split=args.split, seeds=seeds, models=out)))


if __name__ == "__main__":
  main()
