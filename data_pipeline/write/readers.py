"""Readers of raw image collections: class-per-folder trees, ImageNet-21k's per-class tars, Parquet bytes + label."""

from __future__ import annotations

import bisect
import os
import tarfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from data_pipeline.write.dedup import IMAGE_SUFFIXES


@dataclass(frozen=True)
class ItemRef:
    """Where one raw image lives; ``source``: a readable id (folder/file, tar:member, file#row)."""

    kind: str  # "file" | "tar" | "parquet"
    path: str
    source: str
    offset: int = 0  # tar: byte offset of the member's data
    size: int = 0  # tar: member size
    row: int = -1  # parquet: row index


@dataclass(frozen=True)
class SourceUnit:
    kind: str  # "folder" | "tar" | "parquet"
    path: str
    label: int  # folder/tar: every image's class; parquet: -1 (labels from a column)


@dataclass(frozen=True)
class Source:
    kind: str
    units: tuple[SourceUnit, ...]
    class_names: tuple[str, ...]
    image_column: str = "image"
    label_column: str = "label"
    class_ids: tuple[str, ...] = ()  # the labels' class ids where they are not the units': other splits' (`splits`)


def readable(name: str) -> str:
    """``name`` as text that UTF-8 can hold: a Linux name's bytes that are not UTF-8 (a file named in Latin-1), which
    Python reads as surrogates that no Parquet string takes, written as ``\\xNN``."""
    try:
        return name.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    except UnicodeEncodeError:  # a surrogate no byte was read as
        return name.encode("utf-8", "backslashreplace").decode("utf-8")


def is_safe_member(name: str) -> bool:
    """Whether a tar member name is relative, without ``..`` or a drive letter."""
    parts = name.replace("\\", "/").split("/")
    return bool(name) and not name.startswith(("/", "\\")) and ".." not in parts and ":" not in parts[0]


def read_class_names(path: str | Path | None, ids: list[str]) -> list[str]:
    """Class names from a file of ``id<TAB>name`` lines, ``id name`` lines or names in label order; ValueError for
    ids that match no class, or a list of names of another length."""
    if path is None:
        return list(ids)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(
            f"class-name file {path} is not UTF-8 text (byte {error.start}); give 'id name' lines or one name per line"
        ) from None
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    known = set(ids)
    numbered = not ids  # Parquet, TFDS: the ids are the labels, and the file may name classes that hold no image

    def is_label(text: str) -> bool:
        return text.isascii() and text.isdigit()

    if all("\t" in line for line in lines):
        pairs = [line.split("\t", 1) for line in lines]
    elif all(line.split(None, 1)[0] in known or numbered and is_label(line.split(None, 1)[0]) for line in lines):
        pairs = [line.split(None, 1) + [""] for line in lines]
    elif known and all(len(line.split()) > 1 for line in lines) and known <= {line.split()[0] for line in lines}:
        pairs = [line.split(None, 1) for line in lines]  # a map of more classes than the source holds
    elif not numbered and lines and all(len(line.split()) > 1 and is_label(line.split()[0]) for line in lines):
        raise _unmatched(path, next(line.split()[0] for line in lines if line.split()[0] not in known), ids)
    else:
        pairs = None
    if pairs is not None:
        table = {p[0].strip(): (p[1].strip() or p[0].strip()) for p in pairs}
        if numbered:
            if not all(is_label(key) for key in table):
                raise ValueError(
                    f"class-name file {path}: ids such as {next(k for k in table if not is_label(k))!r} are not "
                    "labels; this source's ids are its labels: give 'label name' lines or one name per line"
                )
            table = {str(int(key)): name for key, name in table.items()}
            ids = [str(i) for i in range(max(map(int, table), default=-1) + 1)]
        elif table and not known & table.keys():  # e.g. label-numbered lines for folders named by wnid
            raise _unmatched(path, next(iter(table)), ids)
        return [table.get(i, i) for i in ids]
    if ids and len(lines) != len(ids):
        raise ValueError(
            f"class-name file {path} has {len(lines)} names but the source has {len(ids)} classes; give one name "
            "per class, in the order of its sorted ids, or 'id name' lines"
        )
    return lines


