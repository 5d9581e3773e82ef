"""`TrainStream`: one rank's endless micro-batches; every faster path yields the same batches (docs/design.md, "What
the data stream keeps bit-identical")."""

from __future__ import annotations

import itertools
import logging
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch.utils.data import IterableDataset, get_worker_info

from data_pipeline.manifest import DatasetInfo, ShardFormatError, check_class_count, dataset_info
from data_pipeline.stream.augment import (
    DECODE_ERRORS,
    TrainImage,
    channels_first,
    decode_train_image,
    decoded_train_image,
    mix,
    mixup,
    mixup_lambda,
    planes,
    to_float_images,
)
from data_pipeline.stream.config import DataConfig
from data_pipeline.stream.decoded_cache import DECODED_KEY, DecodedCache
from data_pipeline.stream.loader import worker_items
from data_pipeline.stream.order import TrainPlan, check_split, rank_position, stream_draws, stream_state
from data_pipeline.stream.shards import read_shard, sample_label, set_read_retries
from data_pipeline.stream.step_pool import (
    PREFETCH_FACTOR,
    Pixels,
    StepPool,
    check_shared_memory,
    conversion_rows,
    shm_free,
    step_pool_bytes,
    step_slots,
)

log = logging.getLogger(__name__)

_clamp_warned: set[tuple[int, int]] = set()  # (num_workers, streams per rank) warned about
# A worker's item per global batch: (pool buffer or uint8 pixels, labels, position and counters)
_Item = tuple[int | torch.Tensor, list[int], dict[str, Any]]


