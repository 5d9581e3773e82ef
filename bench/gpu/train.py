"""The campaign's real-path part, in a child process of its own: `pretrain.train` through DeepSpeed on one device, a
resume from its checkpoint, and the same step at ZeRO-0 (plain PyTorch), ZeRO-1 and ZeRO-2 (docs/benchmarks/gpu.md).

    python -m bench.gpu.train SPEC.json OUT.json       (bench.gpu.campaign starts it; SPEC is a `TrainSpec` as JSON)
"""

from __future__ import annotations

import gc
import json
import resource
import shutil
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from bench import out_file
from bench.gpu.step import profile_keys
from bench.train import time_steps
from data_pipeline.cli import fail
from data_pipeline.paths import write_text_atomically
from pretrain.checkpointer import StartPoint
from pretrain.config.optim import build_optimizer
from pretrain.config.train_config import TrainConfig, load_config, model_overrides
from pretrain.distributed import finish_distributed, init_distributed, training_device_type
from pretrain.engine import decide_precision
from pretrain.feed import DeviceFeed
from pretrain.loop import train_worker
from pretrain.model.flops import train_flops
from pretrain.model.tasks import build_task
from pretrain.model.vit import build_model, model_config
from pretrain.telemetry.heartbeat import Heartbeat
from pretrain.telemetry.peak import device_peak
from pretrain.trainer import Trainer, build_stream, prepare_data

RECIPE = "vit_h14_i21k"


@dataclass(frozen=True)
class TrainSpec:
    data: str  # shard folder (the campaign's formula set)
    run_root: str  # scratch folder for the runs
    smoke: bool = False
    steps: int = 24
    checkpoint_at: int = 12
    resume_steps: int = 4
    warmup_steps: int = 4  # steps left out of the steady state
    lr_warmup: int = 100  # the schedule's: the lr stays in it (finite losses) yet moves them from the first steps
    zero_steps: int = 8  # timed steps per ZeRO setting (after 2 warm-up steps)
    num_workers: int = 8
    resume: bool = True  # run part 2
    zero: bool = True  # run part 3
    deadline: float = 0.0  # time.time() to end by: a ZeRO setting that would end later is skipped; 0: none
    more: tuple[str, ...] = ()  # further recipe overrides (`python -m bench.gpu --train-set`), e.g. model.compile=true

    def sets(self, run_dir: Path) -> list[str]:
        """The recipe's overrides: this data, accumulation 1, a short stop, no MLflow, no evals."""
        sets = [
            f"data.train={self.data}",
            "data.builtin=null",
            f"data.streams={4 if self.smoke else 8}",
            "data.shuffle_buffer=256",
            f"data.num_workers={self.num_workers}",
            "schedule.total=20000",
            # Within the recipe's 10k-step warm-up the lr (~1e-6) moves no logit off the head's -10 by bf16's step
            # there (0.06): every loss was the same, and a resume that restored nothing would have matched it.
            f"schedule.warmup={self.lr_warmup}",
            f"schedule.stop_at_step={self.steps}",
            f"checkpoint.dir={run_dir}",
            f"checkpoint.every_steps={self.checkpoint_at}",
            "checkpoint.keep_last=2",
            "logging.progress_bar=false",
            f"logging.log_every={max(1, self.steps // 4)}",
            "evals.suite=null",
        ]
        if self.smoke:  # a tiny ViT at 32 px; fork: forkserver's start-up is seconds on 2 cores
            sets += [
                "model.name=vit_tiny_debug",
                "data.image_size=32",
                "model.num_classes=10",
                "model.representation_size=null",
                "data.shuffle_buffer=16",
                "data.loader_start_method=fork",
                "logging.peak_tflops=1.0",
            ]
        return [*sets, *self.more]

    def config(self, run_dir: Path, *more: str) -> TrainConfig:
        config = load_config(RECIPE, self.sets(run_dir))
        micro = 4 if self.smoke else config.data.micro_batch_size  # the recipe's (64 for H/14)
        return load_config(
            RECIPE, [*self.sets(run_dir), f"data.micro_batch_size={micro}", f"data.global_batch_size={micro}", *more]
        )


class Results(dict):
    """The part's keys, written to ``path`` whenever ``save`` is called: a kill keeps what was measured."""

    def __init__(self, path: Path):
        super().__init__()
        self.path = path

    def save(self) -> None:
        write_text_atomically(self.path, json.dumps(self, indent=1))


