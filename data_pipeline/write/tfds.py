"""A TFDS folder as a writer source (``--source tfds:DIR``), read without TensorFlow (docs/vtab.md, "The formats")."""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from data_pipeline.write.readers import ItemRef, Source, SourceUnit, read_class_names
from data_pipeline.write.tfrecord import ExampleError, FeatureValues, count_records, decode_example, scan_records
from data_pipeline.write.vtab_tfds import (
    LABEL_FEATURES,
    LABEL_FUNCTIONS,
    TASKS,
    LabelError,
    VtabTfdsTask,
    class_names,
    scale_binary_image,
    split_expression,
)

TFDS_PREFIX = "tfds:"
INFO_FILE = "dataset_info.json"
FEATURES_FILE = "features.json"
REF_KIND = "tfrecord"  # ItemRef.kind of a record


@dataclass(frozen=True)
class TfdsUnit(SourceUnit):
    start: int = 0
    stop: int = 0
    split: str = ""  # the file's TFDS split
    first_index: int = 0  # index in that split of the file's first record


@dataclass(frozen=True)
class TfdsSource(Source):
    """``image_column`` / ``label_column`` name features, ``task`` a VTAB-1k task or ""."""

    task: str = ""
    tfds_name: str = ""
    version: str = ""
    split_expression: str = ""


@dataclass(frozen=True)
class TfdsFolder:
    path: Path
    name: str
    config: str
    version: str
    shard_lengths: dict[str, list[int]]  # split -> records per file, in file order
    files: dict[str, list[Path]]
    features: dict[str, dict]  # "objects/size" -> {"kind", "dtype", "num_classes"}
    supervised: tuple[str, str] | None  # (input, output) feature names

    @property
    def sizes(self) -> dict[str, int]:
        return {split: sum(lengths) for split, lengths in self.shard_lengths.items()}


def tfds_path(source: str) -> str | None:
    return str(Path(source[len(TFDS_PREFIX) :]).expanduser()) if source.startswith(TFDS_PREFIX) else None


def is_tfds_folder(path: str | Path) -> bool:
    root = Path(path)
    return (root / INFO_FILE).is_file() and any(root.glob("*.tfrecord*"))


def _not_tfds(root: Path, what: str) -> ValueError:
    return ValueError(
        f"--source tfds:{root} is not a TFDS dataset folder ({what}); give the version folder that holds "
        f"{INFO_FILE}, {FEATURES_FILE} and the *.tfrecord-* files, e.g. ~/tensorflow_datasets/cifar100/3.0.2"
    )


def _read_json(root: Path, name: str) -> dict:
    file = root / name
    if not file.is_file():
        raise _not_tfds(root, f"no {name}")
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError) as error:
        raise ValueError(f"{file} does not parse as JSON ({error}); re-download or re-prepare the dataset") from None
    if not isinstance(data, dict):
        raise ValueError(f"{file} holds a JSON {type(data).__name__}, not an object; re-prepare the dataset")
    return data


def _feature_kind(node: dict) -> str:
    class_name = node.get("pythonClassName") or node.get("type") or ""
    if class_name:
        return class_name.rsplit(".", 1)[-1]
    for key in ("featuresDict", "sequence", "image", "classLabel", "tensor", "text"):
        if key in node:
            return key[0].upper() + key[1:]
    return "unknown"


def _flatten(node: dict, prefix: str, out: dict[str, dict]) -> None:
    """Every leaf feature under its Example key (nested names joined with ``/``) into ``out``."""
    kind = _feature_kind(node)
    body = node.get("content", node)  # the old format's details
    if kind == "FeaturesDict":
        children = body.get("featuresDict", {}).get("features", body) if "featuresDict" in body else body
        for name, child in children.items():
            if isinstance(child, dict):
                _flatten(child, f"{prefix}/{name}" if prefix else name, out)
        return
    if kind == "Sequence":
        inner = body.get("sequence", body).get("feature")
        if isinstance(inner, dict):
            _flatten(inner, prefix, out)
        return
    details = body.get({"Image": "image", "ClassLabel": "classLabel", "Tensor": "tensor"}.get(kind, ""), body)
    details = details if isinstance(details, dict) else {}
    classes = details.get("numClasses", details.get("num_classes"))
    out[prefix] = dict(kind=kind, dtype=details.get("dtype"), num_classes=None if classes is None else int(classes))


