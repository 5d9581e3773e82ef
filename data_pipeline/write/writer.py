"""Write a raw image collection as globally pre-shuffled WebDataset shards with a Parquet manifest (docs/reference.md
§6); a re-run after an interruption keeps the finished shards.
"""

from __future__ import annotations

import hashlib
import io
import json
import multiprocessing
import os
import sys
import tarfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
import webdataset as wds
from PIL import Image
from tqdm import tqdm

from data_pipeline import manifest
from data_pipeline.cli import ignore_interrupt
from data_pipeline.write.dedup import (
    ExclusionSet,
    eight_bit,
    near_duplicates_of_earlier,
    perceptual_hash,
    sha256_hex,
    turned,
    upright,
)
from data_pipeline.write.readers import ItemRef, Source, SourceUnit, iter_unit, read_parquet_rows, read_ref
from data_pipeline.write.tfds import REF_KIND, TfdsSource, iter_tfds_unit, read_tfds_ref, unit_ids

# Fixed tar headers; an int: a float mtime makes tarfile add a PAX header per member.
TAR_MTIME = 0
TAR_OWNER = "vitscale"
# A source file's read failing in the write pass: removed, cut or rewritten since the scan (ArrowInvalid and
# ExampleError are ValueErrors, ArrowIndexError an IndexError).
_GONE = (OSError, ValueError, IndexError, KeyError)
# _write_settings.json: 2 names the source's units as they are named in it (1: as the paths given, no class names)
SETTINGS_FORMAT = 2


@dataclass(frozen=True)
class WriteConfig:
    name: str = "dataset"  # recorded in dataset.json
    split: str = "train"
    samples_per_shard: int = 3000  # keep >= 8 shards per stream; docs/reference.md §6
    max_short_side: int = 512  # larger JPEGs are downscaled and re-encoded at quality 90
    min_size: int = 8  # a smaller short side is skipped as "too_small"
    seed: int = 0  # seeds the global pre-shuffle
    processes: int = field(default_factory=lambda: os.cpu_count() or 1)
    keep_exact_duplicates: bool = False  # else exact (sha256) duplicates are dropped
    near_duplicate_distance: int = 3  # pHash bits; near duplicates are flagged, not dropped

    def validate(self) -> None:
        if self.samples_per_shard < 1:
            raise ValueError(f"--samples-per-shard must be >= 1, got {self.samples_per_shard}")
        if self.min_size < 1:
            raise ValueError(f"--min-size must be >= 1, got {self.min_size}")
        if self.max_short_side < self.min_size:
            raise ValueError(f"--max-short-side {self.max_short_side} is below --min-size {self.min_size}")
        if self.processes < 1:
            raise ValueError(f"--processes must be >= 1, got {self.processes}")
        if not 0 <= self.near_duplicate_distance <= 15:
            raise ValueError(f"--near-duplicate-distance must be in [0, 15], got {self.near_duplicate_distance}")
        if self.seed < 0:
            raise ValueError(f"--seed must be >= 0, got {self.seed}")


@dataclass(frozen=True)
class Candidate:
    ref: ItemRef | None
    data: bytes | None  # of in-memory sources
    label: int
    source: str
    sha256: str
    phash: int
    width: int
    height: int
    needs_reencode: bool
    near_duplicate: bool = False
    exact_duplicate: bool = False


def inspect_image(data: bytes, min_size: int, max_short_side: int) -> tuple[str, dict]:
    """("ok", facts) or (corrupt / not_image / too_small, {})."""
    try:
        with Image.open(io.BytesIO(data)) as img:
            fmt, mode = img.format, img.mode
            img.load()  # a truncated JPEG raises here
            width, height = img.size
            if min(width, height) < min_size:
                return "too_small", {}
            phash, sideways = perceptual_hash(img), turned(img)
    except Image.UnidentifiedImageError:
        return "not_image", {}
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError):
        return "corrupt", {}
    reencode = fmt != "JPEG" or mode not in ("RGB", "L") or min(width, height) > max_short_side or sideways
    return "ok", dict(width=width, height=height, phash=phash, needs_reencode=reencode)


def encode_for_shard(data: bytes, needs_reencode: bool, max_short_side: int) -> tuple[bytes, int, int]:
    """(bytes, width, height) to store: the JPEG as it is, or an RGB re-encode (q90 downscaled, else q95)."""
    with Image.open(io.BytesIO(data)) as opened:
        if not needs_reencode:
            return data, *opened.size
        img = eight_bit(upright(opened)).convert("RGB")  # turned as the camera meant; 16-bit grey scaled, not clipped
        width, height = img.size
        quality = 95
        if min(width, height) > max_short_side:
            scale = max_short_side / min(width, height)
            width, height = max(1, round(width * scale)), max(1, round(height * scale))
            img = img.resize((width, height), Image.Resampling.BICUBIC)
            quality = 90
        out = io.BytesIO()
        img.save(out, format="JPEG", quality=quality)
        return out.getvalue(), width, height


