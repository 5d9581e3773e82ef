"""Deterministic, resumable streams over shard folders, for training (TrainStream) and evaluation (EvalStream).

Training epoch ``e`` on rank ``r`` of ``R``, with ``W`` DataLoader workers:

1. the non-empty shards are put in a permutation seeded by (seed, e) — identical on every rank;
2. walking that order, each shard goes to the rank holding the fewest samples so far (ties: lowest rank), then
   within a rank to the worker holding the fewest — disjoint slices, balanced to within one shard;
3. every rank yields exactly ``batches_per_epoch = floor(N / (R * B))`` batches (``ceil`` with drop_last=False);
   batch ``j`` is made by worker ``j mod W``, so a worker needs a number of samples fixed by the manifest counts.
   A worker whose shards hold more stops early (the surplus is dropped for this epoch, a different surplus each
   epoch); one whose shards hold fewer (or lost samples to corruption) wraps around its own shards. Both are
   counted in ``stream.stats`` (``dropped_samples`` / ``wrapped_samples`` are the per-epoch plan);
4. a worker reads its shards with webdataset's tar iteration, through a seeded shuffle buffer, then decodes.

Exact resume: every random choice is a pure function of the position — the shuffle buffer of worker ``l`` is
seeded by (seed, e, r, l), the augmentation of a sample by (seed, e, shard, member, repeat), mixup by
(seed, e, r, j). Each batch carries how many buffer draws its worker has made; ``state_dict()`` records
(epoch, batches done, draws per worker) and a resumed worker replays its draws without decoding them.
Resume needs the same seed, world size, rank, num_workers and batch size (checked). Creating a stream's
DataLoader never draws from the global RNGs (its workers' base seed comes from a generator of its own), so
iterating, resuming or rolling over an epoch leaves the training process's random state as it was.
"""

from __future__ import annotations

import heapq
import logging
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from data_pipeline.augment import AugmentConfig, decode_eval, decode_train, mixup, to_float_images
from data_pipeline.manifest import DatasetInfo, ShardFormatError, read_dataset_info
from data_pipeline.shards import read_shard

log = logging.getLogger(__name__)

DECODE_ERRORS = (OSError, ValueError, SyntaxError, Image.DecompressionBombError)
STATE_VERSION = 1


def balanced_split(order: list[int], counts: list[int], parts: int) -> list[list[int]]:
    """Deal items (in ``order``) to ``parts`` bins, each to the bin with the smallest total so far (ties: lowest bin).

    A heap of (total, bin) gives the same choice as scanning every bin, in O(log parts) per item: 4,700 shards over
    512 ranks is milliseconds, not seconds.
    """
    bins: list[list[int]] = [[] for _ in range(parts)]
    heap = [(0, b) for b in range(parts)]  # already a heap: sorted
    for item in order:
        total, k = heap[0]
        bins[k].append(item)
        heapq.heapreplace(heap, (total + counts[item], k))
    return bins


def _loader_generator(*key: int) -> torch.Generator:
    """A private generator for a DataLoader, seeded by ``key``: each (re)created multi-process iterator draws its
    workers' base seed from it.

    Without one, that draw comes from the *global* torch generator, the one dropout uses, so creating the loader at
    a resume, an epoch rollover or a resolution switch would shift the model's random stream. The workers seed every
    choice they make by position (module docstring), so the base seed only has to be reproducible, never random.
    """
    return torch.Generator().manual_seed(int(np.random.SeedSequence(list(key)).generate_state(1, np.uint64)[0]))


def _as_info(source) -> DatasetInfo:
    return source if isinstance(source, DatasetInfo) else read_dataset_info(source)


@dataclass(frozen=True)
class _TrainPlan:
    """Everything a worker process needs (picklable, so forkserver/spawn contexts work)."""

    info: DatasetInfo
    batch_size: int
    image_size: int
    rank: int
    world_size: int
    workers: int  # logical workers: max(1, num_workers)
    seed: int
    shuffle_buffer: int
    augment: AugmentConfig | None
    mixup_alpha: float
    label_format: str
    num_classes: int
    batches_per_epoch: int

    def worker_shards(self, epoch: int, logical: int) -> list[int]:
        live = [i for i, c in enumerate(self.info.shard_counts) if c > 0]
        order = [live[i] for i in np.random.default_rng([self.seed, epoch]).permutation(len(live))]
        counts = self.info.shard_counts
        mine = balanced_split(order, counts, self.world_size)[self.rank]
        return balanced_split(mine, counts, self.workers)[logical]

    def worker_batches(self, logical: int) -> range:
        return range(logical, self.batches_per_epoch, self.workers)


