"""Convert an official checkpoint into a params-only Orbax export that every job loads with ``--config.checkpoint``.

    python -m margrpo_jax.convert --family=mar --src=checkpoint-last.pth --out=DIR [--size=base] [--dtype=bfloat16]

Every source key is used or deliberately ignored and every target parameter is filled; a mismatch (a missing or
unused key, a wrong shape, a weight that is not floating point or not finite, a file that is not a checkpoint of
the family) ends in one sentence naming the key and exit code 2, before anything is written; ``--out`` must be a
new path. Families are modules of this package with
``convert(state_dict, origin, size) -> (model_cfg, params, report)`` and a ``PREFER`` tuple (which sub-dict of a
``.pth`` holds the weights to use, EMA first).
"""
from __future__ import annotations

import importlib
import json

from absl import app, flags

from margrpo_jax import cli

FAMILIES = {  # --family -> module of margrpo_jax.convert
    "mar": "mar",
    "qwen2": "qwen2", "harmon": "harmon",
    "clip_openclip": "clip_openclip", "clip_hf": "clip_hf", "aesthetic": "aesthetic",
    "imagereward": "imagereward",
    "phi2": "phi2",
    "nova": "nova",
    "kl16": "kl16",
    "sdvae": "sdvae",
}

_FAMILY = flags.DEFINE_string("family", None, f"one of {', '.join(FAMILIES)}")
_SRC = flags.DEFINE_string("src", None, "official checkpoint: a .pth/.bin/.safetensors file or a folder of shards")
_OUT = flags.DEFINE_string("out", None, "output folder (model.json + params/)")
_SIZE = flags.DEFINE_string("size", None, "model size when it cannot be read from the weights")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "dtype of the written parameters")


def run(family: str, src: str, out: str, size: str | None = None, dtype: str = "float32") -> dict:
  """Convert ``src`` and write ``out``; returns the coverage report."""
  from margrpo_jax import checkpoint, fileio
  from margrpo_jax.convert import core
  if family not in FAMILIES:
    raise core.ConversionError(f"--family={family!r} is not one of {', '.join(FAMILIES)}.")
  module = importlib.import_module(f"margrpo_jax.convert.{FAMILIES[family]}")
  sd = core.state_dict(core.read_checkpoint(src), prefer=getattr(module, "PREFER", ()), origin=src)
  try:
    model_cfg, params, report = module.convert(sd, origin=src, size=size)
  except core.ConversionError:
    raise
  except (KeyError, IndexError, ValueError, TypeError) as e:  # a size read from weights that are not there
    raise core.ConversionError(f"{src} is not a checkpoint of --family={family} that this converter knows ({type(e).__name__}: "
                               f"{str(e).splitlines()[0] if str(e) else 'no detail'}).") from None
  checkpoint.save_model(out, params, model_cfg, dtype=None if dtype == "float32" else dtype,
                        source=fileio.resolve(src))
  return report


def main(argv):
  cli.check_args(argv, {"family": _FAMILY, "src": _SRC, "out": _OUT})
  if _FAMILY.value not in FAMILIES:
    cli.fail(f"--family={_FAMILY.value!r} is not one of {', '.join(FAMILIES)}.")
  out = cli.check_new_output(_OUT.value)
  from margrpo_jax import checkpoint
  from margrpo_jax.convert.core import ConversionError
  try:
    report = run(_FAMILY.value, _SRC.value, out, _SIZE.value, _DTYPE.value)
  except (ConversionError, checkpoint.CheckpointError) as e:
    cli.fail(cli.sentence(e))
  except (checkpoint.StorageError, OSError) as e:
    cli.fail(f"writing {out} failed: {e.strerror or e}.", code=1, hard=True)
  print(json.dumps(report, indent=1))
  print(f"wrote {out}")


if __name__ == "__main__":
  app.run(main, flags_parser=cli.parse_flags)
