"""The plan's data-wait prediction: will the run wait for its batches, and how many loader workers does it need?

A rank loads ``d`` core-seconds per step beside a compute step of ``c`` seconds (docs/performance.md, "Data wait:
predicted, and the decoded cache").
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from cluster.plan.memory import GB
from cluster.plan.storage import read_manifest
from cluster.profiles import ClusterProfile
from data_pipeline.builtin import sets as builtin
from data_pipeline.manifest import DatasetInfo
from data_pipeline.paths import is_remote, resolve_location
from data_pipeline.stream.loader_rate import LoaderRate, cache_bytes, loader_rate
from data_pipeline.stream.step_pool import decoded_bytes
from pretrain.config.ds_config import BatchPlan
from pretrain.config.train_config import TrainConfig

INPUT_BOUND_WAIT = 0.05  # share of a step: above it the run is input-bound


@dataclass(frozen=True)
class DataWait:
    """Flat: `DataPlan` carries the fields into plan.json."""

    loader_img_s_per_core: float  # r
    loader_rate_source: str
    loader_workers: int  # W per rank
    loader_cores_per_rank: float  # k
    load_s_per_step: float  # d, per rank
    predicted_step_time_s: float
    predicted_data_wait: float  # 0..1
    input_bound: bool
    loader_workers_needed: int | None  # fewest W under INPUT_BOUND_WAIT (at most the rank's streams); None: none
    loader_cores_needed: float  # d / c


def step_with_data(c: float, d: float, workers: int, cores: float, threads: float) -> tuple[float, float]:
    """(seconds per step, seconds of it waiting) for W ``workers``, k ``cores`` per rank, t ``threads`` computing
    (a GPU rank's host work counts as one). W = 0: ``c + d``; t + W <= k: ``max(c, d / W)``; t + W > k: all share
    the cores per thread, and no step is under ``(c t + d) / k``.
    """
    if workers == 0 or d == 0:
        return c + d, d
    if threads + workers <= cores:
        step = max(c, d / workers)
        return step, step - c
    c_wall = max(c, c * (threads + workers) / cores)
    loaded = c_wall * workers * cores / (threads + workers)
    if loaded >= d:
        return max(c, (c * threads + d) / cores), 0.0
    wait = (d - loaded) / min(workers, cores)
    return c_wall + wait, wait


def predict(
    c: float, images_per_rank: int, rate: LoaderRate, workers: int, max_workers: int, cores: float, threads: float
) -> DataWait:
    """Counts up to ``max_workers`` are tried for the workers needed."""
    d = images_per_rank / rate.img_s_per_core
    step, wait = step_with_data(c, d, workers, cores, threads)
    needed = next(
        (w for w in range(max_workers + 1) if _share(*step_with_data(c, d, w, cores, threads)) <= INPUT_BOUND_WAIT),
        None,
    )
    return DataWait(
        loader_img_s_per_core=rate.img_s_per_core,
        loader_rate_source=rate.source,
        loader_workers=workers,
        loader_cores_per_rank=cores,
        load_s_per_step=d,
        predicted_step_time_s=step,
        predicted_data_wait=_share(step, wait),
        input_bound=_share(step, wait) > INPUT_BOUND_WAIT,
        loader_workers_needed=needed,
        loader_cores_needed=d / c if c > 0 else math.inf,
    )


def _share(step: float, wait: float) -> float:
    return min(1.0, max(0.0, wait / step)) if step > 0 else 0.0


def profile_loader_rate(profile: ClusterProfile, config: TrainConfig) -> LoaderRate:
    """Measured here for a local profile."""
    d = config.data
    if not profile.is_local:
        rate = profile.hardware.loader_img_s_per_core
        return LoaderRate(rate, f"declared: profile {profile.name} hardware.loader_img_s_per_core")
    side = builtin.config(d.builtin, **d.builtin_options).resolution if d.builtin else None
    source: str | DatasetInfo | None = resolve_location(d.train)
    if is_remote(source):  # the plan's one read, bounded and quiet: an unreachable store's client retries for minutes
        try:
            source = read_manifest(str(source))
        except Exception:  # the plan's data line says why
            source = None
    return loader_rate(source, d.image_size, d.augment, d.cache_mb, side, d.pixels_for(profile.device_type))


def data_wait(profile: ClusterProfile, config: TrainConfig, batch: BatchPlan, images_per_s: float) -> DataWait:
    d, hw = config.data, profile.hardware
    ranks_per_node = math.ceil(batch.world_size / hw.nodes)
    streams_per_rank = max(1, d.streams // batch.world_size)
    workers = min(d.num_workers, streams_per_rank)  # a worker reads whole streams
    return predict(
        c=batch.global_batch_size / images_per_s,
        images_per_rank=batch.global_batch_size // batch.world_size,
        rate=profile_loader_rate(profile, config),
        workers=workers,
        max_workers=streams_per_rank,
        cores=hw.cpus_per_node / ranks_per_node,
        threads=1 if profile.uses_gpus else profile.workers.cpus_per_worker,
    )


def data_wait_line(wait: DataWait, images_per_rank: int) -> str:
    w = wait
    verdict = "input-bound" if w.input_bound else "not input-bound"
    if w.loader_workers_needed is None:
        need = f"no worker count gets it under {INPUT_BOUND_WAIT:.0%}: {w.loader_cores_per_rank:g} core(s) per rank"
    elif w.loader_workers_needed <= w.loader_workers:
        fewer = w.loader_workers_needed < w.loader_workers
        need = f"data.num_workers={w.loader_workers} is enough" + (f" ({w.loader_workers_needed} would do)" * fewer)
    else:
        need = f"needs data.num_workers={w.loader_workers_needed} (has {w.loader_workers})"
    return (
        f"predicted {w.predicted_data_wait:.0%} of each step ({verdict}): {images_per_rank} images/rank take "
        f"{w.load_s_per_step:.3g} core-s at {w.loader_img_s_per_core:,.0f} images/s per core ({w.loader_rate_source});"
        f" loading needs {w.loader_cores_needed:.2g} core(s) per rank; {need}"
    )


def loader_host_bytes(
    config: TrainConfig, world: int, bytes_per_image: float, image_size: int, samples: int | None, device_type: str
) -> tuple[float, str]:
    """(bytes, what they are) of one rank's TrainStream: its streams' shuffle buffers, its decoded step buffers (uint8
    where the ranks' device normalizes, ``data.normalize_on``) and, where the set fits ``data.cache_mb``, its decoded
    cache."""
    d = config.data
    streams, share = d.streams // world, d.global_batch_size // world
    held = min(d.shuffle_buffer, math.ceil(samples / d.streams)) if samples else d.shuffle_buffer
    buffers = streams * held * bytes_per_image
    workers = min(d.num_workers, streams)  # as TrainStream runs them: a worker reads whole streams
    decoded = decoded_bytes(share, image_size, workers, pixels=d.pixels_for(device_type))
    cache = _cache_bytes(config, image_size)
    detail = (
        f"{streams} streams x {held} buffered samples x {bytes_per_image / 1e3:.0f} KB = "
        f"{buffers / GB:.3g} GB + decoded steps {decoded / GB:.3g} GB"
    ) + (f" + decoded cache of the set {cache / GB:.3g} GB" if cache else "")
    return buffers + decoded + cache, detail


def _cache_bytes(config: TrainConfig, image_size: int) -> int:
    try:
        info = read_manifest(resolve_location(config.data.train))
    except Exception:  # the plan's manifest line says why
        return 0
    return cache_bytes(info, image_size, config.data.cache_mb)
