"""Sample a checkpoint on prompts and score the images (``config.mode = 'sample'``).

Writes ``<workdir>/samples/<i>.png`` (one image per prompt line i, of the size the family decodes to: 32 x 32
for the shapes world, 256 x 256 for MAR through KL-16), ``<workdir>/grid.png`` (captioned, with each image's
verdict), ``<workdir>/scores.json`` (per-image strict pass / partial score and their means over prompts with
shapes-world metadata; none for other prompts) and prints the pass rate.

Configs of real families (those with a ``model`` block, e.g. configs/mar.py) must name ``config.checkpoint``
(a converted export) and every path of their model block (``model.vae_checkpoint``, ``model.tokenizer_path``);
those paths are written into the export's model config before sampling. Prompts come from ``config.prompt_file``,
else a comma-separated ``config.prompts`` (when the config has one), else the shapes-world eval split.
"""
from __future__ import annotations

import os

from absl import logging
from PIL import Image

from margrpo_jax import checkpoint, fileio, generate, visualize
from margrpo_jax.data import prompt_files, shapes, tfds_builders
from margrpo_jax.models import random_instance


def load_prompts(config, workdir: str) -> list[dict]:
  """``[{'prompt', 'tag', 'metadata' (shapes metadata or None)}]`` from the prompt file or the eval split."""
  if config.prompt_file:
    recs = prompt_files.read_prompt_file(os.path.expanduser(config.prompt_file))
  elif config.get("prompts"):
    recs = [dict(prompt=p.strip()) for p in config.prompts.split(",") if p.strip()]
  else:
    data_dir = config.tfds_dir or os.path.join(workdir, "tfds")
    recs = tfds_builders.load_split("shapes_world", "eval", data_dir)
  out = []
  for r in recs:
    md = r.get("metadata") or {}
    out.append(dict(prompt=r["prompt"], tag=r.get("tag", ""), metadata=shapes.verifiable(md)))
  return out[:config.max_prompts] if config.max_prompts else out


PATHS = ("vae_checkpoint", "tokenizer_path")  # model-block paths a real family needs at sampling time


def load_for_sampling(config, workdir: str | None = None):
  """``(checkpoint dir, model_cfg, graphdef, params)``; ``model_cfg`` carries ``config.model``'s paths (a tiny
  random-weight instance, ``config.init='random'``, carries its own: written into ``W/random_base``)."""
  model = config.get("model")
  if model is not None and not config.checkpoint and config.get("init") == "random" and workdir:
    ckpt = random_instance.materialize(model, os.path.join(workdir, "random_base"), config.seed)
    return (ckpt, *checkpoint.load_model(ckpt))
  if model is not None and not config.checkpoint:
    raise checkpoint.CheckpointError("config.checkpoint is not set: convert the official weights with "
                                     "`python -m margrpo_jax.convert` and pass the output folder.")
  ckpt = config.checkpoint or checkpoint.resolve("shapes_base")
  model_cfg, graphdef, params = checkpoint.load_model(ckpt)
  for key in PATHS:
    if model is not None and key in model:
      model_cfg[key] = model[key]
      if not model[key]:
        raise checkpoint.CheckpointError(f"model.{key} is not set: pass --config.model.{key}=PATH.")
  return ckpt, model_cfg, graphdef, params


def run(config, workdir: str) -> dict:
  recs = load_prompts(config, workdir)
  ckpt, model_cfg, graphdef, params = load_for_sampling(config, workdir)
  logging.info("sampling %d prompts from %s", len(recs), ckpt)
  images = generate.generate(graphdef, params, model_cfg, [r["prompt"] for r in recs], config.sampling,
                             seed=config.seed, batch_size=config.batch_size, progress=True)
  res = generate.score(images, [r["metadata"] for r in recs])
  for i, im in enumerate(images):
    fileio.save_image(os.path.join(workdir, "samples", f"{i}.png"), Image.fromarray(im))
  per = [dict(index=i, prompt=r["prompt"], tag=r["tag"], **(s or dict(strict=None, partial=None, noise=None)))
         for i, (r, s) in enumerate(zip(recs, res["per_image"]))]
  scores = dict(checkpoint=fileio.resolve(ckpt), seed=config.seed, num_images=len(recs),
                num_scored=res["num_scored"], strict_pass=res["strict_pass"], partial=res["partial"],
                noise=res["noise"], per_task=res.get("per_task", {}), per_image=per)
  fileio.write_json(os.path.join(workdir, "scores.json"), scores)
  n = min(len(recs), config.grid_size)
  footers = ["" if p["strict"] is None else ("PASS" if p["strict"] else "fail") + f" {p['partial']:.2f}"
             for p in per[:n]]
  scale = max(1, 128 // images.shape[1])  # 32 px shapes-world images x 4; 256 px and larger as they are
  fileio.save_image(os.path.join(workdir, "grid.png"), visualize.captioned_grid(
      images[:n], [r["prompt"] for r in recs[:n]], scale=scale, footers=footers))
  if res["num_scored"]:
    print(f"strict pass rate {res['strict_pass']:.3f}, partial score {res['partial']:.3f} "
          f"on {res['num_scored']} shapes-world prompts ({workdir}/scores.json)")
  else:
    print(f"wrote {len(recs)} images to {workdir}/samples (no shapes-world prompts to score)")
  return scores