def _listed(names: list[str], most: int = 5) -> str:
    return ", ".join(names[:most]) + (", ..." if len(names) > most else "")


def _unmatched(path: str | Path, key: str, ids: list[str]) -> ValueError:
    return ValueError(
        f"class-name file {path}: ids such as {key!r} match no class of the source (its ids: {_listed(ids)}); key "
        f"each line by a class's id ('{ids[0]} name' or '{ids[0]}<TAB>name') or give one name per line in that order"
    )


def _parquet_schema(file: Path) -> pa.Schema:
    """The schema of ``file``; ValueError naming it when it is no Parquet file (cut short, or another format)."""
    try:
        return pq.read_schema(file)
    except (OSError, pa.ArrowException) as error:
        raise ValueError(
            f"{file} is not a readable Parquet file ({error}); copy it again whole, or move it out of --source"
        ) from None


def _holds_bytes(kind: pa.DataType) -> bool:
    """Whether a column of ``kind`` holds encoded images: binary, or structs with a binary ``bytes`` field (HF)."""
    if pa.types.is_struct(kind) and kind.get_field_index("bytes") >= 0:
        kind = kind.field("bytes").type
    binary = (pa.types.is_binary, pa.types.is_large_binary, pa.types.is_binary_view, pa.types.is_fixed_size_binary)
    return any(is_type(kind) for is_type in binary)


def _check_image_column(file: Path, schema: pa.Schema, column: str) -> None:
    """ValueError unless ``column`` holds image bytes: paths or other values are not images the writer can read."""
    kind = schema.field(column).type
    if not _holds_bytes(kind):
        candidates = [field.name for field in schema if _holds_bytes(field.type)]
        raise ValueError(
            f"{file}: image column '{column}' holds {kind} values, not encoded image bytes; name a column of image "
            f"bytes (binary, or structs with a binary 'bytes' field) with --image-column (such columns here: "
            f"{candidates or 'none'})"
        )


def _max_label(file: Path, column: str) -> int:
    """The largest label of a Parquet file; ValueError unless every label is a whole number >= 0."""
    labels = pq.read_table(file, columns=[column]).column(column)
    where = f"{file}: column '{column}'"
    fix = "give integer class ids 0..N-1 (their names with --class-names) or name another --label-column"
    if not (pa.types.is_integer(labels.type) or pa.types.is_floating(labels.type)):
        given = labels.drop_null()
        example = f" (e.g. {given[0].as_py()!r})" if len(given) else ""
        raise ValueError(f"{where} holds {labels.type} labels{example}, not class ids; {fix}")
    if labels.null_count or len(labels) and pc.min(labels).as_py() < 0:
        raise ValueError(f"{where} holds a negative or missing label; {fix}")
    if pa.types.is_floating(labels.type):
        whole = pc.and_(pc.is_finite(labels), pc.equal(pc.floor(labels), labels))
        if not pc.all(whole).as_py():
            bad = labels.filter(pc.invert(whole))[0].as_py()
            raise ValueError(f"{where} holds label {bad}, not a whole number; {fix}")
    return int(pc.max(labels).as_py()) if len(labels) else -1


def is_hidden(name: str) -> bool:
    """A dot-file or dot-folder: .ipynb_checkpoints, .git, macOS's .DS_Store and ._ copies; never a class or image."""
    return name.startswith(".")


def _visible(root: Path, pattern: str) -> list[Path]:
    """The entries of ``root`` matching ``pattern``, sorted, without hidden ones."""
    return sorted(p for p in root.glob(pattern) if not is_hidden(p.name))


_SNAPSHOT_FOLDERS = 16  # a Hugging Face snapshot holds data/ or one folder per config


