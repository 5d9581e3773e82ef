"""A run's random numbers: the global generators (`rng_state`) and the model's own (`model_randomness`)."""

from __future__ import annotations

import base64
import random
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, cast

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


@contextmanager
def model_randomness(seed: int, step: int, micro_batch: int, device: torch.device) -> Iterator[None]:
    """Run the enclosed code with torch's generators seeded by (seed, step, global micro-batch), restored afterwards
    (docs/elastic.md, "Checkpoints at another world size")."""
    key = int(np.random.SeedSequence([seed, step, micro_batch]).generate_state(1, np.uint64)[0])
    gpus = [device.index] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=gpus):
        torch.default_generator.manual_seed(key)
        for index in gpus:
            torch.cuda.default_generators[index].manual_seed(key)
        yield


def rng_state() -> dict[str, Any]:
    """This process's global RNG states (python, numpy, torch, each visible CUDA device), JSON-safe."""
    py, np_state = random.getstate(), cast(tuple[Any, ...], np.random.get_state())  # numpy's: the legacy tuple
    state: dict[str, Any] = {
        "python": [py[0], list(py[1]), py[2]],
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
    }
    if torch.cuda.is_available():
        state["cuda"] = [base64.b64encode(s.numpy().tobytes()).decode() for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(_bytes_tensor(state["torch"]))
    if "cuda" in state and torch.cuda.is_available():
        # a process seeing fewer devices restores those it has
        for index, saved in enumerate(state["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(_bytes_tensor(saved), index)


def _bytes_tensor(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8).clone()
