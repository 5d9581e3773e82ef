"""The decoded cache (``data.cache_mb``, data_pipeline/stream/decoded_cache.py) changes no batch and no loss.

- an image decoded whole and then cropped is bit-identical to the loader's per-crop decode, for RGB, grayscale, CMYK,
  progressive and PNG images, tall ones, crops that decode at a reduced DCT scale, with and without RandAugment;
- a TrainStream with the cache yields the same batches, keys, counters and positions as one without, over two
  epochs, with no loader workers and with 2, and resumes the same; a shard with read damage is left out of the cache
  (read from storage each time, counted as before); a set over ``cache_mb`` gets no cache (all or nothing);
- 2 ranks x 2 loader workers under torchrun, across an epoch boundary: the per-step losses and batch digests with the
  cache equal those without it (==), and those of the shared reference run (no loader workers, the cache on).
"""

from __future__ import annotations

import io
import subprocess
import sys
import tarfile

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image

from data_pipeline.manifest import int64_column, iter_samples, read_dataset_info
from data_pipeline.stream.augment import AugmentConfig, decode_train_image, decode_whole, decoded_train_image, rgb_array
from data_pipeline.stream.config import DataConfig
from data_pipeline.stream.decoded_cache import DecodedCache, planned_bytes
from data_pipeline.stream.train_stream import TrainStream
from data_pipeline.write.writer import WriteConfig, write_dataset


def _photo(width: int, height: int, seed: int, mode: str = "RGB") -> Image.Image:
    rng = np.random.default_rng(seed)
    cells = rng.integers(0, 256, size=(6, 8, 3), dtype=np.uint8)
    img = np.asarray(Image.fromarray(cells).resize((width, height), Image.BICUBIC), dtype=np.float32)
    img = np.clip(img + rng.normal(0, 12, img.shape), 0, 255).astype(np.uint8)
    return Image.fromarray(img).convert(mode)


def _encoded(img: Image.Image, **save) -> bytes:
    out = io.BytesIO()
    img.save(out, **{"format": "JPEG", "quality": 90, **save})
    return out.getvalue()


IMAGES = {
    "rgb": _encoded(_photo(300, 200, 0)),
    "tall": _encoded(_photo(60, 260, 1)),  # Pillow resizes such an image vertical pass first
    "grayscale": _encoded(_photo(180, 140, 2, "L")),
    "cmyk": _encoded(_photo(150, 120, 3, "CMYK")),
    "progressive": _encoded(_photo(200, 150, 4), progressive=True),
    "png": _encoded(_photo(90, 70, 5), format="PNG"),
}
CONFIGS = {
    "default": AugmentConfig(),
    "randaugment": AugmentConfig(randaugment_n=2, randaugment_m=10),
    "full decode": AugmentConfig(scaled_decode=False),
    "resize only": None,
}


@pytest.mark.parametrize("name", sorted(IMAGES))
@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_an_image_decoded_whole_then_cropped_is_bit_identical_to_the_per_crop_decode(name, config):
    data, cfg = IMAGES[name], CONFIGS[config]
    pixels, image_format = decode_whole(data)
    for size in (32, 96):  # at 32 px most crops of the JPEGs decode at 1/2 or 1/4 scale (from the bytes)
        for seed in range(12):
            rng_a, rng_b = np.random.default_rng([seed, size]), np.random.default_rng([seed, size])
            want = decode_train_image(data, size, cfg, rng_a)
            got = decoded_train_image(pixels, image_format, data, size, cfg, rng_b)
            got, want = rgb_array(got), rgb_array(want)  # as the loader packs them: RGB planes
            assert got.shape == want.shape == (size, size, 3)
            assert np.array_equal(got, want), (name, config, size, seed)
            assert rng_a.random() == rng_b.random()  # the same draws made


def _write(root, count: int = 96, side: int = 40, per_shard: int = 12):
    """A shard folder written by the project's writer (samples.parquet holds the image sizes the cache plans with)."""
    items = [(_encoded(_photo(side, side - 6, i)), i % 4, f"img/{i}") for i in range(count)]
    config = WriteConfig(name="cached", samples_per_shard=per_shard, processes=1, keep_exact_duplicates=True)
    write_dataset(root, config, items=items, class_names=[str(c) for c in range(4)])
    return root


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return _write(tmp_path_factory.mktemp("cached") / "train")


def _stream(root, cache_mb: float, workers: int = 0, **kw) -> TrainStream:
    config = DataConfig.for_stream(
        root,
        micro_batch_size=4,
        image_size=16,
        global_batch_size=16,
        streams=4,
        shuffle_buffer=10,
        augment=AugmentConfig(),
        cache_mb=cache_mb,
        num_workers=workers,
    )
    return TrainStream(config, record_keys=True, **kw)


def _batches(stream: TrainStream, steps: int) -> list:
    it = iter(stream)
    out = []
    for _ in range(steps * stream.accumulation_steps):
        x, y = next(it)
        out.append((x.clone(), y.clone(), list(stream.last_keys)))
    return out


def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(
        torch.equal(xa, xb) and torch.equal(ya, yb) and ka == kb for (xa, ya, ka), (xb, yb, kb) in zip(a, b)
    )


