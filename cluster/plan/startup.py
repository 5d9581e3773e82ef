"""The hang watchdog's allowances before the first step and in the first save, from the plan's own numbers: the
margin x the estimate, never below the profile's `hang.startup_s` / `hang.checkpoint_s`.
"""

from __future__ import annotations

from dataclasses import dataclass

from cluster.plan.checkpoint_costs import CHECKPOINT_BYTES_PER_PARAM
from cluster.profiles import ClusterProfile

PROCESS_START_S = 60.0  # Ray starting a worker, its imports (docs/performance.md, "A rank's start"), the group
ENGINE_S_PER_GPARAM = 60.0  # the model and DeepSpeed's engine, per 1e9 parameters
MANIFEST_BYTES_PER_SHARD = 128  # a manifest.parquet row, rounded up
EPOCH_PLAN_S_PER_SHARD = 0.10 / 4_700  # docs/benchmarks/2026-11-23-i21k-scale.md
ALLOWANCE_MARGIN = 2.0  # an allowance too short kills a healthy group


@dataclass(frozen=True)
class StartupAllowance:
    """How long a group may go without a report before its first step and in an unmeasured save."""

    terms: tuple[tuple[str, float], ...]  # (what, estimated seconds)
    estimate_s: float  # their sum
    floor_s: float  # hang.startup_s
    startup_s: float  # max(floor_s, margin x estimate_s)
    checkpoint_gb: float
    write_mb_per_s: float  # hang.write_mb_per_s
    save_floor_s: float  # hang.checkpoint_s
    first_save_s: float  # max(save_floor_s, margin x the checkpoint's write)
    manifest_mb: float = 0.0
    read_mb_per_s: float = 0.0  # storage.read_mb_per_s
    num_shards: int = 0
    margin: float = ALLOWANCE_MARGIN


def manifest_seconds(num_shards: int, read_mb_per_s: float) -> float:
    """Reading the manifest and planning the epoch from it."""
    return num_shards * MANIFEST_BYTES_PER_SHARD / (read_mb_per_s * 1e6) + num_shards * EPOCH_PLAN_S_PER_SHARD


def startup_allowance(profile: ClusterProfile, num_params: int, num_shards: int) -> StartupAllowance:
    hang = profile.hang
    checkpoint_gb = num_params * CHECKPOINT_BYTES_PER_PARAM / 1e9
    write_s = checkpoint_gb * 1e3 / hang.write_mb_per_s
    terms = [
        ("process start", PROCESS_START_S),
        ("manifest", manifest_seconds(num_shards, profile.storage.read_mb_per_s)),
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
        manifest_mb=num_shards * MANIFEST_BYTES_PER_SHARD / 1e6,
        read_mb_per_s=profile.storage.read_mb_per_s,
        num_shards=num_shards,
    )
