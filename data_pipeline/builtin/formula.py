"""Formula-driven pre-training images (docs/reference.md §9): radial contours (RCDB) and fractals (FractalDB), each a
pure function of (seed, kind, split, class, instance, resolution).
"""

from __future__ import annotations

import io
import time
from collections.abc import Callable

import numpy as np
from PIL import Image, ImageDraw

from data_pipeline.cli import spawned_pool

JPEG_QUALITY = 95
MAX_CLASSES = 21843  # ImageNet-21k's class count
MIN_RESOLUTION = 16
MAX_RESOLUTION = 224
SPLIT_SALT = {"train": 1, "val": 2}


def encode_jpeg(img: Image.Image) -> bytes:
    out = io.BytesIO()
    img.save(out, format="JPEG", quality=JPEG_QUALITY)
    return out.getvalue()


def check_sizes(num_classes: int, images_per_class: int, val_per_class: int, resolution: int) -> None:
    if not 1 <= num_classes <= MAX_CLASSES:
        raise ValueError(f"num_classes={num_classes} is out of range; use 1..{MAX_CLASSES} (ImageNet-21k's count)")
    if images_per_class < 1 or val_per_class < 1:
        raise ValueError(
            f"images_per_class={images_per_class}, val_per_class={val_per_class}: each split needs >= 1 image per class"
        )
    if not MIN_RESOLUTION <= resolution <= MAX_RESOLUTION:
        raise ValueError(f"resolution={resolution} is out of range; use {MIN_RESOLUTION}..{MAX_RESOLUTION} pixels")


