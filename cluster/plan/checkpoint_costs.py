"""What a run's checkpoints cost the plan: disk space, the step-0 baseline save, and the watchdog's allowances."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from cluster.profiles import ClusterProfile
from data_pipeline.paths import is_remote, resolve_location
from pretrain.checkpoint import run_folder
from pretrain.config.train_config import TrainConfig

# Bytes per parameter of one checkpoint: fp32 master weights and Adam's moments (12), the engine's working copy (at
# most 4) and model.safetensors (4).
CHECKPOINT_BYTES_PER_PARAM = 20


def checkpoint_space_warning(config: TrainConfig, num_params: int) -> list[str]:
    """A warning when a local run folder's filesystem cannot take ``keep_last + 1`` checkpoints (a save writes
    before it prunes), less those already there."""
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
    except OSError:  # the workers' filesystem may differ anyway
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


# The terms of `startup_allowance`: estimates, so the allowance is ALLOWANCE_MARGIN times their sum.
PROCESS_START_S = 60.0  # Ray starting a worker, its imports (docs/performance.md, "A rank's start"), the group
ENGINE_S_PER_GPARAM = 60.0  # the model and DeepSpeed's engine, per 1e9 parameters
ALLOWANCE_MARGIN = 2.0  # an allowance too short kills a healthy group


@dataclass(frozen=True)
class StartupAllowance:
    """How long the watchdog lets a group go without a report before its first step, and in an unmeasured save."""

    terms: tuple[tuple[str, float], ...]  # (what, estimated seconds), in order
    estimate_s: float  # their sum
    floor_s: float  # the profile's hang.startup_s
    startup_s: float  # max(floor_s, margin x estimate_s)
    checkpoint_gb: float  # one checkpoint
    write_mb_per_s: float  # the storage's assumed write rate (the profile's hang.write_mb_per_s)
    save_floor_s: float  # the profile's hang.checkpoint_s
    first_save_s: float  # max(save_floor_s, margin x the checkpoint's write)
    margin: float = ALLOWANCE_MARGIN


def startup_allowance(profile: ClusterProfile, num_params: int) -> StartupAllowance:
    """margin x (process start + model and engine + one checkpoint's write or load + for an elastic job, the
    universal conversion: a read and a write), at least hang.startup_s; a first save: margin x one write."""
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
