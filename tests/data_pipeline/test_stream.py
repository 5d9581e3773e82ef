"""TrainStream / EvalStream over deliberately uneven shards: the training order at every world size and worker
count, resume across world sizes, and evaluation that reads every sample once."""

from __future__ import annotations

import io
import json

import numpy as np
import pyarrow as pa
import pytest
import torch
import webdataset as wds
from PIL import Image

from data_pipeline.manifest import SHARD_PATTERN, write_metadata
from data_pipeline.stream.augment import AugmentConfig, channels_first, to_float_images
from data_pipeline.stream.config import DataConfig
from data_pipeline.stream.eval_stream import EvalStream
from data_pipeline.stream.order import balanced_split, merge_stream_states
from data_pipeline.stream.step_pool import StepPool, check_shared_memory, conversion_rows
from data_pipeline.stream.train_stream import TrainStream
from data_pipeline.write.dedup import sha256_hex
from pretrain.config.train_config import load_config

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
        with open(root / name, "wb") as f, wds.TarWriter(f, encoder=False, mtime=0) as w:
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
    """The training process's global torch and NumPy generators, saved in every checkpoint (`rng_state`): creating
    DataLoaders (at a resume, an epoch rollover) must leave them alone. A DataLoader seeds its workers from torch's
    generator unless given its own.

    Python's `random` is not compared: HTTP clients draw their retry jitter from it (urllib3, gcsfs) on their own
    threads, which other tests in this process may have left retrying, so its state moves under a test that draws
    nothing. That nothing of ours draws from it is read from the source (tests/project/test_global_random.py).
    """
    np_state = np.random.get_state()
    return torch.get_rng_state().tolist(), (np_state[0], np_state[1].tolist(), *np_state[2:])


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


# Training: P = 4 canonical streams, G = 8 (c = 2 per stream), m = 2, so R = 1, 2, 4 run A = 4, 2, 1 micro-batches.
ORDER = dict(
    micro_batch_size=2, global_batch_size=8, streams=4, image_size=16, seed=3, shuffle_buffer=8, record_keys=True
)


def train_stream(location, rank=0, world_size=1, **kw):
    """A rank's stream: ``kw`` are `DataConfig` fields and `TrainStream`'s own arguments."""
    args = {k: kw.pop(k) for k in ("num_classes", "label_format", "record_keys", "prefetch_factor") if k in kw}
    config = DataConfig.for_stream(location, world_size=world_size, **kw)
    return TrainStream(config, rank=rank, world_size=world_size, **args)


def rank_streams(root, world_size, num_workers, **kw):
    return [
        train_stream(root, rank=r, world_size=world_size, num_workers=num_workers, **{**ORDER, **kw})
        for r in range(world_size)
    ]


def global_batches(streams, n):
    """``n`` global batches from one stream per rank: (keys, images, labels) with the ranks' slices in rank order."""
    its = [iter(s) for s in streams]
    out = []
    for _ in range(n):
        keys, xs, ys = [], [], []
        for stream, it in zip(streams, its):
            for _ in range(stream.accumulation_steps):
                x, y = next(it)
                keys += stream.last_keys
                xs.append(x)
                ys.append(y)
        out.append((keys, torch.cat(xs), torch.cat(ys)))
    return out


def merged_state(streams):
    return json.loads(json.dumps(merge_stream_states([s.state_dict() for s in streams])))  # as a checkpoint stores it


def assert_same_batches(got, expected, what):
    assert len(got) == len(expected), what
    for i, ((k1, x1, y1), (k2, x2, y2)) in enumerate(zip(got, expected)):
        assert k1 == k2, (what, i)
        assert torch.equal(x1, x2) and torch.equal(y1, y2), (what, i)


