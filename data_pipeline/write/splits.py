"""The label space of a split written beside others: labels are the same in every split (docs/contracts.md, "Shard
folders"), so a split whose source lacks a class takes the classes of the split folders already written beside it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

from data_pipeline import manifest
from data_pipeline.write.readers import readable


def _recorded(folder: Path) -> tuple[str, list[str]] | None:
    """(split, class ids) of a split folder this tool wrote from class folders or per-class tars; None otherwise."""
    try:
        dataset = json.loads((folder / manifest.DATASET_FILE).read_text())
        settings = json.loads((folder / manifest.WRITE_SETTINGS_FILE).read_text())
    except (OSError, ValueError):  # not a split folder, or not one of ours (built-in sets record no source)
        return None
    units = settings.get("source") if isinstance(settings, dict) else None
    if not isinstance(dataset, dict) or not isinstance(units, list) or not all(isinstance(u, str) for u in units):
        return None
    classes = settings.get("classes")  # written where the split lacks classes its labels count
    if isinstance(classes, list) and all(isinstance(c, str) for c in classes):
        return str(dataset.get("split", "")), classes
    names = [Path(unit).name for unit in units]  # format 1 recorded the paths as given
    if names and all(name.endswith(".tar") for name in names):
        names = [name.removesuffix(".tar") for name in names]
    return str(dataset.get("split", "")), [readable(name) for name in names]


def sibling_splits(out: str | Path, split: str) -> list[tuple[Path, list[str]]]:
    """The split folders beside ``out`` (other splits of its dataset: ``ROOT/train`` beside ``ROOT/val``) with their
    class ids, in name order."""
    out = Path(os.path.abspath(out))
    try:
        beside = sorted(p for p in out.parent.iterdir() if p != out and p.is_dir())
    except OSError:
        return []
    found = []
    for folder in beside:
        recorded = _recorded(folder)
        if recorded is not None and recorded[0] != split:  # the same split name: another dataset's folder
            found.append((folder, recorded[1]))
    return found


def label_space(out: str | Path, split: str) -> Callable[[list[str]], list[str]]:
    """For ``readers.open_source``: the class ids that label a source of class folders or tars with ``ids``, those
    of the split folders beside ``out`` that share a class with it, else ``ids``; ValueError when those splits
    disagree, or lack a class of the source."""

    def classes(ids: list[str]) -> list[str]:
        splits = [(folder, known) for folder, known in sibling_splits(out, split) if set(known) & set(ids)]
        if not splits:
            return ids
        (first, known), *others = splits
        other = next((folder for folder, theirs in others if theirs != known), None)
        if other is not None:
            raise ValueError(
                f"the split folders {first} and {other} beside --out hold other classes, so their labels differ; "
                "write them again from their sources, then this split"
            )
        extra = [i for i in ids if i not in set(known)]
        if extra:
            raise ValueError(
                f"--source has classes that the split folder {first} beside --out lacks ({_few(extra)}); labels "
                f"are the same in every split, so write the split holding every class first: delete {first}, "
                "write this split, then that one again"
            )
        return known

    return classes


def _few(ids: list[str]) -> str:
    return ", ".join(ids[:5]) + (f" and {len(ids) - 5} more" if len(ids) > 5 else "")