def _shuffled(items: Iterator, size: int, rng: np.random.Generator) -> Iterator:
    """Seeded shuffle buffer over an endless iterator."""
    if size <= 1:
        yield from items
        return
    buffer = []
    for item in items:
        if len(buffer) < size:
            buffer.append(item)
            continue
        k = int(rng.integers(size))
        yield buffer[k]
        buffer[k] = item


def _cycle_shards(plan: _TrainPlan, shards: list[int], stats: Counter) -> Iterator[tuple]:
    """Endless (shard, member, repeat, sample) over a worker's shards; repeat counts wrap-arounds."""
    repeat = 0
    while True:
        seen = 0
        for s in shards:
            shard = plan.info.shards[s]
            for member, sample in enumerate(read_shard(shard.url, shard.samples, stats)):
                seen += 1
                yield s, member, repeat, sample
        if seen == 0:
            raise ShardFormatError(f"shards {[plan.info.shards[s].url for s in shards]} hold no readable sample")
        repeat += 1


class _TrainEpoch(IterableDataset):
    """One epoch of one rank, started at batch ``start`` with ``draws[l]`` buffer draws already made by worker l."""

    def __init__(self, plan: _TrainPlan, epoch: int, start: int, draws: tuple[int, ...]):
        self.plan, self.epoch, self.start, self.draws = plan, epoch, start, draws

    def __iter__(self):
        info = get_worker_info()
        if info is None:  # in-process: interleave the logical workers exactly as the DataLoader would
            gens = [self._logical(l) for l in self._rotation()]
            while gens:
                for g in list(gens):
                    try:
                        yield next(g)
                    except StopIteration:
                        gens.remove(g)
        else:
            yield from self._logical(self._rotation()[info.id])

    def _rotation(self) -> list[int]:
        # The DataLoader asks worker 0 first; rotating makes it play the worker that owns batch ``start``.
        return [(p + self.start) % self.plan.workers for p in range(self.plan.workers)]

    def _logical(self, logical: int):
        plan, epoch = self.plan, self.epoch
        batches = [j for j in plan.worker_batches(logical) if j >= self.start]
        if not batches:
            return
        shards = plan.worker_shards(epoch, logical)
        stats: Counter = Counter()
        capacity = sum(plan.info.shards[s].samples for s in shards)
        buffer_rng = np.random.default_rng([plan.seed, epoch, plan.rank, logical, 1])
        draws_iter = _shuffled(_cycle_shards(plan, shards, stats), min(plan.shuffle_buffer, capacity), buffer_rng)
        draws = self.draws[logical]
        for _ in range(draws):  # resume: replay the buffer without decoding
            next(draws_iter)
        if self.start == 0:
            needed = len(plan.worker_batches(logical)) * plan.batch_size
            stats["wrapped_samples"] += max(0, needed - capacity)
            stats["dropped_samples"] += max(0, capacity - needed)
        else:
            stats.clear()  # counts from the replayed part were reported before the interruption
        failures_in_row = 0
        for j in batches:
            images, labels = [], []
            while len(images) < plan.batch_size:
                if failures_in_row > 2 * capacity + 10:  # a whole pass and more without one usable sample
                    urls = [plan.info.shards[s].url for s in shards]
                    raise ShardFormatError(f"no usable sample in {urls}: {dict(stats)}; run data_pipeline.validate")
                s, member, repeat, sample = next(draws_iter)
                draws += 1
                failures_in_row += 1
                label = _label(sample, plan.info.num_classes, stats)
                if label is None:
                    continue
                rng = np.random.default_rng([plan.seed, epoch, s, member, repeat])
                try:
                    images.append(decode_train(sample["jpg"], plan.image_size, plan.augment, rng))
                except DECODE_ERRORS:
                    stats["corrupt_samples"] += 1
                    continue
                labels.append(label)
                failures_in_row = 0
            x, y = _collate(images, labels, plan, np.random.default_rng([plan.seed, epoch, plan.rank, j, 2]))
            meta = dict(epoch=epoch, batch=j, logical=logical, draws=draws, stats=dict(stats))
            stats.clear()
            yield x, y, meta


def _label(sample: dict, num_classes: int, stats: Counter) -> int | None:
    if "jpg" not in sample or "cls" not in sample:
        stats["incomplete_samples"] += 1
        return None
    try:
        label = int(sample["cls"])
    except ValueError:
        stats["bad_labels"] += 1
        return None
    if not 0 <= label < num_classes:
        stats["label_out_of_range"] += 1
        return None
    return label


def _collate(images: list, labels: list[int], plan: _TrainPlan, rng: np.random.Generator):
    x = to_float_images(np.stack(images))  # (B, 3, S, S)
    y = torch.tensor(labels, dtype=torch.int64)  # (B,)
    if plan.label_format == "multihot" or plan.mixup_alpha > 0:
        y = torch.nn.functional.one_hot(y, plan.num_classes).float()  # (B, K)
    if plan.mixup_alpha > 0:
        x, y, _ = mixup(x, y, plan.mixup_alpha, rng)
    return x, y


