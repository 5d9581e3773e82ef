"""Deterministic, resumable streams over shard folders, for training (TrainStream) and evaluation (EvalStream).

Training order (docs/elastic.md, "Data order"). Notation: G global batch, m micro-batch, P canonical streams,
R ranks, W DataLoader workers per rank, c = G / P, A = G / (R * m) accumulation steps.

1. Epoch ``e``: the non-empty shards are permuted by (seed, e) and dealt to the P streams by ``balanced_split``.
   Nothing here depends on R or W.
2. A stream reads its shards one after the other (sequential tar reads, no random access) through a shuffle
   buffer of its own seeded by (seed, e, stream). When its shards are exhausted the buffer drains before anything
   is read again, so a stream never yields a sample twice in an epoch unless damage forced it to wrap (counted).
3. Global batch ``b`` = c consecutive usable samples of every stream, concatenated in stream order. An epoch has
   ``steps_in_epoch(e) = min over streams of floor(manifest samples / c)`` global batches; each stream's surplus
   is dropped for that epoch (a different surplus each epoch; counted in ``stats["dropped_samples"]``).
4. Rank r owns streams [r P/R, (r+1) P/R): samples [r G/R, (r+1) G/R) of every global batch, which it yields as A
   micro-batches of m, i.e. global micro-batches [r A, (r+1) A). Its W workers split its streams into min(W, P/R)
   contiguous groups; each worker yields one item per global batch (its streams' chunks), so the DataLoader's
   round-robin returns them in stream order. Each worker converts its rows to float straight into the step's
   buffer in shared memory and hands over only the buffer's number (``_StepPool``, ``_step_batch``).

Exact resume at any R and W: every random choice is a pure function of the position. The augmentation of a sample
is seeded by (seed, e, shard, member, repeat), mixup (applied within each stream's chunk of c) by
(seed, e, stream, b). The position is (epoch, global batches done, buffer draws of each stream);
``state_dict()`` holds this rank's streams, ``merge_stream_states`` joins the ranks' states into the global
position, and a stream at another world size loads it and replays its streams' draws without decoding them.
Creating a DataLoader never draws from the global RNGs (its workers' base seed comes from a generator of its own),
so iterating, resuming or rolling over an epoch leaves the training process's random state as it was.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import multiprocessing
import shutil
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from data_pipeline.augment import (
    AugmentConfig,
    channels_first,
    decode_eval_image,
    decode_train_image,
    mixup,
    to_float_images,
)
from data_pipeline.manifest import DatasetInfo, ShardFormatError, read_dataset_info
from data_pipeline.shards import read_shard

log = logging.getLogger(__name__)

DECODE_ERRORS = (OSError, ValueError, SyntaxError, Image.DecompressionBombError)
STATE_VERSION = 2  # 1: per-rank streams (before issue #14); its positions mean nothing in the canonical streams
# Seed keys of the buffers and of mixup: 6 words ending in a tag, so they differ from the 5-word augmentation keys
# (seed, e, shard, member, repeat) and from each other. The tags are nonzero because numpy's SeedSequence reads a
# trailing 0 as no word at all in short keys.
_BUFFER_TAG, _MIXUP_TAG = 1, 2
_clamp_warned: set = set()
PREFETCH_FACTOR = 2  # TrainStream's default: items each loader worker may have ready ahead of the training process


def step_slots(num_workers: int, prefetch_factor: int = PREFETCH_FACTOR) -> int:
    """Float step buffers in a rank's ``_StepPool``. With loader workers: the ``prefetch_factor`` steps the workers
    may be writing ahead, the step being handed over, the step before it (the consumer's loop variable still holds
    its last micro-batch while it asks for the next) and one spare for a consumer that keeps a step a little
    longer. Without: the last three of those."""
    return prefetch_factor + 3 if num_workers > 0 else 3


def step_pool_bytes(images_per_step: int, image_size: int, num_workers: int, prefetch_factor: int = PREFETCH_FACTOR):
    """Bytes of a rank's ``_StepPool``, in shared memory with loader workers; ``images_per_step`` is the rank's share
    of a global batch, G / R."""
    return step_slots(num_workers, prefetch_factor) * images_per_step * 3 * image_size**2 * 4


def decoded_bytes(images_per_step: int, image_size: int, num_workers: int, prefetch_factor: int = PREFETCH_FACTOR):
    """Host bytes of one rank's decoded images: its step pool and each worker's uint8 planes of one image."""
    return step_pool_bytes(images_per_step, image_size, num_workers, prefetch_factor) + num_workers * 3 * image_size**2


def check_shared_memory(needed: int, free: int | None, where: str = "/dev/shm") -> None:
    """Refuse a step pool that ``where`` cannot hold (``free`` bytes; None: unknown), naming the fixes. Past a full
    ``/dev/shm`` a loader worker dies of SIGBUS mid-write instead of raising, and Docker gives containers 64 MB."""
    if free is not None and needed > free:
        raise ValueError(
            f"the loader's step buffers need {needed / 2**20:.0f} MiB of shared memory but {where} has "
            f"{free / 2**20:.0f} MiB free: give it more (docker run --shm-size=..., a memory-backed emptyDir on "
            "/dev/shm in Kubernetes), or lower the per-rank batch (global batch / world size) or the image size, or "
            "set data.num_workers=0 (no shared memory)"
        )


def _shm_free(where: str = "/dev/shm") -> int | None:
    try:
        return shutil.disk_usage(where).free
    except OSError:  # no /dev/shm: not Linux, where torch shares memory another way
        return None


def balanced_split(order: list[int], counts: list[int], parts: int) -> list[list[int]]:
    """Deal items (in ``order``) to ``parts`` bins, each to the bin with the smallest total so far (ties: lowest bin).

    A heap of (total, bin) gives the same choice as scanning every bin, in O(log parts) per item: 4,700 shards over
    512 streams is milliseconds, not seconds.
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
    micro_batch: int  # m
    global_batch: int  # G
    streams: int  # P
    image_size: int
    rank: int
    world_size: int
    workers: int  # logical workers of this rank: min(max(1, num_workers), P / R)
    seed: int
    shuffle_buffer: int
    augment: AugmentConfig | None
    mixup_alpha: float
    label_format: str
    num_classes: int
    record_keys: bool

    @property
    def chunk(self) -> int:
        """c: samples each stream gives every global batch."""
        return self.global_batch // self.streams

    @property
    def accumulation(self) -> int:
        """A: micro-batches of this rank per global batch."""
        return self.global_batch // (self.world_size * self.micro_batch)

    @property
    def rank_streams(self) -> range:
        per_rank = self.streams // self.world_size
        return range(self.rank * per_rank, (self.rank + 1) * per_rank)

    def worker_streams(self, logical: int) -> list[int]:
        """The contiguous group of this rank's streams that logical worker ``logical`` reads."""
        mine = self.rank_streams
        return list(mine[logical * len(mine) // self.workers : (logical + 1) * len(mine) // self.workers])

    def stream_shards(self, epoch: int) -> list[list[int]]:
        """Shard indices of every stream in ``epoch``, in reading order (the same at every R and W)."""
        live = [i for i, c in enumerate(self.info.shard_counts) if c > 0]
        order = [live[i] for i in np.random.default_rng([self.seed, epoch]).permutation(len(live))]
        return balanced_split(order, self.info.shard_counts, self.streams)

    def capacities(self, epoch: int) -> list[int]:
        counts = self.info.shard_counts
        return [sum(counts[s] for s in shards) for shards in self.stream_shards(epoch)]

    def steps_in_epoch(self, epoch: int) -> int:
        return min(self.capacities(epoch)) // self.chunk


def _shuffled(items: Iterator, size: int, rng: np.random.Generator) -> Iterator:
    """Seeded shuffle buffer over a finite iterator; at its end the buffer drains in a seeded random order."""
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
    for k in rng.permutation(len(buffer)):
        yield buffer[k]


def _stream_draws(plan: _TrainPlan, shards: list[int], stats: Counter, rng: np.random.Generator) -> Iterator[tuple]:
    """Endless buffer draws (shard, member, repeat, sample) of one stream; ``repeat`` counts passes over its shards.

    Each pass goes through the buffer and drains it before the next starts, so pass 1 (reached only when damage
    left fewer usable samples than the manifest promised) never mixes with pass 0.
    """
    size = min(plan.shuffle_buffer, sum(plan.info.shards[s].samples for s in shards))

    def one_pass(repeat: int) -> Iterator[tuple]:
        for s in shards:
            shard = plan.info.shards[s]
            for member, sample in enumerate(read_shard(shard.url, shard.samples, stats)):
                yield s, member, repeat, sample

    for repeat in itertools.count():
        seen = 0
        for item in _shuffled(one_pass(repeat), size, rng):
            seen += 1
            yield item
        if seen == 0:
            raise ShardFormatError(f"shards {[plan.info.shards[s].url for s in shards]} hold no readable sample")


class _StreamReader:
    """One canonical stream within an epoch: its draws so far, and chunks of c decoded samples."""

    def __init__(self, plan: _TrainPlan, epoch: int, stream: int, shards: list[int], draws: int):
        self.plan, self.epoch, self.stream, self.shards = plan, epoch, stream, shards
        self.stats: Counter = Counter()
        self.capacity = sum(plan.info.shards[s].samples for s in shards)
        rng = np.random.default_rng([plan.seed, epoch, stream, 0, 0, _BUFFER_TAG])
        self.draws_iter = _stream_draws(plan, shards, self.stats, rng)
        for _ in range(draws):  # resume: replay the buffer without decoding
            next(self.draws_iter)
        self.draws = draws
        if draws == 0:
            self.stats["dropped_samples"] += self.capacity - plan.steps_in_epoch(epoch) * plan.chunk
        else:
            self.stats.clear()  # counts from the replayed part were reported before the interruption

    def chunk(self) -> tuple[list[Image.Image], list[int], list[str]]:
        """The next c usable samples: decoded RGB images (S, S), labels, keys."""
        plan, stats = self.plan, self.stats
        images, labels, keys = [], [], []
        failures_in_row = 0
        while len(images) < plan.chunk:
            if failures_in_row > 2 * self.capacity + 10:  # a whole pass and more without one usable sample
                urls = [plan.info.shards[s].url for s in self.shards]
                raise ShardFormatError(f"no usable sample in {urls}: {dict(stats)}; run data_pipeline.validate")
            s, member, repeat, sample = next(self.draws_iter)
            self.draws += 1
            failures_in_row += 1
            label = _label(sample, plan.info.num_classes, stats)
            if label is None:
                continue
            rng = np.random.default_rng([plan.seed, self.epoch, s, member, repeat])
            try:
                images.append(decode_train_image(sample["jpg"], plan.image_size, plan.augment, rng))
            except DECODE_ERRORS:
                stats["corrupt_samples"] += 1
                continue
            labels.append(label)
            keys.append(sample["__key__"])
            if repeat:
                stats["wrapped_samples"] += 1
            failures_in_row = 0
        return images, labels, keys


def _storage_uses(t: torch.Tensor) -> int | None:
    """References to ``t``'s storage (torch's own count); None where this torch has no such count."""
    count = getattr(torch._C, "_storage_Use_Count", None)
    return None if count is None else count(t.untyped_storage()._cdata)


class _StepPool:
    """A rank's float step buffers, which the loader's workers write straight into.

    Each buffer holds one step's share of the global batch (A m, 3, S, S) in [-1, 1]; micro-batches are views of it.
    Before the loader can ask for step s, the training process grants s a buffer (``grant``), one that no step in
    flight owns and no view of which is alive: its storage's use count is back to what it was when it was made, so
    no micro-batch from it, no view of one and no autograd graph saving one is held. Each worker (or the training
    process itself, without workers) decodes its streams' chunks, packs each image into uint8 planes and converts
    them into its row of that buffer (``write``), then sends only the buffer number. So the training process
    converts nothing: on a 2-core machine its conversion of every step had taken the CPU that a second loader
    worker needs (docs/elastic.md, "Assembly"). When no buffer is free (a consumer keeping many steps), the grant
    is -1 and the workers hand over uint8 pixels, which the training process converts into a tensor of the step's
    own.

    ``grants[step mod len]`` is (step, buffer) and ``stamps[buffer, worker]`` the step that worker's rows hold (-1
    while it writes), both in shared memory; ``take`` checks every stamp, so a mix-up would be an error, never
    silent.
    """

    def __init__(self, slots: int, rows: int, image_size: int, workers: int, lookahead: int, shared: bool):
        def made(t: torch.Tensor) -> torch.Tensor:
            return t.share_memory_() if shared else t

        self.buffers = [made(torch.empty((rows, 3, image_size, image_size))) for _ in range(slots)]
        self.stamps = made(torch.full((slots, workers), -1, dtype=torch.int64))
        self.grants = made(torch.full((lookahead + 2, 2), -1, dtype=torch.int64))
        self.owner: list[int | None] = [None] * slots  # training process only: the step in flight in each buffer
        self.unshared = [_storage_uses(b) for b in self.buffers]

    def __getstate__(self) -> dict:  # what a worker needs; the bookkeeping stays in the training process
        return dict(buffers=self.buffers, stamps=self.stamps, grants=self.grants)

    def grant(self, step: int) -> None:
        """Give ``step`` a free buffer, or -1 where none is free, before the loader can ask for its items."""
        free = [j for j, b in enumerate(self.buffers) if self.owner[j] is None and _storage_uses(b) == self.unshared[j]]
        slot = free[0] if free and self.unshared[0] is not None else -1  # without a use count: never reuse one
        if slot >= 0:
            self.owner[slot] = step
        self.grants[step % len(self.grants)] = torch.tensor([step, slot])

    def slot(self, step: int) -> int:
        """In a worker: the buffer granted to ``step``, -1 for none."""
        granted, slot = self.grants[step % len(self.grants)].tolist()
        if granted != step:
            raise RuntimeError(f"loader grant for step {step} missing (the table holds step {granted})")
        return slot

    def write(self, step: int, slot: int, worker: int, start: int, images: list[Image.Image], scratch: np.ndarray):
        """A worker's images of ``step`` -> rows [start, start + len) of buffer ``slot``, through uint8 ``scratch``.

        One image at a time: its uint8 planes and float rows (0.75 MB at 224 px) stay in a core's L2 cache through
        the conversion's three passes, so only the finished rows go out to memory."""
        self.stamps[slot, worker] = -1
        rows = self.buffers[slot][start : start + len(images)]
        for i, image in enumerate(images):
            to_float_images([torch.from_numpy(channels_first([image], out=scratch))], out=rows[i : i + 1])
        self.stamps[slot, worker] = step

    def take(self, step: int, slot: int) -> torch.Tensor:
        """Buffer ``slot`` once every worker's stamp says that its rows hold ``step``; it is no longer in flight."""
        stamps = self.stamps[slot].tolist()
        if any(s != step for s in stamps):
            raise RuntimeError(f"loader buffer {slot} holds steps {stamps} of the workers' rows, not step {step}")
        self.owner[slot] = None  # from here on, the views handed out keep it from being granted again
        return self.buffers[slot]


def _step_batch(plan: _TrainPlan, epoch: int, step: int, parts: list, pool: _StepPool):
    """This rank's share of global batch ``step`` from its workers' items, laid end to end in stream order: float
    images (A m, 3, S, S) and labels (A m,), or (A m, K) one-hot / mixed targets.

    The workers have written their rows of the step's pool buffer and send its number (or, when the step got none,
    uint8 channels-first pixels, converted here into a tensor of the step's own) and int labels, no one-hot rows.
    Mixup mixes within each stream's chunk of c.
    """
    slots = {p for p, _, _ in parts if isinstance(p, int)}
    if slots:  # every worker read the same grant
        if len(slots) > 1 or len(parts) != sum(isinstance(p, int) for p, _, _ in parts):
            raise RuntimeError(f"step {step}: the workers' items disagree on its buffer: {[p for p, _, _ in parts]}")
        x = pool.take(step, slots.pop())  # (A m, 3, S, S)
    else:
        x = to_float_images([p for p, _, _ in parts])
    y = torch.tensor([label for _, labels, _ in parts for label in labels], dtype=torch.int64)  # (A m,)
    if plan.label_format == "multihot" or plan.mixup_alpha > 0:
        y = torch.nn.functional.one_hot(y, plan.num_classes).float()  # (A m, K)
    if plan.mixup_alpha > 0:
        c = plan.chunk
        for i, stream in enumerate(plan.rank_streams):
            rows = slice(i * c, (i + 1) * c)
            rng = np.random.default_rng([plan.seed, epoch, stream, step, 0, _MIXUP_TAG])
            x[rows], y[rows], _ = mixup(x[rows], y[rows], plan.mixup_alpha, rng)
    return x, y


class _TrainEpoch(IterableDataset):
    """One epoch of one rank from global batch ``start``, ``draws[stream]`` buffer draws already made per stream.

    Every logical worker yields one item per global batch: (pixels, labels, meta) of its streams' chunks, labels a
    list of ints and pixels the number of the ``pool`` buffer it wrote its rows of, or, for a step granted none,
    uint8 (k c, 3, S, S); ``_step_batch`` turns the items into the rank's batch.
    """

    def __init__(self, plan: _TrainPlan, epoch: int, start: int, draws: dict[int, int], pool: _StepPool):
        self.plan, self.epoch, self.start, self.draws, self.pool = plan, epoch, start, draws, pool

    def __iter__(self):
        info = get_worker_info()
        yield from self._logical(0 if info is None else info.id)

    def _logical(self, logical: int):
        plan, epoch = self.plan, self.epoch
        shards = plan.stream_shards(epoch)
        group = plan.worker_streams(logical)
        readers = [_StreamReader(plan, epoch, s, shards[s], self.draws[s]) for s in group]
        first_row = (group[0] - plan.rank_streams[0]) * plan.chunk  # of this worker's rows in the step's batch
        scratch = _planes(1, plan.image_size)  # reused: an image's uint8 planes before their conversion
        for step in range(self.start, plan.steps_in_epoch(epoch)):
            images, labels, keys = [], [], []
            stats: Counter = Counter()
            for reader in readers:
                more = reader.chunk()
                images += more[0]
                labels += more[1]
                keys += more[2]
                stats.update(reader.stats)
                reader.stats.clear()
            slot = self.pool.slot(step)
            if slot >= 0:
                self.pool.write(step, slot, logical, first_row, images, scratch)
                pixels = slot
            else:
                pixels = torch.from_numpy(channels_first(images, out=_planes(len(images), plan.image_size)))
            meta = dict(
                epoch=epoch,
                step=step,
                draws={r.stream: r.draws for r in readers},
                stats=dict(stats),
                keys=keys if plan.record_keys else None,
            )
            yield pixels, labels, meta


def _loader_context(method: str | None) -> str | None:
    """The DataLoader's start method, with this module preloaded in the fork server when it is ``forkserver``.

    forkserver is the default: workers then fork from a server process that started clean, never from the training
    process. That one runs other threads (gloo's, DeepSpeed's, the queue feeders of the previous epoch's loader), and
    a fork that lands while one of them holds an interpreter lock leaves the child hung before it runs a line: seen
    here with CPython 3.11, a rank waiting forever on its first batch (docs/reference.md, "DataLoader workers").
    Preloaded, the server has imported torch and this module once, and a new epoch's workers start in milliseconds
    instead of ~1.5 s each. Only effective before the process's fork server starts (the first forkserver loader).
    """
    if method == "forkserver":
        multiprocessing.set_forkserver_preload([__name__])
    return method


def _planes(rows: int, size: int) -> np.ndarray:
    """A fresh uint8 (rows, 3, size, size) for `channels_first`."""
    return np.empty((rows, 3, size, size), np.uint8)


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


def merge_stream_states(states: list[dict]) -> dict:
    """The global position: the ranks' ``state_dict()``s joined into one state holding the draws of all P streams
    (stats summed). Raises ValueError when they disagree on epoch, step or fingerprint, or a stream is missing or
    held twice — the states of one checkpoint always agree."""
    if not states:
        raise ValueError("merge_stream_states needs at least one stream state")
    for state in states:
        _check_version(state)
    first = states[0]
    for field in ("epoch", "step", "fingerprint"):
        values = [s[field] for s in states]
        if any(v != values[0] for v in values):
            raise ValueError(f"stream states disagree on {field}: {values}; merge the states of one checkpoint only")
    draws: dict[str, int] = {}
    stats: Counter = Counter()
    for state in states:
        twice = sorted(set(draws) & set(state["draws"]), key=int)
        if twice:
            raise ValueError(f"streams {twice} appear in more than one stream state; pass each rank's state once")
        draws.update({str(k): int(v) for k, v in state["draws"].items()})
        stats.update(state.get("stats", {}))
    streams = int(first["fingerprint"]["streams"])
    missing = [s for s in range(streams) if str(s) not in draws]
    if missing:
        more = "..." if len(missing) > 8 else ""
        raise ValueError(f"no stream state holds streams {missing[:8]}{more}; pass the states of every rank")
    return dict(
        version=STATE_VERSION,
        epoch=int(first["epoch"]),
        step=int(first["step"]),
        draws={str(s): draws[str(s)] for s in range(streams)},
        stats=dict(stats),
        fingerprint=dict(first["fingerprint"]),
    )


def _check_version(state: dict) -> None:
    version = state.get("version")
    if version == 1:
        raise ValueError(
            "this stream state (version 1) predates world-size-invariant streams (issue #14): its positions are per "
            "rank and worker, not per canonical stream; resume that checkpoint with the version that wrote it"
        )
    if version != STATE_VERSION:
        raise ValueError(
            f"stream state version {version} is not {STATE_VERSION}; resume with the version that wrote it"
        )


class TrainStream:
    """Endless iterable of micro-batches (images float32 (m, 3, S, S) in [-1, 1], labels) of one rank.

    ``batch_size`` is the micro-batch m; A = G / (R m) consecutive micro-batches make this rank's share of one global
    batch (one optimizer step). ``global_batch_size`` G defaults to m x world_size (A = 1). ``streams`` P defaults,
    for standalone use, to world_size x max(1, num_workers) when that divides G, else to world_size; training passes
    ``data.streams`` so that the order does not depend on R or W. Labels are int64 (m,) with ``label_format="int"``,
    float32 (m, K) with ``"multihot"``; with ``mixup_alpha > 0`` always float32 (m, K) soft targets. With
    ``record_keys`` the sample keys of the last micro-batch are in ``last_keys``. The module docstring gives the
    order and the resume contract; ``stats`` counts skipped, truncated, dropped and wrapped samples.

    A yielded micro-batch is a view of a step buffer that the stream writes again only once no view of it is alive,
    so keeping micro-batches (in a list, in an autograd graph) is safe; modifying one in place changes only it. A
    consumer that keeps more than one step's micro-batches alive costs a copy per step (``unpooled_steps``).
    """

    def __init__(
        self,
        source,
        *,
        batch_size: int,
        image_size: int,
        global_batch_size: int | None = None,
        streams: int | None = None,
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
        multiprocessing_context: str | None = "forkserver",
        prefetch_factor: int = PREFETCH_FACTOR,
        record_keys: bool = False,
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
        if not isinstance(prefetch_factor, int) or prefetch_factor < 1:
            raise ValueError(
                f"prefetch_factor must be an int >= 1 (steps a loader worker may be ahead), got {prefetch_factor!r}"
            )
        if not drop_last:
            raise ValueError("drop_last=False is not supported: every stream gives whole chunks (docs/elastic.md)")
        num_classes = info.num_classes if num_classes is None else num_classes
        if num_classes < info.num_classes:
            raise ValueError(
                f"num_classes={num_classes} but {info.root} has {info.num_classes} classes; "
                "pass num_classes >= the dataset's (or leave it None)"
            )
        if augment is not None:
            augment.validate()
        G = batch_size * world_size if global_batch_size is None else global_batch_size
        if streams is None:
            streams = world_size * max(1, num_workers)
            streams = streams if G % streams == 0 else world_size
        P = streams
        _check_sizes(info, G, batch_size, P, world_size, mixup_alpha)
        workers = min(max(1, num_workers), P // world_size)
        if num_workers > workers and (num_workers, P // world_size) not in _clamp_warned:
            _clamp_warned.add((num_workers, P // world_size))
            log.warning(
                "num_workers=%d but each rank reads %d streams: %d loader workers run (a worker reads whole streams)",
                num_workers,
                P // world_size,
                workers,
            )
        self.plan = _TrainPlan(
            info=info,
            micro_batch=batch_size,
            global_batch=G,
            streams=P,
            image_size=image_size,
            rank=rank,
            world_size=world_size,
            workers=workers,
            seed=seed,
            shuffle_buffer=shuffle_buffer,
            augment=augment,
            mixup_alpha=float(mixup_alpha),
            label_format=label_format,
            num_classes=num_classes,
            record_keys=bool(record_keys),
        )
        if self.plan.steps_in_epoch(0) < 1:
            raise ValueError(
                f"{info.root}: a stream of epoch 0 holds {min(self.plan.capacities(0))} samples, fewer than the "
                f"{self.plan.chunk} (global_batch_size / streams) it gives each global batch; lower the global batch "
                "or the streams"
            )
        self.num_workers = workers if num_workers > 0 else 0
        self.multiprocessing_context = multiprocessing_context if num_workers > 0 else None
        self.prefetch_factor = prefetch_factor
        self.stats: Counter = Counter()
        self.last_keys: list[str] | None = None
        self.unpooled_steps = 0  # steps that found no free step buffer (a consumer keeping many): copied, not pooled
        self._epoch, self._step, self._micro = 0, 0, 0
        self._draws = {s: 0 for s in self.plan.rank_streams}

    @property
    def info(self) -> DatasetInfo:
        return self.plan.info

    @property
    def accumulation_steps(self) -> int:
        """A: micro-batches per optimizer step on this rank."""
        return self.plan.accumulation

    @property
    def steps_per_epoch(self) -> int:
        """Global batches in the current epoch (it varies a little between epochs: see ``steps_in_epoch``)."""
        return self.plan.steps_in_epoch(self._epoch)

    def steps_in_epoch(self, epoch: int) -> int:
        """Global batches in ``epoch``: the smallest stream's manifest count over c (shards are re-dealt per epoch)."""
        return self.plan.steps_in_epoch(epoch)

    def _fingerprint(self) -> dict:
        p = self.plan
        return dict(
            seed=p.seed,
            global_batch_size=p.global_batch,
            streams=p.streams,
            shuffle_buffer=p.shuffle_buffer,
            num_samples=p.info.num_samples,
            num_shards=len(p.info.shards),
        )

    def state_dict(self) -> dict:
        """This rank's position after the optimizer steps yielded so far (plain ints: JSON-serialisable).

        Holds the draws of this rank's streams only; ``merge_stream_states`` joins the ranks' states."""
        if self._micro:
            raise ValueError(
                f"state_dict() after {self._micro} of the {self.plan.accumulation} micro-batches of a step: a stream "
                "position exists only between optimizer steps; checkpoint after the step's last micro-batch"
            )
        return dict(
            version=STATE_VERSION,
            epoch=self._epoch,
            step=self._step,
            draws={str(s): n for s, n in self._draws.items()},
            stats=dict(self.stats),
            fingerprint=self._fingerprint(),
        )

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state``: a merged state (any world size) or any state holding this rank's streams."""
        _check_version(state)
        saved, now = state["fingerprint"], self._fingerprint()
        diff = {k: (saved.get(k), v) for k, v in now.items() if saved.get(k) != v}
        if diff:
            raise ValueError(
                f"stream state does not match this stream (saved, now): {diff}; resume with the same data, seed, "
                "global batch size, streams and shuffle buffer"
            )
        draws = {int(k): int(v) for k, v in state["draws"].items()}
        missing = [s for s in self.plan.rank_streams if s not in draws]
        if missing:
            raise ValueError(
                f"stream state holds the draws of streams {sorted(draws)} but rank {self.plan.rank} of "
                f"{self.plan.world_size} reads streams {list(self.plan.rank_streams)}; load the merged state "
                "(merge_stream_states over every rank's state)"
            )
        self._epoch, self._step, self._micro = int(state["epoch"]), int(state["step"]), 0
        self._draws = {s: draws[s] for s in self.plan.rank_streams}
        # Counters are sums over ranks: the rank reading the state's first stream takes them, so merging the
        # states again counts each event once.
        self.stats = Counter(state.get("stats", {})) if min(draws) in self.plan.rank_streams else Counter()

    def __iter__(self):
        plan = self.plan
        m, A = plan.micro_batch, plan.accumulation
        self._micro = 0  # a new iterator starts at the last whole step
        while True:
            steps = plan.steps_in_epoch(self._epoch)
            if self._step >= steps:
                self._epoch, self._step = self._epoch + 1, 0
                self._draws = {s: 0 for s in plan.rank_streams}
                if plan.steps_in_epoch(self._epoch) < 1:
                    raise ValueError(
                        f"epoch {self._epoch} has a stream with fewer than {plan.chunk} samples; lower the global "
                        "batch or the streams"
                    )
                continue
            # Per epoch: the workers of an earlier epoch can never write into these. A step's buffer is granted
            # before the DataLoader can ask for it: it asks for step s + prefetch_factor as it hands over step s.
            lookahead = self.prefetch_factor if self.num_workers > 0 else 0
            slots, rows = step_slots(self.num_workers, self.prefetch_factor), plan.global_batch // plan.world_size
            if self.num_workers > 0:
                check_shared_memory(
                    step_pool_bytes(rows, plan.image_size, self.num_workers, self.prefetch_factor), _shm_free()
                )
            pool = _StepPool(slots, rows, plan.image_size, plan.workers, lookahead, shared=self.num_workers > 0)
            for step in range(self._step, min(self._step + lookahead, steps)):
                pool.grant(step)
            epoch = _TrainEpoch(plan, self._epoch, self._step, dict(self._draws), pool)
            if self.num_workers == 0:
                items = iter(epoch)
            else:
                items = iter(
                    DataLoader(
                        epoch,
                        batch_size=None,
                        num_workers=self.num_workers,
                        multiprocessing_context=_loader_context(self.multiprocessing_context),
                        prefetch_factor=self.prefetch_factor,
                        generator=_loader_generator(plan.seed, self._epoch, plan.rank, self._step),
                    )
                )
            for step in range(self._step, steps):
                if step + lookahead < steps:
                    pool.grant(step + lookahead)
                parts = list(itertools.islice(items, plan.workers))  # worker 0, 1, ...: stream order
                if len(parts) < plan.workers:  # the workers ended early: never silently shorten an epoch
                    raise RuntimeError(f"epoch {self._epoch} ended after {step} of {steps} global batches")
                assert all(p[2]["step"] == step and p[2]["epoch"] == self._epoch for p in parts), (step, self._epoch)
                keys = [k for p in parts for k in p[2]["keys"]] if plan.record_keys else None
                images, targets = _step_batch(plan, self._epoch, step, parts, pool)
                self.unpooled_steps += not isinstance(parts[0][0], int)
                for i in range(A):
                    x, y = images[i * m : (i + 1) * m], targets[i * m : (i + 1) * m]  # views: (m, 3, S, S), labels
                    if i == A - 1:  # the step is done once its last micro-batch is handed out
                        self._step = step + 1
                        for p in parts:
                            self._draws.update(p[2]["draws"])
                            self.stats.update(p[2]["stats"])
                    self._micro = (i + 1) % A
                    if keys is not None:
                        self.last_keys = keys[i * m : (i + 1) * m]
                    yield x, y


def _check_sizes(info: DatasetInfo, G: int, m: int, P: int, R: int, mixup_alpha: float) -> None:
    """The divisibility the stream split needs (pretrain.ds_config.batch_plan checks the same for a config)."""
    if G < 1 or P < 1:
        raise ValueError(f"global_batch_size and streams must be >= 1, got {G} and {P}")
    if G % P:
        raise ValueError(f"global_batch_size={G} is not divisible by streams={P}; set streams to a divisor of it")
    if P % R:
        valid = [w for w in range(1, P + 1) if P % w == 0 and G % (w * m) == 0]
        raise ValueError(
            f"world_size {R} does not divide streams={P}: each rank reads a contiguous block of streams; run at a "
            f"world size in {valid} or change streams"
        )
    if G % (R * m):
        raise ValueError(
            f"global_batch_size={G} is not divisible by world_size {R} x batch_size {m}; pick a micro-batch that "
            f"divides {G // R}"
        )
    live = sum(1 for c in info.shard_counts if c > 0)
    if live < P:
        raise ValueError(
            f"{info.root} has {live} non-empty shards but streams={P} need one each; rewrite it with a smaller "
            "--samples-per-shard or use fewer streams"
        )
    if mixup_alpha > 0 and G // P < 2:
        raise ValueError(
            f"mixup mixes samples within each stream's chunk of global_batch_size / streams = {G // P}; it needs "
            ">= 2: use fewer streams or a larger global batch"
        )


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
                    images.append(decode_eval_image(sample["jpg"], self.image_size, self.resize_size))
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
        """(uint8 pixels (B, 3, S, S), labels, keys, counters): the float conversion is the consumer's, so a loader
        worker hands over a quarter of the bytes (as in training)."""
        pixels = torch.from_numpy(channels_first(images, out=_planes(len(images), self.image_size)))
        out = (pixels, list(labels), list(keys), dict(stats))
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
        multiprocessing_context: str | None = "forkserver",
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
                    multiprocessing_context=_loader_context(self.multiprocessing_context),
                    generator=_loader_generator(0),  # evaluation draws nothing: any fixed seed will do
                )
            )
        for pixels, labels, keys, stats in batches:
            self.stats.update(stats)
            if not labels:
                continue
            x, y = to_float_images([pixels]), torch.tensor(labels, dtype=torch.int64)  # (B, 3, S, S), (B,)
            yield (x, y, keys) if self.return_keys else (x, y)
