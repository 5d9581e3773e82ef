"""The shard-folder format (docs/contracts.md, "Shard folders"): one split, a local path or any fsspec URL."""

from __future__ import annotations

import fnmatch
import json
import posixpath
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from fsspec.implementations.local import LocalFileSystem

MANIFEST_FILE = "manifest.parquet"
SAMPLES_FILE = "samples.parquet"
CLASSES_FILE = "classes.parquet"
DATASET_FILE = "dataset.json"
WRITE_SETTINGS_FILE = "_write_settings.json"
WIDS_INDEX_FILE = "shardindex.json"
TIMM_INFO_FILE = "_info.json"
WIDS_KIND = "wids-shard-index-v1"
SHARD_PATTERN = "shard-{index:06d}.tar"
SHARD_GLOB = "shard-*.tar"

MANIFEST_SCHEMA = pa.schema(
    [("url", pa.string()), ("samples", pa.int64()), ("bytes", pa.int64()), ("sha256", pa.string())]
)
CLASSES_SCHEMA = pa.schema([("label", pa.int64()), ("name", pa.string())])
SAMPLES_SCHEMA = pa.schema(
    [
        ("key", pa.string()),
        ("shard", pa.string()),
        ("label", pa.int64()),
        ("width", pa.int64()),
        ("height", pa.int64()),
        ("sha256", pa.string()),  # of the stored bytes
        ("source_sha256", pa.string()),  # of the source file's bytes (--exclude-like matches it too)
        ("phash", pa.int64()),  # 64-bit perceptual hash, bit pattern in a signed int
        ("source", pa.string()),
        ("near_duplicate", pa.bool_()),
        ("exact_duplicate", pa.bool_()),
    ]
)
SAMPLES_ROW_GROUP = 262_144
_DAMAGE = (OSError, ValueError, KeyError, TypeError)  # ArrowInvalid is a ValueError


class ShardFormatError(ValueError):
    """A shard folder lacks a file or contradicts itself; the message names the file and the fix."""


@dataclass(frozen=True)
class ShardInfo:
    url: str  # absolute
    samples: int
    bytes: int
    sha256: str


@dataclass(frozen=True)
class DatasetInfo:
    root: str
    name: str
    split: str
    num_classes: int
    num_samples: int
    shards: tuple[ShardInfo, ...]
    class_names: tuple[str, ...]

    @property
    def shard_urls(self) -> list[str]:
        return [s.url for s in self.shards]

    @property
    def shard_counts(self) -> list[int]:
        return [s.samples for s in self.shards]


def _fs_and_path(url: str | Path) -> tuple[fsspec.AbstractFileSystem, str]:
    fs, path = fsspec.core.url_to_fs(str(url))
    return fs, path.rstrip("/")


def store_info(fs: fsspec.AbstractFileSystem, path: str) -> dict[str, Any] | None:
    """``fs.info(path)``, None where nothing is there; it raises where the store refuses or cannot be reached, where
    fsspec's own exists/isfile/isdir answer False, which would read as "no such folder"."""
    try:
        return fs.info(path)
    except (FileNotFoundError, NotADirectoryError):
        return None


def _exists(fs: fsspec.AbstractFileSystem, path: str, kind: str | None = None) -> bool:
    """`store_info`'s answer as ``fs.exists`` would give it, of a ``kind`` ("file", "directory") if given."""
    info = store_info(fs, path)
    return info is not None and (kind is None or info["type"] == kind)


def _read_parquet(fs: fsspec.AbstractFileSystem, file: str) -> list[dict[str, Any]]:
    """On the calling thread: an Arrow pool thread holding a Python file's bytes can abort the process at exit
    (docs/reference.md §7, "Ending a process")."""
    with fs.open(file, "rb") as f:
        return pq.ParquetFile(f, pre_buffer=False).read(use_threads=False).to_pylist()


def join_url(root: str | Path, name: str) -> str:
    root = str(root)
    return root.rstrip("/") + "/" + name if "://" in root else str(Path(root) / name)


def _inside(url: object) -> bool:
    """Whether a manifest's shard URL names a file inside its folder."""
    return (
        isinstance(url, str)
        and url not in ("", ".")
        and "://" not in url
        and not url.startswith(("/", "\\"))
        and ".." not in url.replace("\\", "/").split("/")
    )


def is_shard_folder(shard_dir: str | Path) -> bool:
    """Whether ``shard_dir`` has a ``manifest.parquet`` (complete or being finished)."""
    fs, path = _fs_and_path(shard_dir)
    return _exists(fs, posixpath.join(path, MANIFEST_FILE), "file")