class TrainStream:
    """Endless iterable of (images float32 (B, 3, S, S) in [-1, 1], labels) over a shard folder.

    Labels are int64 (B,) with ``label_format="int"``, float32 (B, K) with ``"multihot"`` (for sigmoid losses);
    with ``mixup_alpha > 0`` they are always float32 (B, K) soft targets. See the module docstring for the order,
    the per-rank balance and the resume contract. ``stats`` counts skipped, truncated, dropped and wrapped samples.
    """

    def __init__(
        self,
        source,
        *,
        batch_size: int,
        image_size: int,
        rank: int = 0,
        world_size: int = 1,
        num_workers: int = 0,
        seed: int = 0,
        shuffle_buffer: int = 1000,
        augment: AugmentConfig | None = None,
        mixup_alpha: float = 0.0,
        label_format: str = "int",
        num_classes: int | None = None,
        drop_last: bool = True,
        multiprocessing_context: str | None = "fork",
        prefetch_factor: int = 2,
    ):
        info = _as_info(source)
        if batch_size < 1 or image_size < 1:
            raise ValueError(f"batch_size and image_size must be >= 1, got {batch_size} and {image_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}")
        if label_format not in ("int", "multihot"):
            raise ValueError(f"label_format must be 'int' or 'multihot', got {label_format!r}")
        if mixup_alpha < 0:
            raise ValueError(f"mixup_alpha must be >= 0, got {mixup_alpha}")
        num_classes = info.num_classes if num_classes is None else num_classes
        if num_classes < info.num_classes:
            raise ValueError(
                f"num_classes={num_classes} but {info.root} has {info.num_classes} classes; "
                "pass num_classes >= the dataset's (or leave it None)"
            )
        if augment is not None:
            augment.validate()
        workers = max(1, num_workers)
        live = sum(1 for c in info.shard_counts if c > 0)
        if live < world_size * workers:
            raise ValueError(
                f"{info.root} has {live} shards but world_size x num_workers = {world_size * workers} readers need "
                "one each; rewrite it with a smaller --samples-per-shard or use fewer DataLoader workers"
            )
        per_rank = info.num_samples / (world_size * batch_size)
        batches = int(per_rank) if drop_last else int(np.ceil(per_rank))
        if batches < 1:
            raise ValueError(
                f"{info.root} has {info.num_samples} samples, fewer than one batch of {batch_size} per "
                f"rank for {world_size} ranks; lower batch_size"
            )
        self.plan = _TrainPlan(
            info,
            batch_size,
            image_size,
            rank,
            world_size,
            workers,
            seed,
            shuffle_buffer,
            augment,
            float(mixup_alpha),
            label_format,
            num_classes,
            batches,
        )
        self.num_workers = num_workers
        self.multiprocessing_context = multiprocessing_context if num_workers > 0 else None
        self.prefetch_factor = prefetch_factor
        self.stats: Counter = Counter()
        self._epoch, self._batch, self._draws = 0, 0, [0] * workers

    @property
    def batches_per_epoch(self) -> int:
        return self.plan.batches_per_epoch

    @property
    def info(self) -> DatasetInfo:
        return self.plan.info

    def _fingerprint(self) -> dict:
        p = self.plan
        return dict(
            seed=p.seed,
            rank=p.rank,
            world_size=p.world_size,
            workers=p.workers,
            batch_size=p.batch_size,
            shuffle_buffer=p.shuffle_buffer,
            num_samples=p.info.num_samples,
            num_shards=len(p.info.shards),
        )

    def state_dict(self) -> dict:
        """Position after the batches yielded so far (plain ints: JSON-serialisable)."""
        return dict(
            version=STATE_VERSION,
            epoch=self._epoch,
            batch=self._batch,
            draws=list(self._draws),
            stats=dict(self.stats),
            fingerprint=self._fingerprint(),
        )

    def load_state_dict(self, state: dict) -> None:
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"stream state version {state.get('version')} is not {STATE_VERSION}")
        saved, now = state["fingerprint"], self._fingerprint()
        diff = {k: (saved.get(k), v) for k, v in now.items() if saved.get(k) != v}
        if diff:
            raise ValueError(
                f"stream state does not match this stream (saved, now): {diff}; resume with the same "
                "data, seed, world size, rank, num_workers, batch size and shuffle buffer"
            )
        self._epoch, self._batch, self._draws = int(state["epoch"]), int(state["batch"]), list(state["draws"])
        self.stats = Counter(state.get("stats", {}))

    def __iter__(self):
        while True:
            if self._batch >= self.batches_per_epoch:
                self._epoch, self._batch, self._draws = self._epoch + 1, 0, [0] * self.plan.workers
            epoch = _TrainEpoch(self.plan, self._epoch, self._batch, tuple(self._draws))
            if self.num_workers == 0:
                batches = iter(epoch)
            else:
                batches = iter(
                    DataLoader(
                        epoch,
                        batch_size=None,
                        num_workers=self.num_workers,
                        multiprocessing_context=self.multiprocessing_context,
                        prefetch_factor=self.prefetch_factor,
                        generator=_loader_generator(self.plan.seed, self._epoch, self.plan.rank, self._batch),
                    )
                )
            for x, y, meta in batches:
                assert meta["batch"] == self._batch and meta["epoch"] == self._epoch, (meta, self._batch)
                self._batch += 1
                self._draws[meta["logical"]] = meta["draws"]
                self.stats.update(meta["stats"])
                yield x, y
            if self._batch < self.batches_per_epoch:  # the workers ended early: never silently shorten an epoch
                raise RuntimeError(f"epoch {self._epoch} ended after {self._batch} of {self.batches_per_epoch} batches")


