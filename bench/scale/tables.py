"""ImageNet-21k's tables without the images, and what one rank does with them; reading, planning and the first batch
each run in a fresh interpreter (``_run_probe``), so its peak RSS is one rank's.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

from bench.shard_rates import read_speed
from data_pipeline import manifest
from data_pipeline.manifest import SamplesWriter, iter_samples, read_dataset_info, write_metadata
from data_pipeline.stream.config import DataConfig
from data_pipeline.stream.train_stream import TrainStream

# ImageNet-21k (fall 2011), what every projection scales to
I21K_SAMPLES = 14_197_122
I21K_CLASSES = 21_843
I21K_SHARDS = 4_700
I21K_MEAN_JPEG_KB = 92  # 1.31 TB / 14.2M images, docs/reference.md §6
LOADER_WORKERS = 8
GLOBAL_BATCH = 4096
STREAMS = 512  # data.streams of the i21k recipes
PROBE = "import sys, bench.scale.tables as s; s._probe(sys.argv[1:])"


def _digits(values: np.ndarray, width: int) -> np.ndarray:
    """(n, width) ASCII digits of non-negative ints, zero-padded."""
    values = values.astype(np.int64)
    out = np.empty((len(values), width), dtype=np.uint8)
    for k in range(width):
        out[:, width - 1 - k] = 48 + (values // 10**k) % 10
    return out


def _const(text: str, n: int) -> np.ndarray:
    return np.broadcast_to(np.frombuffer(text.encode(), dtype=np.uint8), (n, len(text)))


def _strings(*parts: np.ndarray) -> pa.Array:
    """A string column from fixed-width byte rows, built from buffers (no Python string per row)."""
    data = np.ascontiguousarray(np.concatenate(parts, axis=1))
    n, width = data.shape
    offsets = np.arange(n + 1, dtype=np.int32) * width
    return pa.Array.from_buffers(pa.string(), n, [None, pa.py_buffer(offsets), pa.py_buffer(data)])


def hex_digests(rng: np.random.Generator, n: int) -> pa.Array:
    """``n`` random sha256-like digests (64 lowercase hex characters) as a string column."""
    table = np.frombuffer(b"0123456789abcdef", dtype=np.uint8)
    raw = rng.integers(0, 256, size=(n, 32), dtype=np.uint8)
    return _strings(np.stack([table[raw >> 4], table[raw & 15]], axis=2).reshape(n, 64))


def build_tables(root: Path, samples: int, shards: int, classes: int, seed: int = 0) -> dict:
    """Write the three tables and dataset.json of an i21k-sized split folder (no tar files) with the project's
    writers, the samples table a chunk at a time."""
    root.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    sizes = np.full(shards, samples // shards, dtype=np.int64)
    sizes[: samples % shards] += 1
    shard_of = np.repeat(np.arange(shards), sizes)
    start = time.perf_counter()
    with SamplesWriter(root / manifest.SAMPLES_FILE) as writer:
        for lo in range(0, samples, manifest.SAMPLES_ROW_GROUP):
            idx = np.arange(lo, min(lo + manifest.SAMPLES_ROW_GROUP, samples))
            n = len(idx)
            label = rng.integers(0, classes, n)
            wnid = _digits(label, 8)
            columns = dict(
                key=_strings(_digits(idx, 9)),
                shard=_strings(_const("shard-", n), _digits(shard_of[idx], 6), _const(".tar", n)),
                label=pa.array(label),
                width=pa.array(rng.integers(200, 513, n)),
                height=pa.array(rng.integers(200, 513, n)),
                sha256=hex_digests(rng, n),
                source_sha256=hex_digests(rng, n),
                phash=pa.array(rng.integers(np.iinfo(np.int64).min, np.iinfo(np.int64).max, n, dtype=np.int64)),
                source=_strings(
                    _const("n", n), wnid, _const(".tar:n", n), wnid, _const("_", n), _digits(idx, 9), _const(".JPEG", n)
                ),
                near_duplicate=pa.array(np.zeros(n, dtype=bool)),
                exact_duplicate=pa.array(np.zeros(n, dtype=bool)),
            )
            writer.write_batch(pa.RecordBatch.from_pydict(columns, schema=manifest.SAMPLES_SCHEMA))
    shard_rows = [
        dict(
            url=manifest.SHARD_PATTERN.format(index=s),
            samples=int(c),
            bytes=int(c) * I21K_MEAN_JPEG_KB * 1000,
            sha256=h,
        )
        for s, (c, h) in enumerate(zip(sizes, hex_digests(rng, shards).to_pylist()))
    ]
    names = [f"n{c:08d}" for c in range(classes)]
    write_metadata(root, shards=shard_rows, samples=None, class_names=names, dataset=dict(name="i21k-tables"))
    sizes_mb = {p.name: round(p.stat().st_size / 2**20, 1) for p in root.glob("*.parquet")}
    return dict(tables_write_s=round(time.perf_counter() - start, 1), tables_mb=sizes_mb)


def _peak_mb() -> float:
    """This process's peak RSS (VmHWM); not ru_maxrss, which a fork+exec child inherits from its parent."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024  # kB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # not Linux: the best there is


