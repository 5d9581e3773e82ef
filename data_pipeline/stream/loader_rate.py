"""The loader's images/s on one core (`loader_rate`), for the planner's data wait (docs/performance.md, "Data wait:
predicted, and the decoded cache")."""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import PIL
import simplejpeg
import torch
from PIL import Image

from data_pipeline.manifest import DatasetInfo, dataset_info
from data_pipeline.paths import cache_dir, write_text_atomically
from data_pipeline.stream.augment import AugmentConfig
from data_pipeline.stream.config import DataConfig
from data_pipeline.stream.decoded_cache import planned_bytes
from data_pipeline.stream.step_pool import Pixels
from data_pipeline.stream.train_stream import TrainStream
from data_pipeline.write.writer import WriteConfig, write_dataset

MEASURE_SECONDS = 0.5  # timed CPU seconds, after the first step
MEASURE_SAMPLES = 320  # at least this many samples' shards are read
BATCH = 32
SYNTHETIC_IMAGES = 128  # JPEGs timed when the training set is not readable here
VERSION = 2  # bumped when what is timed changes: cached rates go stale


@dataclass(frozen=True)
class LoaderRate:
    img_s_per_core: float
    source: str  # where the number comes from


def cache_path() -> Path:
    return cache_dir() / "loader_rate.json"


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return torch.backends.cpu.get_cpu_capability()


def cache_fits(info: DatasetInfo, image_size: int, cache_mb: float) -> bool:
    return cache_bytes(info, image_size, cache_mb) > 0


def cache_bytes(info: DatasetInfo, image_size: int, cache_mb: float) -> int:
    """`planned_bytes`, or 0 where the cache does not fit (or is unsized)."""
    limit = cache_mb * 2**20
    need = planned_bytes(info, image_size, stop_above=limit) if cache_mb > 0 else None
    return need if need is not None and need <= limit else 0


def loader_rate(
    location: str | Path | DatasetInfo | None,
    image_size: int,
    augment: AugmentConfig | None,
    cache_mb: float = 0.0,
    synthetic_side: int | None = None,
    pixels: Pixels = "float",
) -> LoaderRate:
    """Images/s one core loads for a run reading ``location`` or its manifest (None or unreadable: synthetic JPEGs),
    sending ``pixels`` (`DataConfig.pixels_for`: uint8 where the device normalizes)."""
    try:
        info = dataset_info(location) if location is not None else None
    except Exception:  # absent, unreachable or damaged
        info = None
    cached = info is not None and cache_fits(info, image_size, cache_mb)
    side = synthetic_side or round(image_size * 1.15)
    if info is not None:
        per_sample = sum(s.bytes for s in info.shards) / max(1, info.num_samples)
        data = f"{info.name or Path(info.root).name} {info.num_samples} samples ~{per_sample / 1e3:.2g} KB"
    else:
        data = f"synthetic {side}px JPEGs"
    key = (
        f"{cpu_model()} | v{VERSION} torch {torch.__version__} pillow {PIL.__version__} simplejpeg "
        f"{simplejpeg.__version__} | {data} | {image_size}px | {augment} | {'decoded cache' if cached else 'shards'}"
    ) + (" | uint8 pixels" if pixels == "uint8" else "")
    path = cache_path()
    try:
        store = json.loads(path.read_text())
    except (OSError, ValueError):
        store = {}
    how = "measured earlier"
    if not isinstance(store.get(key), float):
        if info is not None:
            store[key] = _time_stream(_first_shards(info), image_size, augment, cached, pixels)
        else:
            with tempfile.TemporaryDirectory() as tmp:
                synthetic = dataset_info(_synthetic_shards(Path(tmp), side))
                store[key] = _time_stream(synthetic, image_size, augment, cached, pixels)
        write_atomically(path, json.dumps(store, indent=1, sort_keys=True))
        how = "measured now"
    where = "from its decoded cache" if cached else ("from its shards" if info is not None else data)
    return LoaderRate(store[key], f"this CPU, one core, {image_size}px {where} ({how}; {path})")


def _first_shards(info: DatasetInfo) -> DatasetInfo:
    count, shards = 0, []
    for shard in info.shards:
        shards.append(shard)
        count += shard.samples
        if count >= MEASURE_SAMPLES:
            break
    return dataclasses.replace(info, shards=tuple(shards), num_samples=count)


def _time_stream(
    info: DatasetInfo, image_size: int, augment: AugmentConfig | None, cached: bool, pixels: Pixels
) -> float:
    batch = min(BATCH, max(1, info.num_samples // 2))
    spec = DataConfig.for_stream(
        info,
        micro_batch_size=batch,
        image_size=image_size,
        streams=1,
        shuffle_buffer=batch,
        augment=augment,
        cache_mb=float(2**20) if cached else 0.0,
    )
    threads, stream_log = torch.get_num_threads(), logging.getLogger("data_pipeline.stream.train_stream")
    torch.set_num_threads(1)  # as in a loader worker
    stream_log.disabled = True  # its decoded-cache line
    try:
        batches = iter(TrainStream(spec, pixels=pixels))
        next(batches)
        images, start = 0, time.process_time()
        while images < 2 * batch or time.process_time() - start < MEASURE_SECONDS:
            next(batches)
            images += batch
        return images / max(time.process_time() - start, 1e-9)
    finally:
        torch.set_num_threads(threads)
        stream_log.disabled = False


def _synthetic_shards(root: Path, side: int) -> Path:
    rng = np.random.default_rng(0)
    items = []
    for i in range(SYNTHETIC_IMAGES):
        cells = rng.integers(0, 256, size=(12, 16, 3), dtype=np.uint8)
        img = np.asarray(
            Image.fromarray(cells).resize((side * 4 // 3, side), Image.Resampling.BICUBIC), dtype=np.float32
        )
        img = np.clip(img + rng.normal(0, 10.0, size=img.shape), 0, 255).astype(np.uint8)
        buf = io.BytesIO()
        Image.fromarray(img).save(buf, format="JPEG", quality=90)
        items.append((buf.getvalue(), i % 4, f"synthetic/{i}"))
    config = WriteConfig(name="synthetic", samples_per_shard=64, processes=1, keep_exact_duplicates=True)
    write_dataset(root / "shards", config, items=items, class_names=[str(c) for c in range(4)])
    return root / "shards"


def write_atomically(path: Path, text: str) -> None:
    """Replace a per-machine cache file whole (also `pretrain.telemetry.peak`'s); a read-only home is skipped."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomically(path, text)
    except OSError:
        pass
