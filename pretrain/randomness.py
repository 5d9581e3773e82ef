"""Where a run's random numbers come from: the global generators seeded once per rank, and the model's own
randomness (dropout) seeded by its position in the run, so that nothing outside the model can shift it."""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


@contextmanager
def model_randomness(seed: int, step: int, micro_batch: int, device: torch.device) -> Iterator[None]:
    """Run the enclosed forward/backward with torch's generators (CPU, and this rank's GPU) seeded by the position
    (seed, optimizer step, global micro-batch index); the global states before it are put back afterwards.

    Why by position, and not one long per-rank stream that checkpoints save and restore: the model's randomness
    (dropout, attention dropout, anything stochastic in the task) then depends on nothing outside the model. A
    DataLoader created at a resume or an epoch rollover, a checkpoint write, an engine rebuild or any library that
    draws from the global generator cannot shift it, and a resumed or restarted run continues it exactly without any
    saved state: the same contract as the data stream's. Activation checkpointing replays the state it stashed in
    the forward, so a recompute in the backward sees the same masks.

    Why the global micro-batch index (rank × accumulation steps + micro) and not the rank: global micro-batch u holds
    the same samples at every world size (docs/elastic.md), so seeded by u its dropout masks are the same too, and a
    run resumed at another world size computes the same losses up to the order of the sums.
    """
    key = int(np.random.SeedSequence([seed, step, micro_batch]).generate_state(1, np.uint64)[0])
    gpus = [device.index] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=gpus):
        torch.default_generator.manual_seed(key)
        for index in gpus:
            torch.cuda.default_generators[index].manual_seed(key)
        yield