def _probe(args: list[str]) -> None:
    """Run in a fresh interpreter by ``_run_probe``; prints one JSON line."""
    what, root = args[0], args[1]
    baseline = _peak_mb()  # after the imports a rank makes too (the stream, torch)
    start = time.perf_counter()
    out: dict = {}
    if what == "samples":
        out["rows"] = sum(batch.num_rows for batch in iter_samples(root))
    else:  # "plan" or "first_batch", as the last of args[2] ranks
        world, plan = int(args[2]), what == "plan"
        spec = DataConfig.for_stream(
            read_dataset_info(root) if plan else root,
            micro_batch_size=max(1, GLOBAL_BATCH // world) if plan else 64,
            image_size=224,
            global_batch_size=GLOBAL_BATCH if plan else 64 * world,  # first batch: 64 per rank per step
            streams=STREAMS,
            num_workers=LOADER_WORKERS,
        )
        stream = TrainStream(spec, rank=world - 1, world_size=world)
        if plan:
            dealt = stream.plan.stream_shards(0)  # all streams' shards: every rank deals the whole epoch
            out["shards_this_rank"] = sum(len(dealt[s]) for s in stream.plan.rank_streams)
        else:
            out["batch_shape"] = list(next(iter(stream))[0].shape)
        out["steps_per_epoch"] = stream.steps_per_epoch
    out["seconds"] = time.perf_counter() - start
    out["peak_mb"], out["baseline_mb"] = _peak_mb(), baseline
    print(json.dumps(out))


def _run_probe(*args: object) -> dict:
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", PROBE, *map(str, args)], capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"probe {args} failed: {done.stderr.strip()[-2000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["process_s"] = time.perf_counter() - start
    return result


def measure_tables(root: Path, samples: int, shards: int, classes: int, worlds: tuple[int, int]) -> dict:
    """Write the tables into ``root``; time reading the manifest, and (probes) streaming ``samples.parquet`` and
    planning epoch 0 at each of ``worlds`` ranks."""
    result = build_tables(root, samples, shards, classes)
    print(f"tables written in {result['tables_write_s']} s: {result['tables_mb']} MB")
    start = time.perf_counter()
    read_dataset_info(root)
    result["manifest_read_s"] = round(time.perf_counter() - start, 3)
    probe = _run_probe("samples", root)
    result["samples_read_s"] = round(probe["seconds"], 2)
    result["samples_read_peak_mb"] = round(probe["peak_mb"], 1)
    result["samples_read_baseline_mb"] = round(probe["baseline_mb"], 1)
    for world in worlds:
        probe = _run_probe("plan", root, world)
        name = "512" if world == worlds[1] else "64"  # the keys name i21k's world sizes, --tiny's too
        result[f"plan_s_{name}_ranks"] = round(probe["seconds"], 3)
        result[f"plan_peak_mb_{name}_ranks"] = round(probe["peak_mb"], 1)
        result[f"plan_{name}_ranks_detail"] = dict(
            world_size=world,
            per_rank_batch=max(1, GLOBAL_BATCH // world),
            shards_this_rank=probe["shards_this_rank"],
            shards_per_stream=round(shards / STREAMS, 2),
            streams=STREAMS,
            baseline_mb_after_imports=round(probe["baseline_mb"], 1),
            process_s_with_imports=round(probe["process_s"], 2),
        )
        print(f"plan {world} ranks x {LOADER_WORKERS} workers: {probe['seconds']:.3f} s, {probe['peak_mb']:.0f} MB")
    result["plan_peak_mb_per_rank"] = result["plan_peak_mb_512_ranks"]
    return result


def measure_first_batch(written: Path, stand_in: Path, shards: int, world: int) -> dict:
    """The last of ``world`` ranks' first batch (probe) from a ``shards``-row manifest in ``stand_in`` pointing at
    the shards in ``written``; and the shuffle buffer's fill time at i21k's JPEG size."""
    info = read_dataset_info(written)
    stand_in.mkdir()
    rows = []
    for i in range(shards):
        s, name = info.shards[i % len(info.shards)], manifest.SHARD_PATTERN.format(index=i)
        (stand_in / name).symlink_to(s.url)  # a manifest's URLs name files inside its folder
        rows.append(dict(url=name, samples=s.samples, bytes=s.bytes, sha256=s.sha256))
    write_metadata(stand_in, shards=rows, samples=None, class_names=list(info.class_names), dataset={})
    probe = _run_probe("first_batch", stand_in, world)
    result: dict = {"first_batch_s": round(probe["seconds"], 2)}
    read_mb_s = read_speed(written)
    fill_s = 1000 * I21K_MEAN_JPEG_KB * 1000 / 2**20 / read_mb_s  # kB per image; read_speed gives MiB/s
    result["first_batch_buffer_fill_s_i21k"] = round(fill_s, 2)
    result["first_batch_buffer_fill_inputs"] = dict(
        formula="shuffle_buffer * i21k_jpeg_kb * 1000 / 2**20 / read_mb_s_per_core (MiB/s), added to first_batch_s",
        shuffle_buffer=1000,
        i21k_jpeg_kb=I21K_MEAN_JPEG_KB,
        read_mb_s_per_core=round(read_mb_s, 1),
        note="tar reading from the page cache; remote storage reads slower",
    )
    result["first_batch_detail"] = dict(
        world_size=world,
        rank=world - 1,
        loader_workers=LOADER_WORKERS,
        per_rank_batch=64,
        global_batch=64 * world,
        streams=STREAMS,
        batch_shape=probe["batch_shape"],
        image_size=224,
        real_shards=len(info.shards),
        samples_per_real_shard=info.shards[0].samples,
        process_s_with_imports=round(probe["process_s"], 2),
        note="from TrainStream construction (manifest read, plan, worker start, shard read, decode) to the "
        "first batch; real i21k shards hold ~3k samples, so the 1000-sample shuffle buffer fills from more",
    )
    print(f"first batch: {result['first_batch_s']} s")
    return result
