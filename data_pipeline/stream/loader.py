"""DataLoader workers for both streams (`worker_items`)."""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset

_WORKER_MODULES = ("data_pipeline.stream.train_stream", "data_pipeline.stream.eval_stream")


def worker_items(
    dataset: IterableDataset,
    num_workers: int,
    start_method: str | None,
    seed_key: tuple[int, ...],
    prefetch_factor: int | None = None,
) -> Iterator[Any]:
    """``dataset``'s items, read here (``num_workers=0``) or by DataLoader workers round-robin."""
    if num_workers == 0:
        return iter(dataset)
    if start_method == "forkserver":  # never forks the threaded trainer (docs/reference.md §6, "DataLoader workers")
        multiprocessing.set_forkserver_preload(list(_WORKER_MODULES))
    loader = DataLoader(
        dataset,
        batch_size=None,
        num_workers=num_workers,
        multiprocessing_context=start_method,
        prefetch_factor=prefetch_factor,
        generator=_loader_generator(*seed_key),
        worker_init_fn=_Environment(dict(os.environ)) if start_method == "forkserver" else None,
    )
    return _worker_errors_as_raised(iter(loader))


def _worker_errors_as_raised(items: Iterator[Any]) -> Iterator[Any]:
    """``items``, a ValueError a worker raised (a damaged set, bad input) with its own one-line message: DataLoader
    raises it again with the worker's traceback in the message, which entry points print as their one line."""
    try:
        yield from items
    except ValueError as error:
        kind, text = type(error), str(error)
        name = kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
        marker = f"\n{name}: "
        if not text.startswith("Caught ") or marker not in text:
            raise
        raise kind(text.rsplit(marker, 1)[1].strip()) from error


@dataclass(eq=False)
class _Environment:
    """A forkserver worker gets this process's environment, not the fork server's from its start."""

    environ: dict[str, str]

    def __call__(self, worker_id: int) -> None:
        os.environ.clear()
        os.environ.update(self.environ)


def _loader_generator(*key: int) -> torch.Generator:
    """The DataLoader's base seed, from a private generator: not the global one dropout uses."""
    return torch.Generator().manual_seed(int(np.random.SeedSequence(list(key)).generate_state(1, np.uint64)[0]))