class TimedBeat(Heartbeat):
    """A heartbeat without a file that keeps every step's end time and data wait; ``on_step`` hears of each."""

    def __init__(self, on_step: Callable[[int], None] | None = None) -> None:
        super().__init__(None)
        self.ends: dict[int, float] = {}
        self.waits: dict[int, float] = {}
        self.started = time.perf_counter()
        self.on_step = on_step

    def step(self, step, data_s, data) -> None:
        self.ends[step] = time.perf_counter()
        self.waits[step] = data_s
        super().step(step, data_s, data)
        if self.on_step is not None:
            self.on_step(step)


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def _memory(device: torch.device, prefix: str) -> dict:
    """Peak GB that tensors held and that the allocator reserved; on a CPU both are the peak RSS."""
    if device.type != "cuda":
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9  # Linux reports KiB
        return {f"{prefix}_peak_memory_allocated_gb": peak, f"{prefix}_peak_memory_reserved_gb": peak}
    return {
        f"{prefix}_peak_memory_allocated_gb": torch.cuda.max_memory_allocated(device) / 1e9,
        f"{prefix}_peak_memory_reserved_gb": torch.cuda.max_memory_reserved(device) / 1e9,
    }


def _flops_per_image(config: TrainConfig) -> int:
    return train_flops(model_config(config.model.name, **model_overrides(config, config.model.num_classes or 1000)))


def _steady_state(spec: TrainSpec, config: TrainConfig, beat: TimedBeat, saves: dict, device: torch.device) -> dict:
    """``train_path_*`` from the steps so far: the median step after ``warmup_steps``, saves' steps left out."""
    steps = sorted(beat.ends)
    durations = {s: beat.ends[s] - beat.ends[p] for p, s in zip(steps, steps[1:]) if p not in saves}
    steady = [s for s in durations if s > spec.warmup_steps]
    if not steady:  # warm-up only (the first steps, compiles): no rate rather than a wrong one
        return {}
    step_s = statistics.median(durations[s] for s in steady)
    batch = config.data.global_batch_size
    peak = device_peak(config.logging.peak_tflops, device, "bf16" if device.type == "cuda" else "fp32")
    img_s = batch / step_s
    out = dict(
        train_path_steps_done=steps[-1],
        train_path_steady_steps=len(steady),
        train_path_step_s=step_s,
        train_path_img_s=img_s,
        train_path_mfu=img_s * _flops_per_image(config) / (peak.tflops * 1e12),
        train_path_peak_tflops=peak.tflops,
        train_path_peak_source=peak.source,
        train_path_data_wait=sum(beat.waits[s] for s in steady) / sum(durations[s] for s in steady),
        train_path_start_s=beat.ends[steps[0]] - beat.started,
        train_path_step_times_s=[round(durations[s], 4) for s in sorted(durations)],
        **_memory(device, "train_path"),
    )
    if spec.checkpoint_at in saves:
        save_s, save_bytes = saves[spec.checkpoint_at]
        out |= dict(train_path_checkpoint_save_s=save_s, train_path_checkpoint_gb=save_bytes / 1e9)
    return out


def real_path(spec: TrainSpec, out: Results) -> None:
    """``train_path_*``: the recipe at its micro-batch, accumulation 1, checkpoints at ``checkpoint_at`` and the end
    (the lr stays in the warm-up, so the few steps stay finite); a save's time runs from its step's end to its
    COMPLETE. Written after every step from the second on, so a kill keeps the steps measured."""
    run_dir = Path(spec.run_root) / "run"
    config = spec.config(run_dir)
    device = torch.device("cuda", 0) if training_device_type() == "cuda" else torch.device("cpu")
    saves: dict[int, tuple[float, int]] = {}
    out |= dict(
        train_path_model=config.model.name,
        train_path_micro_batch=config.data.micro_batch_size,
        train_path_global_batch=config.data.global_batch_size,
        train_path_zero_stage=config.deepspeed.zero_stage,
        train_path_num_workers=config.data.num_workers,
    )

    def on_step(step: int) -> None:
        out.update(_steady_state(spec, config, beat, saves, device))
        out.save()

    def on_checkpoint(folder: Path, step: int, metrics: dict) -> None:
        saves[step] = (time.perf_counter() - beat.ends[step], folder_bytes(Path(folder)))
        on_step(step)

    beat = TimedBeat(on_step)
    summary = train_worker(config, on_checkpoint=on_checkpoint, heartbeat=beat)
    distinct = len({loss for _, loss in summary.losses})
    out |= dict(train_path_steps=summary.steps, train_path_losses=summary.losses, train_path_distinct_losses=distinct)
    out.update(_steady_state(spec, config, beat, saves, device))
    for step in list(saves)[1:]:  # only the first is resumed from: one H/14 save less on the disk
        shutil.rmtree(run_dir / "checkpoints" / f"step_{step:08d}", ignore_errors=True)