@pytest.mark.timeout(180)
def test_global_order_and_pixels_are_the_same_at_every_world_size_and_worker_count(uneven):
    """1.5 epochs with augmentation and mixup on: the same keys, images and soft labels per global batch whether
    one rank or four read it, in-process or with loader workers, whatever the micro-batch."""
    aug = dict(augment=AugmentConfig(), mixup_alpha=0.4)
    reference = rank_streams(uneven, 1, 0, **aug)
    first, second = reference[0].steps_in_epoch(0), reference[0].steps_in_epoch(1)
    n = first + second // 2
    expected = global_batches(reference, n)
    assert expected[0][2].shape == (8, NUM_CLASSES) and not torch.equal(expected[0][1], expected[1][1])
    # the last one takes micro-batches of 4 that span both workers' parts (the others are views of one part)
    for world_size, num_workers, micro in [(1, 2, 2), (2, 0, 2), (2, 1, 2), (4, 1, 2), (2, 2, 4)]:
        streams = rank_streams(uneven, world_size, num_workers, micro_batch_size=micro, **aug)
        assert streams[0].accumulation_steps == 8 // (world_size * micro)
        assert_same_batches(global_batches(streams, n), expected, (world_size, num_workers, micro))
        state = merged_state(streams)
        assert (state["epoch"], state["step"]) == (1, second // 2)


@pytest.mark.timeout(60)
def test_an_epoch_yields_each_sample_once_and_drops_what_the_manifest_predicts(uneven):
    streams = rank_streams(uneven, 2, 0)
    plan, unused = streams[0].plan, []
    for epoch in range(2):
        steps = streams[0].steps_in_epoch(epoch)
        capacities = plan.capacities(epoch)
        assert steps == min(capacities) // plan.chunk and sum(capacities) == sum(UNEVEN)
        keys = [k for batch in global_batches(streams, steps) for k in batch[0]]
        assert len(keys) == steps * 8 and len(set(keys)) == len(keys)
        unused.append({f"{k:06d}" for k in range(sum(UNEVEN))} - set(keys))
        state = merged_state(streams)
        assert (state["epoch"], state["step"]) == (epoch, steps)
        # counted when each stream starts its epoch: the surplus of every stream over steps x c
        predicted = sum(sum(UNEVEN) - streams[0].steps_in_epoch(e) * 8 for e in range(epoch + 1))
        assert state["stats"]["dropped_samples"] == predicted
        assert "wrapped_samples" not in state["stats"]
    assert unused[0] != unused[1]  # shards are re-dealt every epoch: a different surplus is left out


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "before, after, at",
    [((2, 2), (1, 2), "mid"), ((2, 2), (1, 2), "boundary"), ((1, 2), (4, 2), "mid-second")],
)
def test_resume_at_another_world_size_continues_the_global_order(uneven, before, after, at):
    """Checkpointed at R ranks (W workers each), resumed at another R from the merged state: the global sequence
    (keys and pixels, augmentation on) continues the uninterrupted one, across the next epoch boundary."""
    reference = rank_streams(uneven, 1, 0, augment=AugmentConfig())
    first = reference[0].steps_in_epoch(0)
    k = {"mid": first // 2, "boundary": first, "mid-second": first + 1}[at]
    total = first + reference[0].steps_in_epoch(1) + 1  # into the third epoch
    expected = global_batches(reference, total)
    streams = rank_streams(uneven, *before, augment=AugmentConfig())
    assert_same_batches(global_batches(streams, k), expected[:k], "before")
    state = merged_state(streams)
    resumed = rank_streams(uneven, *after, augment=AugmentConfig())
    for stream in resumed:
        stream.load_state_dict(state)
    assert_same_batches(global_batches(resumed, total - k), expected[k:], "after")
    # the counters carry over once: the merged state of the resumed ranks sums to the uninterrupted run's
    assert merged_state(resumed)["stats"] == merged_state(reference)["stats"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("num_workers", [2, 0])
def test_resume_at_the_same_world_size_is_bit_identical(uneven, num_workers):
    kwargs = dict(
        ORDER,
        rank=1,
        world_size=2,
        num_workers=num_workers,
        seed=5,
        shuffle_buffer=32,
        mixup_alpha=0.4,
        augment=AugmentConfig(randaugment_n=2, randaugment_m=9),
    )
    before = global_rng_states()
    reference = train_stream(uneven, **kwargs)
    A, first = reference.accumulation_steps, reference.steps_in_epoch(0)
    total = first + reference.steps_in_epoch(1) + 3
    states, expected = {}, []
    for i, batch in enumerate(take_iter(reference, total * A)):
        expected.append(batch)
        if (i + 1) % A == 0:
            states[(i + 1) // A] = json.loads(json.dumps(reference.state_dict()))  # as a checkpoint would store it
    assert expected[0][1].shape == (2, NUM_CLASSES)  # mixup gives soft targets
    for k in (2, first, first + 3):  # mid-epoch, exactly at the epoch boundary, and mid second epoch
        resumed = train_stream(uneven, **kwargs)
        resumed.load_state_dict(states[k])
        for i, (x, y) in enumerate(take(resumed, (total - k) * A), start=k * A):
            assert torch.equal(x, expected[i][0]), (k, i)
            assert torch.equal(y, expected[i][1]), (k, i)
    # the DataLoaders above (3 epochs, 3 resumes) drew their workers' seeds from private generators, not the global ones
    assert global_rng_states() == before


def take_iter(stream, n):
    it = iter(stream)
    for _ in range(n):
        yield next(it)


@pytest.mark.timeout(60)
def test_a_stream_rebuilt_at_another_image_size_continues_the_order(uneven):
    """Progressive resolution builds a new stream at the new size and loads the old one's state."""
    expected = [batch[0] for batch in global_batches(rank_streams(uneven, 1, 0), 6)]
    small = rank_streams(uneven, 1, 0)
    assert [b[0] for b in global_batches(small, 3)] == expected[:3]
    large = rank_streams(uneven, 1, 0, image_size=24)
    large[0].load_state_dict(small[0].state_dict())
    batches = global_batches(large, 3)
    assert [b[0] for b in batches] == expected[3:] and batches[0][1].shape == (8, 3, 24, 24)


def test_state_errors_name_the_problem(uneven):
    two = rank_streams(uneven, 2, 0)
    it = iter(two[0])
    next(it)  # 1 of A = 2 micro-batches: no position between optimizer steps
    with pytest.raises(ValueError, match="1 of the 2 micro-batches"):
        two[0].state_dict()
    next(it)
    local = two[0].state_dict()
    assert sorted(local["draws"]) == ["0", "1"] and not {"rank", "world_size", "workers"} & set(local["fingerprint"])
    with pytest.raises(ValueError, match=r"reads streams \[2, 3\]"):  # rank 1 cannot resume from rank 0's streams
        two[1].load_state_dict(local)
    with pytest.raises(ValueError, match=r"no stream state holds streams \[2, 3\]"):
        merge_stream_states([local])
    with pytest.raises(ValueError, match="more than one"):
        merge_stream_states([local, local])
    with pytest.raises(ValueError, match="disagree on step"):
        merge_stream_states([local, two[1].state_dict()])
    with pytest.raises(ValueError, match="predates world-size-invariant streams"):
        two[0].load_state_dict(dict(local, version=1))
    other = train_stream(uneven, **dict(ORDER, shuffle_buffer=4))
    with pytest.raises(ValueError, match="shuffle_buffer"):
        other.load_state_dict(local)


def test_sizes_that_do_not_split_are_clear_errors(uneven, tmp_path):
    with pytest.raises(ValueError, match=r"world_size 3 does not divide streams=4.*\[1, 2, 4\]"):
        train_stream(uneven, **dict(ORDER, global_batch_size=24), rank=0, world_size=3)
    with pytest.raises(ValueError, match="not divisible by streams"):
        train_stream(uneven, **dict(ORDER, streams=3))
    with pytest.raises(ValueError, match="not divisible by world_size 2 x micro_batch_size 8"):
        train_stream(uneven, **dict(ORDER, micro_batch_size=8), world_size=2)
    with pytest.raises(ValueError, match="needs >= 2"):
        train_stream(uneven, **dict(ORDER, streams=8), mixup_alpha=0.2)
    for prefetch in (0, None):
        with pytest.raises(ValueError, match=f"prefetch_factor must be an int >= 1 .*got {prefetch}"):
            train_stream(uneven, **ORDER, num_workers=2, prefetch_factor=prefetch)
    root = make_shards(tmp_path / "small", sizes=[5, 5, 5])
    with pytest.raises(ValueError, match="smaller --samples-per-shard"):
        train_stream(root, **ORDER)


@pytest.mark.timeout(60)
def test_file_url_gives_the_same_batches_as_a_local_path(uneven):
    kwargs = dict(
        micro_batch_size=4, image_size=16, num_workers=0, seed=2, label_format="multihot", augment=AugmentConfig()
    )
    local = take(train_stream(uneven, **kwargs), 3)
    remote = take(train_stream(f"file://{uneven}", **kwargs), 3)
    for (x1, y1), (x2, y2) in zip(local, remote):
        assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert local[0][1].shape == (4, NUM_CLASSES) and set(local[0][1].sum(1).tolist()) == {1.0}
    keys = [
        k for _, _, ks in EvalStream(f"file://{uneven}", batch_size=50, image_size=16, return_keys=True) for k in ks
    ]
    assert len(keys) == sum(UNEVEN)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_forkserver_workers_are_the_default_and_give_the_same_batches_as_fork(uneven):
    """Loader workers start from a fork server unless told otherwise (forking the threaded training process can hang
    the child: docs/reference.md §6); the epoch dataset pickles and yields the batches forked workers give."""
    kwargs = dict(ORDER, num_workers=2, seed=4, augment=AugmentConfig(), mixup_alpha=0.2)
    served = train_stream(uneven, **kwargs)
    assert served.config.loader_start_method == "forkserver"
    assert load_config("local_demo").data.loader_start_method == "forkserver"  # what pretrain.train passes it
    forked = take(train_stream(uneven, loader_start_method="fork", **kwargs), 5)
    for (x1, y1), (x2, y2) in zip(forked, take(served, 5)):
        assert torch.equal(x1, x2) and torch.equal(y1, y2)


def test_step_pool_grants_a_buffer_only_when_no_view_of_it_is_alive():
    pool = StepPool(slots=2, rows=2, image_size=4, workers=1, lookahead=0, shared=True)
    images, scratch = [Image.new("RGB", (4, 4), (v, v, v)) for v in (0, 255)], np.empty((2, 3, 4, 4), np.uint8)
    pool.grant(0)
    slot = pool.slot(0)
    pool.write(0, slot, 0, 0, images, scratch)  # what a worker does
    step0 = pool.take(0, slot)
    assert step0[:, 0, 0, 0].tolist() == [-1.0, 1.0] and step0.is_shared()
    micro = step0[1:]  # a yielded micro-batch still held by the consumer
    pool.grant(1)
    assert pool.slot(1) == 1 - slot
    pool.grant(2)  # one buffer in flight (granted, not taken), the other viewed: none
    assert pool.slot(2) == -1
    with pytest.raises(RuntimeError, match=r"holds steps \[-1\] of the workers' rows, not step 1"):
        pool.take(1, 1 - slot)  # nobody wrote step 1: its stamp says so
    pool.write(1, 1 - slot, 0, 0, images, scratch)
    pool.take(1, 1 - slot)
    kept = micro.view(-1)  # views of views count too
    del micro
    pool.grant(3)
    assert pool.slot(3) == 1 - slot  # taken and never viewed: free again
    del kept
    pool.grant(4)
    assert pool.slot(4) == slot
    with pytest.raises(RuntimeError, match="loader grant for step 2 missing"):
        pool.slot(2)  # the table has moved on: asking for an old step is a bug, never a wrong buffer


def test_a_pool_converts_images_in_groups_of_its_scratch_rows():
    """`StepPool.write` packs and converts `conversion_rows` images at a time (all 32 of a chunk at 32 px, one at 224):
    any group size gives the rows that converting the images one by one gives."""
    assert (conversion_rows(32), conversion_rows(64), conversion_rows(224)) == (42, 10, 1)
    rng = np.random.default_rng(0)
    images = [rng.integers(0, 256, (4, 4, 3), dtype=np.uint8) for _ in range(5)]
    planes = [torch.from_numpy(channels_first([i], np.empty((1, 3, 4, 4), np.uint8))) for i in images]
    one_by_one = torch.cat([to_float_images([p]) for p in planes])
    for group in (1, 2, 5, 8):
        pool = StepPool(slots=1, rows=6, image_size=4, workers=1, lookahead=0, shared=False)
        pool.grant(0)
        pool.write(0, 0, 0, 1, images, np.empty((group, 3, 4, 4), np.uint8))  # rows 1-5 of 6
        assert torch.equal(pool.take(0, 0)[1:], one_by_one), group


@pytest.mark.timeout(120)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_workers_write_into_pooled_buffers_unless_the_consumer_keeps_them(uneven, num_workers):
    """A consumer that drops each micro-batch gets every step from the pool (what a training loop does); one that
    keeps every micro-batch alive gets copies once the pool is used up, with the same pixels."""
    kwargs = dict(ORDER, num_workers=num_workers, augment=AugmentConfig(), mixup_alpha=0.4)
    dropping = train_stream(uneven, **kwargs)
    n = 3 * dropping.steps_in_epoch(0) // 2 * dropping.accumulation_steps  # into the second epoch
    copies = [(x.clone(), y.clone()) for x, y in take_iter(dropping, n)]
    assert dropping.unpooled_steps == 0
    keeping = train_stream(uneven, **kwargs)
    kept = take(keeping, n)
    assert keeping.unpooled_steps > 0
    for (x1, y1), (x2, y2) in zip(copies, kept):
        assert torch.equal(x1, x2) and torch.equal(y1, y2)


def test_a_pool_that_shared_memory_cannot_hold_is_refused_with_the_fixes():
    check_shared_memory(96 * 2**20, 97 * 2**20)
    check_shared_memory(96 * 2**20, None)  # unknown: torch shares memory another way
    with pytest.raises(ValueError, match=r"need 96 MiB of shared memory but /dev/shm has 64 MiB free: .*--shm-size"):
        check_shared_memory(96 * 2**20, 64 * 2**20)
