"""VTAB-1k's 19 tasks over TFDS folders (docs/vtab.md): each task's TFDS dataset, split records and label (`TASKS`)."""

from __future__ import annotations

import io
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from PIL import Image

from data_pipeline.write.tfrecord import FeatureValues

SCHEMES = ("holdout", "tfds_val", "three_way", "half_test")
SPLITS = ("train", "test", "train800", "val200", "train800val200", "val", "trainval")


class LabelError(ValueError):
    """A record lacks what its task's label is computed from."""


@dataclass(frozen=True)
class VtabTfdsTask:
    name: str  # as in evals.vtab.VTAB1K_TASKS: the folder under the VTAB root
    tfds_name: str  # TFDS dataset[/config]
    num_classes: int
    scheme: str  # one of SCHEMES
    train_percent: int = 0  # holdout, three_way: the share of TFDS train that is train
    val_percent: int = 0  # three_way: the share after it that is val
    test_split: str = "test"  # holdout: the TFDS split that is test (clevr's test split has no labels)
    label: str = "label"  # "label": the TFDS ClassLabel; else a key of LABEL_FUNCTIONS
    binary_image: bool = False  # dsprites: 0/1 pixels, scaled to 0/255 as VTAB does

    @property
    def base_name(self) -> str:
        return self.tfds_name.split("/")[0]

    @property
    def config(self) -> str:
        return self.tfds_name.split("/")[1] if "/" in self.tfds_name else ""


def _task(name: str, tfds_name: str, num_classes: int, scheme: str, **kw) -> tuple[str, VtabTfdsTask]:
    return name, VtabTfdsTask(name, tfds_name, num_classes, scheme, **kw)


_DSPRITES = dict(train_percent=80, val_percent=10, binary_image=True)
TASKS: dict[str, VtabTfdsTask] = dict(
    [
        _task("caltech101", "caltech101", 102, "holdout", train_percent=90),
        _task("cifar100", "cifar100", 100, "holdout", train_percent=90),
        _task("dtd", "dtd", 47, "tfds_val"),
        _task("flowers102", "oxford_flowers102", 102, "tfds_val"),
        _task("pets", "oxford_iiit_pet", 37, "holdout", train_percent=80),
        _task("sun397", "sun397/tfds", 397, "tfds_val"),
        _task("svhn", "svhn_cropped", 10, "holdout", train_percent=90),
        _task("camelyon", "patch_camelyon", 2, "tfds_val"),
        _task("eurosat", "eurosat/rgb", 10, "three_way", train_percent=60, val_percent=20),
        _task("resisc45", "resisc45", 45, "three_way", train_percent=60, val_percent=20),
        _task("retinopathy", "diabetic_retinopathy_detection/btgraham-300", 5, "tfds_val"),
        _task("clevr_count", "clevr", 8, "holdout", train_percent=90, test_split="validation", label="clevr_count"),
        _task("clevr_dist", "clevr", 6, "holdout", train_percent=90, test_split="validation", label="clevr_dist"),
        _task("dmlab", "dmlab", 6, "tfds_val"),
        _task("kitti_dist", "kitti", 4, "tfds_val", label="kitti_dist"),
        _task("dsprites_loc", "dsprites", 16, "three_way", label="dsprites_loc", **_DSPRITES),
        _task("dsprites_ori", "dsprites", 16, "three_way", label="dsprites_ori", **_DSPRITES),
        _task("smallnorb_azim", "smallnorb", 18, "half_test", label="label_azimuth"),
        _task("smallnorb_elev", "smallnorb", 9, "half_test", label="label_elevation"),
    ]
)


