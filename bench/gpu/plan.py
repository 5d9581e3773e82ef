"""The campaign's plan part: `cluster.plan.planner`'s prediction for the real path's configuration on ``h100x8``'s
profile cut to one GPU of this device; errors are (planned - measured) / measured (memory: ``max_memory_reserved``,
a CPU run's peak RSS). The one module of ``bench`` that imports ``cluster`` (docs/design.md).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from bench.gpu.train import TrainSpec
from cluster.plan.mfu import gpu_kind
from cluster.plan.planner import build_plan
from cluster.profiles import load_profile
from data_pipeline.paths import safe_name

BASE_PROFILE = "h100x8"
device_kind = gpu_kind  # the kind cluster/mfu.yaml files a device under ("NVIDIA H200" → "H200")


def one_gpu_profile(device_name: str, memory_gb: float, peak_tflops: float, loader_workers: int):
    base = load_profile(BASE_PROFILE)
    hardware = dataclasses.replace(
        base.hardware, nodes=1, gpus_per_node=1, gpu_type=device_name, gpu_memory_gb=memory_gb, peak_tflops=peak_tflops
    )
    workers = dataclasses.replace(base.workers, num_workers=1, loader_workers=loader_workers)
    name = f"bench-{safe_name(device_name)}"
    profile = dataclasses.replace(base, name=name, hardware=hardware, workers=workers)
    profile.validate()
    return profile


def compare(spec: TrainSpec, result: dict, model: str) -> dict:
    """The plan for the real path's configuration, and its errors against ``result``'s measurements."""
    memory_gb = result.get("gpu_memory_gb") or 80.0
    peak = result.get("train_path_peak_tflops") or 989.0
    profile = one_gpu_profile(result.get("device", "GPU"), memory_gb, peak, spec.num_workers)
    plan = build_plan(profile, spec.config(Path(spec.run_root) / "plan"))
    m, c = plan.memory, plan.compute
    out = {
        f"plan_memory_gb_{model}": m.total_gb,
        f"plan_activations_gb_{model}": m.activations_gb,
        f"plan_model_states_gb_{model}": m.params_gb + m.grads_gb + m.optimizer_gb,
        f"plan_overhead_gb_{model}": m.overhead_gb,
        f"plan_step_time_s_{model}": c.step_time_s,
        f"plan_mfu_{model}": c.assumed_mfu,
        f"plan_mfu_source_{model}": c.mfu_source,
        f"plan_precision_{model}": c.precision,
        f"plan_memory_source_{model}": m.memory_source or "model",
    }
    measured_gb = result.get("train_path_peak_memory_reserved_gb")
    if isinstance(measured_gb, (int, float)) and measured_gb > 0:
        out[f"measured_memory_gb_{model}"] = measured_gb
        out[f"plan_memory_error_{model}"] = (m.total_gb - measured_gb) / measured_gb
    step_s = result.get("train_path_step_s")
    if isinstance(step_s, (int, float)) and step_s > 0:
        out[f"plan_step_time_error_{model}"] = (c.step_time_s - step_s) / step_s
    return out
