"""Data benchmark: the training decode+augment path beside bare PIL decode+resize, loader worker scaling, shard
reading speed (keys: docs/benchmarks/2026-11-26-data-loader.md). Rates are images per CPU second of this process on
generated JPEGs, best of interleaved rounds; the loader's are wall-clock (2 workers need 2 idle cores).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from bench import out_file, stopped, write_json
from bench.images import imagenet_like_jpegs
from bench.shard_rates import read_speed, stream_rate, train_stream, write_shards
from data_pipeline.cli import fail
from data_pipeline.stream.augment import AugmentConfig, decode_train, decode_train_image, inception_crop_box, planes
from data_pipeline.stream.step_pool import StepPool, conversion_rows

PROG = "python -m bench.data"


def bare_pil(images: list[bytes], size: int) -> float:
    """Images per CPU second of PIL's decode + bilinear resize to ``size``, uint8 out; resized before
    ``convert("RGB")``, which would copy the full-size image."""
    start = time.process_time()
    for data in images:
        with Image.open(io.BytesIO(data)) as img:
            out = img.resize((size, size), Image.BILINEAR)
            np.asarray(out if out.mode == "RGB" else out.convert("RGB"))
    return len(images) / (time.process_time() - start)


def pipeline(images: list[bytes], size: int, augment: AugmentConfig, batch: int = 32, convert: bool = True) -> float:
    """Images per CPU second of decode + augment + a worker's conversion into a `StepPool`; ``convert=False``: uint8
    out, no conversion."""
    if convert:  # before the clock, as the loader makes them once
        pool = StepPool(2, batch, size, workers=1, lookahead=0, shared=True)
        scratch = planes(conversion_rows(size), size)
    decode = decode_train_image if convert else decode_train
    start = time.process_time()
    for step, first in enumerate(range(0, len(images), batch)):
        arrays = [
            decode(data, size, augment, np.random.default_rng([0, first + i]))
            for i, data in enumerate(images[first : first + batch])
        ]
        if convert:
            pool.grant(step)
            slot = pool.slot(step)
            pool.write(step, slot, 0, 0, arrays, scratch)
            pool.take(step, slot)
    return len(images) / (time.process_time() - start)


def scaled_decode_fraction(images: list[bytes], size: int, augment: AugmentConfig) -> float:
    """Share of the pipeline's crops (same seeds) whose short side is >= 2 x ``size``: decoded at 1/2 scale or less."""
    hits = 0
    for i, data in enumerate(images):
        with Image.open(io.BytesIO(data)) as img:
            box = inception_crop_box(*img.size, np.random.default_rng([0, i]), augment)
        hits += min(box[2] - box[0], box[3] - box[1]) >= 2 * size
    return hits / len(images)


