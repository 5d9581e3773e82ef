"""Split sizes and class counts to price evals: a readable dataset.json, else VTAB-1k's or a built-in set's size."""

from __future__ import annotations

from cluster.plan.errors import PlanError
from data_pipeline.builtin import sets as builtin_sets
from data_pipeline.manifest import read_dataset_json
from data_pipeline.paths import is_remote, resolve_location

# VTAB-1k's test splits (docs/vtab.md, "Eval cost in the plan"); each train folder holds train800val200.
VTAB1K_TRAIN_IMAGES = 1000
VTAB1K_TEST_IMAGES = {
    "caltech101": 6084,
    "cifar100": 10000,
    "dtd": 1880,
    "flowers102": 6149,
    "pets": 3669,
    "sun397": 21750,
    "svhn": 26032,
    "camelyon": 32768,
    "eurosat": 5400,
    "resisc45": 6300,
    "retinopathy": 42670,
    "clevr_count": 15000,
    "clevr_dist": 15000,
    "dmlab": 22735,
    "kitti_dist": 711,
    "dsprites_loc": 73728,
    "dsprites_ori": 73728,
    "smallnorb_azim": 12150,
    "smallnorb_elev": 12150,
}


def split_size(root: str, dataset: str, split: str, vtab_first: bool = False) -> int:
    """Images of ``<root>/<dataset>/<split>``: its local dataset.json, else a built-in set's or VTAB-1k's size
    (names in both: the VTAB task for ``vtab_first``); PlanError when none is known."""
    meta = _meta(root, dataset, split)
    if meta is not None and "num_samples" in meta:
        return int(meta["num_samples"])
    vtab_size = None
    if dataset in VTAB1K_TEST_IMAGES and split in ("train", "test"):
        vtab_size = VTAB1K_TRAIN_IMAGES if split == "train" else VTAB1K_TEST_IMAGES[dataset]
    known = (vtab_size, _builtin_count(dataset, split)) if vtab_first else (_builtin_count(dataset, split), vtab_size)
    for size in known:
        if size is not None:
            return size
    raise PlanError(
        f"cannot price the evals: the size of {root}/{dataset}/{split} is not known here (no readable dataset.json, "
        "not a VTAB-1k task or a built-in set); write the split where this machine can read it, or evaluate "
        "datasets the plan knows"
    )


def _meta(root: str, dataset: str, split: str) -> dict | None:
    return None if is_remote(root) else read_dataset_json(f"{resolve_location(root)}/{dataset}/{split}")


def split_classes(root: str, dataset: str, split: str) -> int:
    """10 where unreadable (a head is a sliver of a ViT's FLOPs)."""
    meta = _meta(root, dataset, split)
    return int(meta["num_classes"]) if meta is not None else 10


def _builtin_count(name: str, split: str) -> int | None:
    """At the set's default settings; None if unknown."""
    if name not in builtin_sets.BUILTIN_NAMES:
        return None
    c = builtin_sets.config(name)
    if name == "digits":
        test = min(c.num_test, 1797 - 1000)  # scikit-learn's 1797 digits, >= 1000 for train
        return {"train": 1797 - test, "test": test}.get(split)
    if name in ("fractal", "rcdb"):
        return {"train": c.images_per_class, "val": c.val_per_class}.get(split, 0) * c.num_classes or None
    return {"train": c.num_train, "test": c.num_test}.get(split)