def _no_layout(root: Path) -> str:
    """Why ``root`` is no collection the writer reads, and what to give instead."""
    layouts = (
        "class sub-folders of images, per-class .tar files (ImageNet-21k layout) or .parquet files with image "
        "bytes and a label column"
    )
    if root.is_file():
        return f"--source {root} is a file, not a folder or a .parquet file; give a folder of {layouts}"
    images = sum(1 for p in _visible(root, "*") if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file())
    if images:
        return (
            f"--source {root} holds {images} images but no class sub-folders; put each class's images in a "
            f"sub-folder named after the class ({root}/CLASS/IMAGE) and give {root} again"
        )
    return f"--source {root} is empty: expected {layouts}"


def _check_not_snapshot(root: Path, folders: list[Path]) -> None:
    """ValueError for a Hugging Face dataset snapshot (``data/train-00000-of-00002.parquet``, a README.md): its
    Parquet folder would be read as one image class. Only a few folders are looked into: ImageNet's thousands of
    class folders would each be listed once more."""
    if len(folders) > _SNAPSHOT_FOLDERS:
        return
    for inner in folders:
        suffixes = {entry.suffix.lower() for entry in _visible(inner, "*")}
        if ".parquet" not in suffixes or suffixes.intersection(IMAGE_SUFFIXES):  # a class with a stray table
            continue
        raise ValueError(
            f"--source {root} holds .parquet files one level down, in {inner.name}/ (a Hugging Face dataset "
            f"snapshot?), not class folders of images; pass --source {inner}"
        )


def _detect_kind(root: Path) -> str:
    """The kind of collection ``root`` is; ValueError when it is none, or when class sub-folders lie beside .tar or
    .parquet files: reading either would silently leave out the other's images."""
    if root.is_file() and root.suffix == ".parquet":
        return "parquet"
    if not root.is_dir():
        raise ValueError(_no_layout(root))
    tables, tars = _visible(root, "*.parquet"), _visible(root, "*.tar")
    if tables and tars:
        raise ValueError(
            f"--source {root} holds both per-class .tar files ({_listed([p.name for p in tars], 3)}) and .parquet "
            f"files ({_listed([p.name for p in tables], 3)}); say which is the collection with --kind imagenet21k "
            "or --kind parquet, or move the others out"
        )
    files = tables or tars
    folders = [p for p in _visible(root, "*") if p.is_dir() and p not in files]
    if folders and not files:
        _check_not_snapshot(root, folders)
    if files and folders:
        raise ValueError(
            f"--source {root} holds both class sub-folders ({_listed([p.name for p in folders], 3)}) and "
            f"{files[0].suffix} files ({_listed([p.name for p in files], 3)}); say which is the collection "
            "with --kind folder, --kind imagenet21k (per-class .tar files) or --kind parquet, or move the others out"
        )
    if files:
        return "parquet" if files[0].suffix == ".parquet" else "imagenet21k"
    if folders:
        return "folder"
    raise ValueError(_no_layout(root))