def _incomplete(root: str, missing: str) -> ShardFormatError:
    return ShardFormatError(
        f"{root} has no {missing}: it is not a complete shard folder (an interrupted write?). "
        "Re-run `python -m data_pipeline.write` with the same arguments to finish it"
    )


def _not_shard_folder(root: str, why: str) -> ShardFormatError:
    return ShardFormatError(
        f"{root} is not a shard folder ({why}); write one with "
        "`python -m data_pipeline.write --source ... --out DIR` or `python -m data_pipeline.builtin NAME --out DIR`"
    )


def _holds_writer_files(fs: fsspec.AbstractFileSystem, path: str) -> bool:
    """Whether ``path`` holds a file the writer writes (shards, metadata, a ``.tmp``): a write begun there."""
    written = {MANIFEST_FILE, SAMPLES_FILE, CLASSES_FILE, WRITE_SETTINGS_FILE, WIDS_INDEX_FILE, TIMM_INFO_FILE}
    try:
        names = _names_in(fs, path)
    except OSError:  # only to word the error: call it an interrupted write, as before
        return True
    return any(n in written or n.endswith(".tmp") or fnmatch.fnmatch(n, SHARD_GLOB) for n in names)


def _split_folders(fs: fsspec.AbstractFileSystem, path: str) -> list[str]:
    """The sub-folders of ``path`` that hold a ``dataset.json``: the split folders of a dataset's folder."""
    try:
        folders = [e["name"].rstrip("/") for e in fs.ls(path, detail=True) if e["type"] == "directory"]
        return sorted(posixpath.basename(f) for f in folders if _exists(fs, posixpath.join(f, DATASET_FILE)))
    except OSError:  # only to word the error better: the caller's "no dataset.json" still holds
        return []


def _not_split_folder(root: str, fs: fsspec.AbstractFileSystem, path: str) -> ShardFormatError:
    """The error for a folder without ``dataset.json``: a dataset's folder of split folders, or an unfinished one."""
    splits = _split_folders(fs, path)
    if not splits and not _holds_writer_files(fs, path):
        why = f"it holds none of the files `python -m data_pipeline.write` writes: no {DATASET_FILE}, manifest or shard"
        return _not_shard_folder(root, why)
    if not splits:
        return _incomplete(root, DATASET_FILE)
    return ShardFormatError(
        f"{root} holds the split folders {', '.join(splits)} of a dataset, not shards; give one of them, "
        f"e.g. {join_url(root, splits[0])}"
    )


def _damaged(root: str, name: str, error: Exception) -> ShardFormatError:
    return ShardFormatError(
        f"{join_url(root, name)} is damaged ({type(error).__name__}: {error}); rewrite the folder with "
        "`python -m data_pipeline.write` (or `python -m data_pipeline.builtin`)"
    )


def read_dataset_json(shard_dir: str | Path) -> dict[str, Any] | None:
    """The split's ``dataset.json``, None when absent; ShardFormatError when damaged."""
    root = str(shard_dir)
    fs, path = _fs_and_path(root)
    file = posixpath.join(path, DATASET_FILE)
    if not _exists(fs, file):
        return None
    try:
        with fs.open(file, "r") as f:
            meta = json.load(f)
        if not isinstance(meta, dict):
            raise TypeError(f"a JSON object was expected, not {type(meta).__name__}")
        meta["num_classes"] = int(meta["num_classes"])
        if "num_samples" in meta:
            meta["num_samples"] = int(meta["num_samples"])
    except _DAMAGE as error:
        raise _damaged(root, DATASET_FILE, error) from None
    return meta


