"""The per-worker training loop: DeepSpeed ZeRO over a ViT classification (or other) task.

`train_worker(config)` runs the same under `torchrun`, the DeepSpeed launcher and Ray Train: it reads RANK /
WORLD_SIZE / LOCAL_RANK and creates the process group only when none exists. Standalone:

    python -m pretrain.train --config configs/local_demo.yaml [--set optim.lr=3e-4 ...] [--dry-run]

The loop reads like the algorithm: resume → (lr, micro-batches, step, log, checkpoint) → final checkpoint. When the
run's checkpoints are evaluated (the cluster driver's `on_checkpoint`, `evals.suite` set, `evals.baseline` on), a fresh
run first saves the step-0 weights, before the first update, so every transfer curve starts at its baseline.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import hashlib
import json
import os
import random
import socket
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
import torch
import torch.distributed as dist

from data_pipeline.builtin import ensure
from data_pipeline.cli import output_file
from data_pipeline.manifest import read_dataset_info
from data_pipeline.paths import resolve_location, resolve_path
from data_pipeline.stream import TrainStream
from pretrain import checkpoint as ckpt
from pretrain import progressive, run_folder
from pretrain.config import TrainConfig, load_config, model_overrides
from pretrain.ds_config import batch_plan, engine_config, resolve_backend
from pretrain.flops import train_flops
from pretrain.metrics import TrainMetrics
from pretrain.model import build_model, model_config
from pretrain.optim import build_optimizer, build_schedule, set_lr
from pretrain.peak import Peak, device_peak
from pretrain.precision import PrecisionChoice, StepShape, decide, decide_on_rank0, probe_bf16_speedup
from pretrain.run_folder import CONFIG_YAML, TrainerState
from pretrain.tasks import build_task
from tracking import keys
from tracking.runs import create_run, finish_run, run_tags
from tracking.tracker import Tracker, flatten_config

CheckpointCallback = Callable[[Path, int, dict], None]


@dataclass(frozen=True)
class Placement:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device


def training_device_type() -> str:
    """``cuda`` where torch sees a GPU, unless ``DS_ACCELERATOR=cpu`` asks DeepSpeed for the CPU: then the model, its
    optimizer and the process group (gloo) stay on the CPU although a GPU is there (docs/reference.md §7, §8)."""
    if os.environ.get("DS_ACCELERATOR") == "cpu":
        return "cpu"
    return "cuda" if torch.cuda.is_available() else "cpu"


def init_distributed(config: TrainConfig) -> Placement:
    """Join (or create) the process group from RANK / WORLD_SIZE / LOCAL_RANK; gloo on CPU, nccl on CUDA."""
    device_type = training_device_type()
    if device_type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before deepspeed is imported anywhere
        if os.environ.get("LOCAL_RANK", "0") == "0":  # one process per machine, or two could remove a live lock
            remove_stale_build_lock(SHM_COMM_OP)
    import deepspeed  # heavy, and DS_ACCELERATOR must be set before its first import

    if not dist.is_initialized():
        _import_world_defaults()  # before the default group exists, or they keep it alive for good
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        os.environ.setdefault("LOCAL_RANK", "0")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        backend = resolve_backend(config.deepspeed, device_type)
        deepspeed.init_distributed(
            dist_backend=backend, timeout=timedelta(minutes=config.deepspeed.timeout_minutes), auto_mpi_discovery=False
        )
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if device_type == "cuda" else torch.device("cpu")
    if device_type == "cuda":
        torch.cuda.set_device(device)
    return Placement(dist.get_rank(), dist.get_world_size(), local_rank, device)


def _import_world_defaults() -> None:
    """Import `torch.distributed.nn.functional` while no default process group exists.

    Its ten collectives take ``group=group.WORLD`` as a default argument (torch/distributed/nn/functional.py), which
    Python evaluates once, at import. torch imports the module lazily, through `torch._dynamo`, at the first
    optimizer's `add_param_group`, i.e. after the default group is created: the functions' ``__defaults__`` then hold
    that group for the rest of the process, and destroying it (which for gloo only removes it from torch's maps) leaves
    its C++ object, two ``pt_gloo_runloop`` threads and a ``gloo_tcp_loop`` thread running until the interpreter is torn
    down (docs/reference.md §7). Imported first, the defaults are None: the default group at call time."""
    import torch.distributed.nn.functional  # noqa: F401


def _release_destroyed_groups() -> None:
    """Drop the destroyed groups that `torch.distributed.nn.functional`'s default arguments still hold, so that the
    last reference goes and the groups' gloo threads are joined now, not during interpreter teardown.

    They hold the default group when the module was imported after it was created: by a caller that made the group
    itself (`init_distributed` imports the module first, `_import_world_defaults`). Called once every group is
    destroyed; None is what the defaults are when the module is imported with no group."""
    functional = sys.modules.get("torch.distributed.nn.functional")
    if functional is None:
        return
    for function in vars(functional).values():
        defaults = getattr(function, "__defaults__", None) or ()
        if any(isinstance(d, dist.ProcessGroup) for d in defaults):
            function.__defaults__ = tuple(None if isinstance(d, dist.ProcessGroup) else d for d in defaults)


# DeepSpeed's CPU communication op, JIT-built by torch's extension builder on the first CPU start (docs/reference.md §7)
SHM_COMM_OP = "deepspeed_shm_comm"
STALE_LOCK_S = 900  # the op builds in about a minute here; no live build holds its lock this long
ORPHAN_LOCK_S = 30  # a lock no process here holds open, this old, was left by a killed one


def remove_stale_build_lock(op: str) -> Path | None:
    """Remove the build lock of torch JIT extension ``op`` if it was left by a killed process; return its path then.

    torch's builder holds ``<build dir>/lock`` open while it checks (about a second at every start) or builds the op,
    and every other process waits, silently and forever, while that file exists. A process killed in that window
    leaves the file behind, and from then on every DeepSpeed start on the machine hangs (docs/reference.md §8). Left
    behind: no process on this machine has it open and it is older than ``ORPHAN_LOCK_S`` (the builder keeps its
    descriptor open until it deletes the file), or, where that cannot be seen, older than any build takes."""
    from torch.utils.cpp_extension import _get_build_directory  # where torch puts (and locks) the op's build

    lock = Path(_get_build_directory(op, verbose=False)) / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return None
    held = _held_open(lock)
    if not (age > STALE_LOCK_S or (held is False and age > ORPHAN_LOCK_S)):
        return None
    lock.unlink(missing_ok=True)
    print(f"vitscale: removed {lock}, a build lock left {age / 60:.0f} min ago by a process that was killed while "
          f"building or loading {op}; DeepSpeed would have waited on it forever", file=sys.stderr)  # fmt: skip
    return lock


def _held_open(path: Path) -> bool | None:
    """Whether a process on this machine has ``path`` open (Linux /proc; processes of other users are not visible);
    None where /proc cannot tell."""
    proc = Path("/proc")
    if not (proc / "self" / "fd").is_dir():
        return None
    target = str(path.resolve())
    for fd_dir in proc.glob("[0-9]*/fd"):
        try:
            if any(os.readlink(fd) == target for fd in fd_dir.iterdir()):
                return True
        except OSError:  # the process ended, or is not ours
            continue
    return False


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


@contextmanager
def model_randomness(seed: int, step: int, micro_batch: int, device: torch.device):
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


def prepare_data(config: TrainConfig, place: Placement) -> tuple[int, int]:
    """Generate a built-in training set if the recipe asks for it (rank 0; others wait); (num_classes, epoch size)."""
    d = config.data
    if d.builtin is not None and place.rank == 0 and not (resolve_path(d.train) / "manifest.parquet").exists():
        ensure(d.builtin, resolve_path(d.train).parent.parent, **d.builtin_options)
    dist.barrier()
    info = read_dataset_info(resolve_location(d.train))
    if config.model.num_classes is not None and info.num_classes > config.model.num_classes:
        raise ValueError(
            f"model.num_classes={config.model.num_classes} but {d.train} has {info.num_classes} classes; set "
            f"model.num_classes={info.num_classes} (or null to take it from the dataset)"
        )
    return config.model.num_classes or info.num_classes, d.epoch_images or info.num_samples


def build_stream(config: TrainConfig, place: Placement, num_classes: int):
    d = config.data
    # Mixup needs soft targets; otherwise int labels are cheapest (the loss one-hots them itself).
    label_format = "multihot" if d.mixup_alpha > 0 else "int"
    return TrainStream(
        resolve_location(d.train),
        batch_size=d.micro_batch_size,
        image_size=d.image_size,
        global_batch_size=d.global_batch_size,
        streams=d.streams,
        rank=place.rank,
        world_size=place.world_size,
        num_workers=d.num_workers,
        seed=d.seed,
        shuffle_buffer=d.shuffle_buffer,
        augment=d.augment,
        mixup_alpha=d.mixup_alpha,
        label_format=label_format,
        num_classes=num_classes,
        multiprocessing_context=d.loader_start_method,
        record_keys=config.logging.record_sample_keys,
    )


def decide_precision(
    config: TrainConfig, place: Placement, num_classes: int, start: ckpt.StartPoint
) -> PrecisionChoice:
    """`deepspeed.precision` for this run, the same on every rank (`pretrain.precision`): `auto` by the rule on this
    device and the model's shapes; `probe` by the run folder's record, else by timing on rank 0, which records it.
    A resumed run keeps the precision its checkpoint trained in."""
    d, run_dir = config.data, resolve_path(config.checkpoint.dir)
    resumed = None
    if start.kind in ("run", "resume_from"):
        kept = TrainerState.read(start.path).precision
        resumed = None if kept is None else (kept, start.path.name)
    record = run_folder.read_precision_record(run_dir) if config.deepspeed.precision == "probe" else None
    recorded = None if record is None else PrecisionChoice(
        record["precision"], "run-record", f"{run_dir / run_folder.PRECISION_RECORD}: {record['reason']}"
    )  # fmt: skip
    shape = StepShape.of(model_config(config.model.name, **model_overrides(config, num_classes)), d.micro_batch_size)

    def probe() -> tuple[float, float]:
        def build():
            return build_task(config, build_model(config.model.name, **model_overrides(config, num_classes)))

        return probe_bf16_speedup(build, d.micro_batch_size, d.image_size)

    def here() -> PrecisionChoice:
        choice = decide(config.deepspeed.precision, place.device.type, shape, resumed=resumed, recorded=recorded,
                        probe=probe, zero_stage=config.deepspeed.zero_stage)  # fmt: skip
        if choice.rule == "probe":  # timed now: later starts of this run repeat it
            run_folder.write_precision_record(run_dir, choice.precision, choice.rule, choice.reason)
        return choice

    return decide_on_rank0(here)


def build_engine(
    config: TrainConfig, place: Placement, num_classes: int, start: ckpt.StartPoint, precision: str,
    load_universal: bool = False,
):  # fmt: skip
    """Model (fresh or `init_from` weights) → task → torch AdamW → DeepSpeed engine. Returns (engine, model).
    ``load_universal``: the engine will load a universal checkpoint (a resume at another world size)."""
    import deepspeed  # heavy, and DS_ACCELERATOR must be set before its first import

    seed_everything(config.seed)  # identical initialisation on every rank
    model = build_model(config.model.name, **model_overrides(config, num_classes))
    if start.kind == "init_from":
        ckpt.init_weights(model, start.path, config.data.image_size)
    if config.model.compile:
        model.compile_blocks()  # compiles at the first step; checkpoints and parameter names are unchanged
    task = build_task(config, model)
    ds_config = engine_config(config, place.world_size, precision, load_universal)
    engine, _, _, _ = deepspeed.initialize(model=task, optimizer=build_optimizer(task, config.optim), config=ds_config)
    return engine, model


def _tracker(config: TrainConfig, place: Placement, model) -> tuple[Tracker, bool]:
    """The MLflow tracker of this run (rank 0 logs; a standalone run may create its own run by experiment name), and
    whether this process created the MLflow run (then it also ends it: nobody else will)."""
    lg = config.logging
    run_id, created = lg.mlflow_run_id, False
    if run_id is None and lg.mlflow_experiment and place.rank == 0:
        try:
            run_id = create_run(lg.mlflow_tracking_uri, lg.mlflow_experiment, config.recipe, config.to_dict(), {})
            created = True
        except Exception as error:  # tracking must never stop training
            print(f"warning: could not create an MLflow run ({error}); training without tracking", file=sys.stderr)
    tracker = Tracker(lg.mlflow_tracking_uri, run_id, enabled=run_id is not None, rank=place.rank)
    # The patch size is not a recipe field (the model name implies it); the comparison report reads it from here.
    tracker.log_params({**config.to_dict(), "model.patch_size": model.config.patch_size})
    tracker.set_tags(run_tags(config.recipe, config.model.name, place.world_size))
    return tracker, created


# Settings a resumed run may change without changing what it computes up to the old schedule's end.
_RESUME_MAY_CHANGE = ("checkpoint.", "logging.", "evals.", "schedule.stop_at_step", "data.num_workers",
                      "data.loader_start_method", "deepspeed.timeout_minutes")  # fmt: skip


def _warn_config_changes(checkpoint_dir: Path, config: TrainConfig) -> None:
    """Say which settings differ from the checkpoint's config.yaml: resuming with them is allowed but not exact."""
    import yaml

    saved = flatten_config(yaml.safe_load((checkpoint_dir / CONFIG_YAML).read_text()))
    now = flatten_config(config.to_dict())
    changed = sorted(
        k for k in set(saved) | set(now) if saved.get(k) != now.get(k) and not k.startswith(_RESUME_MAY_CHANGE)
    )
    if changed:
        diffs = ", ".join(f"{k}: {saved.get(k)} -> {now.get(k)}" for k in changed)
        print(f"warning: resuming {checkpoint_dir} with changed settings ({diffs}); the run is no longer an exact "
              "continuation", file=sys.stderr, flush=True)  # fmt: skip


def _next_batch(it: Iterator, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, float]:
    start = time.perf_counter()
    images, labels = next(it)
    images = images.to(device, dtype=dtype, non_blocking=True)  # (B, 3, S, S)
    return images, labels.to(device, non_blocking=True), time.perf_counter() - start


def _mean_over_ranks(value: torch.Tensor) -> float:
    value = value.detach().float().clone()
    dist.all_reduce(value)
    return value.item() / dist.get_world_size()


def train_step(
    engine, it: Iterator, accum_steps: int, place: Placement, dtype: torch.dtype, step: int, seed: int, digest=None,
    sample_keys: tuple[TrainStream, list[str]] | None = None,
):  # fmt: skip
    """Optimizer step ``step`` (0-based) over ``accum_steps`` micro-batches; (loss averaged over ranks, seconds
    waiting for data). The model's randomness is seeded by (``seed``, step, global micro-batch index). ``sample_keys``:
    (the stream ``it`` iterates, a list that receives this rank's sample keys of the step in order)."""
    loss_sum, data_s = torch.zeros((), device=place.device), 0.0
    for micro in range(accum_steps):
        images, labels, wait = _next_batch(it, place.device, dtype)
        data_s += wait
        if digest is not None:
            digest.update(images.float().cpu().numpy().tobytes() + labels.cpu().numpy().tobytes())
        if sample_keys is not None:
            sample_keys[1].extend(sample_keys[0].last_keys)
        with model_randomness(seed, step, place.rank * accum_steps + micro, place.device):
            loss, _ = engine(images, labels)
            engine.backward(loss)  # DeepSpeed scales by 1/accum_steps and reduces across ranks at the boundary
        engine.step()  # steps the optimizer (with clipping) only at the accumulation boundary
        loss_sum += loss.detach().float()
    return _mean_over_ranks(loss_sum / accum_steps), data_s


def train_worker(config: TrainConfig, on_checkpoint: CheckpointCallback | None = None) -> dict[str, Any]:
    """Train per ``config`` on this rank; returns a summary (steps, final_loss, images_seen, checkpoints, losses).

    ``on_checkpoint(checkpoint_dir, step, metrics)`` runs on every rank after each COMPLETE checkpoint, the step-0
    baseline included (`save_baseline`).
    """
    place = init_distributed(config)
    config.validate(place.world_size)
    if place.rank == 0:
        print(config.format(), flush=True)
    num_classes, epoch_images = prepare_data(config, place)
    plan = batch_plan(config.data, place.world_size)
    schedule = build_schedule(config.optim, config.schedule, plan.global_batch_size, epoch_images)
    last_step = min(schedule.total_steps, config.schedule.stop_at_step or schedule.total_steps)

    start = ckpt.find_start(config)
    current = progressive.start_config(config, start)  # data.image_size in force (progressive resolution)
    choice = decide_precision(current, place, num_classes, start)
    if place.rank == 0:
        print(choice.line(config.deepspeed.precision), flush=True)
    universal = ckpt.prepare_resume(start, place.world_size, place.rank)  # converts for another world size
    engine, model = build_engine(current, place, num_classes, start, choice.precision, universal is not None)
    stream = build_stream(current, place, num_classes)
    state = resume(engine, stream, start, place, current, universal)  # None when starting fresh
    step, images_seen = (state.step, state.images_seen) if state is not None else (0, 0)
    tracker, created_run = _tracker(config, place, model)
    peak = device_peak(config.logging.peak_tflops, place.device, choice.precision)
    tracker.set_tags({keys.PRECISION: choice.precision, keys.PRECISION_RULE: choice.rule,
                      keys.PRECISION_REASON: choice.reason, keys.PEAK_TFLOPS: f"{peak.tflops:.6g}",
                      keys.PEAK_SOURCE: peak.source, **record_world_size(config, place, step, plan)})  # fmt: skip
    metrics = build_metrics(config, place, model, tracker, last_step, step, images_seen, peak)
    # bf16: DeepSpeed keeps bf16 weights for compute and fp32 master weights + optimizer state in ZeRO; the task
    # computes the loss in fp32, and LayerNorm kernels accumulate their statistics in fp32.
    dtype = torch.bfloat16 if choice.precision == "bf16" else torch.float32
    summary: dict[str, Any] = {"start": start.kind, "start_step": step, "losses": [], "checkpoints": [], "digests": [],
                               "sample_keys": []}  # fmt: skip
    # The model's own randomness is seeded by position in train_step (model_randomness), whatever happens here.
    # The global generators are restored last, right before the loop, for any other code that draws from them.
    if state is not None and place.rank < len(state.rng_states):
        ckpt.set_rng_state(state.rng_states[place.rank])
    elif state is not None:  # a rank the checkpoint's (smaller) world did not have: seeded by its position
        seed_everything(config.seed * 1000 + place.rank + 1 + state.step * 100_003)
    else:
        seed_everything(config.seed * 1000 + place.rank + 1)  # different on every rank, reproducibly
    stack = contextlib.ExitStack()  # files kept open for the loop (the sample-key log)
    try:
        if state is None and save_baseline(config, on_checkpoint):
            saved = ckpt.save_checkpoint(engine, model, current, step=0, images_seen=0,
                                         stream_state=stream.state_dict(), metrics={})  # fmt: skip
            summary["checkpoints"].append(str(saved))
            on_checkpoint(saved, 0, {})
        it, last = iter(stream), {}
        if config.logging.record_sample_keys:  # per rank, every attempt: what the whole run trained on, in order
            attempt = _broadcast(len(run_folder.world_size_history(resolve_path(config.checkpoint.dir))))
            keys_path = resolve_path(config.checkpoint.dir) / SAMPLE_KEYS_DIR / f"rank{place.rank}.jsonl"
            keys_path.parent.mkdir(parents=True, exist_ok=True)
            keys_log = stack.enter_context(open(keys_path, "a"))
        while step < last_step:
            current, engine, model, stream, resized = progressive.advance(
                config, current, step, engine, model, stream,
                lambda cfg: build_engine(cfg, place, num_classes, ckpt.StartPoint("scratch", None), choice.precision),
                lambda cfg: build_stream(cfg, place, num_classes),
            )  # fmt: skip
            if resized:
                it = iter(stream)
            lr = schedule(step)
            set_lr(engine.optimizer, lr)
            digest = hashlib.sha256() if config.logging.record_batch_digests else None
            step_keys = (stream, []) if config.logging.record_sample_keys else None
            loss, data_s = train_step(engine, it, plan.grad_accum_steps, place, dtype, step, config.seed, digest,
                                      step_keys)  # fmt: skip
            step += 1
            if step_keys is not None:  # the stream's epoch rolls over when the next step starts: the step's epoch
                entry = {"step": step, "epoch": stream.state_dict()["epoch"], "keys": step_keys[1]}
                summary["sample_keys"].append(entry)
                where = {"attempt": attempt, "rank": place.rank, "world_size": place.world_size}
                keys_log.write(json.dumps({**entry, **where}) + "\n")
                keys_log.flush()  # an attempt killed mid-run (a lost node) keeps what it trained on
            grad_norm = engine.get_global_grad_norm()
            grad_norm = None if grad_norm is None else float(grad_norm)
            last = metrics.step(step, loss, lr, grad_norm, plan.global_batch_size, data_s) or last
            summary["losses"].append([step, loss])
            if digest is not None:
                summary["digests"].append([step, digest.hexdigest()])
            if step % config.checkpoint.every_steps == 0 or step == last_step:
                step_metrics = {**last, keys.LOSS: loss}
                saved = ckpt.save_checkpoint(engine, model, current, step=step, images_seen=metrics.images_seen,
                                             stream_state=stream.state_dict(), metrics=step_metrics)  # fmt: skip
                summary["checkpoints"].append(str(saved))
                if on_checkpoint is not None:
                    on_checkpoint(saved, step, step_metrics)
        outcome = "finished" if step >= schedule.total_steps else "stopped"
        tracker.set_tags({keys.STATUS: outcome})
    except BaseException:
        outcome = "failed"
        tracker.set_tags({keys.STATUS: outcome})
        raise
    finally:
        stack.close()
        metrics.close()
        tracker.close()
        if created_run:  # a stopped run ended well too: its MLflow run is FINISHED, vitscale.status says "stopped"
            finish_run(tracker.tracking_uri, tracker.run_id, "FAILED" if outcome == "failed" else "FINISHED", outcome)
    # DeepSpeed's gradient hooks hold the engine in a reference cycle through autograd's C++ nodes, which Python's
    # collector cannot see: without destroy() a process that trains more than once (a Ray worker) keeps every engine.
    engine.destroy()
    final_loss = summary["losses"][-1][1] if summary["losses"] else None
    return {**summary, "steps": step, "final_loss": final_loss, "images_seen": metrics.images_seen,
            "rank": place.rank, "world_size": place.world_size}  # fmt: skip


SAMPLE_KEYS_DIR = "sample_keys"  # <run>/sample_keys/rank<r>.jsonl with logging.record_sample_keys


def _broadcast(value: Any) -> Any:
    """Rank 0's ``value`` on every rank."""
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def save_baseline(config: TrainConfig, on_checkpoint: CheckpointCallback | None) -> bool:
    """Whether a fresh run saves (and hands to ``on_checkpoint``) its step-0 weights: only when someone evaluates
    checkpoints, a suite is set and ``evals.baseline`` is on. A resumed run never does (its step 0 was handled by the
    run's first attempt), so a restart does not evaluate step 0 again.

    The save draws no random numbers (it reads the RNG states into the trainer state), so the training losses are
    the same with and without it; resuming from this checkpoint continues the run exactly.
    """
    return on_checkpoint is not None and bool(config.evals.suite) and config.evals.baseline


def resume(
    engine, stream, start: ckpt.StartPoint, place: Placement, config: TrainConfig, universal: Path | None = None
) -> TrainerState | None:
    """Restore engine + stream position from a full checkpoint; its trainer state (None when starting fresh).

    At another world size the engine loads ``universal`` (`pretrain.checkpoint.prepare_resume`) and the stream takes
    its streams' positions from the global one: the run continues the same sequence of global batches.
    """
    if start.kind not in ("run", "resume_from"):
        return None
    state = ckpt.load_checkpoint(engine, start.path, universal)
    stream.load_state_dict(state.stream_state)
    if place.rank == 0:
        print(f"resumed from {start.path} at step {state.step} ({start.kind})", flush=True)
        if state.world_size != place.world_size:
            before = batch_plan(config.data, state.world_size).grad_accum_steps
            after = batch_plan(config.data, place.world_size).grad_accum_steps
            print(f"resuming step {state.step} at world size {place.world_size} (was {state.world_size}): accumulation "
                  f"{before} -> {after}, global batch {config.data.global_batch_size}", flush=True)  # fmt: skip
        _warn_config_changes(start.path, config)
    return state


def record_world_size(config: TrainConfig, place: Placement, step: int, plan) -> dict[str, str]:
    """Rank 0 appends this start to the run folder's world-size history; the run's world-size tags from it (the
    current size, how many times it changed, the sizes in order: "2,1,2")."""
    if place.rank != 0:
        return {}
    run_dir = resolve_path(config.checkpoint.dir)
    run_folder.record_world_size(run_dir, step, place.world_size, plan.grad_accum_steps)
    history = run_folder.world_size_history(run_dir)
    events = run_folder.resize_events(history)
    sizes = [history[0]["world_size"], *(e["to"] for e in events)]
    return {keys.WORLD_SIZE: str(place.world_size), keys.RESIZES: str(len(events)),
            keys.WORLD_SIZES: ",".join(map(str, sizes))}  # fmt: skip


def build_metrics(
    config, place, model, tracker, last_step: int, step: int, images_seen: int, peak: Peak
) -> TrainMetrics:
    return TrainMetrics(
        rank=place.rank, world_size=place.world_size, total_steps=last_step, flops_per_image=train_flops(model.config),
        peak_tflops=peak.tflops, device=place.device, log_every=config.logging.log_every, tracker=tracker,
        progress_bar=config.logging.progress_bar, start_step=step, images_seen=images_seen,
    )  # fmt: skip


def _env_world_size() -> int:
    text = os.environ.get("WORLD_SIZE", "1")  # set by torchrun / the DeepSpeed launcher
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"WORLD_SIZE={text!r} in the environment is not a positive integer; unset it or use torchrun")
    return int(text)