@dataclass(frozen=True)
class _ScanJob:
    config: WriteConfig
    unit: SourceUnit | None = None
    source: Source | None = None  # without its units: a job pickles only its own
    items: tuple[tuple[bytes, int, str], ...] = ()  # (bytes, label, source id)


def _scan_items(job: _ScanJob, stats: Counter) -> Iterator[tuple[ItemRef | None, bytes, int, str]]:
    if job.unit is None or job.source is None:
        return ((None, data, label, source) for data, label, source in job.items)
    read = iter_tfds_unit if isinstance(job.source, TfdsSource) else iter_unit
    return ((ref, data, label, ref.source) for ref, data, label in read(job.unit, job.source, stats))


def _read_raw(ref: ItemRef, source: Source | None) -> bytes:
    if ref.kind == REF_KIND and source is not None:
        return read_tfds_ref(ref, source)
    return read_ref(ref, source.image_column if source is not None else "image")


def _scan_unit(job: _ScanJob) -> tuple[list[Candidate], Counter]:
    stats: Counter = Counter()
    kept: list[Candidate] = []
    for ref, data, label, source in _scan_items(job, stats):
        stats["scanned"] += 1
        status, facts = inspect_image(data, job.config.min_size, job.config.max_short_side)
        if status != "ok":
            stats[status] += 1
            continue
        kept.append(Candidate(ref, data if ref is None else None, label, source, sha256_hex(data), **facts))
    return kept, stats


def _imap(fn, jobs: list, processes: int, desc: str):
    bar = tqdm(total=len(jobs), desc=desc, unit="job", disable=None, file=sys.stderr)
    if processes == 1 or len(jobs) <= 1:
        for job in jobs:
            yield fn(job)
            bar.update()
    else:
        with multiprocessing.get_context().Pool(min(processes, len(jobs)), ignore_interrupt) as pool:
            for result in pool.imap(fn, jobs, chunksize=1):
                yield result
                bar.update()
    bar.close()


def _parquet_rows(entries: list, source: Source | None) -> dict[str, dict[int, bytes]]:
    """A shard's images from Parquet files, each file read once (the shuffle spreads every file over every shard)."""
    wanted: dict[str, list[int]] = {}
    for _key, cand in entries:
        if cand.ref is not None and cand.ref.kind == "parquet":
            wanted.setdefault(cand.ref.path, []).append(cand.ref.row)
    column = source.image_column if source is not None else "image"
    found = {}
    for path, rows in wanted.items():
        try:
            found[path] = read_parquet_rows(path, column, rows)
        except _GONE:  # removed or rewritten since the scan: its images are skipped (`_scanned_bytes`)
            found[path] = {}
    return found


def _scanned_bytes(cand: Candidate, parquet: dict[str, dict[int, bytes]], source: Source | None) -> bytes | None:
    """The image's bytes as the scan read them; None where its file was removed or changed since: what the scan
    checked (dedup, --exclude-like, size) and the manifest's source_sha256 hold for those bytes only."""
    if cand.ref is None:
        return cand.data
    try:
        raw = parquet[cand.ref.path].get(cand.ref.row) if cand.ref.kind == "parquet" else _read_raw(cand.ref, source)
    except _GONE:
        return None
    return raw if raw is not None and sha256_hex(raw) == cand.sha256 else None