def read_dataset_info(shard_dir: str | Path) -> DatasetInfo:
    """A split folder's metadata; ShardFormatError names a missing or inconsistent file."""
    root = str(shard_dir)
    fs, path = _fs_and_path(root)
    if not _exists(fs, path, "directory"):
        raise _not_shard_folder(root, "it does not exist")
    if not _exists(fs, posixpath.join(path, DATASET_FILE)):
        raise _not_split_folder(root, fs, path)
    if not _exists(fs, posixpath.join(path, MANIFEST_FILE)):
        raise _incomplete(root, MANIFEST_FILE)
    meta = read_dataset_json(root)
    if meta is None:
        raise _incomplete(root, DATASET_FILE)
    try:
        manifest = _read_parquet(fs, posixpath.join(path, MANIFEST_FILE))
        outside = [r["url"] for r in manifest if not _inside(r["url"])]
        shards = tuple(
            ShardInfo(join_url(root, r["url"]), int(r["samples"]), int(r["bytes"]), r["sha256"]) for r in manifest
        )
    except _DAMAGE as error:
        raise _damaged(root, MANIFEST_FILE, error) from None
    if outside:
        raise ShardFormatError(
            f"{join_url(root, MANIFEST_FILE)} lists the shard {outside[0]!r}, which is not a path inside the folder "
            "(absolute, in another store or through '..'): shard URLs are relative to it and nothing is read outside "
            "it; rewrite the folder with `python -m data_pipeline.write`"
        )
    class_names: tuple[str, ...] = ()
    if _exists(fs, posixpath.join(path, CLASSES_FILE)):
        try:
            rows = sorted(_read_parquet(fs, posixpath.join(path, CLASSES_FILE)), key=lambda r: r["label"])
            class_names = tuple(str(r["name"]) for r in rows)
        except _DAMAGE as error:
            raise _damaged(root, CLASSES_FILE, error) from None
    num_samples = sum(s.samples for s in shards)
    if meta.get("num_samples", num_samples) != num_samples:
        raise ShardFormatError(
            f"{root}: {DATASET_FILE} says {meta['num_samples']} samples but {MANIFEST_FILE} counts {num_samples}; "
            "the folder is damaged — rewrite it with `python -m data_pipeline.write` (or `python -m "
            "data_pipeline.builtin`)"  # not validate: it stops here too
        )
    if not shards:
        raise ShardFormatError(f"{root}: {MANIFEST_FILE} lists no shards; the dataset is empty")
    return DatasetInfo(
        root=root,
        name=str(meta.get("name", Path(path).name)),
        split=str(meta.get("split", "")),
        num_classes=meta["num_classes"],
        num_samples=num_samples,
        shards=shards,
        class_names=class_names,
    )


def check_class_count(info: DatasetInfo) -> None:
    """ShardFormatError when ``classes.parquet`` and ``dataset.json`` disagree on the number of classes."""
    if info.class_names and len(info.class_names) != info.num_classes:
        raise ShardFormatError(
            f"{info.root}: {CLASSES_FILE} names {len(info.class_names)} classes but {DATASET_FILE} says num_classes "
            f"{info.num_classes}; set it to {len(info.class_names)} if the names are right, or write the folder again "
            f"(`python -m data_pipeline.validate {info.root}` checks it)"
        )


def _names_in(fs: fsspec.AbstractFileSystem, folder: str) -> set[str]:
    """The names ``folder`` holds; none where it is not there."""
    if not _exists(fs, folder, "directory"):
        return set()
    return {posixpath.basename(p.rstrip("/")) for p in fs.ls(folder, detail=False)}


def missing_shards(info: DatasetInfo) -> list[str]:
    """The shards of a local folder's manifest that are not there (one listing per folder); [] for a store's URL."""
    fs, _ = _fs_and_path(info.root)
    if not isinstance(fs, LocalFileSystem):
        return []
    listed: dict[str, set[str]] = {}
    missing = []
    for shard in info.shards:
        folder, name = posixpath.split(fs._strip_protocol(shard.url))
        if folder not in listed:
            listed[folder] = _names_in(fs, folder)
        if name not in listed[folder]:
            missing.append(shard.url)
    return missing


def check_shards_exist(info: DatasetInfo) -> None:
    """ShardFormatError naming the local folder's missing shards and the fix."""
    missing = missing_shards(info)
    if missing:
        raise ShardFormatError(
            f"{info.root}: {MANIFEST_FILE} lists {len(missing)} shard(s) that do not exist, e.g. {missing[0]}; "
            f"check the folder with `python -m data_pipeline.validate {info.root}` and write it again"
        )


def dataset_info(source: str | Path | DatasetInfo) -> DatasetInfo:
    return source if isinstance(source, DatasetInfo) else read_dataset_info(source)