class _EvalShards(IterableDataset):
    def __init__(
        self,
        info: DatasetInfo,
        slices: list[list[int]],
        batch_size: int,
        image_size: int,
        resize_size: int | None,
        return_keys: bool,
    ):
        self.info, self.slices, self.batch_size = info, slices, batch_size
        self.image_size, self.resize_size, self.return_keys = image_size, resize_size, return_keys

    def __iter__(self):
        info = get_worker_info()
        worker = 0 if info is None else info.id
        stats: Counter = Counter()
        images, labels, keys = [], [], []
        for s in self.slices[worker]:
            shard = self.info.shards[s]
            for sample in read_shard(shard.url, shard.samples, stats):
                label = _label(sample, self.info.num_classes, stats)
                if label is None:
                    continue
                try:
                    images.append(decode_eval(sample["jpg"], self.image_size, self.resize_size))
                except DECODE_ERRORS:
                    stats["corrupt_samples"] += 1
                    continue
                labels.append(label)
                keys.append(sample["__key__"])
                if len(images) == self.batch_size:
                    yield self._batch(images, labels, keys, stats)
                    images, labels, keys = [], [], []
        if images or stats:  # the last partial batch is kept; an empty one still carries the counters
            yield self._batch(images, labels, keys, stats)

    def _batch(self, images, labels, keys, stats):
        shape = (0, self.image_size, self.image_size, 3)
        x = to_float_images(np.stack(images) if images else np.zeros(shape, np.uint8))
        out = (x, torch.tensor(labels, dtype=torch.int64), list(keys), dict(stats))
        stats.clear()
        return out


class EvalStream:
    """Every sample of a split exactly once across all ranks, in batches (the last one partial), no augmentation.

    Shards are dealt to ranks and then workers by the same balanced split as training, in manifest order. Ranks may
    get different batch counts (evaluation needs no lockstep). ``num_samples`` is this rank's share by the
    manifest; ``stats`` counts what could not be read. With ``return_keys=True`` batches are (images, labels, keys).
    """

    def __init__(
        self,
        source,
        *,
        batch_size: int,
        image_size: int,
        resize_size: int | None = None,
        rank: int = 0,
        world_size: int = 1,
        num_workers: int = 0,
        return_keys: bool = False,
        multiprocessing_context: str | None = "fork",
    ):
        info = _as_info(source)
        if batch_size < 1 or image_size < 1:
            raise ValueError(f"batch_size and image_size must be >= 1, got {batch_size} and {image_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}")
        if resize_size is not None and resize_size < image_size:
            raise ValueError(f"resize_size {resize_size} must be >= image_size {image_size}")
        self.info = info
        counts = info.shard_counts
        mine = balanced_split(list(range(len(counts))), counts, world_size)[rank]
        self._slices = balanced_split(mine, counts, max(1, num_workers))
        self.num_samples = sum(counts[s] for s in mine)
        self._dataset = _EvalShards(info, self._slices, batch_size, image_size, resize_size, return_keys)
        self.num_workers, self.return_keys = num_workers, return_keys
        self.multiprocessing_context = multiprocessing_context if num_workers > 0 else None
        self.stats: Counter = Counter()

    def __iter__(self):
        if self.num_workers == 0:
            batches = iter(self._dataset)
        else:
            batches = iter(
                DataLoader(
                    self._dataset,
                    batch_size=None,
                    num_workers=self.num_workers,
                    multiprocessing_context=self.multiprocessing_context,
                    generator=_loader_generator(0),  # evaluation draws nothing: any fixed seed will do
                )
            )
        for x, y, keys, stats in batches:
            self.stats.update(stats)
            if len(y) == 0:
                continue
            yield (x, y, keys) if self.return_keys else (x, y)