# A resumed run's later losses may differ from the first run's in their last bits on a GPU, where the attention
# backward sums with atomics: what a resume that restored the optimizer's state wrong would not stay under.
RESUME_NOISE = 0.01  # of the first run's median step-to-step loss change


def compare_resumed(first: list, resumed: list, distinct: int) -> dict:
    """``resume_*``: the resumed run's losses against the first run's at the same steps. ``resume_losses_equal``: all
    bit for bit (what a CPU run keeps); ``resume_first_loss_equal``: the first resumed step's, which the restore alone
    decides (weights, data position, random state), bit for bit; ``resume_losses_match``, the resume's check on any
    device: that, and every later loss within ``RESUME_NOISE`` of a step's change. Equal losses say something only
    where they move (``distinct`` > 1)."""
    by_step = {int(s): loss for s, loss in first}
    pairs = [(loss, by_step[int(s)]) for s, loss in resumed if int(s) in by_step]
    diffs = [abs(a - b) for a, b in pairs]
    ordered = [by_step[s] for s in sorted(by_step)]
    change = statistics.median(abs(b - a) for a, b in zip(ordered, ordered[1:])) if len(ordered) > 1 else 0.0
    moving = distinct > 1
    first_equal = bool(pairs) and pairs[0][0] == pairs[0][1]
    return dict(
        resume_compared_steps=len(diffs),
        resume_max_abs_loss_diff=max(diffs) if diffs else None,
        resume_loss_step_change=change,
        resume_first_loss_equal=first_equal,
        resume_losses_equal=bool(diffs) and max(diffs) == 0.0 and moving,
        resume_losses_match=first_equal and moving and max(diffs) <= RESUME_NOISE * change,
    )


def resume(spec: TrainSpec, out: Results) -> None:
    """``resume_*``: a new run resumed from the first checkpoint, its losses against the first run's; skipped
    (``resume_skipped``) if it would end past the deadline, so that the ZeRO settings still run in what is left."""
    # about the real path's start-up (the checkpoint's read included), the steps and the save at the resume's end
    estimate = (
        out.get("train_path_start_s", 0.0)
        + (spec.resume_steps + 1) * out.get("train_path_step_s", 0.0)
        + out.get("train_path_checkpoint_save_s", 0.0)
    )
    if spec.deadline and time.time() + estimate > spec.deadline:
        out["resume_skipped"] = f"~{estimate:.0f} s needed, {spec.deadline - time.time():.0f} s left"
        shutil.rmtree(Path(spec.run_root) / "run", ignore_errors=True)
        return
    source = Path(spec.run_root) / "run" / "checkpoints" / f"step_{spec.checkpoint_at:08d}"
    stop = spec.checkpoint_at + spec.resume_steps
    config = spec.config(
        Path(spec.run_root) / "resumed", f"checkpoint.resume_from={source}", f"schedule.stop_at_step={stop}"
    )
    beat = TimedBeat()
    summary = train_worker(config, heartbeat=beat)
    out |= dict(
        resume_start=summary.start,
        resume_start_step=summary.start_step,
        resume_losses=summary.losses,
        **compare_resumed(out["train_path_losses"], summary.losses, out["train_path_distinct_losses"]),
        resume_start_s=beat.ends[min(beat.ends)] - beat.started if beat.ends else None,
    )
    shutil.rmtree(Path(spec.run_root) / "run", ignore_errors=True)
    shutil.rmtree(Path(spec.run_root) / "resumed", ignore_errors=True)


def _median_step(step, device: torch.device, steps: int) -> float:
    for _ in range(2):
        step()
    return statistics.median(time_steps(step, steps, device))


