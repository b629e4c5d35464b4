"""Pictures people look at: captioned image grids (PNG)."""
from __future__ import annotations

import textwrap

import numpy as np
from PIL import Image, ImageDraw, ImageFont


def _font(size: int):
  try:
    return ImageFont.load_default(size=size)  # scalable font where Pillow has FreeType
  except (TypeError, OSError):
    return ImageFont.load_default()


def captioned_grid(images: np.ndarray, captions: list[str], cols: int = 8, scale: int = 4,
                   footers: list[str] | None = None) -> Image.Image:
  """Images (N, H, W, 3) uint8 upscaled ``scale`` x (nearest), each with its wrapped caption (and an optional
  coloured footer line such as a verdict) below."""
  n, h, w, _ = images.shape
  cols = max(1, min(cols, n))
  font, line_h, max_lines = _font(11), 13, 3
  cw = w * scale
  cell_h = h * scale + line_h * (max_lines + (1 if footers else 0)) + 8
  rows = -(-n // cols)
  canvas = Image.new("RGB", (cols * (cw + 8) + 8, rows * cell_h + 8), (255, 255, 255))
  draw = ImageDraw.Draw(canvas)
  for i in range(n):
    r, c = divmod(i, cols)
    x, y = 8 + c * (cw + 8), 8 + r * cell_h
    canvas.paste(Image.fromarray(images[i]).resize((cw, h * scale), Image.NEAREST), (x, y))
    lines = textwrap.wrap(captions[i], width=max(8, cw // 6))[:max_lines]
    for k, line in enumerate(lines):
      draw.text((x, y + h * scale + 2 + k * line_h), line, fill=(0, 0, 0), font=font)
    if footers and footers[i]:
      color = (0, 130, 0) if footers[i].startswith("PASS") else (190, 0, 0)
      draw.text((x, y + h * scale + 2 + len(lines) * line_h), footers[i], fill=color, font=font)
  return canvas