def _plan(
    config: DataConfig, rank: int, world_size: int, num_classes: int | None, label_format: str, record_keys: bool
) -> TrainPlan:
    info = dataset_info(config.train)
    check_class_count(info)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world_size {world_size}")
    num_classes = info.num_classes if num_classes is None else num_classes
    if num_classes < info.num_classes:
        raise ValueError(
            f"num_classes={num_classes} but {info.root} has {info.num_classes} classes; "
            "pass num_classes >= the dataset's (or leave it None)"
        )
    m, G, P = config.micro_batch_size, config.global_batch_size, config.streams
    check_split(info, G, m, P, world_size, config.mixup_alpha)
    clamp = (config.num_workers, P // world_size)
    workers = min(max(1, config.num_workers), P // world_size)
    if config.num_workers > workers and clamp not in _clamp_warned:
        _clamp_warned.add(clamp)
        log.warning(
            "num_workers=%d but each rank reads %d streams: %d loader workers run (a worker reads whole streams)",
            *clamp,
            workers,
        )
    plan = TrainPlan(
        info=info,
        micro_batch=m,
        global_batch=G,
        streams=P,
        image_size=config.image_size,
        rank=rank,
        world_size=world_size,
        workers=workers,
        seed=config.seed,
        shuffle_buffer=config.shuffle_buffer,
        augment=config.augment,
        mixup_alpha=float(config.mixup_alpha),
        label_format=label_format,
        num_classes=num_classes,
        record_keys=bool(record_keys),
    )
    if plan.steps_in_epoch(0) < 1:
        raise ValueError(
            f"{info.root}: a stream of epoch 0 holds {min(plan.capacities(0))} samples, fewer than the "
            f"{plan.chunk} (global_batch_size / streams) it gives each global batch; lower the global batch "
            "or the streams"
        )
    return plan


class _StreamReader:
    def __init__(
        self, plan: TrainPlan, epoch: int, stream: int, shards: list[int], draws: int, cache: DecodedCache | None = None
    ):
        self.plan, self.epoch, self.stream, self.shards = plan, epoch, stream, shards
        self.stats: Counter = Counter()
        self.out_of_range: Counter = Counter()  # samples dropped for a label >= the folder's num_classes, by shard
        self.capacity = sum(plan.info.shards[s].samples for s in shards)
        read = read_shard if cache is None else cache.read
        self.draws_iter = stream_draws(plan, epoch, stream, shards, self.stats, read)
        for _ in range(draws):  # resume: replay without decoding
            next(self.draws_iter)
        self.draws = draws
        if draws == 0:
            self.stats["dropped_samples"] += self.capacity - plan.steps_in_epoch(epoch) * plan.chunk
        else:
            self.stats.clear()  # reported before the interruption

    def chunk(self) -> tuple[list[TrainImage], list[int], list[str]]:
        plan, stats = self.plan, self.stats
        images: list[TrainImage] = []
        labels: list[int] = []
        keys: list[str] = []
        failures_in_row = 0
        while len(images) < plan.chunk:
            if failures_in_row > 2 * self.capacity + 10:  # a pass without a usable sample
                urls = [plan.info.shards[s].url for s in self.shards]
                raise ShardFormatError(f"no usable sample in {urls}: {dict(stats)}; run data_pipeline.validate")
            s, member, repeat, sample = next(self.draws_iter)
            self.draws += 1
            failures_in_row += 1
            dropped = stats["label_out_of_range"]
            label = sample_label(sample, plan.info.num_classes, stats)
            if label is None:
                self.out_of_range[plan.info.shards[s].url] += stats["label_out_of_range"] - dropped
                continue
            decoded = sample.get(DECODED_KEY)
            args = (sample["jpg"], plan.image_size, plan.augment, plan.augment_rng(self.epoch, s, member, repeat))
            try:
                if decoded is None:
                    images.append(decode_train_image(*args))
                else:
                    images.append(decoded_train_image(decoded.pixels, decoded.image_format, *args))
            except DECODE_ERRORS:
                stats["corrupt_samples"] += 1
                continue
            labels.append(label)
            keys.append(sample["__key__"])
            if repeat:
                stats["wrapped_samples"] += 1
            failures_in_row = 0
        return images, labels, keys


@dataclass(eq=False)
class _TrainEpoch(IterableDataset):
    """One rank's epoch from global batch ``start`` and ``draws[stream]``: an `_Item` per worker and step."""

    plan: TrainPlan
    epoch: int
    start: int
    draws: dict[int, int]
    pool: StepPool
    read_retries: int = 3
    cache: DecodedCache | None = None

    def __iter__(self) -> Iterator[_Item]:
        set_read_retries(self.read_retries)  # a loader worker has its own module state
        info = get_worker_info()
        logical = 0 if info is None else info.id
        plan, epoch = self.plan, self.epoch
        shards = plan.stream_shards(epoch)
        group = plan.worker_streams(logical)
        readers = [_StreamReader(plan, epoch, s, shards[s], self.draws[s], self.cache) for s in group]
        first_row = (group[0] - plan.rank_streams[0]) * plan.chunk
        scratch = planes(conversion_rows(plan.image_size), plan.image_size)
        for step in range(self.start, plan.steps_in_epoch(epoch)):
            images: list[TrainImage] = []
            labels: list[int] = []
            keys: list[str] = []
            stats: Counter = Counter()
            out_of_range: Counter = Counter()
            for reader in readers:
                more = reader.chunk()
                images += more[0]
                labels += more[1]
                keys += more[2]
                stats.update(reader.stats)
                reader.stats.clear()
                out_of_range.update(+reader.out_of_range)
                reader.out_of_range.clear()
            slot = self.pool.slot(step)
            pixels: int | torch.Tensor = slot
            if slot >= 0:
                self.pool.write(step, slot, logical, first_row, images, scratch)
            else:
                pixels = torch.from_numpy(channels_first(images, out=planes(len(images), plan.image_size)))
            draws = {r.stream: r.draws for r in readers}
            meta = dict(epoch=epoch, step=step, draws=draws, stats=dict(stats), keys=keys if plan.record_keys else None)
            meta["out_of_range"] = dict(out_of_range)
            yield pixels, labels, meta


@dataclass(frozen=True)
class MixRows:
    """Mixup left to the device: in each (start, stop, lam) span row i becomes ``mix(row i, partners[i], lam)``."""

    partners: torch.Tensor
    spans: tuple[tuple[int, int, float], ...]


def _step_batch(
    plan: TrainPlan, epoch: int, step: int, parts: list[_Item], pool: StepPool, pixels: Pixels = "float"
) -> tuple[torch.Tensor, torch.Tensor, list[float]]:
    """This rank's share of global batch ``step``: images, labels or targets, and each chunk's mixup weight."""
    slots = {p for p, _, _ in parts if isinstance(p, int)}
    pieces = [p for p, _, _ in parts if isinstance(p, torch.Tensor)]
    if slots:
        if len(slots) > 1 or pieces:
            raise RuntimeError(f"step {step}: the workers' items disagree on its buffer: {[p for p, _, _ in parts]}")
        x = pool.take(step, slots.pop())
    else:
        x = to_float_images(pieces) if pixels == "float" else torch.cat(pieces)
    y = torch.tensor([label for _, labels, _ in parts for label in labels], dtype=torch.int64)
    if plan.label_format == "multihot" or plan.mixup_alpha > 0:
        y = torch.nn.functional.one_hot(y, plan.num_classes).float()
    lams: list[float] = []
    c = plan.chunk
    for i, stream in enumerate(plan.rank_streams if plan.mixup_alpha > 0 else ()):
        rows, rng = slice(i * c, (i + 1) * c), plan.mixup_rng(epoch, stream, step)
        if pixels == "float":
            x[rows], y[rows], lam = mixup(x[rows], y[rows], plan.mixup_alpha, rng)
        else:  # the images are mixed on the device (`MixRows`)
            lam = mixup_lambda(plan.mixup_alpha, rng)
            y[rows] = mix(y[rows], y[rows].roll(1, dims=0), lam)
        lams.append(lam)
    return x, y, lams


# A micro-batch: (images, targets), with `MixRows` (or None) third where the device normalizes.
Batch = tuple[torch.Tensor, torch.Tensor] | tuple[torch.Tensor, torch.Tensor, "MixRows | None"]


def _mix_rows(images: torch.Tensor, lams: list[float], chunk: int, rows: range) -> MixRows:
    partner = [r - 1 if r % chunk else r + chunk - 1 for r in rows]  # cyclically
    spans, start = [], rows.start
    while start < rows.stop:
        stop = min(rows.stop, (start // chunk + 1) * chunk)
        spans.append((start - rows.start, stop - rows.start, lams[start // chunk]))
        start = stop
    return MixRows(images[partner], tuple(spans))


class TrainStream:
    """Endless micro-batches (float32 images (m, 3, S, S) in [-1, 1], labels) of rank ``rank``, A per optimizer
    step (docs/elastic.md, "Data order"). Views kept over a step cost copies (``unpooled_steps``)."""

    def __init__(
        self,
        config: DataConfig,
        *,
        rank: int = 0,
        world_size: int = 1,
        num_classes: int | None = None,
        label_format: Literal["int", "multihot"] = "int",
        record_keys: bool = False,
        prefetch_factor: int = PREFETCH_FACTOR,
        pixels: Pixels = "float",
    ):
        """``num_classes``: None → the dataset's. ``label_format``: "int" int64 (m,), "multihot" float32 (m, K),
        always the latter with mixup. ``record_keys``: fill `last_keys`. ``pixels="uint8"``: yield (uint8 images,
        labels, `MixRows` or None) for the device."""
        if label_format not in ("int", "multihot"):
            raise ValueError(f"label_format must be 'int' or 'multihot', got {label_format!r}")
        if pixels not in ("float", "uint8"):
            raise ValueError(f"pixels must be 'float' or 'uint8', got {pixels!r}")
        if not isinstance(prefetch_factor, int) or prefetch_factor < 1:
            raise ValueError(
                f"prefetch_factor must be an int >= 1 (steps a loader worker may be ahead), got {prefetch_factor!r}"
            )
        self.config, self.prefetch_factor, self.pixels = config, prefetch_factor, pixels
        self.plan = _plan(config, rank, world_size, num_classes, label_format, record_keys)
        self.stats: Counter = Counter()
        self.last_keys: list[str] | None = None
        self.unpooled_steps = 0
        self._warned_labels = False
        self._processes = self.plan.workers if config.num_workers > 0 else 0
        self._epoch, self._step, self._micro = 0, 0, 0
        self._draws = {s: 0 for s in self.plan.rank_streams}
        # now: its read of the set is not waiting for data
        pool = step_pool_bytes(
            self.plan.global_batch // world_size, config.image_size, self._processes, prefetch_factor, pixels
        )
        self.cache, self.cache_line = DecodedCache.build(
            self.plan.info, self.plan.image_size, config.cache_mb, shared=self._processes > 0, reserve_bytes=pool
        )
        if rank == 0 and config.cache_mb > 0:
            log.warning(self.cache_line)

    @property
    def info(self) -> DatasetInfo:
        return self.plan.info

    @property
    def accumulation_steps(self) -> int:
        """A: micro-batches per optimizer step on this rank."""
        return self.plan.accumulation

    @property
    def steps_per_epoch(self) -> int:
        """Global batches in the current epoch (they vary a little)."""
        return self.plan.steps_in_epoch(self._epoch)

    def steps_in_epoch(self, epoch: int) -> int:
        return self.plan.steps_in_epoch(epoch)

    def state_dict(self) -> dict[str, Any]:
        """This rank's position (plain ints), only between optimizer steps."""
        if self._micro:
            raise ValueError(
                f"state_dict() after {self._micro} of the {self.plan.accumulation} micro-batches of a step: a stream "
                "position exists only between optimizer steps; checkpoint after the step's last micro-batch"
            )
        return stream_state(self.plan, self._epoch, self._step, self._draws, self.stats)

    def load_state_dict(self, state: dict) -> None:
        """Continue from a merged state (any world size) or any state holding this rank's streams."""
        self._epoch, self._step, self._draws, self.stats = rank_position(self.plan, state)
        self._micro = 0

    def __iter__(self) -> Iterator[Batch]:
        self._micro = 0  # a new iterator starts at the last whole step
        while True:
            steps = self.plan.steps_in_epoch(self._epoch)
            if self._step < steps:
                yield from self._epoch_batches(steps)
                continue
            self._epoch, self._step = self._epoch + 1, 0
            self._draws = {s: 0 for s in self.plan.rank_streams}
            if self.plan.steps_in_epoch(self._epoch) < 1:
                raise ValueError(
                    f"epoch {self._epoch} has a stream with fewer than {self.plan.chunk} samples; lower the global "
                    "batch or the streams"
                )

    def _epoch_batches(self, steps: int) -> Iterator[Batch]:
        plan, m, A = self.plan, self.plan.micro_batch, self.plan.accumulation
        # the loader asks for step s + prefetch_factor as it hands over step s
        lookahead = self.prefetch_factor if self._processes > 0 else 0
        pool = self._step_pool(steps, lookahead)
        epoch = _TrainEpoch(
            plan, self._epoch, self._step, dict(self._draws), pool, self.config.read_retries, self.cache
        )
        seed_key = (plan.seed, self._epoch, plan.rank, self._step)
        items = worker_items(epoch, self._processes, self.config.loader_start_method, seed_key, self.prefetch_factor)
        for step in range(self._step, steps):
            if step + lookahead < steps:
                pool.grant(step + lookahead)
            parts = list(itertools.islice(items, plan.workers))  # in stream order
            if len(parts) < plan.workers:  # never silently shorten an epoch
                raise RuntimeError(f"epoch {self._epoch} ended after {step} of {steps} global batches")
            assert all(p[2]["step"] == step and p[2]["epoch"] == self._epoch for p in parts), (step, self._epoch)
            keys = [k for p in parts for k in p[2]["keys"]] if plan.record_keys else None
            images, targets, lams = _step_batch(plan, self._epoch, step, parts, pool, self.pixels)
            self.unpooled_steps += not isinstance(parts[0][0], int)
            for i in range(A):
                x, y = images[i * m : (i + 1) * m], targets[i * m : (i + 1) * m]
                if i == A - 1:
                    self._step = step + 1
                    for p in parts:
                        self._draws.update(p[2]["draws"])
                        self.stats.update(p[2]["stats"])
                        self._warn_out_of_range(p[2]["out_of_range"])
                self._micro = (i + 1) % A
                if keys is not None:
                    self.last_keys = keys[i * m : (i + 1) * m]
                if self.pixels == "uint8":
                    yield x, y, (_mix_rows(images, lams, plan.chunk, range(i * m, (i + 1) * m)) if lams else None)
                else:
                    yield x, y

    def _warn_out_of_range(self, dropped: dict[str, int]) -> None:
        """Say once that samples were dropped for labels the folder's num_classes does not hold."""
        if not dropped or self._warned_labels:
            return
        self._warned_labels = True
        url, count = next(iter(dropped.items()))
        info = self.plan.info
        log.warning(
            "%d sample(s) of shard %s have a label outside [0, %d) and are dropped (label_out_of_range counts them); "
            "the shards' labels and %s's num_classes disagree: check it with `python -m data_pipeline.validate %s`",
            count,
            url,
            info.num_classes,
            info.root,
            info.root,
        )

    def _step_pool(self, steps: int, lookahead: int) -> StepPool:
        plan, processes, prefetch = self.plan, self._processes, self.prefetch_factor
        rows = plan.global_batch // plan.world_size
        if processes > 0:
            check_shared_memory(step_pool_bytes(rows, plan.image_size, processes, prefetch, self.pixels), shm_free())
        slots = step_slots(processes, prefetch)
        pool = StepPool(slots, rows, plan.image_size, plan.workers, lookahead, shared=processes > 0, pixels=self.pixels)
        for step in range(self._step, min(self._step + lookahead, steps)):
            pool.grant(step)
        return pool
