"""Built-in datasets, generated offline and deterministically from a seed, written in the shard format.

The command line is `python -m data_pipeline.builtin` (`data_pipeline/builtin/__main__.py`).

| name         | splits      | what                                                            | default size      |
|--------------|-------------|-----------------------------------------------------------------|-------------------|
| fractal      | train, val  | FractalDB-style (Kataoka et al. 2020): one random IFS per class | 32 x (120 + 10),  |
|              |             | (chaos game)                                                    | 64 px             |
| rcdb         | train, val  | RCDB-style radial contours (Kataoka et al. 2022): one contour   | 64 x (60 + 10),   |
|              |             | formula per class, each at its own place, on a colour ramp      | 32 px             |
| digits       | train, test | scikit-learn's 1797 bundled 8x8 digits, upscaled to RGB         | 1297 + 500, 64 px |
| dsprites_loc | train, test | procedural dSprites, label = x position in 16 bins (dSpr-Loc)   | 1200 + 500, 64 px |
| dsprites_ori | train, test | the same images, label = orientation in 16 bins (dSpr-Ori)      | 1200 + 500, 64 px |
| shapes_count | train, test | Clevr-Count-like: 3-10 objects, label = count - 3 (8 classes)   | 1200 + 500, 64 px |

Each set's defaults are ``BuiltinConfig``'s with ``DEFAULTS[name]`` over them (``config(name)``; rcdb's: class_offset
30, background_ramp 160, the set configs/local_demo.yaml was tuned on); ``--set`` here and ``data.builtin_options``
in a recipe override them. So `all` writes exactly the folders the shipped recipes (``data.builtin``) and eval suites
read (tests/data_pipeline/test_builtin.py checks every one). Every eval split has >= 1000 train images, so VTAB-1k's
train800/val200/train1000 can be drawn from ``train``.
``ensure(name, root)`` generates a dataset when absent (under a file lock, so concurrent callers wait) and returns
``root/<name>``; ``check_folder(name, root)`` says whether it is there, generating nothing. Both refuse a folder
generated with other settings (ValueError naming the folder, the settings and the fix). The two pre-training sets
are formula-driven (data_pipeline.builtin.formula, docs/reference.md §9): any class count up to 21,843 at up to 224 px,
generated in parallel (``--workers``) with identical bytes for any count.
"""

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


@dataclass(frozen=True)
class BuiltinConfig:
    """Sizes of the generated datasets; every default is small enough for `make launch` on 2 cores. These are the
    defaults of every set but those ``DEFAULTS`` changes for its own set (``config(name)``)."""

    resolution: int = 64  # side of the square images, pixels
    seed: int = 0
    num_classes: int = 32  # fractal / rcdb: categories (IFS codes, contour formulas)
    images_per_class: int = 120  # fractal / rcdb train images per category
    val_per_class: int = 10  # fractal / rcdb val images per category
    num_train: int = 1200  # dsprites / shapes_count train images
    num_test: int = 500  # dsprites / shapes_count test images (digits: test split size)
    samples_per_shard: int = 128  # small shards so 2 ranks x 2 workers all get several
    # rcdb: each class's centre sits at its own fixed place, up to this percent of the half side off centre on each
    # axis (data_pipeline.builtin.formula.rcdb_class); 0 centres every class (rcdb's default: 30, DEFAULTS)
    class_offset: int = 0
    # rcdb: 0 draws the contours on a dark grey; N > 0 on a smooth random ramp between two colours with channels in
    # [0, N) (data_pipeline.builtin.formula.ramp_background), which gives masked patch prediction something local to
    # predict (rcdb's default: 160, DEFAULTS)
    background_ramp: int = 0
    processes: int = 1


