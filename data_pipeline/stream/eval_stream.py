"""`EvalStream`: every sample of a split once across all ranks, unaugmented, in manifest order."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from PIL import Image
from torch.utils.data import IterableDataset, get_worker_info

from data_pipeline.manifest import DatasetInfo, dataset_info
from data_pipeline.stream.augment import DECODE_ERRORS, channels_first, decode_eval_image, planes, to_float_images
from data_pipeline.stream.loader import worker_items
from data_pipeline.stream.order import balanced_split
from data_pipeline.stream.shards import read_shard, sample_label

# (uint8 pixels, labels, keys, counters)
_EvalItem = tuple[torch.Tensor, list[int], list[str], dict[str, int]]


@dataclass(eq=False)
class _EvalShards(IterableDataset):
    """One rank's shards, ``slices[w]`` read by worker w, as uint8 batches."""

    info: DatasetInfo
    slices: list[list[int]]
    batch_size: int
    image_size: int
    resize_size: int | None
    read_retries: int

    def __iter__(self) -> Iterator[_EvalItem]:
        info = get_worker_info()
        worker = 0 if info is None else info.id
        stats: Counter = Counter()
        images: list[Image.Image] = []
        labels: list[int] = []
        keys: list[str] = []
        for s in self.slices[worker]:
            shard = self.info.shards[s]
            for sample in read_shard(shard.url, shard.samples, stats, self.read_retries):
                label = sample_label(sample, self.info.num_classes, stats)
                if label is None:
                    continue
                try:
                    images.append(decode_eval_image(sample["jpg"], self.image_size, self.resize_size))
                except DECODE_ERRORS:
                    stats["corrupt_samples"] += 1
                    continue
                labels.append(label)
                keys.append(sample["__key__"])
                if len(images) == self.batch_size:
                    yield self._batch(images, labels, keys, stats)
                    images, labels, keys = [], [], []
        if images or stats:  # an empty batch still carries the counters
            yield self._batch(images, labels, keys, stats)

    def _batch(self, images: list[Image.Image], labels: list[int], keys: list[str], stats: Counter) -> _EvalItem:
        pixels = torch.from_numpy(channels_first(images, out=planes(len(images), self.image_size)))
        out = (pixels, labels, keys, dict(stats))
        stats.clear()
        return out


class EvalStream:
    """This rank's batches (float32 images, int64 labels[, keys]); ``float_images=False``: uint8 pixels.
    ``num_samples``: this rank's share; ``stats``: what could not be read; ``read_retries``: of a failed shard read."""

    def __init__(
        self,
        source: str | Path | DatasetInfo,
        *,
        batch_size: int,
        image_size: int,
        resize_size: int | None = None,
        rank: int = 0,
        world_size: int = 1,
        num_workers: int = 0,
        return_keys: bool = False,
        multiprocessing_context: str | None = "forkserver",
        float_images: bool = True,
        read_retries: int = 3,
    ):
        info = dataset_info(source)
        if batch_size < 1 or image_size < 1:
            raise ValueError(f"batch_size and image_size must be >= 1, got {batch_size} and {image_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}")
        if resize_size is not None and resize_size < image_size:
            raise ValueError(f"resize_size {resize_size} must be >= image_size {image_size}")
        if read_retries < 0:
            raise ValueError(f"read_retries must be >= 0, got {read_retries}")
        self.info = info
        counts = info.shard_counts
        mine = balanced_split(list(range(len(counts))), counts, world_size)[rank]
        slices = balanced_split(mine, counts, max(1, num_workers))
        self.num_samples = sum(counts[s] for s in mine)
        self._dataset = _EvalShards(info, slices, batch_size, image_size, resize_size, read_retries)
        self.num_workers, self.return_keys, self.float_images = num_workers, return_keys, float_images
        self.multiprocessing_context = multiprocessing_context if num_workers > 0 else None
        self.stats: Counter = Counter()

    def __iter__(self) -> Iterator[tuple]:
        batches = worker_items(self._dataset, self.num_workers, self.multiprocessing_context, seed_key=(0,))
        for pixels, labels, keys, stats in batches:
            self.stats.update(stats)
            if not labels:
                continue
            x = to_float_images([pixels]) if self.float_images else pixels
            y = torch.tensor(labels, dtype=torch.int64)
            yield (x, y, keys) if self.return_keys else (x, y)
