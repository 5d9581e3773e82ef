"""Shard folders of the benchmarks' JPEGs, and rates on them per CPU second of this process: `read_speed`, the tar
reader alone (MiB/s), and `stream_rate`, a TrainStream without loader workers over one epoch (images/s)."""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

from data_pipeline.manifest import read_dataset_info
from data_pipeline.stream.augment import AugmentConfig
from data_pipeline.stream.config import DataConfig
from data_pipeline.stream.shards import read_shard
from data_pipeline.stream.train_stream import TrainStream
from data_pipeline.write.writer import WriteConfig, write_dataset


def write_shards(shards: Path, images: list[bytes], per_shard: int) -> Path:
    """``images`` written to ``shards`` in 10 classes (image i in class i % 10), exact duplicates kept."""
    items = [(data, i % 10, f"bench/{i}") for i, data in enumerate(images)]
    config = WriteConfig(name="bench", samples_per_shard=per_shard, processes=1, keep_exact_duplicates=True)
    write_dataset(shards, config, items=items, class_names=[str(c) for c in range(10)])
    return shards


def train_stream(shards: Path, size: int, batch: int, **options) -> TrainStream:
    """Default augmentation, a 64-sample shuffle buffer; ``options``: `DataConfig`'s."""
    return TrainStream(
        DataConfig.for_stream(
            shards, micro_batch_size=batch, image_size=size, shuffle_buffer=64, augment=AugmentConfig(), **options
        )
    )


def read_speed(shard_dir: Path) -> float:
    info = read_dataset_info(shard_dir)
    stats: Counter = Counter()
    start = time.process_time()
    for shard in info.shards:
        for _ in read_shard(shard.url, shard.samples, stats):
            pass
    seconds = time.process_time() - start
    return sum(s.bytes for s in info.shards) / 2**20 / seconds


def stream_rate(shards: Path, size: int, batch: int = 32) -> float:
    stream = train_stream(shards, size, batch)
    it = iter(stream)
    start = time.process_time()
    for _ in range(stream.steps_per_epoch):
        next(it)
    return stream.steps_per_epoch * batch / (time.process_time() - start)
