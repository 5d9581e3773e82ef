"""A small training set held decoded in memory (``data.cache_mb``): later reads skip the tar and the JPEG decode.

A rank's `TrainStream` builds a `DecodedCache` once, before its first batch, when the whole training set fits in
``data.cache_mb`` (`planned_bytes`, from ``samples.parquet``'s image sizes); otherwise there is none and a line
says why. It reads every shard once (`data_pipeline.stream.shards.read_shard`) and keeps each sample as the reader
yielded it, its image decoded whole (`data_pipeline.stream.augment.decode_whole`: before any augmentation). The stream's
buffer draws then read a shard from here (`DecodedCache.read`, with `read_shard`'s signature) and augment each image
from its pixels (`data_pipeline.stream.augment.decoded_train_image`), seeded by its position exactly as before: the
batches, and so the losses, are bit-identical with and without the cache (tests/data_pipeline/test_cache.py). What the
cache cannot reproduce byte for byte it leaves to the original path: a shard whose read counted any damage is not cached
(read from storage every time, as before), an image that does not decode whole keeps its bytes (decoded per crop, as
before), and so does one whose crops may decode at a reduced DCT scale (`data_pipeline.stream.augment.drafts`).

The pixels of all samples sit in one uint8 tensor, in shared memory when the stream has loader workers: a worker
unpickles a handle to it, not a copy (docs/performance.md, "Decoded cache").
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

PIXEL_BYTES = 4  # RGBX: what libjpeg-turbo decodes an RGB JPEG into for the loader (`decoded_pixels`)
DECODED_KEY = "__decoded__"  # the sample's `Decoded` in what `DecodedCache.read` yields


@dataclass(frozen=True)
class Decoded:
    """A cached sample's image: its whole pixels (uint8 (H, W, C)) and PIL's name of its format."""

    pixels: np.ndarray
    image_format: str | None


@dataclass(frozen=True)
class _Entry:
    """One sample of a cached shard: what `read_shard` yielded except the JPEG bytes, which are kept (``jpg``) only
    where a crop may need them; its pixels at ``offset`` of the cache's tensor, ``shape`` (H, W, C), or none."""

    fields: dict  # __key__, __url__, cls (bytes), any other member read_shard yielded
    jpg: bytes | None
    offset: int
    shape: tuple[int, int, int] | None
    image_format: str | None


def planned_bytes(info: DatasetInfo, image_size: int, stop_above: float | None = None) -> int | None:
    """Host bytes a cache of ``info`` would hold at ``image_size``: every image's RGBX pixels (``samples.parquet``'s
    widths and heights) and, for images whose crops may decode at a reduced scale (short side >= 2 x image_size), the
    encoded bytes (the manifest's mean per sample, tar headers included: an upper bound). None where
    ``samples.parquet`` is not readable. Past ``stop_above`` bytes it stops reading and returns what it counted so
    far: an ImageNet-sized table is not read to its end to learn that it does not fit."""
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
    """The decoded samples of a training set's cleanly read shards (module docstring); `read` replaces `read_shard`."""

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
        """(the cache of ``info`` for a stream at ``image_size``, or None; one line saying what was done and why).
        None when ``limit_mb`` is 0, the set does not fit in it (all or nothing), its size is unknown, or
        ``shared`` and /dev/shm cannot hold it beside ``reserve_bytes`` (the stream's step buffers)."""
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
                        pixels = None  # decoded from its bytes per crop, failing (and counted) as before
                    if pixels is not None:
                        keep = drafts(image_format, (0, 0, pixels.shape[1], pixels.shape[0]), image_size)
                        entry = _Entry(fields, jpg if keep else None, offset, pixels.shape, image_format)
                        pieces.append(pixels.reshape(-1))
                        offset += pixels.size
                entries.append(entry)
            if stats:  # damage counted: read from storage every time, as without a cache
                offset = start
                continue
            shards[shard.url] = entries
            arrays += pieces
        flat = np.concatenate(arrays) if arrays else np.zeros(0, np.uint8)
        return cls(shards, torch.from_numpy(flat))
