"""Built-in datasets, generated offline from a seed as shard folders (docs/design.md, "Built-in datasets")."""

from __future__ import annotations

import fcntl
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from data_pipeline.builtin import formula
from data_pipeline.builtin.formula import encode_jpeg
from data_pipeline.manifest import read_dataset_json
from data_pipeline.write.writer import WriteConfig, write_dataset

Splits = dict[str, tuple[list, list[str]]]  # split -> (items, class names)


@dataclass(frozen=True)
class BuiltinConfig:
    """Settings of the generated datasets; the defaults suit `make launch` on 2 cores."""

    resolution: int = 64  # image side, pixels
    seed: int = 0
    num_classes: int = 32  # fractal / rcdb: classes (formulas)
    images_per_class: int = 120  # fractal / rcdb: train images per class
    val_per_class: int = 10  # fractal / rcdb: val images per class
    num_train: int = 1200  # dsprites / shapes_count train images
    num_test: int = 500  # dsprites / shapes_count / digits test images
    samples_per_shard: int = 128  # 2 ranks x 2 workers all get several shards
    class_offset: int = 0  # rcdb: each class's fixed centre offset, up to this % of the half side (0: centred)
    background_ramp: int = 0  # rcdb: 0 dark grey background; N > 0 a colour ramp, channels in [0, N)
    processes: int = 1


# Each set's defaults over BuiltinConfig's; rcdb's are those configs/local_demo.yaml was tuned on.
DEFAULTS: dict[str, dict[str, int]] = {
    "rcdb": dict(
        resolution=32, num_classes=64, images_per_class=60, val_per_class=10, class_offset=30, background_ramp=160
    )
}
DIGITS_IMAGES = 1797  # scikit-learn's digits, split into train and test here
MIN_EVAL_TRAIN = 1000  # an eval set's train split holds at least this many images
# A setting's value in folders that do not record it
UNRECORDED = {"class_offset": 0, "background_ramp": 0}


def _formula_set(kind: str, cfg: BuiltinConfig) -> Splits:
    prefix, digits = {"fractal": "ifs", "rcdb": "contour"}[kind], 5 if cfg.num_classes > 1000 else 3
    names = [f"{prefix}_{c:0{digits}d}" for c in range(cfg.num_classes)]
    options = (cfg.class_offset / 100, cfg.background_ramp) if kind == "rcdb" else (0.0, 0)
    splits = {}
    for split, n in (("train", cfg.images_per_class), ("val", cfg.val_per_class)):
        items = formula.generate(kind, cfg.seed, split, cfg.num_classes, n, cfg.resolution, cfg.processes, *options)
        splits[split] = (items, names)
    return splits


def gen_digits(cfg: BuiltinConfig) -> Splits:
    from sklearn.datasets import load_digits

    digits = load_digits()
    images, labels = digits.images, digits.target
    order = np.random.default_rng([cfg.seed, 7002]).permutation(len(labels))
    parts = {"train": order[cfg.num_test :], "test": order[: cfg.num_test]}

    def item(i: int) -> tuple[bytes, int, str]:
        grey = Image.fromarray((images[i] * (255.0 / 16.0)).astype(np.uint8))
        img = grey.resize((cfg.resolution, cfg.resolution), Image.Resampling.BICUBIC).convert("RGB")
        return encode_jpeg(img), int(labels[i]), f"digits/{i}"

    return {
        split: ([item(i) for i in sorted(idx.tolist())], [str(d) for d in range(10)]) for split, idx in parts.items()
    }


def _shape_outline(shape: int) -> np.ndarray:
    t = np.linspace(0, 2 * np.pi, 40, endpoint=False)
    if shape == 0:  # square
        return np.array([[-1, -1], [1, -1], [1, 1], [-1, 1]], np.float64)
    if shape == 1:  # ellipse
        return np.stack([np.cos(t), 0.5 * np.sin(t)], 1)
    x = 16 * np.sin(t) ** 3  # heart
    y = -(13 * np.cos(t) - 5 * np.cos(2 * t) - 2 * np.cos(3 * t) - np.cos(4 * t))
    return np.stack([x, y], 1) / 16.0


