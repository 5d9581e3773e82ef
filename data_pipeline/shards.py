"""Reading one shard: webdataset's tar iteration over an fsspec stream, with every failure counted.

Stock webdataset either raises on the first damaged shard or, with ``warn_and_continue``, sleeps 0.5 s per error
and silently drops the rest of a truncated tar. Here the handler counts and continues without sleeping, member
names are checked before anything is read (a ``../x`` member is skipped and counted; nothing is ever extracted to
disk — members are read into memory), and the number of samples read is compared with the manifest so a
truncated shard shows up in the counters instead of quietly shortening the epoch. ``sample_label`` is the streams'
check of what a sample read here holds, its failures counted the same way.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Iterator

import fsspec
from webdataset import tariterators

from data_pipeline.readers import is_safe_member

log = logging.getLogger(__name__)

WANTED_SUFFIXES = ("jpg", "cls")
_last_warning = [0.0]


def _warn(message: str) -> None:
    """Log at most one warning per 10 s per process: a damaged shard must not flood the training log."""
    now = time.monotonic()
    if now - _last_warning[0] > 10.0:
        _last_warning[0] = now
        log.warning(message)


def read_shard(url: str, expected: int | None, stats: Counter) -> Iterator[dict]:
    """Yield samples (``__key__``, ``jpg``, ``cls`` bytes) of one tar shard at ``url`` (a path or fsspec URL).

    Counters in ``stats``: ``read_errors`` (tar-level errors), ``unsafe_members`` (members with unsafe names),
    ``truncated_shards`` and ``missing_samples`` (fewer samples than ``expected`` when the shard was read to its
    end). A consumer that stops early is not counted as a truncation.
    """

    def handler(exn: Exception) -> bool:
        stats["read_errors"] += 1
        _warn(f"error reading shard {url}: {exn!r}; continuing without it")
        return True  # continue: the sample count check below reports what was lost

    def select(name: str) -> bool:
        if not is_safe_member(name):
            stats["unsafe_members"] += 1
            _warn(f"shard {url}: skipped tar member with unsafe name {name!r}")
            return False
        return name.rsplit(".", 1)[-1].lower() in WANTED_SUFFIXES

    count = 0
    try:
        with fsspec.open(url, "rb") as stream:
            files = tariterators.tar_file_expander(
                [{"url": url, "stream": stream}], handler=handler, select_files=select, eof_value=None
            )
            for sample in tariterators.group_by_keys(files, handler=handler):
                count += 1
                yield sample
    except FileNotFoundError as err:
        stats["missing_shards"] += 1
        _warn(f"shard {url} is missing: {err}")
    if expected is not None and count < expected:
        stats["truncated_shards"] += 1
        stats["missing_samples"] += expected - count
        _warn(f"shard {url} yielded {count} of the {expected} samples its manifest lists (truncated or damaged)")


def sample_label(sample: dict, num_classes: int, stats: Counter) -> int | None:
    """The label of a sample from `read_shard`, or None when it cannot be used: no image or label member
    (``incomplete_samples``), a label that is no integer (``bad_labels``) or outside [0, num_classes)
    (``label_out_of_range``), each counted in ``stats``."""
    if "jpg" not in sample or "cls" not in sample:
        stats["incomplete_samples"] += 1
        return None
    try:
        label = int(sample["cls"])
    except ValueError:
        stats["bad_labels"] += 1
        return None
    if not 0 <= label < num_classes:
        stats["label_out_of_range"] += 1
        return None
    return label
