"""Rates on a shard folder, per CPU second of this process: `read_speed`, the tar reader alone (MiB/s), and
`stream_rate`, a TrainStream without loader workers (images/s). `bench.data`, the GPU campaign's loader part and
the ImageNet-21k rehearsal measure with them.
"""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

from data_pipeline.manifest import read_dataset_info
from data_pipeline.stream.augment import AugmentConfig
from data_pipeline.stream.config import DataConfig
from data_pipeline.stream.shards import read_shard
from data_pipeline.stream.train_stream import TrainStream


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
    """``stream_img_s``: images per CPU second of a TrainStream without loader workers, one epoch."""
    spec = DataConfig.for_stream(
        shards, micro_batch_size=batch, image_size=size, shuffle_buffer=64, augment=AugmentConfig()
    )
    stream = TrainStream(spec)
    it = iter(stream)
    start = time.process_time()
    for _ in range(stream.steps_per_epoch):
        next(it)
    return stream.steps_per_epoch * batch / (time.process_time() - start)
