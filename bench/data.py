"""Data benchmark: the training decode+augment path beside bare PIL decode+resize, and shard reading speed.

    python -m bench.data [--images 160] [--size 224] [--out bench-results/data.json]     (make bench-data)

Generates its own ImageNet-like JPEGs (~400x350, quality 90, textured so they compress like photos) in a temp
folder, so it needs no data and no network. Both decoders run in this one process on the same images, rounds
interleaved, best round kept. Rates are images per CPU second of this one process (``time.process_time``), i.e.
per core, so other jobs sharing the machine do not distort them:

- ``pil``: ``Image.open -> convert("RGB") -> resize((S, S), BILINEAR) -> numpy`` — the floor any loader pays;
- ``pipeline``: ``data_pipeline.augment.decode_train`` (Inception crop, flip) + the [-1, 1] float batch.

``ratio`` = pipeline / pil images/s (goal >= 0.85). ``read_mb_s`` streams the shards written from the same images
through the stream's tar reader (webdataset iteration, no decoding), per CPU second; the files are in the page
cache, so it measures the reader, not the disk. ``stream_img_s`` is a whole TrainStream (num_workers=0) for reference.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from data_pipeline.augment import AugmentConfig, decode_train, to_float_images
from data_pipeline.cli import output_file
from data_pipeline.manifest import read_dataset_info
from data_pipeline.shards import read_shard
from data_pipeline.stream import TrainStream
from data_pipeline.write import WriteConfig, write_dataset


def imagenet_like_jpegs(count: int, seed: int = 0) -> list[bytes]:
    """~400x350 JPEGs at quality 90: smooth colour fields plus grain, sizes varied like a photo collection."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        w, h = int(rng.integers(360, 440)), int(rng.integers(320, 380))
        base = rng.integers(0, 256, size=(int(rng.integers(12, 30)), int(rng.integers(12, 30)), 3), dtype=np.uint8)
        img = np.asarray(Image.fromarray(base).resize((w, h), Image.BICUBIC), dtype=np.float32)
        img = np.clip(img + rng.normal(0, 10, size=img.shape), 0, 255).astype(np.uint8)
        buf = io.BytesIO()
        Image.fromarray(img).save(buf, format="JPEG", quality=90)
        out.append(buf.getvalue())
    return out


def bare_pil(images: list[bytes], size: int) -> float:
    start = time.process_time()
    for data in images:
        with Image.open(io.BytesIO(data)) as img:
            np.asarray(img.convert("RGB").resize((size, size), Image.BILINEAR))
    return len(images) / (time.process_time() - start)


def pipeline(images: list[bytes], size: int, batch: int = 32) -> float:
    augment = AugmentConfig()
    start = time.process_time()
    for first in range(0, len(images), batch):
        arrays = [
            decode_train(data, size, augment, np.random.default_rng([0, first + i]))
            for i, data in enumerate(images[first : first + batch])
        ]
        to_float_images(np.stack(arrays))
    return len(images) / (time.process_time() - start)


def read_speed(shard_dir: Path) -> float:
    info = read_dataset_info(shard_dir)
    stats: Counter = Counter()
    start = time.process_time()
    for shard in info.shards:
        for _ in read_shard(shard.url, shard.samples, stats):
            pass
    seconds = time.process_time() - start
    return sum(s.bytes for s in info.shards) / 2**20 / seconds


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="decode+augment vs bare PIL images/s per core; shard read MB/s")
    p.add_argument("--images", type=int, default=160)
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default="bench-results/data.json")
    args = p.parse_args(argv)
    # The stream stage reads batches of 32 from 40-image shards: fewer images than one batch measure nothing.
    for flag, value, low in (("--images", args.images, 32), ("--size", args.size, 1), ("--rounds", args.rounds, 1)):
        if value < low:
            p.error(f"{flag} {value}: must be >= {low}")
    try:
        out = output_file(args.out, "--out")  # before minutes of timing
    except ValueError as error:
        print(f"bench.data: error: {error}", file=sys.stderr)
        return 2
    torch.set_num_threads(1)  # per core: the float conversion must not borrow the other cores
    images = imagenet_like_jpegs(args.images)
    mean_kb = sum(map(len, images)) / len(images) / 1024
    print(f"{len(images)} generated JPEGs, mean {mean_kb:.0f} KiB; output {args.size}px; one process (one core)")
    pil_runs, pipe_runs = [], []
    for _ in range(args.rounds):
        pil_runs.append(bare_pil(images, args.size))
        pipe_runs.append(pipeline(images, args.size))
    pil_rate, pipe_rate = max(pil_runs), max(pipe_runs)
    with tempfile.TemporaryDirectory() as tmp:
        items = [(data, i % 10, f"bench/{i}") for i, data in enumerate(images)]
        config = WriteConfig(name="bench", samples_per_shard=40, processes=1, keep_exact_duplicates=True)
        write_dataset(Path(tmp) / "shards", config, items=items, class_names=[str(c) for c in range(10)])
        read_mb_s = max(read_speed(Path(tmp) / "shards") for _ in range(args.rounds))
        stream = TrainStream(
            Path(tmp) / "shards", batch_size=32, image_size=args.size, shuffle_buffer=64, augment=AugmentConfig()
        )
        it = iter(stream)
        start = time.process_time()
        for _ in range(stream.batches_per_epoch):
            next(it)
        stream_rate = stream.batches_per_epoch * 32 / (time.process_time() - start)
    result = {
        "pipeline_img_s_per_core": round(pipe_rate, 1),
        "pil_img_s_per_core": round(pil_rate, 1),
        "ratio": round(pipe_rate / pil_rate, 3),
        "read_mb_s": round(read_mb_s, 1),
        "stream_img_s": round(stream_rate, 1),
        "images": len(images),
        "image_size": args.size,
        "mean_jpeg_kib": round(mean_kb, 1),
        "rounds_pil": [round(r, 1) for r in pil_runs],
        "rounds_pipeline": [round(r, 1) for r in pipe_runs],
    }
    print(f"bare PIL decode+resize : {pil_rate:7.1f} images/s per core")
    print(f"decode+augment (ours)  : {pipe_rate:7.1f} images/s per core   ratio {result['ratio']:.2f} (goal >= 0.85)")
    print(f"TrainStream end to end: {stream_rate:7.1f} images/s (num_workers=0)")
    print(f"shard reading          : {read_mb_s:7.1f} MB/s")
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