def _drawn(cfg: BuiltinConfig, salt: int, prefix: str, names: list[str], draw: Callable) -> Splits:
    """Train and test images ``draw(rng, resolution) -> (image, label)``, image i seeded by (seed, salt, split, i)."""
    splits = {}
    for split, count, split_salt in (("train", cfg.num_train, 1), ("test", cfg.num_test, 2)):
        items = []
        for i in range(count):
            img, label = draw(np.random.default_rng([cfg.seed, salt, split_salt, i]), cfg.resolution)
            items.append((encode_jpeg(img), label, f"{prefix}/{split}/{i}"))
        splits[split] = (items, names)
    return splits


def _dsprites(cfg: BuiltinConfig, target: str) -> Splits:
    bins = 16

    def draw(rng: np.random.Generator, res: int) -> tuple[Image.Image, int]:
        shape, scale = int(rng.integers(3)), rng.uniform(0.5, 1.0)
        angle, x, y = rng.uniform(0, 2 * np.pi), rng.uniform(0, 1), rng.uniform(0, 1)
        rot = np.array([[np.cos(angle), -np.sin(angle)], [np.sin(angle), np.cos(angle)]])
        pts = _shape_outline(shape) @ rot.T * scale * res * 0.1
        centre = np.array([0.15 + 0.7 * x, 0.15 + 0.7 * y]) * res
        img = Image.new("RGB", (res, res))
        ImageDraw.Draw(img).polygon([tuple(p) for p in pts + centre], fill=(255, 255, 255))
        value = x if target == "loc" else angle / (2 * np.pi)
        return img, min(int(value * bins), bins - 1)

    names = [f"{'x' if target == 'loc' else 'angle'}_bin_{b:02d}" for b in range(bins)]
    return _drawn(cfg, 7003, "dsprites", names, draw)  # loc and ori: the same images


def _shapes_count(rng: np.random.Generator, res: int) -> tuple[Image.Image, int]:
    """3-10 coloured circles, squares and triangles; label = count - 3."""
    n = int(rng.integers(3, 11))
    img = Image.new("RGB", (res, res), tuple(int(v) for v in rng.integers(90, 140, size=3)))
    draw = ImageDraw.Draw(img)
    radius = res * 0.06
    centres: list[np.ndarray] = []
    while len(centres) < n:  # apart, countable
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
    return img, n - 3


GENERATORS: dict[str, Callable[[BuiltinConfig], dict]] = {
    "fractal": lambda cfg: _formula_set("fractal", cfg),
    "rcdb": lambda cfg: _formula_set("rcdb", cfg),
    "digits": gen_digits,
    "dsprites_loc": lambda cfg: _dsprites(cfg, "loc"),
    "dsprites_ori": lambda cfg: _dsprites(cfg, "ori"),
    "shapes_count": lambda cfg: _drawn(cfg, 7004, "shapes_count", [f"count_{n}" for n in range(3, 11)], _shapes_count),
}
MAX_CLASS_OFFSET = 50
MAX_BACKGROUND_RAMP = 256  # channels are drawn below it
FORMULA_SETS = ("fractal", "rcdb")  # pre-training sets (train, val); the rest (train, test)
SPLITS = {n: ("train", "val") if n in FORMULA_SETS else ("train", "test") for n in GENERATORS}
ALIASES = {"shapes-count": "shapes_count", "dsprites-loc": "dsprites_loc", "dsprites-ori": "dsprites_ori"}
BUILTIN_NAMES = tuple(GENERATORS)


def option_minimum(name: str) -> int | None:
    if name not in {f.name for f in fields(BuiltinConfig)}:
        return None
    return 0 if name in ("seed", "class_offset", "background_ramp") else 1


def config(name: str, **options) -> BuiltinConfig:
    """BuiltinConfig's defaults, ``DEFAULTS[name]``, then ``options``; ValueError for unknown ones."""
    name = _canonical(name)
    known = {f.name for f in fields(BuiltinConfig)}
    unknown = set(options) - known
    if unknown:
        raise ValueError(f"unknown built-in size option(s) {sorted(unknown)}; known: {sorted(known)}")
    return BuiltinConfig(**{**DEFAULTS.get(name, {}), **options})


def _canonical(name: str) -> str:
    name = ALIASES.get(name, name)
    if name not in GENERATORS:
        raise ValueError(f"unknown built-in dataset {name!r}; choose from {', '.join(BUILTIN_NAMES)} (or 'all')")
    return name


