"""The MFU denominator (pretrain.telemetry.peak): the peak of the precision and device in use, never a fixed fp32
figure."""

from __future__ import annotations

import json

import pytest
import torch

from cluster.plan.planner import build_plan, resolve_config
from cluster.profiles import load_profile
from pretrain.telemetry.peak import GPU_PEAK_TFLOPS, cpu_peak, device_peak, gpu_peak


def test_gpu_peaks_follow_the_precision():
    assert gpu_peak("NVIDIA H100 80GB HBM3", "bf16").tflops == 989.0
    assert gpu_peak("NVIDIA H100 80GB HBM3", "fp32").tflops == 66.9  # torch's default: TF32 off
    assert gpu_peak("NVIDIA H100 80GB HBM3", "fp32", tf32=True).tflops == 494.7
    assert gpu_peak("A100-SXM4-80GB", "fp32").source == "A100 dense fp32 peak (datasheet)"
    assert gpu_peak("Some Future GPU", "bf16") is None
    assert all(p["bf16"] > p["tf32"] > p["fp32"] for p in GPU_PEAK_TFLOPS.values())


def test_a_gpu_named_after_a_shorter_one_is_not_given_its_peak():
    # "L4" is in "NVIDIA L40S" (362 dense bf16 TFLOP/s, not the L4's 121): its MFU read 3x too high
    assert gpu_peak("NVIDIA L40S", "bf16") is None and gpu_peak("NVIDIA L40", "fp32") is None
    assert gpu_peak("NVIDIA L4", "bf16").tflops == 121.0
    assert gpu_peak("NVIDIA GH200 480GB", "bf16").tflops == 989.0  # a Hopper GPU: the H100's and H200's peak


def test_cpu_peak_is_measured_once_per_precision_and_cached(tmp_path, monkeypatch, one_torch_thread):
    monkeypatch.setenv("VITSCALE_CACHE", str(tmp_path))
    first = cpu_peak("fp32", threads=1)
    assert first.tflops > 0 and "measured now" in first.source and "1 thread(s)" in first.source
    again = cpu_peak("fp32", threads=1)
    assert again.tflops == first.tflops and "measured earlier" in again.source
    cache = json.loads((tmp_path / "gemm_peak.json").read_text())
    assert [k for k in cache if k.endswith("fp32 2048x2048")] and all("1 threads" in k for k in cache)
    bf16 = cpu_peak("bf16", threads=1)  # its own entry: a bf16 run's MFU divides by the bf16 GEMM rate
    assert len(json.loads((tmp_path / "gemm_peak.json").read_text())) == 2 and "bf16" in bf16.source
    assert torch.get_num_threads() == 1  # measuring at another thread count puts the process's back
    declared = device_peak(2.5, torch.device("cpu"), "bf16")
    assert (declared.tflops, declared.source) == (2.5, "logging.peak_tflops (declared)")
    assert device_peak(None, torch.device("cpu"), "bf16").tflops == bf16.tflops


@pytest.mark.parametrize("precision, peak", [("auto", 312.0), ("bf16", 312.0), ("fp32", 19.5)])
def test_a_gpu_plan_passes_the_peak_of_its_precision_to_the_run(precision, peak):
    profile = load_profile("a100x64")
    config = resolve_config(profile, "vit_b16_i21k", [f"deepspeed.precision={precision}"], "run")
    assert config.logging.peak_tflops == peak
    plan = build_plan(profile, config)
    assert plan.compute.peak_tflops == peak and plan.compute.precision == ("fp32" if precision == "fp32" else "bf16")
