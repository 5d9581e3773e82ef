"""The campaign's plan part (`bench.gpu.campaign`): what `cluster.plan.planner` predicts for the configuration the
real-path part ran, against what it measured. The one module of ``bench`` that imports ``cluster`` (docs/design.md: a
benchmark that checks the planner must ask the planner).

The profile is ``h100x8``'s with its hardware made this machine's: one node, one GPU of this device's name and memory
and its dense bf16 peak (`pretrain.telemetry.peak`), one worker with the part's loader workers. The config is the real
path's own (`bench.gpu.train.TrainSpec.config`). Errors are relative and signed, (planned - measured) / measured:
positive when the plan expects more memory or a longer step than the device took.

- memory: the plan's total per device (model states + activations + its overhead allowance) against the largest
  memory the run's process reserved from the device (``torch.cuda.max_memory_reserved``: what the allocator took,
  fragmentation included; on a CPU, a smoke run, the process's peak resident size);
- step time: the plan's step time (its MFU: measured for this model and GPU kind in cluster/mfu.yaml, or the profile's
  assumption; ``plan_mfu_source`` says which) against the real path's steady-state step.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from bench.gpu.train import TrainSpec
from cluster.calibrate import gpu_kind
from cluster.plan.planner import build_plan
from cluster.profiles import load_profile

BASE_PROFILE = "h100x8"


def device_kind(name: str) -> str:
    """The GPU kind cluster/mfu.yaml files a device's numbers under ("NVIDIA H200" → "H200": `cluster.calibrate`)."""
    return gpu_kind(name)


def one_gpu_profile(device_name: str, memory_gb: float, peak_tflops: float, loader_workers: int):
    """``BASE_PROFILE`` reduced to one GPU of this device (module docstring)."""
    base = load_profile(BASE_PROFILE)
    hardware = dataclasses.replace(
        base.hardware, nodes=1, gpus_per_node=1, gpu_type=device_name, gpu_memory_gb=memory_gb, peak_tflops=peak_tflops
    )
    workers = dataclasses.replace(base.workers, num_workers=1, loader_workers=loader_workers)
    profile = dataclasses.replace(base, name=f"bench-{device_name}", hardware=hardware, workers=workers)
    profile.validate()
    return profile


def compare(spec: TrainSpec, result: dict, model: str) -> dict:
    """The plan's numbers for the real path's configuration and their errors against ``result``'s measurements."""
    memory_gb = result.get("gpu_memory_gb") or 80.0
    peak = result.get("train_path_peak_tflops") or 989.0
    profile = one_gpu_profile(result.get("device", "GPU"), memory_gb, peak, spec.num_workers)
    config = spec.config(Path(spec.run_root) / "plan")
    plan = build_plan(profile, config)
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
