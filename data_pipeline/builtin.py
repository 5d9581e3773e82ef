"""Built-in datasets, generated offline and deterministically from a seed, written in the shard format.

    python -m data_pipeline.builtin all --out data          # what `make shards` / `make launch` use
    python -m data_pipeline.builtin fractal --out data --set num_classes=64 --set images_per_class=500

| name          | splits       | what                                                                         |
|---------------|--------------|------------------------------------------------------------------------------|
| fractal       | train, val   | FractalDB-style (Kataoka et al. 2020): one random IFS per class, chaos game  |
| digits        | train, test  | scikit-learn's 1797 bundled 8x8 digits, upscaled to RGB, 1297/500 split      |
| dsprites_loc  | train, test  | procedural dSprites, label = x position in 16 bins (VTAB dSpr-Loc)            |
| dsprites_ori  | train, test  | the same images, label = orientation in 16 bins (VTAB dSpr-Ori)               |
| shapes_count  | train, test  | Clevr-Count-like: 3-10 objects, label = count - 3 (8 classes)                 |

Every eval split has >= 1000 train images, so VTAB-1k's train800/val200/train1000 can be drawn from ``train``.
``ensure(name, root)`` generates a dataset when absent (under a file lock, so concurrent callers wait) and returns
``root/<name>``.
"""

from __future__ import annotations

import argparse
import fcntl
import io
import json
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from data_pipeline.cli import output_folder
from data_pipeline.manifest import DATASET_FILE
from data_pipeline.write import WriteConfig, write_dataset

JPEG_QUALITY = 95


@dataclass(frozen=True)
class BuiltinConfig:
    """Sizes of the generated datasets; every default is small enough for `make launch` on 2 cores."""

    resolution: int = 64  # side of the square images, pixels
    seed: int = 0
    num_classes: int = 32  # fractal: IFS categories
    images_per_class: int = 120  # fractal train images per category
    val_per_class: int = 10  # fractal val images per category
    num_train: int = 1200  # dsprites / shapes_count train images
    num_test: int = 500  # dsprites / shapes_count test images (digits: test split size)
    samples_per_shard: int = 128  # small shards so 2 ranks x 2 workers all get several
    processes: int = 1


def _encode(img: Image.Image) -> bytes:
    out = io.BytesIO()
    img.save(out, format="JPEG", quality=JPEG_QUALITY)
    return out.getvalue()


# ----------------------------------------------------------------------------------------------- fractal (IFS)


