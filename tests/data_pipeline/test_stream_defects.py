"""Defects of the training stream found by review, each pinned by the test that showed it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pytest

from data_pipeline.manifest import SAMPLES_FILE, write_table_atomic
from tests.data_pipeline.test_cache import _batches, _same, _stream
from tests.data_pipeline.test_stream import make_shards


def test_a_sample_without_its_image_counts_as_incomplete_with_the_cache_as_without(tmp_path):
    """A cached shard's sample with no .jpg member (a .png, say) is an incomplete sample, as when read from storage,
    not a corrupt one."""

    def no_jpg(key, index, sample):
        return {"__key__": key, "png": sample.pop("jpg"), "cls": sample["cls"]} if index % 7 == 3 else sample

    sizes = [12] * 8
    root = make_shards(tmp_path / "train", sizes=sizes, member=no_jpg)
    n = sum(sizes)  # the image sizes the cache plans with
    samples = pa.table({"key": [f"{k:06d}" for k in range(n)], "width": [24] * n, "height": [20] * n})
    write_table_atomic(samples, root / SAMPLES_FILE)
    plain, cached = _stream(root, 0), _stream(root, 64)
    assert cached.cache is not None and cached.cache.num_samples == n
    steps = plain.steps_per_epoch + 2
    assert _same(_batches(cached, steps), _batches(plain, steps))
    assert plain.stats["incomplete_samples"] > 0 and not plain.stats["corrupt_samples"]
    assert cached.stats == plain.stats


RACED_CACHE = """
import sys, torch
from data_pipeline.stream.decoded_cache import DecodedCache
from tests.data_pipeline.test_cache import _batches, _same, _stream

read_all, held = DecodedCache._read_all, []


def other_rank_first(cls, info, image_size):
    # while this rank decodes its set, another rank of the node puts its own copy in /dev/shm
    cache = read_all(info, image_size)
    held.append(torch.empty(6 << 20, dtype=torch.uint8).share_memory_())
    return cache


if __name__ == "__main__":  # not in the loader workers
    DecodedCache._read_all = classmethod(other_rank_first)
    root = sys.argv[1]
    raced = _stream(root, 64, workers=1)
    print(raced.cache_line)
    assert raced.cache is None
    assert _same(_batches(raced, 3), _batches(_stream(root, 0), 3))
    print("same batches")
"""


def test_a_decoded_cache_that_dev_shm_cannot_hold_after_all_is_left_off(tmp_path):
    """The ranks of a node each find that their decoded cache fits /dev/shm, then all put it there: the one that
    finds it full runs without the cache (the same batches), with a line saying so, not torch's traceback."""
    from tests.data_pipeline.test_cache import _write
    from tests.pretrain.test_checkpoint_faults import _can_mount_tmpfs

    if not _can_mount_tmpfs(tmp_path / "probe"):
        pytest.skip("cannot mount a tmpfs here (needs root or user namespaces)")
    root = _write(tmp_path / "train", count=150, side=100)  # 6.1 MiB decoded
    line, same = run_with_small_shm(tmp_path, RACED_CACHE, "9m", root).splitlines()[-2:]
    assert line.startswith("decoded cache off: cached (150 images): /dev/shm") and same == "same batches", line


def run_with_small_shm(tmp_path: Path, code: str, size: str, *args) -> str:
    """``code`` run as a script (``args`` its arguments) where /dev/shm is a tmpfs of ``size``; its stdout."""
    (tmp_path / "code.py").write_text(code)
    argv = " ".join(map(str, args))
    script = f"mount -t tmpfs -o size={size} tmpfs /dev/shm && exec {sys.executable} {tmp_path / 'code.py'} {argv}"
    done = subprocess.run(
        ["unshare", "--mount", "sh", "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).parents[2],
        env=dict(os.environ, PYTHONPATH=str(Path(__file__).parents[2])),
    )
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    return done.stdout.strip()