# Each set's own defaults over BuiltinConfig's: what `ensure(name, root)` and `python -m data_pipeline.builtin all`
# (= `make shards`) generate. rcdb's are the set configs/local_demo.yaml was tuned on (its comments and docs/demo.md;
# the recipe names them again in its data.builtin_options), so `make shards && make launch` reuses the folder, and
# the `inspect_rcdb` suite reads the demo's own images. A shipped recipe or suite that needs other sizes needs a
# change here too: tests/data_pipeline/test_builtin.py checks that `all` satisfies every one.
DEFAULTS: dict[str, dict[str, int]] = {
    "rcdb": {
        "resolution": 32,
        "num_classes": 64,
        "images_per_class": 60,
        "val_per_class": 10,
        "class_offset": 30,
        "background_ramp": 160,
    },
}
# The value a setting had in every folder written before the folder recorded it (the generator then had no such
# setting): a folder without the record was generated at this value, whatever the default is now. A field added to
# BuiltinConfig later that changes the bytes gets an entry here, with the behaviour from before it existed.
UNRECORDED = {"class_offset": 0, "background_ramp": 0}


# --------------------------------------------------------------------------------- formula-driven (fractal, rcdb)


def _formula_set(kind: str, cfg: BuiltinConfig) -> dict[str, tuple[list, list[str]]]:
    """Train and val splits of a formula-driven set (data_pipeline.builtin.formula), generated by ``cfg.processes``."""
    prefix = {"fractal": "ifs", "rcdb": "contour"}[kind]
    names = [f"{prefix}_{c:05d}" if cfg.num_classes > 1000 else f"{prefix}_{c:03d}" for c in range(cfg.num_classes)]
    splits = {}
    offset = cfg.class_offset / 100 if kind == "rcdb" else 0.0
    ramp = cfg.background_ramp if kind == "rcdb" else 0
    for split, per_class in (("train", cfg.images_per_class), ("val", cfg.val_per_class)):
        items = formula.generate(
            kind,
            cfg.seed,
            split,
            cfg.num_classes,
            per_class,
            cfg.resolution,
            cfg.processes,
            class_offset=offset,
            background_ramp=ramp,
        )
        splits[split] = (items, names)
    return splits


def gen_fractal(cfg: BuiltinConfig) -> dict[str, tuple[list, list[str]]]:
    return _formula_set("fractal", cfg)


def gen_rcdb(cfg: BuiltinConfig) -> dict[str, tuple[list, list[str]]]:
    return _formula_set("rcdb", cfg)


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
            img = grey.resize((cfg.resolution, cfg.resolution), Image.Resampling.BICUBIC).convert("RGB")
            items.append((encode_jpeg(img), int(labels[i]), f"digits/{i}"))
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
            items.append((encode_jpeg(img), min(int(value * bins), bins - 1), f"dsprites/{split}/{i}"))
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
            items.append((encode_jpeg(img), n - 3, f"shapes_count/{split}/{i}"))
        splits[split] = (items, names)
    return splits


GENERATORS: dict[str, Callable[[BuiltinConfig], dict]] = {
    "fractal": gen_fractal,
    "rcdb": gen_rcdb,
    "digits": gen_digits,
    "dsprites_loc": gen_dsprites_loc,
    "dsprites_ori": gen_dsprites_ori,
    "shapes_count": gen_shapes_count,
}
MAX_CLASS_OFFSET = 50
MAX_BACKGROUND_RAMP = 256  # channels are drawn below it: up to full brightness
FORMULA_SETS = ("fractal", "rcdb")  # pre-training sets (train, val); the rest are eval sets (train, test)
SPLITS = {n: ("train", "val") if n in FORMULA_SETS else ("train", "test") for n in GENERATORS}
ALIASES = {"shapes-count": "shapes_count", "dsprites-loc": "dsprites_loc", "dsprites-ori": "dsprites_ori"}
BUILTIN_NAMES = tuple(GENERATORS)


def option_minimum(name: str) -> int | None:
    """The smallest value BuiltinConfig field ``name`` takes (a seed may be 0; a size of 0 makes no image, shard or
    class); None when there is no such field. The one rule behind `--set` here and `data.builtin_options` in recipes."""
    if name not in {f.name for f in fields(BuiltinConfig)}:
        return None
    return 0 if name in ("seed", "class_offset", "background_ramp") else 1