def _supervised(info: dict) -> tuple[str, str] | None:
    keys = info.get("supervisedKeys") or {}
    if "input" in keys and "output" in keys:
        return str(keys["input"]), str(keys["output"])
    items = keys.get("tuple", {}).get("items", [])
    if len(items) == 2 and all("featureKey" in item for item in items):
        return str(items[0]["featureKey"]), str(items[1]["featureKey"])
    return None


def _split_files(root: Path, name: str, split: str, lengths: list[int] | None) -> tuple[list[Path], list[int]]:
    """A split's files and their record counts; no files (a split left out of a copy) are refused by `_units` only
    where the split is read."""
    files = sorted(root.glob(f"{name}-{split}.tfrecord-*")) or sorted(root.glob(f"*-{split}.tfrecord-*"))
    if not files:
        return [], lengths or []
    if lengths is None:  # an old dataset_info.json
        lengths = [count_records(f) for f in files]
    if len(files) != len(lengths):
        raise ValueError(
            f"{root}: {INFO_FILE} lists {len(lengths)} files for split {split!r} but {len(files)} are there; "
            "the folder is incomplete — re-download or re-prepare the dataset"
        )
    return files, lengths


def read_folder(path: str | Path) -> TfdsFolder:
    root = Path(path).expanduser()
    if not root.is_dir():
        raise _not_tfds(root, "it is not a folder")
    info = _read_json(root, INFO_FILE)
    features_json = _read_json(root, FEATURES_FILE)
    if info.get("fileFormat", "tfrecord") not in ("tfrecord", "TFRECORD"):
        raise ValueError(
            f"{root / INFO_FILE}: file format {info['fileFormat']!r}; only TFRecord folders are read — "
            "prepare the dataset with file_format='tfrecord'"
        )
    name = str(info.get("name") or root.parent.name)
    shard_lengths: dict[str, list[int]] = {}
    files: dict[str, list[Path]] = {}
    for split in info.get("splits", []):
        lengths = [int(n) for n in split["shardLengths"]] if split.get("shardLengths") else None
        files[split["name"]], shard_lengths[split["name"]] = _split_files(root, name, split["name"], lengths)
    if not files:
        raise _not_tfds(root, f"{INFO_FILE} lists no splits")
    features: dict[str, dict] = {}
    _flatten(features_json, "", features)
    config, version = str(info.get("configName", "")), str(info.get("version", ""))
    return TfdsFolder(root, name, config, version, shard_lengths, files, features, _supervised(info))


_PART = re.compile(r"(?P<split>[\w.-]+)(?:\[(?P<start>-?\d+%?)?:(?P<stop>-?\d+%?)?\])?")


def _bound(text: str | None, n: int) -> int | None:
    if not text:
        return None
    return round(int(text[:-1]) * n / 100) if text.endswith("%") else int(text)  # TFDS's default rounding


def resolve_split(expression: str, sizes: dict[str, int]) -> list[tuple[str, int, int]]:
    """(split, start, stop) of each ``+`` part of a TFDS split expression."""
    parts = []
    for part in expression.split("+"):
        match = _PART.fullmatch(part.strip())
        if match is None:
            raise ValueError(
                f"split {part!r} of {expression!r} is not TFDS split syntax; write e.g. train, train[:800], "
                "train[45000:45200], test[50%:] or parts joined with +"
            )
        split = match["split"]
        if split not in sizes:
            raise ValueError(f"split {split!r} is not in this TFDS folder (splits: {', '.join(sorted(sizes))})")
        n = sizes[split]
        start, stop, _ = slice(_bound(match["start"], n), _bound(match["stop"], n)).indices(n)
        parts.append((split, start, max(start, stop)))
    return parts


