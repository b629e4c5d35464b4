"""Write a fine-tuned export back in the official release layout, loadable by the official PyTorch code.

    python -m margrpo_jax.export_official --family=mar|harmon|nova --src=EXPORT_DIR --out=PATH [--template=OFFICIAL]

``--out`` gets the layout of the official file (MAR ``checkpoint-last.pth``, Harmon ``.pth``) or folder (NOVA's
pipeline ``transformer/``) the base was converted from, with the fine-tuned weights (``convert/official.py``: the
converters' exact inverse). That official checkpoint is the one the export records (``source.json``: the
converter writes it, the RL and export jobs carry it on); ``--template`` names it when it has moved or was never
recorded. A mismatch ends in one sentence and exit code 2; ``--out`` must be a new path.
"""
from __future__ import annotations

import json

from absl import app, flags

from margrpo_jax import checkpoint, cli
from margrpo_jax.convert import core, official

_FAMILY = flags.DEFINE_string("family", None, "mar, harmon or nova")
_SRC = flags.DEFINE_string("src", None, "the fine-tuned export (model.json + params/), e.g. an RL run's W/export")
_TEMPLATE = flags.DEFINE_string("template", None, "the official file / folder the base was converted from "
                                 "(default: the one --src records in source.json)")
_OUT = flags.DEFINE_string("out", None, "where to write: a .pth file (mar, harmon) or a transformer/ folder (nova)")


def main(argv):
  cli.check_args(argv, {"family": _FAMILY, "src": _SRC, "out": _OUT})
  out = cli.check_new_output(_OUT.value)
  try:
    report = official.export(_FAMILY.value, _SRC.value, _TEMPLATE.value, out)
  except (core.ConversionError, checkpoint.CheckpointError) as e:
    cli.fail(cli.sentence(e))
  except OSError as e:
    cli.fail(f"writing {out} failed: {e.strerror or e}.", code=1)
  print(json.dumps(report, indent=1))


if __name__ == "__main__":
  app.run(main, flags_parser=cli.parse_flags)