def write_table_atomic(table: pa.Table, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    pq.write_table(table, tmp)
    tmp.replace(path)


def write_json_atomic(obj: dict, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")
    tmp.replace(path)


class SamplesWriter:
    """``samples.parquet`` a row group at a time, renamed into place by ``close()``."""

    def __init__(self, path: Path, schema: pa.Schema = SAMPLES_SCHEMA, row_group: int = SAMPLES_ROW_GROUP):
        self.path, self.schema, self.row_group = Path(path), schema, row_group
        self._tmp = self.path.with_name(self.path.name + ".tmp")
        self._writer = pq.ParquetWriter(self._tmp, schema)
        self._pending: list[pa.RecordBatch] = []
        self._pending_rows = 0
        self.rows = 0

    def write_rows(self, rows: list[dict]) -> None:
        if rows:
            self.write_batch(pa.RecordBatch.from_pylist(rows, schema=self.schema))

    def write_batch(self, batch: pa.RecordBatch) -> None:
        self._pending.append(batch)
        self._pending_rows += batch.num_rows
        self.rows += batch.num_rows
        if self._pending_rows >= self.row_group:
            self._flush(final=False)

    def _flush(self, final: bool) -> None:
        table = pa.Table.from_batches(self._pending, self.schema)
        whole = table.num_rows if final else table.num_rows - table.num_rows % self.row_group
        if whole:
            self._writer.write_table(table.slice(0, whole), row_group_size=self.row_group)
        rest = table.slice(whole)
        self._pending, self._pending_rows = rest.to_batches(), rest.num_rows

    def close(self) -> None:
        self._flush(final=True)
        self._writer.close()
        self._tmp.replace(self.path)

    def __enter__(self) -> SamplesWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self._writer.close()
            self._tmp.unlink(missing_ok=True)


def iter_samples(shard_dir: str | Path, columns: list[str] | None = None, batch_rows: int = 65536):
    """Record batches of ``columns`` of ``samples.parquet`` (a folder's, or the file), a row group in memory."""
    fs, path = _fs_and_path(shard_dir)
    file = path if path.endswith(".parquet") else posixpath.join(path, SAMPLES_FILE)
    try:
        with fs.open(file, "rb") as f:
            parquet = pq.ParquetFile(f, pre_buffer=False, buffer_size=1 << 20)
            missing = set(columns or ()) - set(parquet.schema_arrow.names)
            if missing:
                raise ShardFormatError(
                    f"{file} has no column(s) {sorted(missing)}; rewrite it with `python -m data_pipeline.write`"
                )
            yield from parquet.iter_batches(batch_size=batch_rows, columns=columns, use_threads=False)
    except FileNotFoundError:
        raise ShardFormatError(f"{file} is missing; write the folder with `python -m data_pipeline.write`") from None
    except (OSError, pa.ArrowInvalid) as error:
        raise ShardFormatError(f"{file} is damaged ({type(error).__name__}: {error}); rewrite the folder") from None


def int64_column(batch: pa.RecordBatch, name: str) -> np.ndarray:
    """Column ``name`` as int64 numpy from its Arrow buffer (``to_numpy`` imports pandas)."""
    column = batch.column(name).cast(pa.int64())
    if column.null_count:
        raise ValueError(f"column {name!r} holds {column.null_count} nulls")
    return np.frombuffer(column.buffers()[1], dtype=np.int64, count=len(column), offset=column.offset * 8)


def write_metadata(
    out_dir: Path, *, shards: list[dict], samples: pa.Table | None, class_names: list[str], dataset: dict
) -> None:
    """A split folder's metadata, ``dataset.json`` last; ``samples=None``: already written."""
    out_dir = Path(out_dir)
    write_table_atomic(pa.Table.from_pylist(shards, schema=MANIFEST_SCHEMA), out_dir / MANIFEST_FILE)
    if samples is not None:
        write_table_atomic(samples, out_dir / SAMPLES_FILE)
    classes = pa.Table.from_pylist([dict(label=i, name=n) for i, n in enumerate(class_names)], schema=CLASSES_SCHEMA)
    write_table_atomic(classes, out_dir / CLASSES_FILE)
    write_reader_indexes(out_dir, shards, dataset, len(class_names))
    counts = dict(num_classes=len(class_names), num_samples=sum(int(s["samples"]) for s in shards))
    write_json_atomic(dict(dataset, **counts, num_shards=len(shards)), out_dir / DATASET_FILE)


def write_reader_indexes(out_dir: Path, shards: list[dict], dataset: dict, num_classes: int) -> None:
    out_dir = Path(out_dir)
    name, split = str(dataset.get("name") or out_dir.parent.name), str(dataset.get("split") or out_dir.name)
    counts = [int(s["samples"]) for s in shards]
    shardlist = [dict(url=s["url"], nsamples=n, filesize=int(s["bytes"])) for s, n in zip(shards, counts)]
    wids = {"__kind__": WIDS_KIND, "wids_version": 1, "name": f"{name}-{split}", "shardlist": shardlist}
    write_json_atomic(wids, out_dir / WIDS_INDEX_FILE)
    timm = dict(name=split, num_samples=sum(counts), filenames=[s["url"] for s in shards], shard_lengths=counts)
    write_json_atomic(dict(name=name, num_classes=num_classes, splits={split: timm}), out_dir / TIMM_INFO_FILE)


def rewrite_reader_indexes(shard_dir: str | Path) -> None:
    info = read_dataset_info(shard_dir)
    root = Path(shard_dir)
    rows = pq.ParquetFile(root / MANIFEST_FILE).read().to_pylist()
    write_reader_indexes(root, rows, dict(name=info.name, split=info.split), info.num_classes)


def _read_index(root: str, name: str) -> tuple[dict | None, str | None]:
    """(the index, None), (None, None) when absent, or (None, what is wrong)."""
    fs, path = _fs_and_path(root)
    file = posixpath.join(path, name)
    if not _exists(fs, file):
        return None, None
    try:
        with fs.open(file, "r") as f:
            data = json.load(f)
    except (OSError, ValueError) as error:
        return None, f"{name} does not parse ({type(error).__name__}: {error})"
    return (data, None) if isinstance(data, dict) else (None, f"{name} holds a JSON {type(data).__name__}")


def _index_mismatch(name: str, root: str, info: DatasetInfo, urls: list, counts: list) -> str | None:
    if any(not isinstance(u, str) or "://" in u or u.startswith("/") for u in urls):
        return f"{name} holds absolute shard URLs; they must be relative to the folder so that it can move"
    if [join_url(root, u) for u in urls] != info.shard_urls:
        listed = [posixpath.basename(u) for u in info.shard_urls]
        return f"{name} lists the shards {urls[:3]}... ({len(urls)}), the manifest {listed[:3]}... ({len(listed)})"
    try:
        numbers = [int(c) for c in counts]
    except (TypeError, ValueError):
        return f"{name}: a shard's sample count is not an integer"
    for url, got, want in zip(urls, numbers, info.shard_counts):
        if got != want:
            return f"{name}: shard {url} has {got} samples there, {want} in the manifest"
    return None


def _check_wids(root: str, info: DatasetInfo, index: dict) -> str | None:
    if index.get("__kind__") != WIDS_KIND or index.get("wids_version") != 1:
        return f"{WIDS_INDEX_FILE} is not a wids index (__kind__ {WIDS_KIND!r}, wids_version 1 expected)"
    shards = index.get("shardlist")
    if not isinstance(shards, list) or not all(isinstance(s, dict) and "url" in s and "nsamples" in s for s in shards):
        return f"{WIDS_INDEX_FILE}: shardlist is not a list of {{url, nsamples}}"
    return _index_mismatch(WIDS_INDEX_FILE, root, info, [s["url"] for s in shards], [s["nsamples"] for s in shards])


def _check_timm(root: str, info: DatasetInfo, index: dict) -> str | None:
    split = (index.get("splits") or {}).get(info.split)
    if not isinstance(split, dict) or not {"num_samples", "filenames", "shard_lengths", "name"} <= set(split):
        return f"{TIMM_INFO_FILE} has no split {info.split!r} with name, num_samples, filenames and shard_lengths"
    found = _index_mismatch(TIMM_INFO_FILE, root, info, list(split["filenames"]), list(split["shard_lengths"]))
    if found is None and int(split["num_samples"]) != info.num_samples:
        return f"{TIMM_INFO_FILE}: num_samples {split['num_samples']}, the manifest counts {info.num_samples}"
    return found


def check_reader_indexes(shard_dir: str | Path, info: DatasetInfo) -> tuple[list[str], list[str]]:
    """(problems, notes) of the reader indexes: damaged or contradicting, or absent."""
    root = str(shard_dir)
    problems, notes = [], []
    for name, check in ((WIDS_INDEX_FILE, _check_wids), (TIMM_INFO_FILE, _check_timm)):
        index, damage = _read_index(root, name)
        if damage is not None:
            problems.append(damage)
        elif index is None:
            notes.append(
                f"no {name}: a folder written before the reader indexes (wids / timm cannot open it by index); "
                f"add it with `python -m data_pipeline.validate {root} --write-index`"
            )
        elif (found := check(root, info, index)) is not None:
            problems.append(found)
    return problems, notes
