"""The training order (docs/elastic.md, "Data order") and the position that resumes it at any world size. G global
batch, m micro-batch, P streams, R ranks, c = G / P, A = G / (R m)."""

from __future__ import annotations

import heapq
import itertools
import logging
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from data_pipeline.manifest import DatasetInfo, ShardFormatError
from data_pipeline.stream.augment import AugmentConfig
from data_pipeline.stream.shards import read_shard

log = logging.getLogger(__name__)

STATE_VERSION = 2
# 6-word seed keys ending in a tag: unlike each other and the 5-word augmentation keys (a trailing 0 counts as none)
_BUFFER_TAG, _MIXUP_TAG = 1, 2

Draw = tuple[int, int, int, dict]  # (shard, member, repeat, sample)


def balanced_split(order: list[int], counts: list[int], parts: int) -> list[list[int]]:
    """Deal items (in ``order``) to ``parts`` bins, each to the least full so far (ties: the lowest)."""
    bins: list[list[int]] = [[] for _ in range(parts)]
    heap = [(0, b) for b in range(parts)]
    for item in order:
        total, k = heap[0]
        bins[k].append(item)
        heapq.heapreplace(heap, (total + counts[item], k))
    return bins


@dataclass(frozen=True)
class TrainPlan:
    """One rank's share of the order (picklable): a `DataConfig` resolved and checked."""

    info: DatasetInfo
    micro_batch: int  # m
    global_batch: int  # G
    streams: int  # P
    image_size: int
    rank: int
    world_size: int
    workers: int  # logical workers of this rank
    seed: int
    shuffle_buffer: int
    augment: AugmentConfig | None
    mixup_alpha: float
    label_format: str
    num_classes: int
    record_keys: bool

    @property
    def chunk(self) -> int:
        """c: samples each stream gives a global batch."""
        return self.global_batch // self.streams

    @property
    def accumulation(self) -> int:
        """A: this rank's micro-batches per global batch."""
        return self.global_batch // (self.world_size * self.micro_batch)

    @property
    def rank_streams(self) -> range:
        per_rank = self.streams // self.world_size
        return range(self.rank * per_rank, (self.rank + 1) * per_rank)

    def worker_streams(self, logical: int) -> list[int]:
        mine = self.rank_streams
        return list(mine[logical * len(mine) // self.workers : (logical + 1) * len(mine) // self.workers])

    def stream_shards(self, epoch: int) -> list[list[int]]:
        """Every stream's shards in ``epoch``, in reading order (the same at every R and W)."""
        live = [i for i, c in enumerate(self.info.shard_counts) if c > 0]
        order = [live[i] for i in np.random.default_rng([self.seed, epoch]).permutation(len(live))]
        return balanced_split(order, self.info.shard_counts, self.streams)

    def capacities(self, epoch: int) -> list[int]:
        counts = self.info.shard_counts
        return [sum(counts[s] for s in shards) for shards in self.stream_shards(epoch)]

    def steps_in_epoch(self, epoch: int) -> int:
        return min(self.capacities(epoch)) // self.chunk

    def buffer_rng(self, epoch: int, stream: int) -> np.random.Generator:
        return np.random.default_rng([self.seed, epoch, stream, 0, 0, _BUFFER_TAG])

    def augment_rng(self, epoch: int, shard: int, member: int, repeat: int) -> np.random.Generator:
        return np.random.default_rng([self.seed, epoch, shard, member, repeat])

    def mixup_rng(self, epoch: int, stream: int, step: int) -> np.random.Generator:
        return np.random.default_rng([self.seed, epoch, stream, step, 0, _MIXUP_TAG])

    def fingerprint(self) -> dict[str, int]:
        return dict(
            seed=self.seed,
            global_batch_size=self.global_batch,
            streams=self.streams,
            shuffle_buffer=self.shuffle_buffer,
            num_samples=self.info.num_samples,
            num_shards=len(self.info.shards),
        )


def check_split(info: DatasetInfo, G: int, m: int, P: int, R: int, mixup_alpha: float) -> None:
    """The divisibility the stream split needs (as pretrain.config.ds_config.batch_plan)."""
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
            f"global_batch_size={G} is not divisible by world_size {R} x micro_batch_size {m}; pick a micro-batch "
            f"that divides {G // R}"
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


def _shuffled(items: Iterator[Draw], size: int, rng: np.random.Generator) -> Iterator[Draw]:
    if size <= 1:
        yield from items
        return
    buffer: list[Draw] = []
    for item in items:
        if len(buffer) < size:
            buffer.append(item)
            continue
        k = int(rng.integers(size))
        yield buffer[k]
        buffer[k] = item
    for k in rng.permutation(len(buffer)):
        yield buffer[k]


def stream_draws(
    plan: TrainPlan, epoch: int, stream: int, shards: list[int], stats: Counter, read: Callable = read_shard
) -> Iterator[Draw]:
    """Endless buffer draws of ``stream`` in ``epoch``; each pass (``repeat``) drains the buffer first. A pass of
    shards that yields nothing (all missing or unreadable) is followed by passes of the epoch's other shards."""
    size = min(plan.shuffle_buffer, sum(plan.info.shards[s].samples for s in shards))
    rng = plan.buffer_rng(epoch, stream)

    def one_pass(repeat: int, reading: list[int]) -> Iterator[Draw]:
        for s in reading:
            shard = plan.info.shards[s]
            for member, sample in enumerate(read(shard.url, shard.samples, stats)):
                yield s, member, repeat, sample

    reading = shards
    for repeat in itertools.count():
        seen = 0
        for item in _shuffled(one_pass(repeat, reading), size, rng):
            seen += 1
            yield item
        if seen:
            continue
        if reading is not shards or plan.streams == 1:
            raise _no_readable_shard(plan.info)
        reading = borrowed_shards(plan, epoch, stream)
        stats["borrowing_streams"] += 1
        log.warning(
            "stream %d of epoch %d: its shards hold no readable sample; it reads the epoch's other shards instead "
            "(those samples repeat in the epoch); check the folder with `python -m data_pipeline.validate %s`",
            stream,
            epoch,
            plan.info.root,
        )


def borrowed_shards(plan: TrainPlan, epoch: int, stream: int) -> list[int]:
    """What ``stream`` reads in ``epoch`` when its own shards hold no readable sample: the other streams' shards, in
    stream order from the next one; a wrap (``repeat`` >= 1, counted in ``wrapped_samples``) over them."""
    dealt = plan.stream_shards(epoch)
    return [s for k in range(1, plan.streams) for s in dealt[(stream + k) % plan.streams]]


def _no_readable_shard(info: DatasetInfo) -> ShardFormatError:
    return ShardFormatError(
        f"no shard of {info.root} holds a readable sample ({len(info.shards)} shards, e.g. {info.shards[0].url}); "
        f"check it with `python -m data_pipeline.validate {info.root}` and write the folder again"
    )


def stream_state(plan: TrainPlan, epoch: int, step: int, draws: dict[int, int], stats: Counter) -> dict[str, Any]:
    """A rank's position (JSON-serialisable) after ``step`` global batches of ``epoch``."""
    return dict(
        version=STATE_VERSION,
        epoch=epoch,
        step=step,
        draws={str(s): n for s, n in draws.items()},
        stats=dict(stats),
        fingerprint=plan.fingerprint(),
    )


def merge_stream_states(states: list[dict]) -> dict[str, Any]:
    """The ranks' states joined (all P streams' draws, stats summed); ValueError when they do not fit."""
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


def rank_position(plan: TrainPlan, state: dict) -> tuple[int, int, dict[int, int], Counter]:
    """(epoch, step, this rank's draws, counters) from any state holding them; ValueError on a mismatch."""
    _check_version(state)
    saved, now = state["fingerprint"], plan.fingerprint()
    diff = {k: (saved.get(k), v) for k, v in now.items() if saved.get(k) != v}
    if diff:
        raise ValueError(
            f"stream state does not match this stream (saved, now): {diff}; resume with the same data, seed, "
            "global batch size, streams and shuffle buffer"
        )
    draws = {int(k): int(v) for k, v in state["draws"].items()}
    missing = [s for s in plan.rank_streams if s not in draws]
    if missing:
        raise ValueError(
            f"stream state holds the draws of streams {sorted(draws)} but rank {plan.rank} of "
            f"{plan.world_size} reads streams {list(plan.rank_streams)}; load the merged state "
            "(merge_stream_states over every rank's state)"
        )
    # only the rank reading the state's first stream takes the counters: merged again, each counts once
    stats = Counter(state.get("stats", {})) if min(draws) in plan.rank_streams else Counter()
    return int(state["epoch"]), int(state["step"]), {s: draws[s] for s in plan.rank_streams}, stats


def _check_version(state: dict) -> None:
    version = state.get("version")
    if version == 1:
        raise ValueError(
            "this stream state (version 1) predates world-size-invariant streams: its positions are per "
            "rank and worker, not per canonical stream; resume that checkpoint with the version that wrote it"
        )
    if version != STATE_VERSION:
        raise ValueError(
            f"stream state version {version} is not {STATE_VERSION}; resume with the version that wrote it"
        )