def split_expression(task: VtabTfdsTask, split: str, sizes: dict[str, int]) -> str:
    """The TFDS split expression (``train[:800]+validation[:200]``) of VTAB split ``split``."""
    if split not in SPLITS:
        raise ValueError(f"--split {split!r} is not a VTAB split; use one of {', '.join(SPLITS)}")

    def size(name: str) -> int:
        if name not in sizes:
            raise ValueError(f"VTAB task {task.name} needs the TFDS split {name!r}; the folder has {sorted(sizes)}")
        return sizes[name]

    if task.scheme == "holdout":
        cut = task.train_percent * size("train") // 100
        named = (f"train[:{cut}]", f"train[{cut}:]", "train", task.test_split, f"train[{cut}:{cut + 200}]")
    elif task.scheme == "tfds_val":
        size("validation")
        named = ("train", "validation", "train+validation", "test", "validation[:200]")
    elif task.scheme == "three_way":
        n = size("train")
        cut, val_end = task.train_percent * n // 100, task.train_percent * n // 100 + task.val_percent * n // 100
        val200 = f"train[{cut}:{cut + 200}]"
        named = (f"train[:{cut}]", f"train[{cut}:{val_end}]", f"train[:{val_end}]", f"train[{val_end}:]", val200)
    else:  # half_test
        size("test")
        named = ("train", "test[:50%]", "train+test[:50%]", "test[50%:]", "test[:200]")
    parts = dict(zip(("train", "val", "trainval", "test", "val200"), named))
    size(parts["test"].split("[")[0])
    parts["train800"] = "train[:800]"
    parts["train800val200"] = f"train[:800]+{parts['val200']}"
    return parts["train800val200" if split == "train" else split]


def _values(example: dict[str, FeatureValues], key: str) -> list:
    if key not in example:
        raise LabelError(f"no feature {key!r}")
    return list(example[key])


def _bin(value: float, thresholds: tuple[float, ...]) -> int:
    """The index of the last threshold below ``value``, as VTAB bins."""
    below = [i for i, t in enumerate(thresholds) if t < value]
    if not below:
        raise LabelError(f"value {value} is below every bin")
    return below[-1]


def _clevr_count(example: dict[str, FeatureValues]) -> int:
    return len(_values(example, "objects/size")) - 3  # 3..10 objects → 0..7


def _clevr_dist(example: dict[str, FeatureValues]) -> int:
    depth = _values(example, "objects/pixel_coords")[2::3]
    if not depth:
        raise LabelError("no objects")
    return _bin(min(depth), (0.0, 8.0, 8.5, 9.0, 9.5, 10.0, 100.0))


def _kitti_dist(example: dict[str, FeatureValues]) -> int:
    types = _values(example, "objects/type")
    z = _values(example, "objects/location")[2::3]  # metres
    vehicles = [depth for depth, kind in zip(z, types) if kind < 3]  # Car, Van, Truck
    return _bin(min([*vehicles, 1000.0]), (-100.0, 8.0, 20.0, 999.0))  # 3 distances + "no vehicle"


def _binned(key: str, original_classes: int, classes: int) -> Callable[[dict[str, FeatureValues]], int]:
    factor = original_classes / classes

    def label(example: dict[str, FeatureValues]) -> int:
        return int(float(_values(example, key)[0]) // factor)

    return label


def _feature(key: str) -> Callable[[dict[str, FeatureValues]], int]:
    return lambda example: int(_values(example, key)[0])


LABEL_FUNCTIONS: dict[str, Callable[[dict[str, FeatureValues]], int]] = {
    "clevr_count": _clevr_count,
    "clevr_dist": _clevr_dist,
    "kitti_dist": _kitti_dist,
    "dsprites_loc": _binned("label_x_position", 32, 16),
    "dsprites_ori": _binned("label_orientation", 40, 16),
    "label_azimuth": _feature("label_azimuth"),
    "label_elevation": _feature("label_elevation"),
}
LABEL_FEATURES = {
    "clevr_count": ("objects/size",),
    "clevr_dist": ("objects/pixel_coords",),
    "kitti_dist": ("objects/type", "objects/location"),
    "dsprites_loc": ("label_x_position",),
    "dsprites_ori": ("label_orientation",),
    "label_azimuth": ("label_azimuth",),
    "label_elevation": ("label_elevation",),
}


def class_names(task: VtabTfdsTask) -> list[str]:
    if task.label == "clevr_count":
        return [f"{k} objects" for k in range(3, 3 + task.num_classes)]
    if task.label == "clevr_dist":
        return ["depth<8", "8-8.5", "8.5-9", "9-9.5", "9.5-10", "depth>10"]
    if task.label == "kitti_dist":
        return ["vehicle<8m", "vehicle 8-20m", "vehicle>20m", "no vehicle"]
    return [f"{task.label}_bin{k}" for k in range(task.num_classes)]


def scale_binary_image(data: bytes) -> bytes:
    with Image.open(io.BytesIO(data)) as img:
        pixels = np.asarray(img.convert("L"), dtype=np.uint16) * 255
    out = io.BytesIO()
    Image.fromarray(np.minimum(pixels, 255).astype(np.uint8)).save(out, format="PNG")
    return out.getvalue()