def decode_us_by_scale(images: list[bytes], rounds: int) -> dict[int, float]:
    """{n: µs per image of libjpeg-turbo's decode alone at DCT scale n/8}, n = 8..4 (why the loader scales only by
    powers of 2: docs/benchmarks/2026-11-26-data-loader.md)."""
    import simplejpeg

    sizes = [simplejpeg.decode_jpeg_header(data)[:2] for data in images]
    best = {}
    for n in (8, 7, 6, 5, 4):
        times = []
        for _ in range(rounds):
            start = time.process_time()
            for data, (h, w) in zip(images, sizes):
                simplejpeg.decode_jpeg(data, colorspace="RGBX", min_height=-(-h * n // 8), min_width=-(-w * n // 8))
            times.append(time.process_time() - start)
        best[n] = min(times) / len(images) * 1e6
    return best


def dali_rate(images: list[bytes], size: int, augment: AugmentConfig, batch: int = 32) -> float:
    """Images per CPU second of DALI's CPU random-crop decoder (``augment``'s ranges), antialiased bilinear resize,
    random flip; one thread, uint8 out."""
    from nvidia.dali import fn, pipeline_def, types

    encoded = [np.frombuffer(data, dtype=np.uint8) for data in images]

    def source(info):
        if info.idx_in_epoch >= len(encoded):
            raise StopIteration
        return encoded[info.idx_in_epoch]

    @pipeline_def(batch_size=batch, num_threads=1, device_id=None, prefetch_queue_depth=1, exec_dynamic=False)
    def crop_resize_flip():
        jpegs = fn.external_source(source=source, batch=False, dtype=types.UINT8)
        img = fn.decoders.image_random_crop(
            jpegs,
            device="cpu",
            output_type=types.RGB,
            random_area=[augment.area_min, augment.area_max],
            random_aspect_ratio=[augment.aspect_min, augment.aspect_max],
            num_attempts=10,
        )
        img = fn.resize(img, resize_x=size, resize_y=size, interp_type=types.INTERP_LINEAR, antialias=True)
        return fn.flip(img, horizontal=fn.random.coin_flip())

    pipe = crop_resize_flip()
    pipe.build()
    done = 0
    start = time.process_time()
    with contextlib.suppress(StopIteration):
        while True:
            (out,) = pipe.run()
            done += len(out)
    return done / (time.process_time() - start)


def loader_rate(shards: Path, size: int, workers: int, batch: int = 32, streams: int = 2) -> tuple[float, float]:
    """(images per wall-clock second after the first batch, training-process CPU µs per image) of a TrainStream
    with ``workers`` loader processes (2 streams: the same samples in the same order at any worker count)."""
    stream = train_stream(shards, size, batch, streams=streams, num_workers=workers)
    it = iter(stream)
    next(it)  # worker start-up and the first batch
    start, cpu = time.perf_counter(), time.process_time()
    for _ in range(stream.steps_per_epoch - 1):
        next(it)
    images = (stream.steps_per_epoch - 1) * batch
    return images / (time.perf_counter() - start), (time.process_time() - cpu) / images * 1e6


@dataclass(frozen=True)
class LoaderRates:
    read_mb_s: float  # the tar reader alone, page cache, best round
    stream_img_s: float  # TrainStream without workers
    workers: dict[int, list[float]]  # loader worker count -> images per wall-clock second, one per round
    main_cpu_us: list[float]  # at 2 workers: the training process's CPU µs per image, one per round

    @property
    def best(self) -> dict[int, float]:
        return {n: max(r) for n, r in self.workers.items()}


def measure_decoders(images: list[bytes], size: int, rounds: int, dali: bool) -> dict[str, list[float]]:
    """Images per CPU second of bare PIL, each pipeline variant (and DALI): one per interleaved round."""
    variants = dict(
        pipeline=AugmentConfig(),
        pipeline_full_decode=AugmentConfig(scaled_decode=False),
        pipeline_randaugment=AugmentConfig(randaugment_n=2, randaugment_m=10),
    )
    runs: dict[str, list[float]] = {"pil": [], **{name: [] for name in variants}, "pipeline_uint8": []}
    for i in range(rounds):
        runs["pil"].append(bare_pil(images, size))
        for name, augment in variants.items():
            runs[name].append(pipeline(images, size, augment))
        runs["pipeline_uint8"].append(pipeline(images, size, AugmentConfig(), convert=False))
        if dali:
            runs.setdefault("dali", []).append(dali_rate(images, size, AugmentConfig()))
        line = ", ".join(f"{k} {v[-1]:.0f}" for k, v in runs.items())
        print(f"round {i + 1}/{rounds}: {line}", file=sys.stderr, flush=True)
    return runs


def measure_loader(images: list[bytes], size: int, rounds: int, loader_rounds: int, copies: int) -> LoaderRates:
    """Shard reading, a TrainStream without workers, the loader at 1 and 2 workers (rounds interleaved), on shards
    holding every image ``copies`` times so that the timed window lasts seconds."""
    with tempfile.TemporaryDirectory() as tmp:
        shards = write_shards(Path(tmp) / "shards", images * copies, 40)
        read_mb_s = max(read_speed(shards) for _ in range(rounds))
        stream_img_s = stream_rate(shards, size)
        workers: dict[int, list[float]] = {count: [] for count in (1, 2)}
        main_cpu_us: list[float] = []
        for _ in range(loader_rounds):
            for count in workers:
                img_s, cpu_us = loader_rate(shards, size, count)
                workers[count].append(img_s)
                if count == 2:
                    main_cpu_us.append(cpu_us)
    return LoaderRates(read_mb_s, stream_img_s, workers, main_cpu_us)


def _rate_keys(
    rate: dict[str, float], decode_us: dict[int, float], loader: LoaderRates, images: list[bytes], size: int
) -> dict:
    """``rate``: the best round of each decoder."""

    def ratio(name: str) -> float:
        return round(rate[name] / rate["pil"], 3)

    worker_rate = loader.best
    dali = {"ratio_dali": ratio("dali"), "dali_img_s_per_core": round(rate["dali"], 1)} if "dali" in rate else {}
    variants = ("pipeline", "pipeline_uint8", "pipeline_full_decode", "pipeline_randaugment", "pil")
    return dict(
        ratio=ratio("pipeline"),
        ratio_uint8=ratio("pipeline_uint8"),
        ratio_randaugment=ratio("pipeline_randaugment"),
        **dali,
        ratio_full_decode=ratio("pipeline_full_decode"),
        workers_2_over_1=round(worker_rate[2] / worker_rate[1], 3),
        workers_2_over_1_paired_median=round(float(np.median(np.divide(loader.workers[2], loader.workers[1]))), 3),
        **{f"{name}_img_s_per_core": round(rate[name], 1) for name in variants},
        scaled_decode_fraction=round(scaled_decode_fraction(images, size, AugmentConfig()), 3),
        **{f"decode_us_scale_{n}_8": round(us, 1) for n, us in decode_us.items()},
        loader_img_s_workers1=round(worker_rate[1], 1),
        loader_img_s_workers2=round(worker_rate[2], 1),
        loader_main_cpu_us_per_image_workers2=round(float(np.median(loader.main_cpu_us)), 1),
        read_mb_s=round(loader.read_mb_s, 1),
        stream_img_s=round(loader.stream_img_s, 1),
    )


def _print_summary(result: dict, rate: dict[str, float], decode_us: dict[int, float], loader: LoaderRates) -> None:
    worker_rate = loader.best
    print(f"bare PIL decode+resize : {rate['pil']:7.1f} images/s per core")
    print(
        f"decode+crop+flip (ours): {rate['pipeline']:7.1f} images/s per core   ratio {result['ratio']:.2f} "
        f"(goal >= 1.3); without scaled decode {result['ratio_full_decode']:.2f}; scaled decode on "
        f"{result['scaled_decode_fraction']:.0%} of crops"
    )
    print(
        f"  uint8 out, like PIL's: {rate['pipeline_uint8']:7.1f} images/s per core   ratio "
        f"{result['ratio_uint8']:.2f} (without the loader's copy and float conversion)"
    )
    if "dali" in rate:
        print(
            f"  DALI CPU random crop : {rate['dali']:7.1f} images/s per core   ratio {result['ratio_dali']:.2f} "
            "(uint8 out: the anchor for ratio_uint8)"
        )
    print(
        f"  + RandAugment(2, 10) : {rate['pipeline_randaugment']:7.1f} images/s per core   ratio "
        f"{result['ratio_randaugment']:.2f}"
    )
    print("JPEG decode by DCT scale: " + ", ".join(f"{n}/8 {us:.0f} us" for n, us in decode_us.items()))
    print(
        f"loader, 1 / 2 workers  : {worker_rate[1]:7.1f} / {worker_rate[2]:.1f} images/s (wall)   "
        f"{result['workers_2_over_1']:.2f}x (goal >= 1.8x; paired median of the rounds "
        f"{result['workers_2_over_1_paired_median']:.2f}x); training process "
        f"{result['loader_main_cpu_us_per_image_workers2']:.0f} us CPU per image at 2 workers"
    )
    print(f"TrainStream end to end: {loader.stream_img_s:7.1f} images/s (num_workers=0)")
    print(f"shard reading          : {loader.read_mb_s:7.1f} MiB/s")


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="decode+augment vs bare PIL images/s per core; workers; shard read MiB/s",
    )
    add = p.add_argument
    add("--images", type=int, default=320)
    add("--size", type=int, default=224)
    add("--rounds", type=int, default=3)
    add("--loader-rounds", type=int, default=5, help="rounds of the 1- and 2-worker loader, interleaved")
    add("--loader-copies", type=int, default=4, help="each image this many times in the loader's shards")
    add("--out", default="bench-results/data.json")
    add("--dali", action="store_true", help="also time NVIDIA DALI's CPU random-crop decoder (the anchor)")
    args = p.parse_args(argv)
    # 40-image shards, batches of 32, 2 workers: >= 2 shards and 2 batches per epoch
    for flag, low in (("--images", 80), ("--size", 1), ("--rounds", 1), ("--loader-rounds", 1), ("--loader-copies", 1)):
        value = getattr(args, flag[2:].replace("-", "_"))
        if value < low:
            p.error(f"{flag} {value}: must be >= {low}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    if (out := out_file(args.out, PROG)) is None:  # before minutes of timing
        return 2
    try:
        if args.dali:
            import nvidia.dali  # noqa: F401
    except ImportError:
        return fail(
            PROG,
            "--dali needs NVIDIA DALI, which is not a vitscale dependency: pip install nvidia-dali-cuda120 (its CPU "
            "decoders need no GPU), or leave --dali out",
        )
    try:
        return _measure(args, out)
    except KeyboardInterrupt:
        return stopped(PROG, out)


def _measure(args: argparse.Namespace, out: Path) -> int:
    torch.set_num_threads(1)  # per core, as in a loader worker: the resize and the float conversion use one thread
    images = imagenet_like_jpegs(args.images)
    mean_kb = sum(map(len, images)) / len(images) / 1024
    shorts = sorted(min(Image.open(io.BytesIO(d)).size) for d in images)
    print(
        f"{len(images)} generated JPEGs, mean {mean_kb:.0f} KiB, short side median {shorts[len(shorts) // 2]} px "
        f"(max {shorts[-1]}); output {args.size}px; one process (one core)"
    )
    runs = measure_decoders(images, args.size, args.rounds, args.dali)
    decode_us = decode_us_by_scale(images, args.rounds)
    loader = measure_loader(images, args.size, args.rounds, args.loader_rounds, args.loader_copies)
    rate = {name: max(r) for name, r in runs.items()}
    result = dict(
        **_rate_keys(rate, decode_us, loader, images, args.size),
        images=len(images),
        loader_samples=len(images) * args.loader_copies,
        image_size=args.size,
        mean_jpeg_kib=round(mean_kb, 1),
        short_side_median=shorts[len(shorts) // 2],
        short_side_max=shorts[-1],
        load_average_1min=os.getloadavg()[0],
        cpu_count=os.cpu_count(),
        **{f"rounds_{name}": [round(r, 1) for r in values] for name, values in runs.items()},
        **{f"rounds_loader_workers{n}": [round(r, 1) for r in loader.workers[n]] for n in (1, 2)},
    )
    _print_summary(result, rate, decode_us, loader)
    write_json(out, result)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