def _write_shard(job: tuple) -> tuple[dict, list[dict]]:
    """Write one shard atomically (or keep it); (its manifest row, its sample rows)."""
    out_dir, index, entries, class_names, source, max_short_side = job
    name = manifest.SHARD_PATTERN.format(index=index)
    final = Path(out_dir) / name
    if not final.exists():
        tmp = final.with_name(name + ".tmp")
        tar_args = dict(encoder=False, user=TAR_OWNER, group=TAR_OWNER, mtime=TAR_MTIME)
        parquet = _parquet_rows(entries, source)
        with open(tmp, "wb") as out, wds.TarWriter(out, **tar_args) as w:
            for key, cand in entries:
                raw = _scanned_bytes(cand, parquet, source)
                if raw is None:
                    continue  # counted by write_dataset as removed_or_changed_since_scan
                data, width, height = encode_for_shard(raw, cand.needs_reencode, max_short_side)
                meta = dict(
                    label=cand.label,
                    label_name=class_names[cand.label],
                    source=cand.source,
                    width=width,
                    height=height,
                    sha256=sha256_hex(data),
                )
                w.write(
                    {
                        "__key__": key,
                        "jpg": data,
                        "cls": str(cand.label).encode(),
                        "json": json.dumps(meta, sort_keys=True, separators=(",", ":")).encode(),
                    }
                )
        os.replace(tmp, final)
    # read back: a shard kept from an interrupted run reports the same rows
    metas = {}
    with tarfile.open(final, "r:") as tar:
        for member in tar:
            if member.name.endswith(".json"):
                member_file = tar.extractfile(member)
                assert member_file is not None
                metas[member.name[: -len(".json")]] = json.loads(member_file.read())
    rows = [
        dict(
            key=key,
            shard=name,
            label=cand.label,
            **{k: metas[key][k] for k in ("width", "height", "sha256")},
            source_sha256=cand.sha256,
            phash=cand.phash,
            source=cand.source,
            near_duplicate=cand.near_duplicate,
            exact_duplicate=cand.exact_duplicate,
        )
        for key, cand in entries
        if key in metas
    ]
    digest = hashlib.sha256()
    with open(final, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return dict(url=name, samples=len(rows), bytes=final.stat().st_size, sha256=digest.hexdigest()), rows


@dataclass
class WriteReport:
    scanned: int = 0
    written: int = 0
    shards: int = 0
    bytes: int = 0
    skipped: dict = field(default_factory=dict)  # corrupt / hidden / not_image / too_small / broken_links / …
    exact_duplicates: int = 0
    exact_duplicates_kept: bool = False  # --keep-exact-duplicates, or a TFDS source: written, flagged
    near_duplicates: int = 0
    excluded: int = 0
    seconds: float = 0.0
    empty_classes: list = field(default_factory=list)  # class names with no image written (kept: labels stay)
    unreadable_classes: list = field(default_factory=list)  # class folders that could not be listed

    def summary(self) -> str:
        rate = self.scanned / self.seconds if self.seconds else 0.0
        empty = [name for name in self.empty_classes if name not in set(self.unreadable_classes)]
        unreadable = self.unreadable_classes
        return (
            f"scanned {self.scanned} images, wrote {self.written} in {self.shards} shards "
            f"({self.bytes / 2**20:.1f} MiB) in {self.seconds:.1f}s ({rate:.0f} images/s); skipped "
            f"{dict(sorted(self.skipped.items())) or 'none'}; exact duplicates {self.exact_duplicates} "
            f"({'kept, flagged' if self.exact_duplicates_kept else 'dropped'}), near duplicates "
            f"{self.near_duplicates} (flagged), excluded {self.excluded}"
            + (f"; no image in {len(empty)} of the classes (kept, so labels stay): {_few(empty)}" if empty else "")
            + (
                f"; {len(unreadable)} class folders cannot be read, their images skipped (kept, so labels stay; give "
                f"this user read access, e.g. chmod -R a+rX, and run again): {_few(unreadable)}"
                if unreadable
                else ""
            )
        )


def dedup_candidates(
    candidates: list[Candidate], config: WriteConfig, exclude: ExclusionSet | None, report: WriteReport
) -> list[Candidate]:
    """Drop excluded images and exact duplicates, flag near duplicates, in the sources' order."""
    excluded = (
        np.zeros(len(candidates), dtype=bool)
        if exclude is None
        else exclude.matches_many([c.sha256 for c in candidates], [c.phash for c in candidates])
    )
    report.exact_duplicates_kept = config.keep_exact_duplicates
    seen: set[str] = set()
    survivors: list[Candidate] = []
    for cand, is_excluded in zip(candidates, excluded):
        if is_excluded:
            report.excluded += 1
            continue
        if cand.sha256 in seen:
            report.exact_duplicates += 1
            if not config.keep_exact_duplicates:
                continue
            cand = replace(cand, exact_duplicate=True)
        seen.add(cand.sha256)
        survivors.append(cand)
    near = near_duplicates_of_earlier([c.phash for c in survivors], config.near_duplicate_distance)
    report.near_duplicates = int(near.sum())
    return [replace(c, near_duplicate=True) if flag else c for c, flag in zip(survivors, near)]


def write_dataset(
    out_dir: str | Path,
    config: WriteConfig,
    *,
    source: Source | None = None,
    items: list[tuple[bytes, int, str]] | None = None,
    class_names: list[str] | None = None,
    exclude: ExclusionSet | None = None,
    extra_meta: dict | None = None,
) -> WriteReport:
    """A split folder from a ``source`` or ``items``; ValueError when none is valid or ``out_dir`` holds shards of
    other settings or input."""
    config.validate()
    if (source is None) == (items is None):
        raise ValueError("write_dataset needs exactly one of source= or items=")
    start = time.perf_counter()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    names = list(source.class_names if source is not None else class_names or [])
    settings, given = _settings(config, source, names), _units(source, named=False)
    _check_folder(out, settings, given)  # before the scan: other settings are refused at once
    report = WriteReport()
    candidates = _scan(_scan_jobs(config, source, items or [], names), config.processes, report)
    report.unreadable_classes = [names[label] for label in report.unreadable_classes]
    survivors = dedup_candidates(candidates, config, exclude, report)
    if not survivors:
        raise ValueError(f"no valid images to write (report: {report.summary()})")
    settings["input"] = input_digest(survivors, names)
    present = {c.label for c in survivors}
    report.empty_classes = [name for label, name in enumerate(names) if label not in present]
    _check_folder(out, settings, given)
    manifest.write_json_atomic(settings, out / manifest.WRITE_SETTINGS_FILE)  # before the first shard
    light = replace(source, units=()) if source is not None else None
    shard_rows, report.written = _write_shards(out, survivors, names, light, config)
    if report.written < len(survivors):  # source files removed or changed between the scan and the write
        report.skipped["removed_or_changed_since_scan"] = len(survivors) - report.written
    if not report.written:
        raise ValueError(f"no image could be written: every source file was removed or changed since the scan ({out})")
    dataset = {k: getattr(config, k) for k in ("name", "split", "max_short_side", "seed", "samples_per_shard")}
    manifest.write_metadata(
        out, shards=shard_rows, samples=None, class_names=names, dataset=dataset | (extra_meta or {})
    )
    for stale in out.glob(manifest.SHARD_GLOB + ".tmp"):
        stale.unlink()
    report.shards, report.bytes = len(shard_rows), sum(r["bytes"] for r in shard_rows)
    report.seconds = time.perf_counter() - start
    return report


def _settings(config: WriteConfig, source: Source | None, names: list[str]) -> dict:
    """What the folder records: the settings its output depends on (not --processes: the bytes are the same for
    any), the class names' digest, and the source's units by their names in it, so that the same input given by
    another path or from another cwd is the same run."""
    recorded = {k: v for k, v in asdict(config).items() if k != "processes"}
    units = _units(source, named=True)
    class_names = hashlib.sha256(json.dumps(names).encode()).hexdigest()
    if source is not None and source.class_ids:  # labelled as the splits beside it (`splits.label_space`)
        recorded["classes"] = list(source.class_ids)
    return json.loads(json.dumps(dict(recorded, format=SETTINGS_FORMAT, source=units, class_names=class_names)))


def _units(source: Source | None, *, named: bool) -> list[str] | None:
    """The source's class folders, tars, Parquet files or record ranges: by name, or by path as given (format 1)."""
    if source is None:
        return None
    spell = (lambda path: Path(path).name) if named else str
    if isinstance(source, TfdsSource):
        return [*unit_ids(source, spell), source.task, source.label_column]
    return [spell(u.path) for u in source.units]


def input_digest(survivors: list[Candidate], names: list[str]) -> str:
    """A digest of what the shards will hold, in the sources' order (the shuffle follows from it and the seed)."""
    digest = hashlib.sha256(repr(list(names)).encode())
    for c in survivors:  # repr escapes what could blur the fields (quotes, newlines, surrogates)
        digest.update(repr((c.source, c.sha256, c.label, c.exact_duplicate, c.near_duplicate)).encode())
    return digest.hexdigest()


def _readable_units(units: object) -> bool:
    return units is None or isinstance(units, list) and all(isinstance(u, str) for u in units)


def _few(values: list | None) -> str:
    values = values or []
    shown = ", ".join(str(v) for v in values[:3])
    return shown + (f" and {len(values) - 3} more" if len(values) > 3 else "") if values else "none"


def _source_difference(then: list | None, now: list | None) -> str | None:
    if then == now:
        return None
    gone, new = [u for u in then or [] if u not in set(now or [])], [u for u in now or [] if u not in set(then or [])]
    if not gone and not new:
        return "the source's class folders or files in another order"
    return f"the source's class folders or files ({_few(gone)} then only; {_few(new)} now only)"


def _differences(recorded: dict, settings: dict, given: list[str] | None) -> list[str]:
    """What differs between the recorded settings and this run's, one phrase each (old value, then new)."""
    legacy = "format" not in recorded  # format 1 recorded the units as the paths given, and no class names
    then, now = recorded.get("source"), settings["source"]
    if legacy and "input" not in recorded:  # no digest either: only the very paths keep its guarantee
        paths = f"--source's paths ({_few(then)} then; {_few(given)} now), as an older version recorded them"
        found = [None if then == given else paths]
    else:  # the input digest checks the content: compare names, not spellings
        if legacy:
            then, now = [Path(u).name for u in then or []], [Path(u).name for u in given or []]
        found = [_source_difference(then, now)]
    for key in sorted((recorded.keys() | settings.keys()) - {"format", "input", "processes", "source"}):
        old, new = recorded.get(key), settings.get(key)
        if old == new or legacy and key not in recorded:
            continue
        if key in ("class_names", "classes"):
            if found[0] or key == "classes" and "class_names" in recorded.keys() | settings.keys():
                continue  # other class folders or files: other names follow; one phrase for both keys
            found.append("the class names (--class-names, a labels file or the class folders' names)")
        else:
            found.append(f"--{key.replace('_', '-')} {json.dumps(old)} then, {json.dumps(new)} now")
    return [f for f in found if f]


def _check_folder(out: Path, settings: dict, given: list[str] | None) -> None:
    """ValueError when ``out`` holds shards written with other settings or (once known) from other input: a re-run
    keeps the finished shards, so they must be the ones this run would write. ``given``: the units as the paths
    given, which a folder of format 1 recorded."""
    if not any(out.glob(manifest.SHARD_GLOB)):
        return  # no shard to keep (a failed run may have left its settings, an interrupted one a .tmp it rewrites)
    fix = "choose a new --out or delete it"
    try:
        recorded = json.loads((out / manifest.WRITE_SETTINGS_FILE).read_text())
    except (OSError, ValueError):
        recorded = None
    if not isinstance(recorded, dict) or not _readable_units(recorded.get("source")):
        raise ValueError(f"{out} holds shards without a readable {manifest.WRITE_SETTINGS_FILE}; {fix}")
    differ = _differences(recorded, settings, given)
    if differ:
        raise ValueError(
            f"{out} holds shards written with other settings or input: {'; '.join(differ)}. Run with what it was "
            f"written with to go on from them, or {fix}"
        )
    recorded_input = recorded.get("input")  # absent in folders of older versions: accepted
    if recorded_input is not None and settings.get("input", recorded_input) != recorded_input:
        raise ValueError(f"{out} holds shards of other input (images added, removed, changed or excluded since); {fix}")


def _scan_jobs(
    config: WriteConfig, source: Source | None, items: list[tuple[bytes, int, str]], names: list[str]
) -> list[_ScanJob]:
    if source is not None:
        light = replace(source, units=())
        return [_ScanJob(config, unit=u, source=light) for u in source.units]
    for _data, label, src in items:
        if not 0 <= label < len(names):
            raise ValueError(f"item {src}: label {label} out of range for {len(names)} class names")
    return [_ScanJob(config, items=tuple(items[i : i + 256])) for i in range(0, len(items), 256)]


def _scan(jobs: list[_ScanJob], processes: int, report: WriteReport) -> list[Candidate]:
    candidates: list[Candidate] = []
    skipped: Counter = Counter()
    for job, (kept, stats) in zip(jobs, _imap(_scan_unit, jobs, processes, "scan")):
        candidates.extend(kept)
        skipped.update(stats)
        if stats["unreadable_classes"] and job.unit is not None:  # its label, named by write_dataset
            report.unreadable_classes.append(job.unit.label)
    report.scanned = skipped.pop("scanned", 0)
    report.skipped = dict(skipped)
    return candidates


def _write_shards(
    out: Path, survivors: list[Candidate], names: list[str], source: Source | None, config: WriteConfig
) -> tuple[list[dict], int]:
    """Pass 2: (the manifest rows, the samples written)."""
    order = np.random.default_rng(config.seed).permutation(len(survivors))
    keyed = [(f"{i:09d}", survivors[j]) for i, j in enumerate(order)]  # digits only: WebDataset splits keys at dots
    per = config.samples_per_shard
    shard_jobs = [
        (str(out), s, keyed[s * per : (s + 1) * per], names, source, config.max_short_side)
        for s in range((len(keyed) + per - 1) // per)
    ]
    shard_rows = []
    with manifest.SamplesWriter(out / manifest.SAMPLES_FILE) as samples:
        for shard_row, rows in _imap(_write_shard, shard_jobs, config.processes, "write"):
            shard_rows.append(shard_row)
            samples.write_rows(rows)
    return shard_rows, samples.rows