# The fields each generator reads: what must match for reuse
_FORMULA_FIELDS = ("resolution", "seed", "num_classes", "images_per_class", "val_per_class", "samples_per_shard")
_FIELDS = {
    "fractal": _FORMULA_FIELDS,
    "rcdb": (*_FORMULA_FIELDS, "class_offset", "background_ramp"),
    "digits": ("resolution", "seed", "num_test", "samples_per_shard"),
    **dict.fromkeys(
        ("dsprites_loc", "dsprites_ori", "shapes_count"),
        ("resolution", "seed", "num_train", "num_test", "samples_per_shard"),
    ),
}


def set_fields(name: str) -> tuple[str, ...]:
    """The options built-in set ``name`` reads: the settings its bytes depend on, and ``processes``."""
    return (*_FIELDS[_canonical(name)], "processes")


def unread_options(names: tuple[str, ...], options: dict) -> list[str]:
    """The ``options`` that none of the sets ``names`` reads (they would be ignored)."""
    return [k for k in options if not any(k in set_fields(n) for n in names)]


def _settings(name: str, cfg: BuiltinConfig) -> dict:
    return {k: v for k, v in asdict(cfg).items() if k in _FIELDS[name]}


def settings(name: str, **options) -> dict:
    """The settings the bytes of dataset ``name`` depend on, as its folder records them."""
    return _settings(_canonical(name), config(name, **options))


def check_sizes(name: str, cfg: BuiltinConfig) -> None:
    if name in FORMULA_SETS:
        formula.check_sizes(cfg.num_classes, cfg.images_per_class, cfg.val_per_class, cfg.resolution)
    if name == "digits" and not 1 <= cfg.num_test <= DIGITS_IMAGES - MIN_EVAL_TRAIN:
        raise ValueError(
            f"num_test={cfg.num_test} is out of range for digits; use 1..{DIGITS_IMAGES - MIN_EVAL_TRAIN} (its "
            f"{DIGITS_IMAGES} images keep at least {MIN_EVAL_TRAIN} for train)"
        )
    if name == "rcdb" and not 0 <= cfg.class_offset <= MAX_CLASS_OFFSET:
        raise ValueError(
            f"class_offset={cfg.class_offset} is out of range; use 0..{MAX_CLASS_OFFSET} (percent of the half side: "
            "a contour further off centre leaves the frame)"
        )
    if name == "rcdb" and not 0 <= cfg.background_ramp <= MAX_BACKGROUND_RAMP:
        raise ValueError(
            f"background_ramp={cfg.background_ramp} is out of range; use 0 (dark background) or "
            f"1..{MAX_BACKGROUND_RAMP} (the ramp's colours have channels below it)"
        )


class OtherSettings(ValueError):
    """A split of ``folder`` generated at other settings than those asked for; ``had``: those that differ."""

    def __init__(self, folder: Path, split: str, had: dict, wanted: dict) -> None:
        self.folder, self.split = folder, split
        self.had = {k: had[k] for k, v in wanted.items() if had[k] != v}
        self.differ = ", ".join(f"{k}={had[k]} (wanted {wanted[k]})" for k in self.had)
        super().__init__(
            f"{folder / split} was generated with {self.differ}; delete it (rm -r {folder}) to generate it again, or "
            "use another data root"
        )


def _is_complete(folder: Path, name: str, cfg: BuiltinConfig) -> bool:
    complete = True
    wanted = _settings(name, cfg)
    for split in SPLITS[name]:
        meta = read_dataset_json(folder / split)
        if meta is None:
            complete = False
            continue
        stored = meta.get("builtin")
        if stored is None:  # not generated
            continue
        had = {k: stored.get(k, UNRECORDED.get(k, "unrecorded")) for k in wanted}
        if any(had[k] != v for k, v in wanted.items()):
            raise OtherSettings(folder, split, had, wanted)
    return complete


def check_folder(name: str, root: str | Path, **options) -> bool:
    """Whether ``root/<name>`` holds every split; ValueError for invalid settings or a split generated at others."""
    cfg = config(name, **options)
    name = _canonical(name)
    check_sizes(name, cfg)
    return _is_complete(Path(root) / name, name, cfg)


def ensure(name: str, root: str | Path, **size_overrides) -> Path:
    """Generate ``root/<name>/<split>/`` unless present, under a file lock; return ``root/<name>``."""
    name = _canonical(name)
    cfg = config(name, **size_overrides)
    folder = Path(root) / name
    if check_folder(name, root, **size_overrides):
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".generate.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
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
                folder / split, wcfg, items=items, class_names=names, extra_meta={"builtin": _settings(name, cfg)}
            )
    return folder