def _random_ifs(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A random contractive IFS of 2-4 affine maps; probabilities proportional to |det| as in FractalDB."""
    n = int(rng.integers(2, 5))
    mats = rng.uniform(-1.0, 1.0, size=(n, 2, 2))
    for k in range(n):  # contract each map so the attractor is bounded
        sigma = np.linalg.norm(mats[k], 2)
        mats[k] *= rng.uniform(0.45, 0.9) / max(sigma, 1e-6)
    shifts = rng.uniform(-1.0, 1.0, size=(n, 2))
    det = np.abs(np.linalg.det(mats)) + 1e-3
    return mats, shifts, det / det.sum()


def _chaos_game(mats, shifts, probs, rng, chains: int = 256, steps: int = 40, burn_in: int = 6) -> np.ndarray:
    """Points on the attractor, from many short chains run in parallel (vectorised over chains)."""
    cumulative = np.cumsum(probs)
    picks = np.minimum(np.searchsorted(cumulative, rng.random((steps, chains))), len(probs) - 1)  # (T, C)
    x, y = rng.uniform(-1, 1, size=(2, chains))
    pts = np.empty((steps - burn_in, 2, chains))
    for step in range(steps):
        m, t = mats[picks[step]], shifts[picks[step]]  # (C, 2, 2), (C, 2)
        x, y = m[:, 0, 0] * x + m[:, 0, 1] * y + t[:, 0], m[:, 1, 0] * x + m[:, 1, 1] * y + t[:, 1]
        if step >= burn_in:
            pts[step - burn_in, 0], pts[step - burn_in, 1] = x, y
    return pts.transpose(0, 2, 1).reshape(-1, 2)  # (C * (steps - burn_in), 2)


def _render_points(pts: np.ndarray, res: int, rng: np.random.Generator) -> np.ndarray:
    # Robust bounds from a sorted subsample: a few far-flung transient points must not shrink the figure.
    sample = np.sort(pts[:: max(1, len(pts) // 512)], axis=0)
    lo, hi = sample[len(sample) // 100], sample[-1 - len(sample) // 100]
    margin = rng.uniform(0.05, 0.2)
    span = np.maximum(hi - lo, 1e-6)
    uv = (pts - lo) / span * (1 - 2 * margin) + margin  # (P, 2) in [0, 1] for most points
    ij = np.clip((uv * res).astype(np.int64), 0, res - 1)
    counts = np.bincount(ij[:, 1] * res + ij[:, 0], minlength=res * res).reshape(res, res).astype(np.float32)
    return 1.0 - np.exp(-counts / max(counts.mean() * 4, 1e-6))  # (res, res) intensity in [0, 1)


def _filling_rate(mats, shifts, probs, rng) -> float:
    return float((_render_points(_chaos_game(mats, shifts, probs, rng), 32, rng) > 0.05).mean())


def _fractal_categories(cfg: BuiltinConfig) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Sample IFS categories, rejecting degenerate ones (a dot or a line) by their filling rate, as FractalDB does."""
    rng = np.random.default_rng([cfg.seed, 7001])
    cats = []
    while len(cats) < cfg.num_classes:
        ifs = _random_ifs(rng)
        if 0.08 <= _filling_rate(*ifs, rng) <= 0.7:
            cats.append(ifs)
    return cats


def _fractal_image(ifs, rng: np.random.Generator, res: int) -> Image.Image:
    """One instance of a category: jittered map parameters, a random colour, flip and rotation by 90 degrees."""
    mats, shifts, probs = ifs
    mats = mats * rng.uniform(0.9, 1.1, size=mats.shape)
    shifts = shifts + rng.normal(0.0, 0.05, size=shifts.shape)
    intensity = _render_points(_chaos_game(mats, shifts, probs, rng), res, rng)
    colour = rng.uniform(0.3, 1.0, size=3)
    background = rng.uniform(0.0, 0.15, size=3)
    rgb = background + intensity[..., None] * (colour - background)  # (res, res, 3)
    img = np.rot90(rgb, k=int(rng.integers(4)))
    if rng.random() < 0.5:
        img = img[:, ::-1]
    return Image.fromarray((np.clip(img, 0, 1) * 255).astype(np.uint8))


def gen_fractal(cfg: BuiltinConfig) -> dict[str, tuple[list, list[str]]]:
    cats = _fractal_categories(cfg)
    names = [f"ifs_{c:03d}" for c in range(cfg.num_classes)]
    splits = {}
    for split, per_class, salt in (("train", cfg.images_per_class, 1), ("val", cfg.val_per_class, 2)):
        items = []
        for c, ifs in enumerate(cats):
            for i in range(per_class):
                rng = np.random.default_rng([cfg.seed, salt, c, i])
                items.append((_encode(_fractal_image(ifs, rng, cfg.resolution)), c, f"fractal/{split}/{c}/{i}"))
        splits[split] = (items, names)
    return splits


# ------------------------------------------------------------------------------------------------------- digits


def gen_digits(cfg: BuiltinConfig) -> dict[str, tuple[list, list[str]]]:
    from sklearn.datasets import load_digits  # bundled with scikit-learn: no download

    digits = load_digits()
    images, labels = digits.images, digits.target  # (1797, 8, 8) in [0, 16], (1797,)
    order = np.random.default_rng([cfg.seed, 7002]).permutation(len(labels))
    num_test = min(cfg.num_test, len(labels) - 1000)
    parts = {"train": order[num_test:], "test": order[:num_test]}
    names = [str(d) for d in range(10)]
    splits = {}
    for split, idx in parts.items():
        items = []
        for i in sorted(idx.tolist()):
            grey = Image.fromarray((images[i] * (255.0 / 16.0)).astype(np.uint8))
            img = grey.resize((cfg.resolution, cfg.resolution), Image.BICUBIC).convert("RGB")
            items.append((_encode(img), int(labels[i]), f"digits/{i}"))
        splits[split] = (items, names)
    return splits


# ----------------------------------------------------------------------------------------------------- dsprites


def _shape_outline(shape: int) -> np.ndarray:
    t = np.linspace(0, 2 * np.pi, 40, endpoint=False)
    if shape == 0:  # square
        return np.array([[-1, -1], [1, -1], [1, 1], [-1, 1]], np.float64)
    if shape == 1:  # ellipse
        return np.stack([np.cos(t), 0.5 * np.sin(t)], 1)
    x = 16 * np.sin(t) ** 3  # heart
    y = -(13 * np.cos(t) - 5 * np.cos(2 * t) - 2 * np.cos(3 * t) - np.cos(4 * t))
    return np.stack([x, y], 1) / 16.0


def _dsprites(cfg: BuiltinConfig, target: str) -> dict[str, tuple[list, list[str]]]:
    """White sprites on black, as dSprites: shape, scale, orientation, x and y drawn uniformly."""
    res, bins = cfg.resolution, 16
    names = [f"{'x' if target == 'loc' else 'angle'}_bin_{b:02d}" for b in range(bins)]
    splits = {}
    for split, count, salt in (("train", cfg.num_train, 1), ("test", cfg.num_test, 2)):
        items = []
        for i in range(count):
            rng = np.random.default_rng([cfg.seed, 7003, salt, i])  # same images for loc and ori, as in VTAB
            shape, scale = int(rng.integers(3)), rng.uniform(0.5, 1.0)
            angle, x, y = rng.uniform(0, 2 * np.pi), rng.uniform(0, 1), rng.uniform(0, 1)
            rot = np.array([[np.cos(angle), -np.sin(angle)], [np.sin(angle), np.cos(angle)]])
            pts = _shape_outline(shape) @ rot.T * scale * res * 0.1
            centre = np.array([0.15 + 0.7 * x, 0.15 + 0.7 * y]) * res
            img = Image.new("RGB", (res, res))
            ImageDraw.Draw(img).polygon([tuple(p) for p in pts + centre], fill=(255, 255, 255))
            value = x if target == "loc" else angle / (2 * np.pi)
            items.append((_encode(img), min(int(value * bins), bins - 1), f"dsprites/{split}/{i}"))
        splits[split] = (items, names)
    return splits


def gen_dsprites_loc(cfg: BuiltinConfig):
    return _dsprites(cfg, "loc")


def gen_dsprites_ori(cfg: BuiltinConfig):
    return _dsprites(cfg, "ori")


# ------------------------------------------------------------------------------------------------- shapes_count


def gen_shapes_count(cfg: BuiltinConfig) -> dict[str, tuple[list, list[str]]]:
    """Clevr-Count-like scenes: 3-10 coloured circles, squares and triangles; label = count - 3."""
    res = cfg.resolution
    names = [f"count_{n}" for n in range(3, 11)]
    splits = {}
    for split, count, salt in (("train", cfg.num_train, 1), ("test", cfg.num_test, 2)):
        items = []
        for i in range(count):
            rng = np.random.default_rng([cfg.seed, 7004, salt, i])
            n = int(rng.integers(3, 11))
            img = Image.new("RGB", (res, res), tuple(int(v) for v in rng.integers(90, 140, size=3)))
            draw = ImageDraw.Draw(img)
            radius = res * 0.06
            centres: list[np.ndarray] = []
            while len(centres) < n:  # rejection sampling keeps objects apart so they can be counted
                c = rng.uniform(radius * 1.3, res - radius * 1.3, size=2)
                if all(np.linalg.norm(c - o) > 2.3 * radius for o in centres):
                    centres.append(c)
            for c in centres:
                colour = tuple(int(v) for v in rng.integers(0, 256, size=3))
                r = radius * rng.uniform(0.8, 1.2)
                kind = int(rng.integers(3))
                box = [c[0] - r, c[1] - r, c[0] + r, c[1] + r]
                if kind == 0:
                    draw.ellipse(box, fill=colour)
                elif kind == 1:
                    draw.rectangle(box, fill=colour)
                else:
                    draw.polygon([(c[0], c[1] - r), (c[0] - r, c[1] + r), (c[0] + r, c[1] + r)], fill=colour)
            items.append((_encode(img), n - 3, f"shapes_count/{split}/{i}"))
        splits[split] = (items, names)
    return splits


GENERATORS: dict[str, Callable[[BuiltinConfig], dict]] = {
    "fractal": gen_fractal,
    "digits": gen_digits,
    "dsprites_loc": gen_dsprites_loc,
    "dsprites_ori": gen_dsprites_ori,
    "shapes_count": gen_shapes_count,
}
SPLITS = {"fractal": ("train", "val")} | {n: ("train", "test") for n in GENERATORS if n != "fractal"}
ALIASES = {"shapes-count": "shapes_count", "dsprites-loc": "dsprites_loc", "dsprites-ori": "dsprites_ori"}
BUILTIN_NAMES = tuple(GENERATORS)


def option_minimum(name: str) -> int | None:
    """The smallest value BuiltinConfig field ``name`` takes (a seed may be 0; a size of 0 makes no image, shard or
    class); None when there is no such field. The one rule behind `--set` here and `data.builtin_options` in recipes."""
    if name not in {f.name for f in fields(BuiltinConfig)}:
        return None
    return 0 if name == "seed" else 1


def _canonical(name: str) -> str:
    name = ALIASES.get(name, name)
    if name not in GENERATORS:
        raise ValueError(f"unknown built-in dataset {name!r}; choose from {', '.join(BUILTIN_NAMES)} (or 'all')")
    return name


# The BuiltinConfig fields each generator reads; only these must match for an existing folder to be reused.
_FIELDS = {
    "fractal": ("resolution", "seed", "num_classes", "images_per_class", "val_per_class", "samples_per_shard"),
    "digits": ("resolution", "seed", "num_test", "samples_per_shard"),
} | {
    n: ("resolution", "seed", "num_train", "num_test", "samples_per_shard")
    for n in ("dsprites_loc", "dsprites_ori", "shapes_count")
}


def _settings(name: str, cfg: BuiltinConfig) -> dict:
    return {k: v for k, v in asdict(cfg).items() if k in _FIELDS[name]}


def _is_complete(folder: Path, name: str, cfg: BuiltinConfig) -> bool:
    """True when every split exists and was generated with the same settings; raises if settings differ."""
    complete = True
    for split in SPLITS[name]:
        meta_file = folder / split / DATASET_FILE
        if not meta_file.exists():
            complete = False
            continue
        stored = json.loads(meta_file.read_text()).get("builtin")
        wanted = _settings(name, cfg)
        if stored is not None and {k: stored.get(k) for k in wanted} != wanted:
            raise ValueError(f"{folder} was generated with {stored}, not {wanted}; delete it or pass another root")
    return complete


def ensure(name: str, root: str | Path, **size_overrides) -> Path:
    """Generate built-in dataset ``name`` under ``root/<name>/<split>/`` unless present; return ``root/<name>``.

    ``size_overrides`` are BuiltinConfig fields (resolution, seed, num_classes, images_per_class, ...).
    """
    name = _canonical(name)
    known = {f.name for f in fields(BuiltinConfig)}
    unknown = set(size_overrides) - known
    if unknown:
        raise ValueError(f"unknown built-in size option(s) {sorted(unknown)}; known: {sorted(known)}")
    cfg = BuiltinConfig(**size_overrides)
    folder = Path(root) / name
    if _is_complete(folder, name, cfg):
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".generate.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second caller waits here, then finds the dataset complete
        if _is_complete(folder, name, cfg):
            return folder
        splits = GENERATORS[name](cfg)
        for split, (items, names) in splits.items():
            wcfg = WriteConfig(
                name=name,
                split=split,
                samples_per_shard=cfg.samples_per_shard,
                seed=cfg.seed,
                processes=cfg.processes,
                max_short_side=max(512, cfg.resolution),
                min_size=1,
                keep_exact_duplicates=True,
            )
            write_dataset(
                folder / split,
                wcfg,
                items=items,
                class_names=names,
                extra_meta={"builtin": _settings(name, cfg)},
            )
    return folder


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Generate built-in datasets as vitscale shard folders (offline).")
    p.add_argument("name", help=f"one of {', '.join(BUILTIN_NAMES)}, or 'all'")
    p.add_argument("--out", required=True, help="root folder; writes OUT/<name>/<split>/")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=INT",
        help=f"size override, fields: {', '.join(f.name for f in fields(BuiltinConfig))}",
    )
    args = p.parse_args(argv)
    try:
        overrides = {}
        for item in args.set:
            key, sep, value = item.partition("=")
            if not sep:
                raise ValueError(f"--set {item!r} must look like FIELD=INT, e.g. --set resolution=32")
            low = option_minimum(key)
            if low is None:
                known = ", ".join(f.name for f in fields(BuiltinConfig))
                raise ValueError(f"--set {item!r}: no field {key!r}; fields: {known}")
            if not value.strip().isdigit() or int(value) < low:
                raise ValueError(f"--set {item!r}: {key} must be an integer >= {low}")
            overrides[key] = int(value)
        names = BUILTIN_NAMES if args.name == "all" else (_canonical(args.name),)
        output_folder(args.out, "--out")
        for name in names:
            start = time.perf_counter()
            folder = ensure(name, args.out, **overrides)
            counts = {s: json.loads((folder / s / DATASET_FILE).read_text())["num_samples"] for s in SPLITS[name]}
            print(f"{name}: {counts} in {folder} ({time.perf_counter() - start:.1f}s)")
    except ValueError as err:
        print(f"data_pipeline.builtin: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