def _plain_step(config: TrainConfig, place, num_classes: int, dtype: torch.dtype):
    """ZeRO-0 at world size 1 in plain PyTorch: the run's model, task, optimizer and batches, autocast, clipping."""
    with place.device:
        model = build_model(config.model.name, **model_overrides(config, num_classes))
    task = build_task(config, model).to(place.device)
    optimizer = build_optimizer(task, config.optim, place.device.type)
    batches = iter(build_stream(config, place, num_classes))
    feed = DeviceFeed(place.device, torch.float32)  # the trainer's: uint8 pixels normalized on the device

    def step() -> None:
        images, labels = feed(next(batches))
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(place.device.type, dtype=dtype, enabled=dtype != torch.float32):
            loss, _ = task(images, labels)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(task.parameters(), config.optim.grad_clip)
        optimizer.step()

    return step


def zero_stages(spec: TrainSpec, out: Results) -> None:
    """``zero<stage>_step_s`` / ``_img_s`` / peak memory at ZeRO-1, ZeRO-2 and ZeRO-0 (plain PyTorch: DeepSpeed
    refuses bf16 without ZeRO)."""
    # about the real path's start-up (imports done) plus the steps
    estimate = 0.8 * out.get("train_path_start_s", 0.0) + (spec.zero_steps + 3) * out.get("train_path_step_s", 0.0)
    for stage in (1, 2, 0):
        if spec.deadline and time.time() + estimate > spec.deadline:
            out[f"zero{stage}_skipped"] = f"~{estimate:.0f} s needed, {spec.deadline - time.time():.0f} s left"
            continue
        # smoke: the real path has run the loader workers; uint8 pixels normalized on the device, as on a GPU
        more = ["data.num_workers=0", "data.normalize_on=device"] if spec.smoke else []
        config = spec.config(Path(spec.run_root) / f"zero{stage}", f"deepspeed.zero_stage={max(stage, 1)}", *more)
        place = init_distributed(config)
        if place.device.type == "cuda":  # the earlier runs' cached blocks first, or the peak counted them
            gc.collect()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(place.device)
        if stage == 0:  # the classes and precision the trainer would decide; no engine
            classes, _ = prepare_data(config, place)
            choice = decide_precision(config, place, classes, StartPoint("scratch", None))
            dtype = torch.bfloat16 if choice.precision == "bf16" else torch.float32
            step_s = _median_step(_plain_step(config, place, classes, dtype), place.device, spec.zero_steps)
        else:
            trainer = Trainer.start(config, place)
            try:
                step_s = _median_step(lambda t=trainer: t.train_step(None), place.device, spec.zero_steps)
                # the engine's own work (gradient hooks, buckets, copies) beside the model's
                out |= profile_keys(lambda t=trainer: t.train_step(None), place.device, f"zero{stage}_profile")
            finally:
                trainer.close()
            del trainer
        gc.collect()
        out |= {
            f"zero{stage}_step_s": step_s,
            f"zero{stage}_img_s": config.data.global_batch_size / step_s,
            **_memory(place.device, f"zero{stage}"),
        }
        out.save()
        if place.device.type == "cuda":
            torch.cuda.empty_cache()
        shutil.rmtree(Path(spec.run_root) / f"zero{stage}", ignore_errors=True)
    if "zero0_step_s" in out and "zero2_step_s" in out:
        out["zero2_over_zero0_step_time"] = out["zero2_step_s"] / out["zero0_step_s"]


PROG = "python -m bench.gpu.train"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    usage = "usage: python -m bench.gpu.train SPEC.json OUT.json (started by python -m bench.gpu)"
    if args in (["-h"], ["--help"]):
        print(usage)
        return 0
    if len(args) != 2:
        print(usage, file=sys.stderr)
        return 2
    if (out_path := out_file(args[1], PROG, "OUT.json")) is None:
        return 2
    try:
        fields = json.loads(Path(args[0]).read_text())
        spec = TrainSpec(**{**fields, "more": tuple(fields.get("more", ()))})
    except (OSError, ValueError, TypeError) as error:  # unreadable, not JSON, not a spec's fields
        return fail(PROG, f"SPEC.json {args[0]}: {error}; python -m bench.gpu writes it")
    out = Results(out_path)
    parts = [part for part, on in ((real_path, True), (resume, spec.resume), (zero_stages, spec.zero)) if on]
    for part in parts:
        began = time.perf_counter()
        try:
            part(spec, out)
        except Exception as error:  # recorded; the next part still runs
            out[f"error_{part.__name__}"] = f"{type(error).__name__}: {str(error)[:300]}"
            traceback.print_exc()
        out[f"seconds_{part.__name__}"] = round(time.perf_counter() - began, 1)
        out.save()
    finish_distributed()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
