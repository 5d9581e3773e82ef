"""The per-worker training loop, `train_worker`, the same under torchrun, the DeepSpeed launcher and Ray Train
(docs/design.md, "The training loop")."""

from __future__ import annotations

import os
from pathlib import Path

from data_pipeline.cli import to_stderr
from pretrain import collector
from pretrain.checkpoint import run_folder
from pretrain.checkpointer import CheckpointCallback, Checkpointer, PinReason
from pretrain.config.train_config import TrainConfig
from pretrain.distributed import Placement, broadcast, init_distributed
from pretrain.model.flops import train_flops
from pretrain.model.vit import ViTConfig
from pretrain.telemetry.attempt_clock import AttemptClock, attempt_path
from pretrain.telemetry.heartbeat import Heartbeat
from pretrain.telemetry.metrics import TrainMetrics
from pretrain.telemetry.peak import Peak, device_peak
from pretrain.telemetry.recorder import Recorder, TrainSummary
from pretrain.trainer import Trainer
from tracking import keys
from tracking.runs import RUN_RECORD, finish_run, run_tags, standalone_run
from tracking.tracker import Tracker


def train_worker(
    config: TrainConfig,
    on_checkpoint: CheckpointCallback | None = None,
    heartbeat: Heartbeat | None = None,
    *,
    validated: bool = False,
    pin: PinReason | None = None,
) -> TrainSummary:
    """Train on this rank and return what it did. ``on_checkpoint(folder, step, metrics)`` runs on every rank after
    each COMPLETE checkpoint, step 0 included; ``heartbeat`` hears of every step, save and switch. ``validated``: the
    caller ran ``config.validate`` at this world size, else it runs here (under Ray it differs between attempts).
    ``pin(step)``: the reason rank 0 pins that step's checkpoint as it saves it, or None."""
    clock = AttemptClock()  # books every second from here on
    config = config.resolved()
    place = init_distributed(config)
    if not validated:
        config.validate(place.world_size)
    if place.rank == 0:
        print(config.format(), flush=True)
    trainer = Trainer.start(config, place)
    peak = device_peak(config.logging.peak_tflops, place.device, trainer.precision.precision)
    tracker, created_run, starts = start_tracking(config, trainer, peak)
    metrics = open_metrics(config, trainer, peak.tflops, tracker)
    checkpointer = Checkpointer(config, trainer.last_step, on_checkpoint, tracker, pin)
    beat = (heartbeat or Heartbeat(None)).for_run(trainer.last_step, config.checkpoint.every_steps)
    trainer.restore_randomness()  # last before the loop: nothing after it draws from the global generators
    recorder, outcome, status = open_recorder(config, place, starts), "failed", "FAILED"
    open_clock(clock, config, trainer, starts)
    try:
        checkpointer.save_baseline(trainer)
        clock.saved_before_loop(checkpointer.save_seconds)
        collector.resume()  # the start is over
        metrics.start(clock.overhead_s)
        logged: dict[str, float] = {}
        while trainer.step < trainer.last_step:
            clock.lap("productive")
            if trainer.maybe_switch_resolution(on_switch=beat.busy):
                metrics.flops_per_image = train_flops(trainer.model.config)
            clock.lap("startup")  # a resolution switch is start-up work
            result = trainer.train_step(recorder)
            step_s = clock.step_done(trainer.step, result.data_s)
            beat.step(trainer.step, result.data_s, trainer.stream.stats)
            recorder.end_step(trainer.step, result.loss, trainer.epoch)
            new = metrics.step(
                trainer.step,
                result.loss,
                result.lr,
                result.grad_norm,
                trainer.plan.global_batch_size,
                result.data_s,
                step_s=step_s,
                read=checkpointer.due(trainer.step),  # a save must not keep a diverged model
                overhead_s=clock.overhead_s,
            )
            logged = new or logged
            checkpointer.after_step(trainer, {**logged, keys.LOSS: result.loss})
            clock.after_step(checkpointer.save_seconds, logged=bool(new))
        outcome = "finished" if trainer.step >= trainer.total_steps else "stopped"
        status = "FINISHED"  # a stopped run ended well too: vitscale.status "stopped"
    except KeyboardInterrupt:  # the user's stop (Ctrl-C): KILLED, as the job's driver marks it
        outcome, status = "stopped", "KILLED"
        raise
    finally:
        clock.close(outcome)
        beat.end()
        tracker.set_tags({keys.STATUS: outcome})
        recorder.close()
        metrics.close()
        tracker.close()
        if created_run and tracker.run_id is not None:
            finish_run(tracker.tracking_uri, tracker.run_id, status, outcome)
    trainer.close()
    return recorder.summary(**trainer.describe(), checkpoints=checkpointer.saved)