def config(name: str, **options) -> BuiltinConfig:
    """The settings built-in dataset ``name`` is generated with: BuiltinConfig's defaults, ``DEFAULTS[name]`` over
    them, then ``options`` (``--set`` here, ``data.builtin_options`` in a recipe). ValueError for an unknown name or
    option; the ranges are `check_sizes`'s."""
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


# The BuiltinConfig fields each generator reads; only these must match for an existing folder to be reused.
_FORMULA_FIELDS = ("resolution", "seed", "num_classes", "images_per_class", "val_per_class", "samples_per_shard")
_FIELDS = (
    {"fractal": _FORMULA_FIELDS, "rcdb": (*_FORMULA_FIELDS, "class_offset", "background_ramp")}
    | {
        "digits": ("resolution", "seed", "num_test", "samples_per_shard"),
    }
    | {
        n: ("resolution", "seed", "num_train", "num_test", "samples_per_shard")
        for n in ("dsprites_loc", "dsprites_ori", "shapes_count")
    }
)


def _settings(name: str, cfg: BuiltinConfig) -> dict:
    return {k: v for k, v in asdict(cfg).items() if k in _FIELDS[name]}


def settings(name: str, **options) -> dict:
    """The settings of dataset ``name`` that its bytes depend on, at ``config(name, **options)``: what its folder
    records and what must match for the folder to be reused."""
    return _settings(_canonical(name), config(name, **options))


def check_sizes(name: str, cfg: BuiltinConfig) -> None:
    """Reject sizes dataset ``name`` cannot have (ValueError), before any folder is made: nothing is left behind."""
    if name in FORMULA_SETS:
        formula.check_sizes(cfg.num_classes, cfg.images_per_class, cfg.val_per_class, cfg.resolution)
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


def _is_complete(folder: Path, name: str, cfg: BuiltinConfig) -> bool:
    """True when every split exists and was generated with the same settings; raises if settings differ."""
    complete = True
    wanted = _settings(name, cfg)
    for split in SPLITS[name]:
        meta = read_dataset_json(folder / split)
        if meta is None:
            complete = False
            continue
        stored = meta.get("builtin")
        if stored is None:  # a shard folder the user wrote there: theirs to answer for
            continue
        had = {k: stored.get(k, UNRECORDED.get(k, "unrecorded")) for k in wanted}
        differ = [f"{k}={had[k]} (wanted {v})" for k, v in wanted.items() if had[k] != v]
        if differ:
            raise ValueError(
                f"{folder / split} was generated with {', '.join(differ)}; delete it (rm -r {folder}) to generate it "
                "again, or use another data root"
            )
    return complete


def check_folder(name: str, root: str | Path, **options) -> bool:
    """Whether ``root/<name>`` holds built-in dataset ``name`` complete, at the settings ``config(name, **options)``
    gives, generating nothing: True when every split is there, False when one is missing (``ensure`` would generate
    it). ValueError when a split there was generated with other settings (the message names the folder, the
    differing settings and the fix, as `ensure` says it), or when the settings themselves are invalid."""
    cfg = config(name, **options)
    name = _canonical(name)
    check_sizes(name, cfg)
    return _is_complete(Path(root) / name, name, cfg)


def ensure(name: str, root: str | Path, **size_overrides) -> Path:
    """Generate built-in dataset ``name`` under ``root/<name>/<split>/`` unless present; return ``root/<name>``.

    ``size_overrides`` are BuiltinConfig fields (resolution, seed, num_classes, images_per_class, ...) over the set's
    defaults (``config``). A folder there generated with other settings is refused (`check_folder`).
    """
    name = _canonical(name)
    cfg = config(name, **size_overrides)
    folder = Path(root) / name
    if check_folder(name, root, **size_overrides):
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