def _random_ifs(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A random contractive IFS of 2-4 affine maps, chosen in proportion to |det| (as FractalDB)."""
    n = int(rng.integers(2, 5))
    mats = rng.uniform(-1.0, 1.0, size=(n, 2, 2))
    for k in range(n):  # contract: a bounded attractor
        sigma = np.linalg.norm(mats[k], 2)
        mats[k] *= rng.uniform(0.45, 0.9) / max(float(sigma), 1e-6)
    shifts = rng.uniform(-1.0, 1.0, size=(n, 2))
    det = np.abs(np.linalg.det(mats)) + 1e-3
    return mats, shifts, det / det.sum()


def _chaos_game(mats, shifts, probs, rng, chains: int = 256, steps: int = 40, burn_in: int = 6) -> np.ndarray:
    cumulative = np.cumsum(probs)
    picks = np.minimum(np.searchsorted(cumulative, rng.random((steps, chains))), len(probs) - 1)
    x, y = rng.uniform(-1, 1, size=(2, chains))
    pts = np.empty((steps - burn_in, 2, chains))
    for step in range(steps):
        m, t = mats[picks[step]], shifts[picks[step]]
        x, y = m[:, 0, 0] * x + m[:, 0, 1] * y + t[:, 0], m[:, 1, 0] * x + m[:, 1, 1] * y + t[:, 1]
        if step >= burn_in:
            pts[step - burn_in, 0], pts[step - burn_in, 1] = x, y
    return pts.transpose(0, 2, 1).reshape(-1, 2)


def _render_points(pts: np.ndarray, res: int, rng: np.random.Generator) -> np.ndarray:
    # robust bounds
    sample = np.sort(pts[:: max(1, len(pts) // 512)], axis=0)
    lo, hi = sample[len(sample) // 100], sample[-1 - len(sample) // 100]
    margin = rng.uniform(0.05, 0.2)
    span = np.maximum(hi - lo, 1e-6)
    uv = (pts - lo) / span * (1 - 2 * margin) + margin
    ij = np.clip((uv * res).astype(np.int64), 0, res - 1)
    counts = np.bincount(ij[:, 1] * res + ij[:, 0], minlength=res * res).reshape(res, res).astype(np.float32)
    return 1.0 - np.exp(-counts / max(counts.mean() * 4, 1e-6))


def fractal_class(seed: int, c: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Class ``c``'s IFS; degenerate ones (a dot, a line) rejected by filling rate."""
    rng = np.random.default_rng([seed, 7001, c])
    while True:
        ifs = _random_ifs(rng)
        if 0.08 <= (_render_points(_chaos_game(*ifs, rng), 32, rng) > 0.05).mean() <= 0.7:
            return ifs


def fractal_image(ifs, rng: np.random.Generator, res: int) -> Image.Image:
    mats, shifts, probs = ifs
    mats = mats * rng.uniform(0.9, 1.1, size=mats.shape)
    shifts = shifts + rng.normal(0.0, 0.05, size=shifts.shape)
    chains = 256 * max(1, (res // 64) ** 2)  # constant density per pixel
    intensity = _render_points(_chaos_game(mats, shifts, probs, rng, chains=chains), res, rng)
    colour = rng.uniform(0.3, 1.0, size=3)
    background = rng.uniform(0.0, 0.15, size=3)
    rgb = background + intensity[..., None] * (colour - background)
    img = np.rot90(rgb, k=int(rng.integers(4)))
    if rng.random() < 0.5:
        img = img[:, ::-1]
    return Image.fromarray((np.clip(img, 0, 1) * 255).astype(np.uint8))


def rcdb_class(seed: int, c: int, offset: float = 0.0, ramp: int = 0) -> dict:
    """Class ``c``'s contour formula; with ``offset`` > 0 its centre is fixed (docs/reference.md §9)."""
    rng = np.random.default_rng([seed, 7005, c])
    vertices = int(rng.integers(3, 13)) if rng.random() < 0.7 else 48  # polygons, or smooth curves
    return dict(
        vertices=vertices,
        contours=int(rng.integers(1, 5)),
        radius=float(rng.uniform(0.45, 0.9)),  # of the half side
        spacing=float(rng.uniform(0.12, 0.3)),  # relative radius step between contours
        freq=int(rng.integers(0, 7)),
        amplitude=float(rng.uniform(0.0, 0.3)),
        phase=float(rng.uniform(0, 2 * np.pi)),
        profile=rng.uniform(-0.15, 0.15, size=vertices),
        rotation=float(rng.uniform(0, 2 * np.pi)),
        width=float(rng.uniform(0.5, 1.5)),  # pixels per 32 px of resolution
        offset=np.random.default_rng([seed, 9001, c]).uniform(-offset, offset, size=2),  # (x, y), half sides
        ramp=int(ramp),
    )


def rcdb_image(spec: dict, rng: np.random.Generator, res: int) -> Image.Image:
    """One instance, jittered; drawn at twice the resolution and reduced: thin lines keep their shape."""
    n, scale = spec["vertices"], 2 * res
    angles = spec["rotation"] + rng.normal(0.0, 0.05) + 2 * np.pi * np.arange(n) / n
    radial = 1 + spec["amplitude"] * np.sin(spec["freq"] * angles + spec["phase"]) + spec["profile"]
    radial = radial * (1 + rng.normal(0.0, 0.03, size=n))
    centre = scale / 2 * (1 + spec["offset"] + rng.uniform(-0.12, 0.12, size=2))
    size = scale / 2 * spec["radius"] * rng.uniform(0.85, 1.1)
    width = max(1, round(spec["width"] * scale / 32 * rng.uniform(0.7, 1.3)))
    level = int(rng.integers(160, 256))
    img = Image.new("L", (scale, scale), int(rng.integers(0, 40)))
    draw = ImageDraw.Draw(img)
    for k in range(spec["contours"]):
        r = size * radial * (1 - k * spec["spacing"])
        if r.min() <= 0:
            break
        pts = np.stack([centre[0] + r * np.cos(angles), centre[1] + r * np.sin(angles)], 1)
        draw.line([tuple(p) for p in np.vstack([pts, pts[:1]])], fill=level, width=width, joint="curve")
    rgb = img.resize((res, res), Image.Resampling.BOX).convert("RGB")
    return ramp_background(rgb, rng, spec["ramp"]) if spec.get("ramp") else rgb


RAMP_THRESHOLD = 40  # rcdb draws the background below 40, lines at >= 160


def ramp_background(img: Image.Image, rng: np.random.Generator, top: int) -> Image.Image:
    """``img``'s background replaced by a random ramp, so a patch's colour comes from its neighbours
    (docs/demo.md, "Locality")."""
    pixels = np.asarray(img)
    h, w, _ = pixels.shape
    start, end = rng.uniform(0, top, size=3), rng.uniform(0, top, size=3)
    angle = rng.uniform(0, 2 * np.pi)
    yy, xx = np.mgrid[0:h, 0:w] / np.array([max(h - 1, 1), max(w - 1, 1)])[:, None, None]
    t = np.clip(np.cos(angle) * (xx - 0.5) + np.sin(angle) * (yy - 0.5) + 0.5, 0, 1)
    ramp = (start + t[..., None] * (end - start)).astype(np.uint8)
    foreground = pixels.max(axis=-1, keepdims=True) > RAMP_THRESHOLD
    return Image.fromarray(np.where(foreground, pixels, ramp))


CLASS_FORMULA: dict[str, Callable[..., object]] = {"fractal": fractal_class, "rcdb": rcdb_class}
RENDER: dict[str, Callable[..., Image.Image]] = {"fractal": fractal_image, "rcdb": rcdb_image}


def _generate_classes(job: tuple) -> list[tuple[bytes, int, str]]:
    kind, seed, split, classes, per_class, res, class_options = job
    items = []
    for c in classes:
        formula = CLASS_FORMULA[kind](seed, c, **class_options)
        for i in range(per_class):
            rng = np.random.default_rng([seed, SPLIT_SALT[split], c, i])
            items.append((encode_jpeg(RENDER[kind](formula, rng, res)), c, f"{kind}/{split}/{c}/{i}"))
    return items


def generate(
    kind: str,
    seed: int,
    split: str,
    num_classes: int,
    per_class: int,
    res: int,
    workers: int = 1,
    class_offset: float = 0.0,
    background_ramp: int = 0,
) -> list[tuple[bytes, int, str]]:
    """All images of one split in class order, identical for any ``workers``."""
    if class_offset and kind != "rcdb":
        raise ValueError(f"class_offset={class_offset} applies to rcdb only; {kind} classes have no fixed position")
    if background_ramp and kind != "rcdb":
        raise ValueError(f"background_ramp={background_ramp} applies to rcdb only; {kind} draws its own background")
    class_options = {"offset": class_offset, "ramp": background_ramp} if kind == "rcdb" else {}
    block = max(1, min(64, num_classes // (4 * workers) or 1))
    jobs = [
        (kind, seed, split, range(lo, min(lo + block, num_classes)), per_class, res, class_options)
        for lo in range(0, num_classes, block)
    ]
    if workers <= 1:
        return [item for part in map(_generate_classes, jobs) for item in part]
    pool = spawned_pool(workers)
    try:
        items = [item for part in pool.imap(_generate_classes, jobs) for item in part]
    except BaseException:  # Ctrl-C: close + join would wait for the queue's remaining work
        pool.terminate()
        raise
    pool.close()
    pool.join()
    return items


def measure_generation(kind: str, resolution: int, num_images: int) -> float:
    """Images/s generated on one core, JPEG encoding and 16 classes' formulas included."""
    if kind not in CLASS_FORMULA:
        raise ValueError(f"unknown formula kind {kind!r}; choose from {', '.join(CLASS_FORMULA)}")
    check_sizes(1, 1, 1, resolution)
    if num_images < 1:
        raise ValueError(f"num_images must be >= 1, got {num_images}")
    start = time.perf_counter()
    classes = max(1, min(16, num_images))
    per_class = -(-num_images // classes)
    done = 0
    for c in range(classes):
        done += len(_generate_classes((kind, 0, "train", [c], min(per_class, num_images - done), resolution, {})))
        if done >= num_images:
            break
    return done / (time.perf_counter() - start)