def open_source(
    path: str | Path,
    *,
    kind: str = "auto",
    class_names_file: str | Path | None = None,
    image_column: str = "image",
    label_column: str = "label",
    label_space: Callable[[list[str]], list[str]] | None = None,
) -> Source:
    """A raw collection of ``kind`` "folder", "imagenet21k", "parquet" or "auto"; ValueError naming what was
    expected. ``label_space``: the class ids that label class folders or tars, given theirs (`splits.label_space`;
    default: theirs, sorted)."""
    root = Path(path)
    if not root.exists():
        raise ValueError(f"--source {root} does not exist")
    if kind == "auto":
        kind = _detect_kind(root)
    if kind in ("folder", "imagenet21k"):  # one class per sub-folder or .tar
        tar = kind == "imagenet21k"
        paths = _visible(root, "*.tar") if tar else [p for p in _visible(root, "*") if p.is_dir()]
        if not paths:
            raise ValueError(f"--source {root} has no per-class .tar files" if tar else _no_layout(root))
        ids = [readable(p.stem if tar else p.name) for p in paths]
        space = label_space(ids) if label_space else ids
        labels = {i: label for label, i in enumerate(space)}
        names = read_class_names(class_names_file, space)
        units = tuple(SourceUnit("tar" if tar else "folder", str(p), labels[i]) for i, p in zip(ids, paths))
        return Source(kind, units, tuple(names), class_ids=tuple(space) if space != ids else ())
    if kind == "parquet":
        files = [root] if root.is_file() else _visible(root, "*.parquet")
        if not files:
            raise ValueError(f"--source {root} has no .parquet files")
        max_label = -1
        for f in files:
            schema = _parquet_schema(f)
            for col in (image_column, label_column):
                if col not in schema.names:
                    raise ValueError(
                        f"{f} has no column '{col}' (columns: {schema.names}); pass --image-column/--label-column"
                    )
            _check_image_column(f, schema, image_column)
            max_label = max(max_label, _max_label(f, label_column))
        ids = [str(i) for i in range(max_label + 1)]
        names = read_class_names(class_names_file, [] if class_names_file else ids)
        if len(names) <= max_label:
            raise ValueError(
                f"label {max_label} in {root} is out of range for the {len(names)} names in {class_names_file}; "
                "fix the labels or the class-name file"
            )
        units = tuple(SourceUnit("parquet", str(f), -1) for f in files)
        return Source("parquet", units, tuple(names), image_column, label_column)
    raise ValueError(f"unknown source kind {kind!r}; use auto, folder, imagenet21k or parquet")


def _count(stats: dict, key: str) -> None:
    stats[key] = stats.get(key, 0) + 1


def _entries(root: Path, stats: dict) -> list[Path]:
    """Every file and folder under ``root``, sorted, as ``Path.rglob("*")`` lists them (symlinked folders listed, not
    followed), but a folder that cannot be listed is counted: rglob passes over it and its images without a word.
    ``root`` itself unlistable: ``unreadable_classes``."""
    found, folders = [], [root]
    while folders:
        folder = folders.pop()
        try:
            with os.scandir(folder) as listing:
                entries = list(listing)
        except OSError:  # no permission, or a store that failed
            _count(stats, "unreadable_classes" if folder == root else "unreadable_folders")
            continue
        for entry in entries:
            found.append(folder / entry.name)
            try:
                if entry.is_dir(follow_symlinks=False):
                    folders.append(found[-1])
            except OSError:
                _count(stats, "unreadable_folders")
    return sorted(found)


def _iter_folder(unit: SourceUnit, stats: dict) -> Iterator[tuple[ItemRef, bytes, int]]:
    for file in _entries(Path(unit.path), stats):
        if file.is_file() and any(is_hidden(part) for part in file.relative_to(unit.path).parts):
            _count(stats, "hidden")  # .DS_Store, ._x.jpg, .ipynb_checkpoints/…
        elif file.is_file() and file.suffix.lower() in IMAGE_SUFFIXES:
            try:
                data = file.read_bytes()
            except OSError:  # no read permission (another user's file), or removed since the listing
                _count(stats, "unreadable")
                continue
            where = readable(f"{Path(unit.path).name}/{file.relative_to(unit.path)}")
            yield ItemRef("file", str(file), source=where), data, unit.label
        elif file.is_file():
            _count(stats, "not_image")
        elif file.is_symlink() and not file.exists():  # into a store not mounted here, or moved
            _count(stats, "broken_links")
        elif file.is_symlink() and file.is_dir():  # not followed (a loop would never end)
            _count(stats, "linked_folders")


