"""How both streams (training and evaluation) get their items out of DataLoader worker processes: the start method,
with the stream modules preloaded in the fork server, and the workers' base seed, drawn from a private generator.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset

# The modules whose datasets the workers unpickle (TrainStream's epochs, EvalStream's shards), with all they import.
_WORKER_MODULES = ("data_pipeline.stream.train_stream", "data_pipeline.stream.eval_stream")


def worker_items(
    dataset: IterableDataset,
    num_workers: int,
    start_method: str | None,
    seed_key: tuple[int, ...],
    prefetch_factor: int | None = None,
) -> Iterator[Any]:
    """``dataset``'s items: read in this process with ``num_workers=0``, else by that many DataLoader workers
    started by ``start_method`` (None: the platform's default), which the DataLoader's round-robin interleaves in
    worker order. ``prefetch_factor`` (None: torch's default, 2) items per worker may be ready ahead."""
    if num_workers == 0:
        return iter(dataset)
    loader = DataLoader(
        dataset,
        batch_size=None,
        num_workers=num_workers,
        multiprocessing_context=_start_method(start_method),
        prefetch_factor=prefetch_factor,
        generator=_loader_generator(*seed_key),
    )
    return iter(loader)


def _start_method(method: str | None) -> str | None:
    """The DataLoader's start method, with the stream modules preloaded in the fork server when it is ``forkserver``.

    forkserver is the default: workers then fork from a server process that started clean, never from the training
    process. That one runs other threads (gloo's, DeepSpeed's, the queue feeders of the previous epoch's loader), and
    a fork that lands while one of them holds an interpreter lock leaves the child hung before it runs a line: seen
    here with CPython 3.11, a rank waiting forever on its first batch (docs/reference.md, "DataLoader workers").
    Preloaded, the server has imported torch and the stream modules once, and a new epoch's workers start in
    milliseconds instead of ~1.5 s each. Only effective before the process's fork server starts (the first
    forkserver loader).
    """
    if method == "forkserver":
        multiprocessing.set_forkserver_preload(list(_WORKER_MODULES))
    return method


def _loader_generator(*key: int) -> torch.Generator:
    """A private generator for a DataLoader, seeded by ``key``: each (re)created multi-process iterator draws its
    workers' base seed from it.

    Without one, that draw comes from the *global* torch generator, the one dropout uses, so creating the loader at
    a resume, an epoch rollover or a resolution switch would shift the model's random stream. The workers seed every
    choice they make by position (`data_pipeline.stream.order`), so the base seed only has to be reproducible, never
    random.
    """
    return torch.Generator().manual_seed(int(np.random.SeedSequence(list(key)).generate_state(1, np.uint64)[0]))
