"""One rank's engine, data stream and position, and the optimizer step."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from data_pipeline.manifest import is_shard_folder, read_dataset_info
from data_pipeline.stream.train_stream import TrainStream
from pretrain import checkpointer as ckpt
from pretrain.checkpoint.run_folder import TrainerState
from pretrain.config import progressive
from pretrain.config.ds_config import BatchPlan, batch_plan
from pretrain.config.optim import build_schedule, set_lr
from pretrain.config.precision import PrecisionChoice
from pretrain.config.train_config import TrainConfig
from pretrain.distributed import Placement, Readback, mean_over_ranks
from pretrain.engine import build_engine, decide_precision
from pretrain.feed import DeviceFeed
from pretrain.randomness import model_randomness, seed_everything, set_rng_state
from pretrain.telemetry.recorder import Recorder


def prepare_data(config: TrainConfig, place: Placement) -> tuple[int, int]:
    """(num_classes, epoch size) of the training set (a folder that contradicts itself: `TrainConfig.validate` and
    the stream refuse it). Ranks never generate it: `pretrain.train` and `cluster.launch` write a built-in set before
    training starts."""
    d = config.data
    if d.builtin is not None and not is_shard_folder(Path(d.train)):
        raise ValueError(
            f"data.train={d.train!r} holds no shard folder; the built-in set {d.builtin!r} is written before training "
            f"by `python -m pretrain.train` or `make launch`, or by `python -m data_pipeline.builtin {d.builtin} "
            f"--out {Path(d.train).parent.parent}`"
        )
    info = read_dataset_info(d.train)
    if config.model.num_classes is not None and info.num_classes > config.model.num_classes:
        raise ValueError(
            f"model.num_classes={config.model.num_classes} but {d.train} has {info.num_classes} classes; set "
            f"model.num_classes={info.num_classes} (or null to take it from the dataset)"
        )
    return config.model.num_classes or info.num_classes, d.epoch_images or info.num_samples


def build_stream(config: TrainConfig, place: Placement, num_classes: int) -> TrainStream:
    return TrainStream(
        config.data,
        rank=place.rank,
        world_size=place.world_size,
        num_classes=num_classes,
        record_keys=config.logging.record_sample_keys,
        pixels=config.data.pixels_for(place.device.type),
    )


def _next_batch(it: Iterator, feed: DeviceFeed) -> tuple[torch.Tensor, torch.Tensor, float]:
    start = time.perf_counter()
    images, labels = feed(next(it))  # (B, 3, S, S) in the compute dtype, on the device
    return images, labels, time.perf_counter() - start


@dataclass
class StepResult:
    """One optimizer step; ``loss`` and ``grad_norm`` stay on the device until ``float()`` reads them."""

    loss: Readback  # the mean over micro-batches and ranks
    lr: float
    data_s: float  # seconds this rank waited for batches
    grad_norm: Readback | None


class Trainer:
    """One rank's training; ``current``: the config in force (at this step's image size)."""

    def __init__(
        self,
        config: TrainConfig,
        place: Placement,
        num_classes: int,
        plan: BatchPlan,
        schedule: Callable[[int], float],
        last_step: int,
        total_steps: int,
        start: ckpt.StartPoint,
        current: TrainConfig,
        precision: PrecisionChoice,
    ):
        self.config, self.place, self.num_classes, self.plan = config, place, num_classes, plan
        self.schedule, self.last_step, self.total_steps = schedule, last_step, total_steps
        self.start_point, self.current, self.precision = start, current, precision
        # bf16: the compute copy; fp32 master weights and optimizer state live in ZeRO, the loss is fp32
        self.dtype = torch.bfloat16 if precision.precision == "bf16" else torch.float32
        universal = ckpt.prepare_resume(start, place.world_size, place.rank)
        self.engine, self.model = build_engine(
            current, place, num_classes, start, precision.precision, universal is not None
        )
        self.stream = build_stream(current, place, num_classes)
        self.state: TrainerState | None = ckpt.resume(
            self.engine, self.stream, start, place.rank, place.world_size, current, universal
        )
        self.step = self.start_step = self.state.step if self.state else 0
        self.images_seen = self.state.images_seen if self.state else 0
        self._batches: Iterator | None = None
        self.feed = DeviceFeed(place.device, self.dtype)

    @classmethod
    def start(cls, config: TrainConfig, place: Placement) -> Trainer:
        """Everything before the first step."""
        num_classes, epoch_images = prepare_data(config, place)
        plan = batch_plan(config.data, place.world_size)
        schedule = build_schedule(config.optim, config.schedule, plan.global_batch_size, epoch_images)
        last_step = min(schedule.total_steps, config.schedule.stop_at_step or schedule.total_steps)
        start = ckpt.find_start(config)
        current = progressive.start_config(config, start)
        precision = decide_precision(current, place, num_classes, start)
        if place.rank == 0:
            print(precision.line(config.deepspeed.precision), flush=True)
        return cls(
            config, place, num_classes, plan, schedule, last_step, schedule.total_steps, start, current, precision
        )

    def restore_randomness(self) -> None:
        """The global generators as the checkpoint left them, or seeded per rank; the model's randomness does not
        depend on them (`pretrain.randomness.model_randomness`)."""
        state, rank, seed = self.state, self.place.rank, self.config.seed
        if state is not None and rank < len(state.rng_states):
            set_rng_state(state.rng_states[rank])
        elif state is not None:  # a rank the checkpoint's smaller world lacked
            seed_everything(seed * 1000 + rank + 1 + state.step * 100_003)
        else:
            seed_everything(seed * 1000 + rank + 1)

    @property
    def epoch(self) -> int:
        """The stream's epoch; right after a step, that step's."""
        return int(self.stream.state_dict()["epoch"])

    def maybe_switch_resolution(self, on_switch: Callable[[str], None] | None = None) -> bool:
        """Switch to this step's image size if it changed, calling ``on_switch("switch")`` first; whether it did."""
        target = progressive.config_at(self.config, self.step)
        if target.data.image_size == self.current.data.image_size:
            return False
        if on_switch is not None:
            on_switch("switch")
        scratch = ckpt.StartPoint("scratch", None)
        self.engine, self.model = progressive.switch_resolution(
            self.engine,
            self.model,
            lambda: build_engine(target, self.place, self.num_classes, scratch, self.precision.precision),
        )
        stream = build_stream(target, self.place, self.num_classes)
        stream.load_state_dict(self.stream.state_dict())
        self.current, self.stream, self._batches = target, stream, None
        return True

    def train_step(self, recorder: Recorder | None = None) -> StepResult:
        """One optimizer step over ``plan.grad_accum_steps`` micro-batches."""
        if self._batches is None:
            self._batches = iter(self.stream)
        lr = self.schedule(self.step)
        set_lr(self.engine.optimizer, lr)
        accum, place = self.plan.grad_accum_steps, self.place
        loss_sum, data_s = torch.zeros((), device=place.device), 0.0
        for micro in range(accum):
            images, labels, wait = _next_batch(self._batches, self.feed)
            data_s += wait
            if recorder is not None and recorder.wants_batches:
                recorder.batch(images, labels, (self.stream.last_keys or []) if recorder.want_keys else [])
            with model_randomness(self.config.seed, self.step, place.rank * accum + micro, place.device):
                loss, _ = self.engine(images, labels)
                self.engine.backward(loss)  # scales by 1/accum_steps; reduces across ranks at the boundary
            self.engine.step()  # steps only at the accumulation boundary
            loss_sum += loss.detach().float()
        self.step += 1
        self.images_seen += self.plan.global_batch_size
        mean_loss = mean_over_ranks(loss_sum / accum)
        grad_norm = self.engine.get_global_grad_norm()
        return StepResult(mean_loss, lr, data_s, None if grad_norm is None else Readback(grad_norm))

    def close(self) -> None:
        """Destroy the engine: its hooks form a cycle the collector cannot see, so a process that trains more than
        once (a Ray worker) would keep every engine."""
        self.engine.destroy()

    def describe(self) -> dict[str, Any]:
        """Where this attempt started and ended (`TrainSummary`'s position fields)."""
        return {
            "start": self.start_point.kind,
            "start_step": self.start_step,
            "steps": self.step,
            "images_seen": self.images_seen,
            "rank": self.place.rank,
            "world_size": self.place.world_size,
        }
