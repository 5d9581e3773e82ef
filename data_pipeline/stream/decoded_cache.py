"""The decoded cache (``data.cache_mb``), bit-identical batches (docs/performance.md, "Data wait: predicted, and the
decoded cache")."""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from data_pipeline.manifest import DatasetInfo, ShardFormatError, int64_column, iter_samples
from data_pipeline.stream.augment import DECODE_ERRORS, decode_whole, drafts
from data_pipeline.stream.shards import read_shard
from data_pipeline.stream.step_pool import shm_free

log = logging.getLogger(__name__)

PIXEL_BYTES = 4  # RGBX
DECODED_KEY = "__decoded__"  # a sample's `Decoded` from `DecodedCache.read`


@dataclass(frozen=True)
class Decoded:
    """A cached sample's pixels (uint8 (H, W, C)) and PIL's format name."""

    pixels: np.ndarray
    image_format: str | None


@dataclass(frozen=True)
class _Entry:
    """One cached sample; its pixels at ``offset`` of the cache's tensor (``shape`` None: none)."""

    fields: dict  # `read_shard`'s, but jpg
    jpg: bytes | None  # only where a crop may need them
    offset: int
    shape: tuple[int, int, int] | None
    image_format: str | None


def planned_bytes(info: DatasetInfo, image_size: int, stop_above: float | None = None) -> int | None:
    """Host bytes of a cache of ``info`` (an upper bound; stops past ``stop_above``), None if unsized."""
    per_sample = sum(s.bytes for s in info.shards) / max(1, info.num_samples)
    total = 0
    try:
        for batch in iter_samples(info.root, columns=["width", "height"]):
            width, height = int64_column(batch, "width"), int64_column(batch, "height")
            total += int((width * height).sum()) * PIXEL_BYTES
            total += int((np.minimum(width, height) >= 2 * image_size).sum() * per_sample)
            if stop_above is not None and total > stop_above:
                break
    except (ShardFormatError, OSError, ValueError):
        return None
    return total


class DecodedCache:
    """The decoded samples of a training set's cleanly read shards."""

    def __init__(self, shards: dict[str, list[_Entry]], pixels: torch.Tensor):
        self.shards, self.pixels = shards, pixels
        self._array: np.ndarray | None = None

    def __getstate__(self) -> dict:  # the tensor goes by its shared-memory handle
        return dict(shards=self.shards, pixels=self.pixels)

    def __setstate__(self, state: dict) -> None:
        self.shards, self.pixels = state["shards"], state["pixels"]
        self._array = None

    @property
    def nbytes(self) -> int:
        return self.pixels.numel() + sum(len(e.jpg or b"") for entries in self.shards.values() for e in entries)

    @property
    def num_samples(self) -> int:
        return sum(len(entries) for entries in self.shards.values())

    def read(self, url: str, expected: int | None, stats: Counter, retries: int | None = None) -> Iterator[dict]:
        """`read_shard`'s samples, from the cache where it holds the shard (`Decoded` under ``DECODED_KEY``)."""
        entries = self.shards.get(url)
        if entries is None:
            yield from read_shard(url, expected, stats, retries)
            return
        if self._array is None:
            self._array = self.pixels.numpy()
        for e in entries:
            # no pixels and no bytes: the sample had no .jpg (`sample_label` counts it incomplete)
            sample = dict(e.fields) if e.jpg is None and e.shape is None else dict(e.fields, jpg=e.jpg)
            if e.shape is not None:
                n = e.shape[0] * e.shape[1] * e.shape[2]
                pixels = self._array[e.offset : e.offset + n].reshape(e.shape)
                sample[DECODED_KEY] = Decoded(pixels, e.image_format)
            yield sample

    @classmethod
    def build(
        cls, info: DatasetInfo, image_size: int, limit_mb: float, shared: bool, reserve_bytes: int = 0
    ) -> tuple[DecodedCache | None, str]:
        """(the cache, or None unless it fits ``limit_mb`` and, if ``shared``, /dev/shm; why)."""
        if limit_mb <= 0:
            return None, "decoded cache off (data.cache_mb=0)"
        need = planned_bytes(info, image_size, stop_above=limit_mb * 2**20)
        where = f"{info.name or info.root} ({info.num_samples} images)"
        if need is None:
            return None, f"decoded cache off: {where} has no readable samples.parquet to size it"
        if need > limit_mb * 2**20:
            return None, f"decoded cache off: {where} needs over data.cache_mb={limit_mb:g} MiB decoded"
        free = shm_free() if shared else None
        if free is not None and need + reserve_bytes > free:
            return None, (
                f"decoded cache off: {where} needs ~{need / 2**20:,.0f} MiB of /dev/shm beside the step buffers' "
                f"{reserve_bytes / 2**20:,.0f} MiB, and {free / 2**20:,.0f} MiB are free"
            )
        began = time.perf_counter()
        cache = cls._read_all(info, image_size)
        if shared:
            try:  # the node's other ranks found room for theirs at the same time
                cache.pixels.share_memory_()
            except RuntimeError as error:
                return None, f"decoded cache off: {where}: /dev/shm filled up before it could hold it ({error})"
        skipped = len(info.shards) - len(cache.shards)
        note = f"; {skipped} shard(s) with read damage read from storage each time" if skipped else ""
        return cache, (
            f"decoded cache on: {where} held decoded, {cache.nbytes / 2**20:,.1f} MiB of data.cache_mb={limit_mb:g} "
            f"(read and decoded in {time.perf_counter() - began:.1f} s){note}"
        )

    @classmethod
    def _read_all(cls, info: DatasetInfo, image_size: int) -> DecodedCache:
        shards: dict[str, list[_Entry]] = {}
        arrays: list[np.ndarray] = []
        offset = 0
        for shard in info.shards:
            stats: Counter = Counter()
            entries, start, pieces = [], offset, []
            for sample in read_shard(shard.url, shard.samples, stats):
                jpg = sample.pop("jpg", None)
                entry = _Entry(sample, jpg, 0, None, None)
                if jpg is not None:
                    try:
                        pixels, image_format = decode_whole(jpg)
                    except DECODE_ERRORS:
                        pass  # counted when decoded per crop
                    else:
                        keep = drafts(image_format, (0, 0, pixels.shape[1], pixels.shape[0]), image_size)
                        entry = _Entry(sample, jpg if keep else None, offset, pixels.shape, image_format)
                        pieces.append(pixels.reshape(-1))
                        offset += pixels.size
                entries.append(entry)
            if stats:
                offset = start
                continue
            shards[shard.url] = entries
            arrays += pieces
        flat = np.concatenate(arrays) if arrays else np.zeros(0, np.uint8)
        return cls(shards, torch.from_numpy(flat))
