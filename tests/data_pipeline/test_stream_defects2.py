"""Defects of the streams' reads, step buffers and loader timing found by review, each pinned by the test that
showed it."""

from __future__ import annotations

import io
import json
import tarfile
from collections import Counter
from pathlib import Path

import pytest

from data_pipeline.manifest import ShardFormatError
from data_pipeline.stream import shards
from data_pipeline.stream.config import DataConfig
from data_pipeline.stream.eval_stream import EvalStream
from data_pipeline.stream.loader_rate import loader_rate
from data_pipeline.stream.shards import read_shard
from data_pipeline.stream.train_stream import TrainStream
from tests.data_pipeline.test_loader_rate import AUGMENT, own_cache  # noqa: F401 (a fixture)
from tests.data_pipeline.test_retries import flaky  # noqa: F401 (a fixture)
from tests.data_pipeline.test_stream import UNEVEN, jpeg_bytes, make_shards

EVERY_KEY = [f"{k:06d}" for k in range(sum(UNEVEN))]


def _eval(url: str, **kw) -> tuple[list[str], EvalStream]:
    stream = EvalStream(url, batch_size=16, image_size=16, return_keys=True, **kw)
    return [k for _, _, keys in stream for k in keys], stream


@pytest.mark.timeout(120)
def test_the_eval_streams_reads_retry_as_it_is_told_not_as_a_train_stream_left_the_process(
    tmp_path,
    flaky,  # noqa: F811
    monkeypatch,
):
    """A train stream read in process (no loader workers) with data.read_retries=0 left its setting in the process:
    an eval stream read afterwards gave up on the first failed open of every shard. Each stream now uses its own
    setting (3 by default), in process and in its loader workers alike."""
    monkeypatch.setattr(shards, "_retries", [3])  # the process's setting, restored after the test
    root = make_shards(tmp_path / "s")
    train = TrainStream(DataConfig.for_stream(root, micro_batch_size=8, image_size=16, read_retries=0))
    next(iter(train))
    monkeypatch.setattr(flaky, "fail_opens", 1)
    keys, stream = _eval(f"flaky://{root}")
    assert sorted(keys) == EVERY_KEY and not stream.stats["read_failures"]
    assert stream.stats["read_retries"] == len(UNEVEN)
    for p in Path(flaky.state_dir).iterdir():
        p.unlink()
    keys, stream = _eval(f"flaky://{root}", read_retries=0, num_workers=2, multiprocessing_context="fork")
    assert keys == [] and stream.stats["read_failures"] == len(UNEVEN) and not stream.stats["read_retries"]
    for p in Path(flaky.state_dir).iterdir():
        p.unlink()
    monkeypatch.setattr(flaky, "fail_opens", 2)
    keys, stream = _eval(f"flaky://{root}", read_retries=2, num_workers=2, multiprocessing_context="fork")
    assert sorted(keys) == EVERY_KEY and stream.stats["read_retries"] == 2 * len(UNEVEN)


def _big_images(key, index, sample):
    return dict(sample, jpg=jpeg_bytes(index, (200, 150)))  # ~28 KB: a read breaks inside the member it aims at


def _shard_with_unsafe_member(root: Path, before_sample: int) -> tuple[Path, int]:
    """A shard of 40 samples with a member named ../x.cls (skipped, counted) just before sample ``before_sample``;
    and the offset of the middle of the image of the sample before it (of the first sample if 0)."""
    root = make_shards(root, sizes=[40], member=_big_images)
    shard = root / "shard-000000.tar"
    with tarfile.open(shard) as tar:
        members = [(m, tar.extractfile(m).read()) for m in tar.getmembers()]
    bad = tarfile.TarInfo("../x.cls")
    bad.size = 1
    at = 2 * before_sample
    members = members[:at] + [(bad, b"0")] + members[at:]
    with tarfile.open(shard, "w", format=tarfile.USTAR_FORMAT) as tar:
        for member, data in members:
            tar.addfile(member, io.BytesIO(data))
    with tarfile.open(shard) as tar:
        jpgs = [m for m in tar.getmembers() if m.name.endswith(".jpg")]
    image = jpgs[max(0, before_sample - 1)]
    return root, image.offset_data + image.size // 2


