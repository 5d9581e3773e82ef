"""What a run's checkpoints cost the plan: disk space and the step-0 baseline save."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

from cluster.plan.evals.cadence import EvalCadence
from cluster.plan.evals.cost import EvalsPlan, eval_queue
from data_pipeline.paths import is_remote, resolve_location
from pretrain.checkpoint import run_folder
from pretrain.config.train_config import TrainConfig

# fp32 master weights and Adam's moments (12), the engine's copy (at most 4) and model.safetensors (4).
CHECKPOINT_BYTES_PER_PARAM = 20


def pinned_beyond_kept(evals: EvalsPlan, cadence: EvalCadence, step_s: float, keep_last: int) -> int:
    """The most checkpoints older than the newest ``keep_last`` that pins for pending evals keep on disk at a save,
    the evals queued as `eval_queue` has them. The scheduler unpins finished evals at a save's submit, after that
    save's prune: a checkpoint goes at the prune after the first save at or after its evals' end."""
    if not evals.suites or cadence.last_step is None:
        return 0
    last, period = cadence.last_step, cadence.checkpoint_every
    saves = [*([0] if evals.baseline else []), *range(period, last, period), last]
    pinned, most = [], 0  # pinned: (index of its save, end of its evals)
    for i, (_, end) in enumerate(eval_queue(evals, cadence, step_s, saves)):
        pruned_by = saves[i - 2] * step_s if i >= 2 else -math.inf  # ended then: unpinned before the last prune
        pinned = [(j, e) for j, e in pinned if e > pruned_by]
        most = max(most, sum(j < i - keep_last for j, _ in pinned))
        if not math.isnan(end):
            pinned.append((i, end))
    return most


def checkpoint_space_warning(
    config: TrainConfig, num_params: int, pinned: int = 0, runs_here: bool = True
) -> list[str]:
    """A warning when a local run folder cannot take ``keep_last + 1`` checkpoints (a save writes before it prunes)
    and the ``pinned`` older ones pending evals keep (`pinned_beyond_kept`), less those there. ``runs_here`` False (a
    cluster's nodes write it): measured only where the folder of run folders is (mounted) here, not this host's disk."""
    c = config.checkpoint
    if is_remote(c.dir):
        return []
    run_dir = Path(resolve_location(c.dir))
    if not runs_here and not run_dir.parent.is_dir():
        return []
    existing = next(p for p in (run_dir, *run_dir.parents) if p.exists())
    size = num_params * CHECKPOINT_BYTES_PER_PARAM
    held = len(run_folder.complete_checkpoints(run_dir))
    need = max(1, c.keep_last + 1 + pinned - held) * size
    try:
        free = shutil.disk_usage(existing).free
    except OSError:
        return []
    if free >= need:
        return []
    count = f"checkpoint.keep_last + 1 = {c.keep_last + 1}"
    if pinned:
        count = f"{count} + {pinned} pinned for pending evals (the evals' estimated pace) = {c.keep_last + 1 + pinned}"
    return [
        f"{run_dir} has {free / 1e9:.3g} GB free but needs ~{need / 1e9:.3g} GB more to hold {count} checkpoints of "
        f"~{size / 1e9:.3g} GB ({held} there now): a save that fills the disk stops the run "
        "(checkpoint.on_save_error); free space, lower checkpoint.keep_last or move checkpoint.dir"
        + ("; or pin fewer: evals that keep up (a faster eval device, a cheaper or rarer suite)" if pinned else "")
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
