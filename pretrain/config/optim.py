"""The recipe sections ``optim`` and ``schedule`` (docs/reference.md §3). The loop sets `LRSchedule(step)` itself
(`set_lr`), so a resume needs only the step number."""

from __future__ import annotations

import math
import re
import typing
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from data_pipeline.cli import at_least, positive

Decay = Literal["linear", "cosine", "constant"]  # schedule.decay
DECAYS: tuple[str, ...] = typing.get_args(Decay)
Duration = int | str  # optimizer steps, or with a unit: "90ep", "1.2e6img", "500st"
_DURATION = re.compile(
    r"^\s*([0-9][0-9_]*(?:\.[0-9_]*)?(?:[eE][+-]?[0-9]+)?)\s*(st|steps?|ep|epochs?|img|images?)?\s*$"
)


@dataclass(frozen=True)
class OptimConfig:
    """Recipe section ``optim``: AdamW."""

    lr: float = 1e-3  # peak learning rate, reached at the end of warmup
    beta1: float = 0.9  # Adam first-moment decay
    beta2: float = 0.999  # Adam second-moment decay
    eps: float = 1e-8  # Adam denominator epsilon
    weight_decay: float = 0.1  # decoupled, times the current lr; weight matrices only
    grad_clip: float = 1.0  # clip the global gradient norm to this; 0 disables


@dataclass(frozen=True)
class ScheduleConfig:
    """Recipe section ``schedule``: linear warmup to `optim.lr`, then decay to `end_lr`."""

    total: Duration = "90ep"  # training length
    warmup: Duration = 10_000  # linear warmup length
    decay: Decay = "linear"  # linear (i21k) | cosine (AugReg) | constant
    end_lr: float = 1e-5  # lr at the last step (linear/cosine)
    stop_at_step: int | None = None  # stop early; the schedule still spans `total`


def duration_to_steps(
    duration: Duration,
    global_batch_size: int,
    epoch_images: int | None,
    *,
    field: str = "duration",
    zero_ok: bool = False,
) -> int:
    """Optimizer steps in a duration, rounded up; epochs need ``epoch_images``."""
    if isinstance(duration, bool):
        raise ValueError(f"{field}={duration!r} is not a duration; write steps (10000) or '90ep' / '1e6img'")
    if isinstance(duration, int):
        steps = duration
    else:
        match = _DURATION.match(str(duration))
        if match is None:
            raise ValueError(
                f"{field}={duration!r} is not a duration; write steps (10000 or '10000st'), epochs ('90ep') "
                "or images ('1.2e6img')"
            )
        amount, unit = float(match.group(1).replace("_", "")), (match.group(2) or "st")
        if not math.isfinite(amount):
            raise ValueError(f"{field}={duration!r} is not a finite duration; write steps, epochs or images")
        if unit.startswith("ep"):
            if not epoch_images:
                raise ValueError(
                    f"{field}={duration!r} counts epochs but the epoch size is unknown; set data.epoch_images "
                    "(images per epoch) or point data.train at a shard folder with dataset.json"
                )
            steps = math.ceil(amount * epoch_images / global_batch_size)
        elif unit.startswith(("img", "image")):
            steps = math.ceil(amount / global_batch_size)
        else:
            steps = math.ceil(amount)
    if steps < 0 or (steps == 0 and not zero_ok):
        raise ValueError(f"{field}={duration!r} gives {steps} steps; it must be {'>= 0' if zero_ok else '> 0'}")
    return int(steps)


@dataclass(frozen=True)
class LRSchedule:
    """Learning rate of each 0-based optimizer step: warmup to `peak_lr`, then decay to `end_lr`."""

    peak_lr: float
    warmup_steps: int
    total_steps: int
    decay: Decay = "linear"
    end_lr: float = 0.0

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            # the first update already moves the weights, as upstream's step 1 does
            return self.peak_lr * (step + 1) / self.warmup_steps
        if self.decay == "constant":
            return self.peak_lr
        # the last step uses exactly end_lr
        span = max(1, self.total_steps - self.warmup_steps - 1)
        progress = min(1.0, (step - self.warmup_steps) / span)
        if self.decay == "linear":
            return self.peak_lr + (self.end_lr - self.peak_lr) * progress
        if self.decay == "cosine":
            return self.end_lr + 0.5 * (self.peak_lr - self.end_lr) * (1.0 + math.cos(math.pi * progress))
        raise ValueError(f"schedule.decay={self.decay!r} is unknown; use one of {DECAYS}")


def build_schedule(
    optim: OptimConfig, schedule: ScheduleConfig, global_batch_size: int, epoch_images: int | None
) -> LRSchedule:
    total = duration_to_steps(schedule.total, global_batch_size, epoch_images, field="schedule.total")
    warmup = duration_to_steps(schedule.warmup, global_batch_size, epoch_images, field="schedule.warmup", zero_ok=True)
    return LRSchedule(optim.lr, warmup, total, schedule.decay, schedule.end_lr)


def check_config(
    optim: OptimConfig, schedule: ScheduleConfig, global_batch_size: int, epoch_images: int | None
) -> None:
    if not optim.lr > 0:
        raise ValueError(f"optim.lr={optim.lr} must be > 0; the paper's i21k runs use optim.lr=1e-3")
    at_least(optim.weight_decay, 0.0, "optim.weight_decay")
    for name in ("beta1", "beta2"):
        if not 0.0 <= getattr(optim, name) < 1.0:
            raise ValueError(f"optim.{name}={getattr(optim, name)} must be in [0, 1); the paper uses 0.9 / 0.999")
    positive(optim.eps, "optim.eps")
    at_least(optim.grad_clip, 0.0, "optim.grad_clip")
    if not 0.0 <= schedule.end_lr <= optim.lr:
        raise ValueError(f"schedule.end_lr={schedule.end_lr} must be in [0, optim.lr={optim.lr}]")
    lr = build_schedule(optim, schedule, global_batch_size, epoch_images)  # checks each duration
    if lr.warmup_steps >= lr.total_steps:
        raise ValueError(
            f"schedule.warmup ({lr.warmup_steps} steps) must be shorter than schedule.total ({lr.total_steps} steps)"
        )
    if schedule.stop_at_step is not None:
        positive(schedule.stop_at_step, "schedule.stop_at_step")


def no_decay_names(module: nn.Module) -> set[str]:
    """Parameter names that skip weight decay: submodules' `no_weight_decay()` and all 0-/1-D params."""
    names = {name for name, p in module.named_parameters() if p.ndim < 2}
    for prefix, sub in module.named_modules():
        if hasattr(sub, "no_weight_decay"):
            names |= {f"{prefix}.{n}" if prefix else n for n in sub.no_weight_decay()}
    return names


def param_groups(module: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Two AdamW groups, decayed and not; frozen params are left out."""
    skip = no_decay_names(module)
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for name, p in module.named_parameters():
        if p.requires_grad:
            (no_decay if name in skip else decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay, "name": "decay"},
        {"params": no_decay, "weight_decay": 0.0, "name": "no_decay"},
    ]


def build_optimizer(module: nn.Module, optim: OptimConfig, device_type: str = "cpu") -> torch.optim.AdamW:
    """torch AdamW, so no DeepSpeed optimizer op is compiled; on a GPU its fused kernel (one launch for all
    tensors; docs/performance.md, "The GPU step"), elsewhere torch's default, whose CPU numerics the tests pin."""
    return torch.optim.AdamW(
        param_groups(module, optim.weight_decay),
        lr=optim.lr,
        betas=(optim.beta1, optim.beta2),
        eps=optim.eps,
        fused=True if device_type == "cuda" else None,
    )


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