def _units(folder: TfdsFolder, parts: list[tuple[str, int, int]]) -> tuple[TfdsUnit, ...]:
    units = []
    for split, start, stop in parts:
        if not folder.files[split]:
            raise _not_tfds(folder.path, f"no {folder.name}-{split}.tfrecord-* files for split {split!r}")
        first = 0
        for file, length in zip(folder.files[split], folder.shard_lengths[split]):
            lo, hi = max(start, first), min(stop, first + length)
            if lo < hi:
                units.append(
                    TfdsUnit(REF_KIND, str(file), -1, start=lo - first, stop=hi - first, split=split, first_index=first)
                )
            first += length
    return tuple(units)


def _image_feature(folder: TfdsFolder, wanted: str | None) -> str:
    images = sorted(k for k, f in folder.features.items() if f["kind"] == "Image")
    name = wanted or (folder.supervised[0] if folder.supervised else "image")
    feature = folder.features.get(name)
    if feature is None or feature["kind"] != "Image" or feature["dtype"] not in (None, "uint8"):
        what = "no such feature" if feature is None else f"a {feature['kind']} of {feature['dtype']}"
        raise ValueError(
            f"{folder.path / FEATURES_FILE}: image feature {name!r} is {what}, not an encoded uint8 Image; "
            f"name the image with --image-column (Image features here: {images or 'none'})"
        )
    return name


def _class_names(folder: TfdsFolder, label: str, names_file: str | None) -> list[str]:
    feature = folder.features.get(label)
    if feature is None or feature["kind"] != "ClassLabel" or not feature["num_classes"]:
        labels = sorted(k for k, f in folder.features.items() if f["kind"] == "ClassLabel")
        what = "no such feature" if feature is None else f"a {feature['kind']}"
        raise ValueError(
            f"{folder.path / FEATURES_FILE}: label feature {label!r} is {what}, not a ClassLabel; name the label "
            f"with --label-column (ClassLabel features here: {labels or 'none'}) or pick a task with --vtab"
        )
    count = feature["num_classes"]
    if names_file:  # given: it must fit, as for every other source
        names = read_class_names(names_file, [])
        if len(names) != count:
            raise ValueError(
                f"--class-names {names_file} names {len(names)} classes but {label!r} in {folder.path} has {count}; "
                f"give {count} names, one per line in label order, or 'label name' lines for labels 0..{count - 1}"
            )
        return names
    file = folder.path / f"{label.replace('/', '-')}.labels.txt"  # the folder's own: used where it fits
    names = [line.strip() for line in file.read_text().splitlines() if line.strip()] if file.is_file() else []
    return names if len(names) == count else [str(i) for i in range(count)]


def _task_checks(folder: TfdsFolder, task: VtabTfdsTask) -> None:
    if folder.name != task.base_name or task.config and folder.config not in ("", task.config):
        found = folder.name + (f"/{folder.config}" if folder.config else "")
        raise ValueError(
            f"VTAB task {task.name} reads the TFDS dataset {task.tfds_name}, but {folder.path} holds {found}; "
            f"point --source at tfds:<data_dir>/{task.tfds_name}/<version>"
        )
    missing = [k for k in LABEL_FEATURES.get(task.label, ()) if k not in folder.features]
    if missing:
        raise ValueError(f"VTAB task {task.name} computes its label from {missing}, which {FEATURES_FILE} lacks")


