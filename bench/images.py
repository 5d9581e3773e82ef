"""Generated photo-like JPEGs for the benchmarks: no data, no network."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image


def imagenet_like_jpegs(count: int, seed: int = 0, max_short: int = 512) -> list[bytes]:
    """Photo-like JPEGs at quality 90, shaped like ImageNet's after ``data_pipeline.write``: short side ~
    log-normal(375 px) clipped to [160, ``max_short``], aspect 1:1, 4:3 or 3:2, landscape or portrait."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        short = int(np.clip(rng.lognormal(np.log(375), 0.25), 160, max_short))
        long = int(short * rng.choice([1.0, 4 / 3, 4 / 3, 3 / 2]))
        w, h = (long, short) if rng.random() < 0.75 else (short, long)
        cells = (int(rng.integers(12, 30)), int(rng.integers(12, 30)))
        buf = io.BytesIO()
        Image.fromarray(photo_like(w, h, cells, 10.0, rng)).save(buf, format="JPEG", quality=90)
        out.append(buf.getvalue())
    return out


def photo_like(width: int, height: int, cells: tuple[int, int], grain: float, rng: np.random.Generator) -> np.ndarray:
    """uint8 (height, width, 3): smooth random colour fields plus grain of std ``grain``; compresses like a photo."""
    base = rng.integers(0, 256, size=(*cells, 3), dtype=np.uint8)
    img = np.asarray(Image.fromarray(base).resize((width, height), Image.BICUBIC), dtype=np.float32)
    return np.clip(img + rng.normal(0, grain, size=img.shape), 0, 255).astype(np.uint8)
