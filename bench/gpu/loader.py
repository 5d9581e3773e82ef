"""The campaign's loader part: the training stream alone on this machine's CPU cores, at 224 px.

Images per CPU second of a workerless `TrainStream` on one thread: ``loader_img_s_per_core`` on ImageNet-like JPEGs,
``loader_formula_img_s_per_core`` on the real path's formula set; ``loader_img_s_workers<n>``: wall-clock images/s
through ``n`` workers, to check that the per-core rate scales.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch

from bench.data import loader_rate
from bench.images import imagenet_like_jpegs
from bench.shard_rates import stream_rate, write_shards


def run(formula_shards: Path | None, smoke: bool, workers: int) -> dict:
    """``workers``: loader processes for the wall-clock check (0 skips it)."""
    count, size, batch = (16, 32, 8) if smoke else (512, 224, 32)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    out: dict = {"loader_image_size": size, "loader_images": count}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            images = imagenet_like_jpegs(count, max_short=128 if smoke else 512)
            shards = write_shards(Path(tmp) / "shards", images, max(8, count // 16))
            out["loader_jpeg_kib"] = sum(map(len, images)) / len(images) / 1024
            out["loader_img_s_per_core"] = stream_rate(shards, size, batch)
            if formula_shards is not None:
                out["loader_formula_img_s_per_core"] = stream_rate(formula_shards, size, batch)
            if workers:
                out[f"loader_img_s_workers{workers}"] = loader_rate(shards, size, workers, batch, streams=workers)[0]
                out["loader_workers_checked"] = workers
    finally:
        torch.set_num_threads(threads)
    out["loader_cpu_count"] = os.cpu_count()
    return out


def cores_needed(result: dict, models: tuple[str, ...]) -> dict:
    """``loader_cores_needed_<model>``: the model's fastest training rate (eager, compiled, the real path) over the
    per-core loader rate."""
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
