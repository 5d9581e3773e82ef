"""What a run's checkpoints cost the plan: their size on disk (a warning when the run folder cannot hold them), the
step-0 baseline save, and the watchdog's allowances before the first step and in the first save."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from cluster.profiles import ClusterProfile
from data_pipeline.paths import is_remote, resolve_location
from pretrain.checkpoint import run_folder
from pretrain.config.train_config import TrainConfig

# Bytes per parameter of one checkpoint: fp32 master weights + Adam's two moments in the engine state (12), the
# engine's working copy (4 at most) and the consolidated model.safetensors (4).
CHECKPOINT_BYTES_PER_PARAM = 20


def checkpoint_space_warning(config: TrainConfig, num_params: int) -> list[str]:
    """A warning when a local run folder's filesystem cannot take the checkpoints to come: a save holds
    ``checkpoint.keep_last + 1`` (the new one is written before the prune), less those already there."""
    c = config.checkpoint
    if is_remote(c.dir):
        return []
    run_dir = Path(resolve_location(c.dir))
    existing = next(p for p in (run_dir, *run_dir.parents) if p.exists())  # the filesystem it will be made on
    size = num_params * CHECKPOINT_BYTES_PER_PARAM
    held = len(run_folder.complete_checkpoints(run_dir))
    need = max(1, c.keep_last + 1 - held) * size
    try:
        free = shutil.disk_usage(existing).free
    except OSError:  # not readable from here: the workers' filesystem may differ anyway
        return []
    if free >= need:
        return []
    return [
        f"{run_dir} has {free / 1e9:.3g} GB free but needs ~{need / 1e9:.3g} GB more to hold checkpoint.keep_last + 1 "
        f"= {c.keep_last + 1} checkpoints of ~{size / 1e9:.3g} GB ({held} there now): a save that fills the disk "
        "stops the run (checkpoint.on_save_error); free space, lower checkpoint.keep_last or move checkpoint.dir"
    ]


def baseline_eval(config: TrainConfig, num_params: int) -> str:
    if not config.evals.suite:
        return "none (no evals.suite)"
    if not config.evals.baseline:
        return "off (evals.baseline=false): transfer curves have no step-0 point"
    size = num_params * CHECKPOINT_BYTES_PER_PARAM / 1e9
    return (
        f"the step-0 weights are saved before the first update (a checkpoint of ~{size:.2g} GB) and evaluated with "
        f"{config.evals.suite} like every checkpoint; evals.baseline=false skips both"
    )


# The watchdog's allowance from a worker's start to its first step, term by term (`startup_allowance`): estimates, so
# the allowance is ALLOWANCE_MARGIN times their sum, and never below the profile's hang.startup_s.
PROCESS_START_S = 60.0  # Ray starting a worker, its imports (docs/performance.md "A rank's start"), the process group
ENGINE_S_PER_GPARAM = 60.0  # building the model and DeepSpeed's engine around it, per 1e9 parameters
ALLOWANCE_MARGIN = 2.0  # an allowance too short kills a healthy group: a restart, charged to max_failures


@dataclass(frozen=True)
class StartupAllowance:
    """How long the watchdog lets a worker group go without a report from its start to its first step
    (``startup_s``), and in a save before one was measured (``first_save_s``): `startup_allowance`. The driver hands
    both to the watchdog (`cluster.driver.job.job_hang`)."""

    terms: tuple[tuple[str, float], ...]  # (what, estimated seconds), in the order a start does them
    estimate_s: float  # their sum
    floor_s: float  # the profile's hang.startup_s
    startup_s: float  # max(floor_s, margin x estimate_s)
    checkpoint_gb: float  # one checkpoint: CHECKPOINT_BYTES_PER_PARAM bytes a parameter
    write_mb_per_s: float  # the checkpoint storage's write rate assumed (the profile's hang.write_mb_per_s)
    save_floor_s: float  # the profile's hang.checkpoint_s
    first_save_s: float  # max(save_floor_s, margin x the checkpoint's write)
    margin: float = ALLOWANCE_MARGIN


def startup_allowance(profile: ClusterProfile, num_params: int) -> StartupAllowance:
    """The start allowance: margin x (a worker process's start + the model and engine build + one checkpoint at the
    storage's assumed write rate: the step-0 save of a fresh run or the load of a resumed one, reads assumed no
    slower + for an elastic job, the universal conversion rank 0 makes of a checkpoint written at another world size:
    read and written again), at least the profile's hang.startup_s. A later refinement is one more term."""
    hang = profile.hang
    checkpoint_gb = num_params * CHECKPOINT_BYTES_PER_PARAM / 1e9
    write_s = checkpoint_gb * 1e3 / hang.write_mb_per_s
    terms = [
        ("process start", PROCESS_START_S),
        ("model and engine", ENGINE_S_PER_GPARAM * num_params / 1e9),
        ("checkpoint", write_s),
    ]
    if profile.workers.elastic:
        terms.append(("universal conversion", 2 * write_s))
    estimate = sum(seconds for _, seconds in terms)
    return StartupAllowance(
        terms=tuple(terms),
        estimate_s=estimate,
        floor_s=hang.startup_s,
        startup_s=max(hang.startup_s, ALLOWANCE_MARGIN * estimate),
        checkpoint_gb=checkpoint_gb,
        write_mb_per_s=hang.write_mb_per_s,
        save_floor_s=hang.checkpoint_s,
        first_save_s=max(hang.checkpoint_s, ALLOWANCE_MARGIN * write_s),
    )
