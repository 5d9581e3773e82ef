"""The training stream's step buffers (`StepPool`) in shared memory (docs/elastic.md, "Assembly") and their sizes."""

from __future__ import annotations

import shutil
from typing import Literal

import numpy as np
import torch

from data_pipeline.stream.augment import TrainImage, channels_first, to_float_images

Pixels = Literal["float", "uint8"]  # float32 in [-1, 1], or the pixels as decoded
PREFETCH_FACTOR = 2  # steps a loader worker may be ahead
CONVERSION_BYTES = 512 * 1024  # float rows converted at once: they stay in a core's L2


def step_slots(num_workers: int, prefetch_factor: int = PREFETCH_FACTOR) -> int:
    """Steps written ahead (with workers), the one handed over, the one before (still held) and a spare."""
    return prefetch_factor + 3 if num_workers > 0 else 3


def step_pool_bytes(
    images_per_step: int,
    image_size: int,
    num_workers: int,
    prefetch_factor: int = PREFETCH_FACTOR,
    pixels: Pixels = "float",
) -> int:
    value_bytes = 4 if pixels == "float" else 1
    return step_slots(num_workers, prefetch_factor) * images_per_step * 3 * image_size**2 * value_bytes


def conversion_rows(image_size: int) -> int:
    return max(1, CONVERSION_BYTES // (3 * image_size**2 * 4))


def decoded_bytes(
    images_per_step: int,
    image_size: int,
    num_workers: int,
    prefetch_factor: int = PREFETCH_FACTOR,
    pixels: Pixels = "float",
) -> int:
    """Host bytes of a rank's decoded images: its step pool (of ``pixels``) and each worker's planes."""
    planes = conversion_rows(image_size) * 3 * image_size**2
    return step_pool_bytes(images_per_step, image_size, num_workers, prefetch_factor, pixels) + num_workers * planes


def check_shared_memory(needed: int, free: int | None, where: str = "/dev/shm") -> None:
    """ValueError naming the fixes if ``where`` lacks ``needed`` bytes (past a full /dev/shm workers die of SIGBUS)."""
    if free is not None and needed > free:
        raise shared_memory_error(needed, free, where)


def shared_memory_error(needed: int, free: int | None, where: str = "/dev/shm") -> ValueError:
    has = "too little" if free is None else f"{free / 2**20:.0f} MiB"
    return ValueError(
        f"the loader's step buffers need {needed / 2**20:.0f} MiB of shared memory but {where} has "
        f"{has} free: give it more (docker run --shm-size=..., a memory-backed emptyDir on "
        "/dev/shm in Kubernetes), or lower the per-rank batch (global batch / world size) or the image size, or "
        "set data.num_workers=0 (no shared memory)"
    )


def shm_free(where: str = "/dev/shm") -> int | None:
    """Free bytes of ``where``; None where there is none (not Linux)."""
    try:
        return shutil.disk_usage(where).free
    except OSError:
        return None


def _storage_uses(t: torch.Tensor) -> int | None:
    count = getattr(torch._C, "_storage_Use_Count", None)
    return None if count is None else count(t.untyped_storage()._cdata)


class StepPool:
    """A rank's step buffers (A m, 3, S, S). `grant` gives a step only a buffer with no live view (-1 when none
    is free: workers send pixels); `take` checks ``stamps[buffer, worker]``, the step a worker's rows hold."""

    def __init__(
        self,
        slots: int,
        rows: int,
        image_size: int,
        workers: int,
        lookahead: int,
        shared: bool,
        pixels: Pixels = "float",
    ):
        def made(t: torch.Tensor) -> torch.Tensor:
            return t.share_memory_() if shared else t

        dtype = torch.float32 if pixels == "float" else torch.uint8
        try:
            self.buffers = [made(torch.empty((rows, 3, image_size, image_size), dtype=dtype)) for _ in range(slots)]
            self.stamps = made(torch.full((slots, workers), -1, dtype=torch.int64))
            self.grants = made(torch.full((lookahead + 2, 2), -1, dtype=torch.int64))
        except RuntimeError as error:  # the node's other ranks filled /dev/shm after `check_shared_memory`
            if not shared:
                raise
            raise shared_memory_error(slots * rows * 3 * image_size**2 * dtype.itemsize, shm_free()) from error
        self.owner: list[int | None] = [None] * slots  # the step in flight in each buffer
        self.unshared = [_storage_uses(b) for b in self.buffers]

    def __getstate__(self) -> dict:
        return dict(buffers=self.buffers, stamps=self.stamps, grants=self.grants)

    def grant(self, step: int) -> None:
        """Give ``step`` a free buffer, or -1, before the loader can ask for its items."""
        free = [j for j, b in enumerate(self.buffers) if self.owner[j] is None and _storage_uses(b) == self.unshared[j]]
        slot = free[0] if free and self.unshared[0] is not None else -1  # no use count: no reuse
        if slot >= 0:
            self.owner[slot] = step
        self.grants[step % len(self.grants)] = torch.tensor([step, slot])

    def slot(self, step: int) -> int:
        """In a worker: the buffer granted to ``step``, -1 for none."""
        granted, slot = self.grants[step % len(self.grants)].tolist()
        if granted != step:
            raise RuntimeError(f"loader grant for step {step} missing (the table holds step {granted})")
        return slot

    def write(
        self, step: int, slot: int, worker: int, start: int, images: list[TrainImage], scratch: np.ndarray
    ) -> None:
        """A worker's images of ``step`` -> rows [start, start + len) of buffer ``slot``, through uint8 ``scratch``."""
        self.stamps[slot, worker] = -1
        rows = self.buffers[slot][start : start + len(images)]
        if rows.dtype == torch.uint8:
            channels_first(images, out=rows.numpy())
        else:
            for i in range(0, len(images), len(scratch)):
                group = images[i : i + len(scratch)]
                to_float_images([torch.from_numpy(channels_first(group, out=scratch))], out=rows[i : i + len(group)])
        self.stamps[slot, worker] = step

    def take(self, step: int, slot: int) -> torch.Tensor:
        """Buffer ``slot`` once every worker's stamp says its rows hold ``step``; no longer in flight."""
        stamps = self.stamps[slot].tolist()
        if any(s != step for s in stamps):
            raise RuntimeError(f"loader buffer {slot} holds steps {stamps} of the workers' rows, not step {step}")
        self.owner[slot] = None  # from here, live views keep it from a grant
        return self.buffers[slot]