def iter_unit(unit: SourceUnit, source: Source, stats: dict) -> Iterator[tuple[ItemRef, bytes, int]]:
    """(ref, raw bytes, label) of every candidate image of one unit; skips counted in ``stats``."""
    if unit.kind == "folder":
        yield from _iter_folder(unit, stats)
    elif unit.kind == "tar":
        try:
            yield from _iter_tar(unit, stats)
        except PermissionError:  # another user's file
            _count(stats, "unreadable")
        except (tarfile.TarError, OSError):  # truncated, corrupt or empty: the members read before it are kept
            _count(stats, "broken_files")
    elif unit.kind == "parquet":
        table = pq.read_table(unit.path, columns=[source.image_column, source.label_column])
        images = table.column(source.image_column).to_pylist()
        labels = table.column(source.label_column).to_pylist()
        for row, (image, label) in enumerate(zip(images, labels)):
            data = image["bytes"] if isinstance(image, dict) else image  # HF datasets store {bytes, path}
            where = readable(f"{Path(unit.path).name}#{row}")
            yield ItemRef("parquet", unit.path, source=where, row=row), data, int(label)
    else:
        raise ValueError(f"unknown unit kind {unit.kind!r}")


def _iter_tar(unit: SourceUnit, stats: dict) -> Iterator[tuple[ItemRef, bytes, int]]:
    # "r|": a plain tar only, as read_ref reads members at their byte offsets in the file
    with open(unit.path, "rb") as fileobj, tarfile.open(fileobj=fileobj, mode="r|") as tar:
        for member in tar:
            if member.issym() or member.islnk():  # never followed: nothing is read outside the archive
                _count(stats, "tar_links")
                continue
            if not member.isreg():  # a folder entry, or a device or pipe: no image
                if not member.isdir():
                    _count(stats, "not_image")
                continue
            if not is_safe_member(member.name):
                _count(stats, "unsafe_member")
                continue
            member_file = tar.extractfile(member)
            assert member_file is not None
            data = member_file.read()
            where = readable(f"{Path(unit.path).stem}:{member.name}")
            yield ItemRef("tar", unit.path, where, offset=member.offset_data, size=member.size), data, unit.label
        fileobj.seek(tar.offset)
        if fileobj.read(tarfile.BLOCKSIZE) != bytes(tarfile.BLOCKSIZE):  # tarfile ends quietly at a cut header
            raise tarfile.ReadError(f"{unit.path} ends before its end-of-archive block")


@lru_cache(maxsize=2)
def _parquet_images(path: str, column: str) -> list:
    return pq.read_table(path, columns=[column]).column(column).to_pylist()


def read_parquet_rows(path: str, column: str, rows: list[int]) -> dict[int, bytes]:
    """The images of ``rows`` of one Parquet file, reading only the row groups that hold them: a shuffled write
    asks each file for a few rows per shard, and the whole column per row would read the source over and over."""
    file = pq.ParquetFile(path)
    sizes = [file.metadata.row_group(g).num_rows for g in range(file.num_row_groups)]
    starts = [0]
    for size in sizes:
        starts.append(starts[-1] + size)
    groups = sorted({bisect.bisect_right(starts, row) - 1 for row in rows})
    images = file.read_row_groups(groups, columns=[column], use_threads=False).column(0)
    shift, at = {}, 0  # a row group's first row in the table read
    for g in groups:
        shift[g], at = at - starts[g], at + sizes[g]
    picked = images.take([row + shift[bisect.bisect_right(starts, row) - 1] for row in rows]).to_pylist()
    return {row: image["bytes"] if isinstance(image, dict) else image for row, image in zip(rows, picked)}


def read_ref(ref: ItemRef, image_column: str = "image") -> bytes:
    if ref.kind == "file":
        return Path(ref.path).read_bytes()
    if ref.kind == "tar":
        with open(ref.path, "rb") as f:
            f.seek(ref.offset)
            return f.read(ref.size)
    if ref.kind == "parquet":
        image = _parquet_images(ref.path, image_column)[ref.row]
        return image["bytes"] if isinstance(image, dict) else image
    raise ValueError(f"unknown ItemRef kind {ref.kind!r}")