def open_metrics(config: TrainConfig, trainer: Trainer, peak_tflops: float, tracker: Tracker) -> TrainMetrics:
    place = trainer.place
    return TrainMetrics(
        rank=place.rank,
        world_size=place.world_size,
        total_steps=trainer.last_step,
        flops_per_image=train_flops(trainer.model.config),
        flops_seen=flops_before(config, trainer.model.config, trainer.step, trainer.plan.global_batch_size),
        peak_tflops=peak_tflops,
        device=place.device,
        log_every=config.logging.log_every,
        tracker=tracker,
        progress_bar=config.logging.progress_bar,
        start_step=trainer.step,
        images_seen=trainer.images_seen,
    )


def flops_before(config: TrainConfig, model: ViTConfig, step: int, global_batch: int) -> int:
    """The training FLOPs of steps 0 to ``step`` - 1, each at its resolution (`data.resolution_schedule`)."""
    sizes = config.data.resolution_schedule or [[0, config.data.image_size]]
    ends = [start for start, _ in sizes[1:]] + [step]
    return sum(
        max(0, min(end, step) - start) * global_batch * train_flops(model, size)
        for (start, size), end in zip(sizes, ends)
    )


def open_clock(clock: AttemptClock, config: TrainConfig, trainer: Trainer, starts: int) -> None:
    """Rank 0's clock writes ``<run>/goodput/attempt_<starts>.json``; everything until now was start-up."""
    place, rank0 = trainer.place, trainer.place.rank == 0
    clock.open(
        attempt_path(config.checkpoint.dir, starts) if rank0 else None,
        attempt=starts if rank0 else 0,
        world_size=place.world_size,
        start_step=trainer.step,
        last_step=trainer.last_step,
        pid=os.getpid(),
    )
    clock.lap("startup")


def open_recorder(config: TrainConfig, place: Placement, starts: int) -> Recorder:
    """This attempt's recorder; collective when it records (rank 0's ``starts`` numbers the attempt)."""
    lg = config.logging
    attempt = broadcast(starts) if lg.record_batch_digests or lg.record_sample_keys else 0
    return Recorder.for_run(Path(config.checkpoint.dir), config.logging, place.rank, place.world_size, attempt)


def start_tracking(config: TrainConfig, trainer: Trainer, peak: Peak) -> tuple[Tracker, bool, int]:
    """The tagged tracker; whether this process created the run; the run's count of starts (rank 0)."""
    place, choice = trainer.place, trainer.precision
    tracker, created = _tracker(config, place, trainer.model)
    starts, world_size_tags = record_world_size(config, place, trainer.step, trainer.plan)
    tracker.set_tags(
        {
            keys.PRECISION: choice.precision,
            keys.PRECISION_RULE: choice.rule,
            keys.PRECISION_REASON: choice.reason,
            keys.PEAK_TFLOPS: f"{peak.tflops:.6g}",
            keys.PEAK_SOURCE: peak.source,
            **world_size_tags,
        }
    )
    return tracker, created, starts


def _tracker(config: TrainConfig, place: Placement, model) -> tuple[Tracker, bool]:
    """The MLflow tracker, and whether this process owns (created or continued, and must end) the run."""
    lg = config.logging
    run_id, created = lg.mlflow_run_id, False
    if run_id is None and lg.mlflow_experiment and place.rank == 0:
        try:
            run_dir, uri = Path(config.checkpoint.dir), lg.mlflow_tracking_uri
            run_id = standalone_run(run_dir, uri, lg.mlflow_experiment, config.recipe, config.to_dict())
            created = True
        except Exception as error:  # tracking must never stop training
            to_stderr(f"warning: could not create an MLflow run ({error}); training without tracking")
    record = Path(config.checkpoint.dir) / RUN_RECORD  # a job's: what close() cannot send waits in its spool
    tracker = Tracker(lg.mlflow_tracking_uri, run_id, enabled=run_id is not None, rank=place.rank, record=record)
    # the comparison report reads the patch size here
    tracker.log_params({**config.to_dict(), "model.patch_size": model.config.patch_size})
    tracker.set_tags(run_tags(config.recipe, config.model.name, place.world_size))
    return tracker, created


def record_world_size(config: TrainConfig, place: Placement, step: int, plan) -> tuple[int, dict[str, str]]:
    """Rank 0 records this start's world size; returns the run's count of starts and the world-size tags."""
    if place.rank != 0:
        return 0, {}
    run_dir = Path(config.checkpoint.dir)
    run_folder.record_world_size(run_dir, step, place.world_size, plan.grad_accum_steps)
    history = run_folder.world_size_history(run_dir)
    events = run_folder.resize_events(history)
    sizes = [history[0]["world_size"], *(e["to"] for e in events)]
    return len(history), {
        keys.WORLD_SIZE: str(place.world_size),
        keys.RESIZES: str(len(events)),
        keys.WORLD_SIZES: ",".join(map(str, sizes)),
    }