@pytest.mark.parametrize("before_sample", [0, 21])
def test_a_retried_read_counts_the_shards_damage_once(tmp_path, flaky, monkeypatch, before_sample):  # noqa: F811
    """A read broken before its first sample was delivered counted the damage it had passed again on the retry (0);
    one broken after its last delivered sample, before damage it had not reached, never counted that damage (21)."""
    root, at = _shard_with_unsafe_member(tmp_path / "s", before_sample)
    local = root / "shard-000000.tar"
    clean: Counter = Counter()
    samples = [s["__key__"] for s in read_shard(str(local), 40, clean)]
    assert clean == Counter(unsafe_members=1) and len(samples) == 40
    monkeypatch.setattr(flaky, "fail_opens", 1)
    monkeypatch.setattr(flaky, "fail_after_bytes", at)
    stats: Counter = Counter()
    assert [s["__key__"] for s in read_shard(f"flaky://{local}", 40, stats)] == samples
    assert stats == Counter(unsafe_members=1, read_retries=1)


RACED_POOL = """
import sys, torch
from data_pipeline.stream import train_stream
from data_pipeline.stream.config import DataConfig

real, held = train_stream.shm_free, []


def other_rank_after_the_check(where="/dev/shm"):
    free = real(where)
    held.append(torch.empty(3 << 20, dtype=torch.uint8).share_memory_())  # another rank of the node fills it
    return free


if __name__ == "__main__":  # not in the loader workers
    train_stream.shm_free = other_rank_after_the_check
    config = DataConfig.for_stream(
        sys.argv[1], micro_batch_size=16, image_size=64, num_workers=1, loader_start_method="fork"
    )
    try:
        next(iter(train_stream.TrainStream(config)))
    except ValueError as error:
        print(error)
"""


@pytest.mark.timeout(120)
def test_step_buffers_that_dev_shm_cannot_hold_after_all_say_what_to_do(tmp_path):
    """The ranks of a node each find that their step buffers fit /dev/shm, then all allocate them: the one that
    finds it full fails with the check's message naming the fixes, not torch's 'unable to allocate shared memory'."""
    from tests.pretrain.test_checkpoint_faults import _can_mount_tmpfs

    if not _can_mount_tmpfs(tmp_path / "probe"):
        pytest.skip("cannot mount a tmpfs here (needs root or user namespaces)")
    root = make_shards(tmp_path / "train")
    from tests.data_pipeline.test_stream_defects import run_with_small_shm

    # 16 x 3 x 64 x 64 float32 x 5 buffers: 3.75 MiB
    line = run_with_small_shm(tmp_path, RACED_POOL, "4m", root).splitlines()[-1]
    assert line.startswith("the loader's step buffers need 4 MiB of shared memory but /dev/shm has "), line
    assert "--shm-size" in line and "data.num_workers=0" in line


@pytest.mark.timeout(120)
def test_the_loader_rate_of_a_run_sending_uint8_pixels_is_timed_and_kept_apart(tiny_fractal_shards, own_cache):  # noqa: F811
    """On a GPU the loader sends uint8 pixels (data.normalize_on): its rate is timed without the float conversion,
    and cached under its own key."""
    floats = loader_rate(tiny_fractal_shards, 32, AUGMENT)
    pixels = loader_rate(tiny_fractal_shards, 32, AUGMENT, pixels="uint8")
    assert floats.img_s_per_core > 0 and pixels.img_s_per_core > 0
    keys = sorted(json.loads(own_cache.read_text()))
    assert len(keys) == 2 and sum("uint8 pixels" in k for k in keys) == 1
    assert loader_rate(tiny_fractal_shards, 32, AUGMENT, pixels="uint8").img_s_per_core == pixels.img_s_per_core


@pytest.mark.timeout(120)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_set_a_loader_worker_finds_unreadable_is_one_line_as_without_workers(tmp_path, num_workers):
    """With loader workers (as every GPU run has them), a damaged set's ShardFormatError reached the entry points
    with the worker's whole traceback in its message (DataLoader's "Caught ... Original Traceback"), printed as their
    "one line"; it is now the worker's own message, as without workers."""
    root = make_shards(tmp_path / "s", sizes=[5, 6, 7, 8])
    for shard in root.glob("shard-*.tar"):
        shard.unlink()
    config = DataConfig.for_stream(root, micro_batch_size=2, image_size=16, num_workers=num_workers, streams=2)
    with pytest.raises(ShardFormatError) as raised:
        next(iter(TrainStream(config)))
    message = str(raised.value)
    assert "\n" not in message and message.startswith(f"no shard of {root} holds a readable sample")
    assert message.endswith(f"check it with `python -m data_pipeline.validate {root}` and write the folder again")
