"""Pictures people look at: captioned image grids (PNG) and curves."""
from __future__ import annotations

import textwrap

import numpy as np
from PIL import Image, ImageDraw, ImageFont


def captioned_grid(images: np.ndarray, captions: list[str], cols: int = 8, scale: int = 4,
                   footers: list[str] | None = None) -> Image.Image:
  """Images (N, H, W, 3) uint8 upscaled ``scale`` x (nearest), each with its wrapped caption below."""
  n, h, w, _ = images.shape
  font = ImageFont.load_default()
  cw, lines = w * scale, 4
  line_h = 11
  cell_h = h * scale + line_h * (lines + (1 if footers else 0)) + 6
  rows = -(-n // cols)
  canvas = Image.new("RGB", (cols * (cw + 6) + 6, rows * cell_h + 6), (255, 255, 255))
  draw = ImageDraw.Draw(canvas)
  for i in range(n):
    r, c = divmod(i, cols)
    x, y = 6 + c * (cw + 6), 6 + r * cell_h
    canvas.paste(Image.fromarray(images[i]).resize((cw, h * scale), Image.NEAREST), (x, y))
    wrapped = textwrap.wrap(captions[i], width=max(8, cw // 6))[:lines]
    for k, line in enumerate(wrapped):
      draw.text((x, y + h * scale + 2 + k * line_h), line, fill=(0, 0, 0), font=font)
    if footers:
      draw.text((x, y + h * scale + 2 + lines * line_h), footers[i], fill=(0, 90, 160), font=font)
  return canvas
