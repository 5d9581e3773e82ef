"""The campaign's loader part (`bench.gpu.campaign`): the training stream alone on this machine's CPU cores, at 224 px.

Images per CPU second of a `TrainStream` without workers, one torch thread (per core, as a loader worker runs):
``loader_img_s_per_core`` on ImageNet-like JPEGs (``bench.images.imagenet_like_jpegs``), what a real run's loader
does; ``loader_formula_img_s_per_core`` on the real path's formula set, whose small JPEGs decode several times faster,
so the real path's data wait understates ImageNet's. ``loader_img_s_workers<n>``: the ImageNet-like shards through
``n`` workers, images per wall-clock second after the first batch, to check that the per-core rate scales.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import torch

from bench.images import imagenet_like_jpegs
from bench.shard_rates import stream_rate
from data_pipeline.stream.augment import AugmentConfig
from data_pipeline.stream.config import DataConfig
from data_pipeline.stream.train_stream import TrainStream
from data_pipeline.write.writer import WriteConfig, write_dataset


def wall_rate(shards: Path, size: int, workers: int, batch: int) -> float:
    """Images per wall-clock second after the first batch, ``workers`` loader processes, one stream each."""
    spec = DataConfig.for_stream(
        shards,
        micro_batch_size=batch,
        image_size=size,
        streams=workers,
        shuffle_buffer=64,
        augment=AugmentConfig(),
        num_workers=workers,
    )
    stream = TrainStream(spec)
    it = iter(stream)
    next(it)
    start = time.perf_counter()
    for _ in range(stream.steps_per_epoch - 1):
        next(it)
    return (stream.steps_per_epoch - 1) * batch / (time.perf_counter() - start)


def run(formula_shards: Path | None, smoke: bool, workers: int) -> dict:
    """The keys of the module docstring (``workers`` loader processes for the wall-clock check; 0 skips it)."""
    count, size, batch = (16, 32, 8) if smoke else (512, 224, 32)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    out: dict = {"loader_image_size": size, "loader_images": count}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            images = imagenet_like_jpegs(count, max_short=128 if smoke else 512)
            items = [(data, i % 10, f"bench/{i}") for i, data in enumerate(images)]
            shards = Path(tmp) / "shards"
            config = WriteConfig(
                name="bench", samples_per_shard=max(8, count // 16), processes=1, keep_exact_duplicates=True
            )
            write_dataset(shards, config, items=items, class_names=[str(c) for c in range(10)])
            out["loader_jpeg_kib"] = sum(map(len, images)) / len(images) / 1024
            out["loader_img_s_per_core"] = stream_rate(shards, size, batch)
            if formula_shards is not None:
                out["loader_formula_img_s_per_core"] = stream_rate(formula_shards, size, batch)
            if workers:
                out[f"loader_img_s_workers{workers}"] = wall_rate(shards, size, workers, batch)
                out["loader_workers_checked"] = workers
    finally:
        torch.set_num_threads(threads)
    out["loader_cpu_count"] = os.cpu_count()
    return out


def cores_needed(result: dict, models: tuple[str, ...]) -> dict:
    """``loader_cores_needed_<model>``: the fastest measured training rate of each model (the step part's vitscale
    configurations without checkpointing, and the real path's) over the per-core loader rate."""
    per_core = result.get("loader_img_s_per_core")
    out: dict = {}
    for name in models:
        rates = [result.get(f"{v}_img_s_{name}") for v in ("eager", "compiled")]
        if result.get("train_path_model_recipe") == name:
            rates.append(result.get("train_path_img_s"))
        rates = [r for r in rates if isinstance(r, (int, float))]
        if per_core and rates:
            out[f"loader_cores_needed_{name}"] = max(rates) / per_core
    return out
