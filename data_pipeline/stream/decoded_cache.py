"""The decoded cache (``data.cache_mb``): a training set that fits, held decoded in memory (all or nothing).

`DecodedCache.build` reads every shard once, decoding each image whole (`decode_whole`); `DecodedCache.read` then
stands in for `read_shard`. The batches are bit-identical with and without it: a shard read with damage is not
cached, and an image that does not decode whole, or whose crops may decode at a reduced DCT scale (`drafts`), keeps
its bytes. The pixels sit in one uint8 tensor, shared with loader workers by handle, not copied
(docs/performance.md, "Data wait: predicted, and the decoded cache").
"""

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

PIXEL_BYTES = 4  # RGBX, as `decoded_pixels` decodes an RGB JPEG
DECODED_KEY = "__decoded__"  # the sample's `Decoded` in what `DecodedCache.read` yields


@dataclass(frozen=True)
class Decoded:
    """A cached sample's image: its whole pixels (uint8 (H, W, C)) and PIL's name of its format."""

    pixels: np.ndarray
    image_format: str | None


@dataclass(frozen=True)
class _Entry:
    """One cached sample: `read_shard`'s fields, the JPEG bytes only where a crop may need them, and its pixels at
    ``offset`` of the cache's tensor with ``shape`` (H, W, C), or none."""

    fields: dict  # __key__, __url__, cls (bytes), any other member read_shard yielded
    jpg: bytes | None
    offset: int
    shape: tuple[int, int, int] | None
    image_format: str | None


def planned_bytes(info: DatasetInfo, image_size: int, stop_above: float | None = None) -> int | None:
    """Host bytes a cache of ``info`` would hold: RGBX pixels, plus the encoded bytes (an upper bound) where crops
    may decode at a reduced scale. None where ``samples.parquet`` is unreadable; stops past ``stop_above``."""
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
    """The decoded samples of a training set's cleanly read shards; `read` replaces `read_shard`."""

    def __init__(self, shards: dict[str, list[_Entry]], pixels: torch.Tensor):
        self.shards, self.pixels = shards, pixels
        self._array: np.ndarray | None = None

    def __getstate__(self) -> dict:  # to a loader worker: the tensor goes by its shared-memory handle
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
        """`read_shard`'s samples of ``url``: from the cache when it holds the shard (each with its `Decoded` image
        under ``DECODED_KEY`` and ``jpg`` None unless kept), else from storage."""
        entries = self.shards.get(url)
        if entries is None:
            yield from read_shard(url, expected, stats, retries)
            return
        if self._array is None:
            self._array = self.pixels.numpy()  # once per process: a worker's view of the shared storage
        for e in entries:
            sample = dict(e.fields, jpg=e.jpg)
            if e.shape is not None:
                n = e.shape[0] * e.shape[1] * e.shape[2]
                pixels = self._array[e.offset : e.offset + n].reshape(e.shape)
                sample[DECODED_KEY] = Decoded(pixels, e.image_format)
            yield sample

    @classmethod
    def build(
        cls, info: DatasetInfo, image_size: int, limit_mb: float, shared: bool, reserve_bytes: int = 0
    ) -> tuple[DecodedCache | None, str]:
        """(the cache or None, a line saying why). None unless the set fits in ``limit_mb`` and, when ``shared``,
        in /dev/shm beside ``reserve_bytes``."""
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
            cache.pixels.share_memory_()
        skipped = len(info.shards) - len(cache.shards)
        note = f"; {skipped} shard(s) with read damage read from storage each time" if skipped else ""
        return cache, (
            f"decoded cache on: {where} held decoded, {cache.nbytes / 2**20:,.1f} MiB of data.cache_mb={limit_mb:g} "
            f"(read and decoded in {time.perf_counter() - began:.1f} s){note}"
        )

    @classmethod
    def _read_all(cls, info: DatasetInfo, image_size: int) -> DecodedCache:
        """Every shard read once and every image decoded whole; shards whose read counted anything are left out."""
        shards: dict[str, list[_Entry]] = {}
        arrays: list[np.ndarray] = []
        offset = 0
        for shard in info.shards:
            stats: Counter = Counter()
            entries, start, pieces = [], offset, []
            for sample in read_shard(shard.url, shard.samples, stats):
                fields = {k: v for k, v in sample.items() if k != "jpg"}
                jpg = sample.get("jpg")
                entry = _Entry(fields, jpg, 0, None, None)
                if jpg is not None:
                    try:
                        pixels, image_format = decode_whole(jpg)
                    except DECODE_ERRORS:
                        pixels = None  # decoded per crop from its bytes, and counted there
                    if pixels is not None:
                        keep = drafts(image_format, (0, 0, pixels.shape[1], pixels.shape[0]), image_size)
                        entry = _Entry(fields, jpg if keep else None, offset, pixels.shape, image_format)
                        pieces.append(pixels.reshape(-1))
                        offset += pixels.size
                entries.append(entry)
            if stats:  # damage counted: read from storage every time
                offset = start
                continue
            shards[shard.url] = entries
            arrays += pieces
        flat = np.concatenate(arrays) if arrays else np.zeros(0, np.uint8)
        return cls(shards, torch.from_numpy(flat))
