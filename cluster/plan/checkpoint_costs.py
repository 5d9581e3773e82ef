"""What a run's checkpoints cost the plan: disk space and the step-0 baseline save."""

from __future__ import annotations

import shutil
from pathlib import Path

from data_pipeline.paths import is_remote, resolve_location
from pretrain.checkpoint import run_folder
from pretrain.config.train_config import TrainConfig

# fp32 master weights and Adam's moments (12), the engine's copy (at most 4) and model.safetensors (4).
CHECKPOINT_BYTES_PER_PARAM = 20


def checkpoint_space_warning(config: TrainConfig, num_params: int) -> list[str]:
    """A warning when a local run folder cannot take ``keep_last + 1`` checkpoints (a save writes before it prunes),
    less those there."""
    c = config.checkpoint
    if is_remote(c.dir):
        return []
    run_dir = Path(resolve_location(c.dir))
    existing = next(p for p in (run_dir, *run_dir.parents) if p.exists())
    size = num_params * CHECKPOINT_BYTES_PER_PARAM
    held = len(run_folder.complete_checkpoints(run_dir))
    need = max(1, c.keep_last + 1 - held) * size
    try:
        free = shutil.disk_usage(existing).free
    except OSError:
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
    suites = ", ".join(suite for suite, _ in config.evals.schedule())
    return (
        f"the step-0 weights are saved before the first update (a checkpoint of ~{size:.2g} GB) and evaluated with "
        f"{suites} like a checkpoint on every cadence; evals.baseline=false skips both"
    )