def _summary_path(template: str, rank: int) -> str:
    try:
        return template.format(rank=rank)
    except (KeyError, IndexError, ValueError):  # str.format on the user's text: any other {field} or a lone brace
        raise ValueError(
            f"--summary {template!r}: only {{rank}} may appear in braces, e.g. runs/summary_{{rank}}.json"
        ) from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pretrain.train", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="a recipe YAML path or a name under configs/")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="dotted override, repeatable")
    parser.add_argument("--dry-run", action="store_true", help="validate and print the config, then stop")
    parser.add_argument("--summary", metavar="PATH", help="write each rank's summary as JSON ('{rank}' is filled in)")
    # The DeepSpeed launcher appends --local_rank; LOCAL_RANK in the environment (which it also sets) is what counts.
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        world_size = _env_world_size()
        config = load_config(args.config, args.set)
        config.validate(world_size)  # before any process group, data or model: bad input costs nothing
        if args.summary:  # a bad --summary path must not surface only after the whole run
            output_file(_summary_path(args.summary, 0), "--summary")
        if args.dry_run:
            print(config.format())
            plan = batch_plan(config.data, world_size)
            print(f"world size {world_size}: micro-batch {plan.micro_batch_size} x accumulation "
                  f"{plan.grad_accum_steps} x world {world_size} = global batch {plan.global_batch_size}")  # fmt: skip
            return 0
        # ValueError is how the project reports bad input (pretrain.config, data_pipeline.manifest, pretrain.weights):
        # the files the config points at (shards, init_from, a resumed checkpoint) are read only from here on.
        summary = train_worker(config)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if args.summary:
        Path(_summary_path(args.summary, summary["rank"])).write_text(json.dumps(summary))
    if summary["rank"] == 0:
        print(
            f"done: {summary['steps']} steps, final loss {summary['final_loss']}, images seen {summary['images_seen']}"
        )
    finish_distributed()
    return 0


def finish_distributed() -> None:
    """Tear the process groups down once every rank is done (a no-op when there are none).

    The barrier comes first: a rank that exits while its peer is still in a collective makes the peer's gloo threads
    abort the process. DeepSpeed's destroy also drops the groups DeepSpeed caches, which torch's alone leaves alive,
    and `_release_destroyed_groups` the references torch keeps in default arguments: when this returns, every group
    is freed and its gloo threads are joined (docs/reference.md §7).
    """
    if not dist.is_initialized():
        return
    import deepspeed.comm

    dist.barrier()
    deepspeed.comm.destroy_process_group()
    _release_destroyed_groups()


def exit_rank(code: int) -> NoReturn:
    """End a training process with ``code`` once its results are written.

    After `finish_distributed` no process group is left and no gloo thread runs, and the rank exits normally. A rank
    that leaves with a group still alive, on an error path that returns before the teardown (its peers may still be
    in a collective, so no barrier), runs the exit handlers (logging, multiprocessing, ...) and flushes the standard
    streams, then leaves with ``os._exit``: finalizing the interpreter would destroy that live gloo group during
    Python's teardown, where its threads can abort the process (docs/reference.md §7).
    """
    if dist.is_available() and dist.is_initialized():
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    exit_rank(main())