def test_the_stream_yields_the_same_batches_with_and_without_the_cache(shards):
    plain = _stream(shards, 0, rank=1, world_size=2)
    cached = _stream(shards, 64, rank=1, world_size=2)
    assert plain.cache is None and cached.cache is not None and cached.cache.num_samples == 96
    assert cached.cache_line.startswith("decoded cache on: cached (96 images)")
    steps = plain.steps_per_epoch + 3  # into the second epoch: its shards re-dealt, read from the cache
    want = _batches(plain, steps)
    assert _same(_batches(cached, steps), want)
    assert cached.stats == plain.stats and cached.state_dict() == plain.state_dict()
    workers = _stream(shards, 64, workers=2, rank=1, world_size=2)  # the cache in shared memory
    assert workers.cache.pixels.is_shared()
    assert _same(_batches(workers, steps), want)
    stopped = _stream(shards, 0, rank=1, world_size=2)
    _batches(stopped, 4)
    resumed = _stream(shards, 64, rank=1, world_size=2)  # a resume replays its draws from the cache
    resumed.load_state_dict(stopped.state_dict())
    assert _same(_batches(resumed, steps - 4), want[4 * resumed.accumulation_steps :])


def test_planned_bytes_bound_the_cache_and_a_set_over_cache_mb_gets_none(shards):
    info = read_dataset_info(shards)
    need = planned_bytes(info, 16)
    cache, line = DecodedCache.build(info, 16, limit_mb=64, shared=False)
    # 40 x 34 RGBX pixels each, and their JPEG bytes (34 >= 2 x 16: a crop may decode at 1/2 scale), which the plan
    # counts as the shard bytes per sample (tar headers too): an upper bound
    assert cache.nbytes <= need <= 2 * cache.nbytes
    assert all(e.jpg is not None for entries in cache.shards.values() for e in entries)
    assert DecodedCache.build(info, 24, limit_mb=64, shared=False)[0].nbytes == 96 * 40 * 34 * 4  # 34 < 48: none
    assert cache.shards.keys() == {s.url for s in info.shards}
    cache, line = DecodedCache.build(info, 16, limit_mb=need / 2**20 * 0.99, shared=False)
    assert cache is None and line.startswith("decoded cache off: cached (96 images) needs over data.cache_mb=")
    assert DecodedCache.build(info, 16, limit_mb=0, shared=False) == (None, "decoded cache off (data.cache_mb=0)")
    stream = _stream(shards, need / 2**20 * 0.99)
    assert stream.cache is None and stream.cache_line == line


def test_int64_column_reads_arrow_buffers_like_to_numpy_without_importing_pandas(shards, tmp_path):
    batch = next(iter_samples(shards, columns=["width", "height"]))
    for part in (batch, batch.slice(3, 5)):  # a slice starts at an offset into its buffers
        for name in ("width", "height"):
            got = int64_column(part, name)
            assert got.dtype == np.int64 and got.tolist() == part.column(name).to_pylist()
    pq.write_table(pa.table({"width": pa.array([3, None], pa.int32())}), tmp_path / "nulls.parquet")
    with pytest.raises(ValueError, match="1 nulls"):
        int64_column(next(iter_samples(tmp_path / "nulls.parquet", columns=["width"])), "width")
    # pyarrow's to_numpy imports pandas (0.2 s in every rank that plans its decoded cache); planning must not
    code = (
        "import sys; from data_pipeline.stream.decoded_cache import planned_bytes;"
        "from data_pipeline.manifest import read_dataset_info;"
        f"assert planned_bytes(read_dataset_info({str(shards)!r}), 16) > 0;"
        "print('pandas' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "False", done.stdout + done.stderr[-2000:]


def test_a_shard_with_read_damage_is_read_from_storage_and_counted_as_without_the_cache(tmp_path):
    root = _write(tmp_path / "train", count=64, per_shard=8)
    info = read_dataset_info(root)
    damaged = info.shards[2].url
    with tarfile.open(damaged) as tar:
        cut = tar.getmembers()[7].offset  # the shard ends inside its third sample
    with open(damaged, "r+b") as f:
        f.truncate(cut)
    cache, _ = DecodedCache.build(info, 16, limit_mb=64, shared=False)
    assert damaged not in cache.shards and len(cache.shards) == len(info.shards) - 1
    plain, cached = _stream(root, 0), _stream(root, 64)
    steps = plain.steps_per_epoch + 2
    assert _same(_batches(cached, steps), _batches(plain, steps))
    assert cached.stats == plain.stats and plain.stats["truncated_shards"] >= 1


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_ranks_with_loader_workers_train_bit_identically_with_and_without_the_cache(
    tiny_fractal_shards, tmp_path, shared_folder
):
    from tests.pretrain.test_train_distributed import reference_run, tiny_config, torchrun

    # 8 steps of global batch 16 over the 64-image set: 2 epochs, the loader workers created anew at the boundary
    extra = ("deepspeed.zero_stage=2", "data.num_workers=2")
    with_cache = torchrun(tiny_config(tiny_fractal_shards, tmp_path / "on", *extra), tmp_path / "w_on")
    off = tiny_config(tiny_fractal_shards, tmp_path / "off", *extra, "data.cache_mb=0")
    without = torchrun(off, tmp_path / "w_off")
    assert "decoded cache on: fractal (64 images)" in (tmp_path / "w_on" / "output.log").read_text()
    assert "decoded cache" not in (tmp_path / "w_off" / "output.log").read_text()
    assert len(with_cache[0]["losses"]) == 8 and with_cache[0]["digests"] != with_cache[1]["digests"]
    assert [r["losses"] for r in with_cache] == [r["losses"] for r in without]  # bit-identical, every rank and step
    assert [r["digests"] for r in with_cache] == [r["digests"] for r in without]
    _, reference = reference_run(shared_folder, tiny_fractal_shards, 2)  # no loader workers, the cache on
    assert [r["losses"] for r in reference] == [r["losses"] for r in without]
    assert [r["digests"] for r in reference] == [r["digests"] for r in without]
