"""Check a shard folder (`validate`): checksums, counts, labels, a spot decode and the reader indexes. Exit status:
0 intact; 1 damaged; 2 not a shard folder, a store that cannot be read, or bad arguments.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import posixpath
import sys
from collections import Counter
from dataclasses import dataclass, field

import fsspec
import numpy as np
import pyarrow.parquet as pq
from PIL import Image

from data_pipeline.cli import fail, interrupted
from data_pipeline.manifest import (
    CLASSES_FILE,
    DATASET_FILE,
    SAMPLES_FILE,
    DatasetInfo,
    ShardFormatError,
    check_reader_indexes,
    read_dataset_info,
    rewrite_reader_indexes,
)
from data_pipeline.paths import command_line_path, is_remote, quiet_stores
from data_pipeline.stream.shards import CREDENTIALS, read_shard, refused


@dataclass
class ValidationReport:
    root: str
    shards: int = 0
    samples_expected: int = 0
    samples_read: int = 0
    decoded: int = 0
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # not damage
    counters: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.problems

    def render(self) -> str:
        lines = [
            f"shard folder {self.root}",
            f"  shards: {self.shards}   samples: {self.samples_read} read / {self.samples_expected} in manifest   "
            f"spot-decoded: {self.decoded}",
        ]
        if self.counters:
            lines.append(f"  reader counters: {dict(sorted(self.counters.items()))}")
        lines += [f"  note: {n}" for n in self.notes]
        if self.ok:
            lines.append("  OK: checksums, counts, labels and decoded samples all match")
        else:
            lines.append(f"  DAMAGED: {len(self.problems)} problem(s)")
            lines += [f"   - {p}" for p in self.problems]
        return "\n".join(lines)


def _check_shard(info: DatasetInfo, index: int, spot: int, full: bool, report: ValidationReport) -> None:
    shard = info.shards[index]
    fs, path = fsspec.core.url_to_fs(shard.url)
    if not fs.exists(path):
        report.problems.append(f"{shard.url}: missing (manifest lists {shard.samples} samples)")
        return
    digest, size = hashlib.sha256(), 0
    with fs.open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
            size += len(chunk)
    if size != shard.bytes:
        report.problems.append(f"{shard.url}: {size} bytes, manifest says {shard.bytes}")
    if digest.hexdigest() != shard.sha256:
        report.problems.append(f"{shard.url}: sha256 differs from the manifest (damaged or replaced)")
    stats: Counter = Counter()
    samples = list(read_shard(shard.url, shard.samples, stats))
    report.samples_read += len(samples)
    if len(samples) != shard.samples:
        report.problems.append(f"{shard.url}: {len(samples)} samples readable, manifest says {shard.samples}")
    for key in ("unsafe_members", "read_errors"):
        if stats[key]:
            report.problems.append(f"{shard.url}: {stats[key]} {key.replace('_', ' ')}")
    for name, value in stats.items():
        report.counters[name] = report.counters.get(name, 0) + value
    rng = np.random.default_rng(index)
    picks = range(len(samples)) if full else rng.permutation(len(samples))[:spot]
    for i in sorted(int(k) for k in picks):
        sample = samples[i]
        where = f"{shard.url}:{sample.get('__key__')}"
        if "jpg" not in sample or "cls" not in sample:
            report.problems.append(f"{where}: missing .jpg or .cls member")
            continue
        try:
            label = int(sample["cls"])
        except ValueError:
            report.problems.append(f"{where}: label {sample['cls'][:20]!r} is not an integer")
            continue
        if not 0 <= label < info.num_classes:
            report.problems.append(f"{where}: label {label} out of range [0, {info.num_classes})")
        try:
            with Image.open(io.BytesIO(sample["jpg"])) as img:
                img.load()
            report.decoded += 1
        except (OSError, ValueError, SyntaxError) as err:
            report.problems.append(f"{where}: image does not decode ({err})")


def validate(shard_dir: str, spot: int = 16, full: bool = False) -> ValidationReport:
    """ShardFormatError when ``shard_dir`` is not a split folder."""
    info = read_dataset_info(shard_dir)
    report = ValidationReport(root=str(shard_dir), shards=len(info.shards), samples_expected=info.num_samples)
    for index in range(len(info.shards)):
        _check_shard(info, index, spot, full, report)
    fs, path = fsspec.core.url_to_fs(str(shard_dir))
    samples_path = posixpath.join(path.rstrip("/"), SAMPLES_FILE)
    rows = None
    if fs.exists(samples_path):
        try:
            with fs.open(samples_path, "rb") as f:
                rows = pq.read_metadata(f).num_rows
        except ValueError as error:  # ArrowInvalid: cut short, or another format
            report.problems.append(f"{SAMPLES_FILE} is damaged ({' '.join(str(error).split())})")
        if rows is not None and rows != info.num_samples:
            report.problems.append(f"{SAMPLES_FILE}: {rows} rows, manifest counts {info.num_samples} samples")
    else:
        report.problems.append(f"{SAMPLES_FILE} is missing")
    if info.class_names and len(info.class_names) != info.num_classes:
        report.problems.append(f"{CLASSES_FILE} has {len(info.class_names)} names, {DATASET_FILE} {info.num_classes}")
    problems, notes = check_reader_indexes(shard_dir, info)
    report.problems += problems
    report.notes += notes
    return report


def _write_index(shard_dir: str) -> None:
    if is_remote(shard_dir):
        raise ShardFormatError(f"--write-index writes local folders only; {shard_dir} is a URL")
    try:
        rewrite_reader_indexes(command_line_path(shard_dir))
    except OSError as error:
        raise ShardFormatError(f"--write-index: cannot write into {shard_dir} ({error})") from None


def _unreadable(shard_dir: str, error: Exception) -> str:
    reason = f"{type(error).__name__}: {' '.join(str(error).split())}"
    fix = CREDENTIALS.get(shard_dir.split("://")[0]) if is_remote(shard_dir) and refused(error) else None
    if fix is None:
        return f"{shard_dir}: cannot read it ({reason})"
    return (
        f"{shard_dir}: cannot read it ({reason}): the store refused this process's credentials, or it has none; {fix}"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m data_pipeline.validate",
        description="Validate a vitscale shard folder (checksums, counts, spot decode).",
    )
    p.add_argument("shard_dir")
    p.add_argument("--spot", type=int, default=16, help="samples decoded per shard (default 16)")
    p.add_argument("--full", action="store_true", help="decode every sample")
    p.add_argument(
        "--write-index", action="store_true", help="first (re)write shardindex.json and _info.json from the manifest"
    )
    args = p.parse_args(argv)
    if args.spot < 0:
        p.error(f"--spot {args.spot}: give the number of samples to decode per shard (>= 0)")
    try:
        if not is_remote(args.shard_dir) and command_line_path(args.shard_dir).is_file():
            raise ShardFormatError(
                f"{args.shard_dir} is a file, not a shard folder; give the folder that holds {DATASET_FILE} and "
                "the shards"
            )
        if args.write_index:
            _write_index(args.shard_dir)
        with quiet_stores():  # gcsfs and botocore log each failed try with a traceback; the one line says it
            report = validate(args.shard_dir, spot=args.spot, full=args.full)
    except ShardFormatError as err:
        return fail(p.prog, err)
    except ValueError as err:
        return fail(
            p.prog,
            f"{args.shard_dir}: a metadata file is damaged ({err}); rewrite the folder with "
            "`python -m data_pipeline.write` (or `python -m data_pipeline.builtin`)",
        )
    except Exception as err:  # a store that refuses (credentials) or cannot be reached; its message may span lines
        if not isinstance(err, OSError) and not refused(err):
            raise
        return fail(p.prog, _unreadable(args.shard_dir, err))
    except KeyboardInterrupt:  # it only reads (--write-index replaces each index whole): nothing is half-written
        return interrupted(p.prog, f"nothing in {args.shard_dir} is half-written; the same command checks it again")
    print(report.render())
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
