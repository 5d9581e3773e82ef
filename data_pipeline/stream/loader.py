"""DataLoader workers for both streams (`worker_items`): the start method, with the stream modules preloaded in the
fork server, and the workers' base seed, drawn from a private generator.
"""

from __future__ import annotations

import multiprocessing
import os
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
    (``start_method`` None: the platform's default), interleaved round-robin in worker order."""
    if num_workers == 0:
        return iter(dataset)
    loader = DataLoader(
        dataset,
        batch_size=None,
        num_workers=num_workers,
        multiprocessing_context=_start_method(start_method),
        prefetch_factor=prefetch_factor,
        generator=_loader_generator(*seed_key),
        worker_init_fn=_Environment(dict(os.environ)) if start_method == "forkserver" else None,
    )
    return iter(loader)


class _Environment:
    """A forkserver worker's environment made this process's as the loader starts, as a fork or spawn worker's is.
    Forked from the fork server, it would otherwise have the environment the server started with (at the process's
    first forkserver loader): an object-store endpoint or credentials set since then would not reach the reads."""

    def __init__(self, environ: dict[str, str]):
        self.environ = environ

    def __call__(self, worker_id: int) -> None:
        os.environ.clear()
        os.environ.update(self.environ)


def _start_method(method: str | None) -> str | None:
    """``method``, with the stream modules preloaded in the fork server when it is ``forkserver``.

    forkserver, the default, never forks the threaded training process, which can hang the child
    (docs/reference.md §6, "DataLoader workers"). Preloaded, a new epoch's workers need not import torch again.
    Effective only before the process's fork server starts (its first forkserver loader).
    """
    if method == "forkserver":
        multiprocessing.set_forkserver_preload(list(_WORKER_MODULES))
    return method


def _loader_generator(*key: int) -> torch.Generator:
    """A generator seeded by ``key``, from which a DataLoader draws its workers' base seed.

    Without it that draw comes from the global torch generator, which dropout uses, so making a loader would shift
    the model's random stream. Workers seed every choice by position, so the base seed need only be reproducible.
    """
    return torch.Generator().manual_seed(int(np.random.SeedSequence(list(key)).generate_state(1, np.uint64)[0]))
