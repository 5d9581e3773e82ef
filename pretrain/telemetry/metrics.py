"""The training loop's metrics, `TrainMetrics`: every rank calls `step` each optimizer step; rank 0 prints and logs
the `train/` metrics of `tracking.keys`. A non-finite (all-reduced) loss raises `NonFiniteLossError` on every rank.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field
from typing import Any, SupportsFloat

import torch

from tracking import keys
from tracking.tracker import Tracker


class NonFiniteLossError(FloatingPointError):
    """The training loss is NaN or inf."""


def memory_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    with open("/proc/self/statm") as f:  # resident pages
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30


def percentile(values: list[float], p: float) -> float:
    """The ``p``-th percentile, interpolated as numpy's."""
    ordered = sorted(values)
    rank = (len(ordered) - 1) * p / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def tail_metrics(step_s: list[float], data_s: list[float]) -> dict[str, float]:
    """Percentiles of a window's step times and data waits."""
    if not step_s:
        return {}
    out = {keys.step_time_percentile(p): percentile(step_s, p) for p in keys.TAIL_PERCENTILES}
    out.update({keys.data_wait_percentile(p): percentile(data_s, p) for p in keys.TAIL_PERCENTILES})
    return out


@dataclass
class TrainMetrics:
    rank: int
    world_size: int
    total_steps: int
    flops_per_image: int  # training FLOPs per image at the current resolution (the loop updates it at a switch)
    peak_tflops: float  # per device (`pretrain.telemetry.peak`)
    device: torch.device
    log_every: int = 10
    tracker: Tracker | None = None  # no-op off rank 0
    progress_bar: bool = True
    start_step: int = 0
    images_seen: int = 0
    flops_seen: int | None = None  # training FLOPs before start_step; None: images_seen at flops_per_image
    _flops: int = 0  # training FLOPs so far
    _window: dict[str, float] = field(default_factory=dict)
    _step_s: list[float] = field(default_factory=list)  # this window's step times and data waits
    _data_s: list[float] = field(default_factory=list)
    _bar: Any = None
    _unread: list[tuple[int, SupportsFloat, float]] = field(default_factory=list)  # (step, loss, lr) unchecked

    def __post_init__(self) -> None:
        self._flops = self.images_seen * self.flops_per_image if self.flops_seen is None else self.flops_seen
        self._reset_window()
        if self.tracker is not None:
            # a restarted group redoes steps: keep each step's first value
            self.tracker.log_once_per_step(keys.TRAIN_PREFIX)
        if self.rank == 0 and self.progress_bar:
            from tqdm import tqdm

            self._bar = tqdm(
                total=self.total_steps, initial=self.start_step, desc="train", unit="step", dynamic_ncols=True
            )

    def _check_losses(self) -> None:
        """NonFiniteLossError at the first non-finite loss since the last check."""
        unread, self._unread = self._unread, []
        for step, loss, lr in unread:
            if not math.isfinite(float(loss)):
                raise NonFiniteLossError(
                    f"loss is {float(loss)} at step {step} (lr {lr:.3g}); training stopped. Try a lower optim.lr, a "
                    "longer schedule.warmup, optim.grad_clip=1.0, or deepspeed.precision=fp32; the newest checkpoint "
                    "is intact."
                )

    def _reset_window(self, overhead_s: float = 0.0) -> None:
        now = time.perf_counter()
        self._window = {"start": now, "overhead_s": overhead_s, "images": 0, "flops": 0.0, "data_s": 0.0, "last": now}
        self._step_s, self._data_s = [], []

    def start(self, overhead_s: float = 0.0) -> None:
        """The loop begins: the first window starts here, after the start-up and the baseline save (``overhead_s``:
        as `step`'s)."""
        self._reset_window(overhead_s)

    def step(
        self,
        step: int,
        loss: SupportsFloat,
        lr: float,
        grad_norm: SupportsFloat | None,
        images: int,
        data_s: float,
        step_s: float | None = None,
        read: bool = False,
        overhead_s: float = 0.0,
    ) -> dict:
        """Record step ``step`` (1-based); returns the metrics logged, if any. ``images``: all ranks'; ``step_s``:
        without saves (None: since the last call); ``overhead_s``: the seconds so far that were not training (start-up,
        resolution switches, saves: `AttemptClock.overhead_s`), which the window's throughput leaves out. Losses are
        read (a device wait) and checked when logging, at the last step, and if ``read``."""
        now = time.perf_counter()
        self._step_s.append(now - self._window["last"] if step_s is None else step_s)
        self._data_s.append(data_s)
        self._window["last"] = now
        self._unread.append((step, loss, lr))
        logs = not step % self.log_every or step == self.total_steps
        if logs or read:
            self._check_losses()
        self.images_seen += images
        self._flops += images * self.flops_per_image
        self._window["images"] += images
        self._window["flops"] += images * self.flops_per_image
        self._window["data_s"] += data_s
        if self._bar is not None:
            self._bar.update(1)
        if self.rank == 0 and self.tracker is not None:  # every step: an elastic job changes it
            self.tracker.log_metrics({keys.WORLD_SIZE_METRIC: self.world_size}, step=step)
        if not logs:
            return {}
        # the window's wall time, its last loss read included (a GPU's queued work ends there), less saves and switches
        overhead = overhead_s - self._window["overhead_s"]
        elapsed = max(time.perf_counter() - self._window["start"] - overhead, 1e-9)
        images_per_s = self._window["images"] / elapsed
        tflops = self._window["flops"] / elapsed / self.world_size / 1e12  # per device
        metrics = {
            keys.LOSS: float(loss),
            keys.LR: lr,
            keys.IMAGES_PER_S: images_per_s,
            keys.TFLOPS: tflops,
            keys.MFU: tflops / self.peak_tflops,
            keys.DATA_WAIT: min(1.0, self._window["data_s"] / elapsed),
            keys.MEMORY_GB: memory_gb(self.device),
            keys.IMAGES_SEEN: float(self.images_seen),
            keys.EXAFLOPS: self._flops / 1e18,
        }
        if grad_norm is not None and math.isfinite(float(grad_norm)):
            metrics[keys.GRAD_NORM] = float(grad_norm)
        metrics.update(tail_metrics(self._step_s, self._data_s))
        self._reset_window(overhead_s)
        if self.rank == 0:
            if self.tracker is not None:
                self.tracker.log_metrics(metrics, step=step)
            self._show(step, metrics)
        return metrics

    def _show(self, step: int, m: dict[str, float]) -> None:
        text = (
            f"loss {m[keys.LOSS]:.4f} lr {m[keys.LR]:.2e} {m[keys.IMAGES_PER_S]:.1f} img/s "
            f"mfu {m[keys.MFU]:.1%} wait {m[keys.DATA_WAIT]:.0%}"
        )
        if self._bar is not None:
            self._bar.set_postfix_str(text, refresh=False)
        else:
            print(f"step {step}/{self.total_steps} {text}", flush=True)

    def close(self) -> None:
        """Close the progress bar, not the tracker."""
        if self._bar is not None:
            self._bar.close()
