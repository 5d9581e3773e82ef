"""TrainStream / EvalStream over deliberately uneven shards, 2 ranks x 2 DataLoader workers."""

from __future__ import annotations

import io
import json
import random

import numpy as np
import pyarrow as pa
import pytest
import torch
import webdataset as wds
from PIL import Image

from data_pipeline.augment import AugmentConfig
from data_pipeline.dedup import sha256_hex
from data_pipeline.manifest import SHARD_PATTERN, write_metadata
from data_pipeline.stream import EvalStream, TrainStream, balanced_split

UNEVEN = [3, 17, 5, 40, 9, 1, 22, 11, 7, 13]  # 128 samples in 10 shards of very different sizes
NUM_CLASSES = 4


def jpeg_bytes(index: int, size: tuple[int, int] = (24, 20)) -> bytes:
    rng = np.random.default_rng(index)
    pixels = rng.integers(0, 256, size=(size[1], size[0], 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="JPEG", quality=90)
    return out.getvalue()


def make_shards(root, sizes=UNEVEN, num_classes=NUM_CLASSES, member=None):
    """Write a shard folder with the given shard sizes; ``member(key, index) -> dict`` may alter samples."""
    root.mkdir(parents=True, exist_ok=True)
    rows, keys, k = [], [], 0
    for s, n in enumerate(sizes):
        name = SHARD_PATTERN.format(index=s)
        with open(root / name, "wb") as f, wds.TarWriter(f, encoder=False, mtime=0.0) as w:
            for _ in range(n):
                key = f"{k:06d}"
                sample = {"__key__": key, "jpg": jpeg_bytes(k), "cls": str(k % num_classes).encode()}
                if member is not None:
                    sample = member(key, k, sample)
                w.write(sample)
                keys.append(key)
                k += 1
        data = (root / name).read_bytes()
        rows.append(dict(url=name, samples=n, bytes=len(data), sha256=sha256_hex(data)))
    names = [f"class_{c}" for c in range(num_classes)]
    write_metadata(
        root,
        shards=rows,
        samples=pa.table({"key": keys}),
        class_names=names,
        dataset=dict(name="uneven", split="train"),
    )
    return root


@pytest.fixture(scope="module")
def uneven(tmp_path_factory):
    return make_shards(tmp_path_factory.mktemp("uneven") / "train")


def take(stream, n):
    it = iter(stream)
    return [next(it) for _ in range(n)]


def global_rng_states() -> tuple:
    """The training process's global generators: the model's dropout and other libraries draw from them, so
    creating DataLoaders (at a resume, an epoch rollover) must leave them alone."""
    np_state = np.random.get_state()
    return torch.get_rng_state().tolist(), random.getstate(), (np_state[0], np_state[1].tolist(), *np_state[2:])


@pytest.mark.timeout(60)
def test_eval_every_sample_exactly_once_across_ranks_and_workers(uneven):
    before = global_rng_states()
    seen = []
    for rank in range(2):
        stream = EvalStream(
            uneven, batch_size=8, image_size=16, rank=rank, world_size=2, num_workers=2, return_keys=True
        )
        batches = list(stream)
        assert sum(len(b[1]) for b in batches) == stream.num_samples
        assert all(b[0].shape[1:] == (3, 16, 16) for b in batches)
        assert any(len(b[1]) < 8 for b in batches)  # partial last batches are kept, not dropped
        seen += [k for b in batches for k in b[2]]
    assert len(seen) == sum(UNEVEN) and len(set(seen)) == sum(UNEVEN)
    assert global_rng_states() == before  # the worker processes' seeds came from a private generator


@pytest.mark.timeout(90)
def test_train_ranks_take_equal_batches_from_disjoint_shards(uneven):
    streams = [
        TrainStream(
            uneven,
            batch_size=4,
            image_size=16,
            rank=r,
            world_size=2,
            num_workers=2,
            seed=3,
            shuffle_buffer=16,
            augment=AugmentConfig(),
        )
        for r in range(2)
    ]
    assert streams[0].batches_per_epoch == streams[1].batches_per_epoch == 128 // (2 * 4)
    for stream in streams:
        batches = take(stream, stream.batches_per_epoch)
        assert all(x.shape == (4, 3, 16, 16) and y.shape == (4,) for x, y in batches)
        assert all(x.min() >= -1 and x.max() <= 1 for x, _ in batches)
        assert stream.state_dict()["epoch"] == 0 and stream.state_dict()["batch"] == stream.batches_per_epoch
        assert stream.stats["wrapped_samples"] + stream.stats["dropped_samples"] > 0  # uneven: said, not hidden
    for epoch in range(3):  # every (rank, worker) slice is disjoint and together they cover every shard
        plan = streams[0].plan
        slices = [
            sorted(
                TrainStream(
                    uneven, batch_size=4, image_size=16, rank=r, world_size=2, num_workers=2, seed=3
                ).plan.worker_shards(epoch, w)
            )
            for r in range(2)
            for w in range(2)
        ]
        flat = [s for sl in slices for s in sl]
        assert sorted(flat) == list(range(len(UNEVEN))) and all(slices)
        assert sorted(plan.worker_shards(epoch, 0)) == slices[0]


def test_shard_order_changes_every_epoch_and_is_shared_by_ranks(uneven):
    plans = [
        TrainStream(uneven, batch_size=4, image_size=16, rank=r, world_size=2, num_workers=2, seed=3).plan
        for r in range(2)
    ]
    orders = [tuple(plans[0].worker_shards(e, 0)) for e in range(4)]
    assert len(set(orders)) > 1
    # both ranks compute the same global assignment, so rank 1's slice is the complement of rank 0's
    for e in range(4):
        r0 = set(plans[0].worker_shards(e, 0)) | set(plans[0].worker_shards(e, 1))
        r1 = set(plans[1].worker_shards(e, 0)) | set(plans[1].worker_shards(e, 1))
        assert not r0 & r1 and len(r0 | r1) == len(UNEVEN)


def test_balanced_split_is_greedy_and_deterministic():
    bins = balanced_split([0, 1, 2, 3], [10, 1, 1, 1], 2)
    assert bins == [[0], [1, 2, 3]]


def test_balanced_split_deals_exactly_as_the_bin_by_bin_scan():
    """The heap must reproduce the original rule (fewest samples so far, ties to the lowest bin) item for item:
    the shard order of every rank, hence every loss, depends on it."""

    def scan(order, counts, parts):
        bins, totals = [[] for _ in range(parts)], [0] * parts
        for item in order:
            k = min(range(parts), key=lambda b: (totals[b], b))
            bins[k].append(item)
            totals[k] += counts[item]
        return bins

    rng = np.random.default_rng(0)
    for _ in range(200):
        n, parts = int(rng.integers(0, 80)), int(rng.integers(1, 12))
        counts = [int(c) for c in rng.choice([0, 1, 2, 3, 7, 3020, 3021], n)]  # many ties, zero-sample shards
        order = [int(i) for i in rng.permutation(n)]
        assert balanced_split(order, counts, parts) == scan(order, counts, parts)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("num_workers", [2, 0])
def test_resume_after_k_batches_is_bit_identical(uneven, num_workers):
    kwargs = dict(
        batch_size=4,
        image_size=16,
        rank=1,
        world_size=2,
        num_workers=num_workers,
        seed=5,
        shuffle_buffer=32,
        mixup_alpha=0.4,
        augment=AugmentConfig(randaugment_n=2, randaugment_m=9),
    )
    before = global_rng_states()
    reference = TrainStream(uneven, **kwargs)
    bpe = reference.batches_per_epoch
    total = 2 * bpe + 3
    states, expected = {}, []
    for i, batch in enumerate(take_iter(reference, total)):
        expected.append(batch)
        states[i + 1] = json.loads(json.dumps(reference.state_dict()))  # as a checkpoint would store it
    assert expected[0][1].shape == (4, NUM_CLASSES)  # mixup gives soft targets
    assert not torch.equal(expected[0][0], expected[bpe][0])
    for k in (5, bpe, bpe + 3):  # mid-epoch, exactly at the epoch boundary, and mid second epoch
        resumed = TrainStream(uneven, **kwargs)
        resumed.load_state_dict(states[k])
        for i, (x, y) in enumerate(take(resumed, total - k), start=k):
            assert torch.equal(x, expected[i][0]), (k, i)
            assert torch.equal(y, expected[i][1]), (k, i)
    # the DataLoaders above (3 epochs, 3 resumes) drew their workers' seeds from private generators, not the global ones
    assert global_rng_states() == before


def take_iter(stream, n):
    it = iter(stream)
    for _ in range(n):
        yield next(it)


def test_load_state_dict_refuses_another_configuration(uneven):
    a = TrainStream(uneven, batch_size=4, image_size=16, rank=0, world_size=2, num_workers=2, seed=1)
    b = TrainStream(uneven, batch_size=4, image_size=16, rank=0, world_size=2, num_workers=1, seed=1)
    with pytest.raises(ValueError, match="workers"):
        b.load_state_dict(a.state_dict())


@pytest.mark.timeout(60)
def test_file_url_gives_the_same_batches_as_a_local_path(uneven):
    kwargs = dict(batch_size=4, image_size=16, num_workers=0, seed=2, label_format="multihot", augment=AugmentConfig())
    local = take(TrainStream(uneven, **kwargs), 3)
    remote = take(TrainStream(f"file://{uneven}", **kwargs), 3)
    for (x1, y1), (x2, y2) in zip(local, remote):
        assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert local[0][1].shape == (4, NUM_CLASSES) and set(local[0][1].sum(1).tolist()) == {1.0}
    keys = [
        k for _, _, ks in EvalStream(f"file://{uneven}", batch_size=50, image_size=16, return_keys=True) for k in ks
    ]
    assert len(keys) == sum(UNEVEN)


def test_too_few_shards_for_the_readers_is_a_clear_error(tmp_path):
    root = make_shards(tmp_path / "small", sizes=[5, 5, 5])
    with pytest.raises(ValueError, match="smaller --samples-per-shard"):
        TrainStream(root, batch_size=2, image_size=16, world_size=2, num_workers=2)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_forkserver_workers_give_the_same_batches_as_fork(uneven):
    """The context recommended inside Ray actors: the epoch dataset pickles and yields identical batches."""
    kwargs = dict(batch_size=4, image_size=16, num_workers=2, seed=4, augment=AugmentConfig(), mixup_alpha=0.2)
    forked = take(TrainStream(uneven, **kwargs), 5)
    served = take(TrainStream(uneven, multiprocessing_context="forkserver", **kwargs), 5)
    for (x1, y1), (x2, y2) in zip(forked, served):
        assert torch.equal(x1, x2) and torch.equal(y1, y2)