def open_tfds_source(
    path: str | Path,
    *,
    split: str,
    tfds_split: str | None = None,
    vtab: str | None = None,
    image_feature: str | None = None,
    label_feature: str | None = None,
    class_names_file: str | None = None,
) -> TfdsSource:
    """``tfds_split`` (TFDS syntax), else VTAB split ``split`` of task ``vtab``, else TFDS split ``split``."""
    folder = read_folder(path)
    task = None
    if vtab is not None:
        if vtab not in TASKS:
            raise ValueError(f"--vtab {vtab!r} is not a VTAB-1k task; choose one of {', '.join(TASKS)}")
        task = TASKS[vtab]
        _task_checks(folder, task)
    expression = tfds_split or (split_expression(task, split, folder.sizes) if task else split)
    if not tfds_split and not task and split not in folder.sizes:
        raise ValueError(
            f"--split {split!r} is not a split of {folder.path} (splits: {', '.join(sorted(folder.sizes))}); "
            "pass --split with one of them, --tfds-split with a TFDS expression, or --vtab TASK"
        )
    units = _units(folder, resolve_split(expression, folder.sizes))
    if not units:
        raise ValueError(f"{expression!r} selects no records of {folder.path} (split sizes: {folder.sizes})")
    image = _image_feature(folder, image_feature)
    derived = task is not None and task.label != "label"
    if derived and label_feature is not None:
        raise ValueError(f"--label-column is not used with --vtab {vtab}: its label is computed by the task")
    label = task.label if derived and task else (label_feature or (folder.supervised or ("", "label"))[1])
    names = class_names(task) if derived and task else _class_names(folder, label, class_names_file)
    if task is not None and len(names) != task.num_classes:
        raise ValueError(
            f"VTAB task {task.name} has {task.num_classes} classes but {label!r} in {folder.path} has {len(names)}"
        )
    return TfdsSource(
        "tfds",
        units,
        tuple(names),
        image,
        label,
        task=task.name if task else "",
        tfds_name=folder.name + (f"/{folder.config}" if folder.config else ""),
        version=folder.version,
        split_expression=expression,
    )


def describe(source: TfdsSource) -> dict:
    return dict(
        name=source.tfds_name,
        version=source.version,
        split=source.split_expression,
        vtab_task=source.task or None,
        image_feature=source.image_column,
        label=source.label_column,
    )


def unit_ids(source: TfdsSource, spell: Callable[[str], str] = str) -> list[str]:
    """Each unit as its file (``spell``: how to name it) and record range."""
    return [f"{spell(u.path)}[{getattr(u, 'start', 0)}:{getattr(u, 'stop', 0)}]" for u in source.units]


def _label_function(source: TfdsSource) -> Callable[[dict[str, FeatureValues]], int]:
    if source.label_column in LABEL_FUNCTIONS and source.task:
        return LABEL_FUNCTIONS[source.label_column]

    def label(example: dict[str, FeatureValues]) -> int:
        values = example.get(source.label_column)
        if not values or len(values) != 1 or not isinstance(values[0], int):
            raise LabelError(f"{source.label_column!r} is not one integer")
        return values[0]

    return label


def _image(example: dict[str, FeatureValues], source: TfdsSource) -> bytes:
    values = example.get(source.image_column)
    if not values or len(values) != 1 or not isinstance(values[0], bytes):
        raise ExampleError(f"{source.image_column!r} is not one encoded image")
    task = TASKS.get(source.task)
    return scale_binary_image(values[0]) if task is not None and task.binary_image else values[0]


def iter_tfds_unit(unit: SourceUnit, source: Source, stats: Counter) -> Iterator[tuple[ItemRef, bytes, int]]:
    """(ref, image bytes, label) of every usable record of ``unit``; the rest counted in ``stats``."""
    assert isinstance(unit, TfdsUnit) and isinstance(source, TfdsSource)
    label_of = _label_function(source)
    with open(unit.path, "rb") as f:
        for index, offset, data in scan_records(f, unit.start, unit.stop, stats):
            try:
                example = decode_example(data)
                image = _image(example, source)
                label = label_of(example)
            except LabelError:
                stats["bad_labels"] += 1
                continue
            except (ExampleError, OSError, ValueError):
                stats["bad_examples"] += 1
                continue
            if not 0 <= label < len(source.class_names):
                stats["label_out_of_range"] += 1
                continue
            where = f"{unit.split}[{unit.first_index + index}]"
            yield ItemRef(REF_KIND, unit.path, source=where, offset=offset, size=len(data)), image, label


def read_tfds_ref(ref: ItemRef, source: Source) -> bytes:
    assert isinstance(source, TfdsSource)
    with open(ref.path, "rb") as f:
        f.seek(ref.offset)
        data = f.read(ref.size)
    return _image(decode_example(data), source)
