"""The MFU denominator (pretrain.telemetry.peak): the peak of the precision and device in use, never a fixed fp32
figure."""

from __future__ import annotations

import json

import pytest
import torch

from cluster.plan import mfu
from cluster.plan.mfu import gpu_kind
from cluster.plan.planner import build_plan, resolve_config
from cluster.profiles import load_profile
from pretrain.telemetry.peak import GPU_PEAK_TFLOPS, cpu_peak, device_peak, gpu_bf16, gpu_peak


def test_gpu_peaks_follow_the_precision():
    assert gpu_peak("NVIDIA H100 80GB HBM3", "bf16").tflops == 989.0
    assert gpu_peak("NVIDIA H100 80GB HBM3", "fp32").tflops == 66.9  # torch's default: TF32 off
    assert gpu_peak("NVIDIA H100 80GB HBM3", "fp32", tf32=True).tflops == 494.7
    assert gpu_peak("A100-SXM4-80GB", "fp32").source == "A100 dense fp32 peak (datasheet)"
    assert gpu_peak("Some Future GPU", "bf16") is None
    assert all(p["bf16"] > p["tf32"] > p["fp32"] for p in GPU_PEAK_TFLOPS.values() if "bf16" in p)


def test_h100_pcie_and_nvl_get_their_own_peaks_not_the_sxms():
    """An H100 PCIe (756 dense bf16 TFLOP/s) or NVL (835) read as the SXM (989): an MFU up to 24% low, its
    measurements filed under the SXM's kind and applied to SXM plans."""
    assert gpu_peak("NVIDIA H100 PCIe", "bf16").tflops == gpu_peak("H100-PCIE-80GB", "bf16").tflops == 756.0
    assert gpu_peak("NVIDIA H100 PCIe", "fp32").tflops == 51.2
    assert gpu_peak("NVIDIA H100 NVL", "bf16").tflops == gpu_peak("NVIDIA H200 NVL", "bf16").tflops == 835.5
    assert gpu_peak("H100-SXM5-80GB", "bf16").tflops == gpu_peak("NVIDIA H100 80GB HBM3", "bf16").tflops == 989.0
    assert gpu_peak("H100 SXM5 NVLink", "bf16").tflops == 989.0  # NVLink is no NVL
    assert gpu_kind("NVIDIA H100 PCIe") == "H100 PCIe" and mfu.same_peak_kinds("H100 PCIe") == []
    assert mfu.same_peak_kinds("H100 NVL") == ["H200 NVL"] and mfu.same_peak_kinds("H100") == ["H200"]


def test_pre_ampere_gpus_have_an_fp32_peak_and_no_bf16_one():
    """The fp32 a V100 or T4 trains in under `auto` has its peak (TF32 allowed changes nothing there); bf16 has none:
    it is emulated."""
    assert gpu_peak("Tesla V100-SXM2-32GB", "fp32").tflops == gpu_peak("V100", "fp32", tf32=True).tflops == 15.7
    assert gpu_peak("Tesla V100-PCIE-16GB", "fp32").tflops == 14.0 and gpu_peak("Tesla T4", "fp32").tflops == 8.1
    assert gpu_peak("Tesla V100-SXM2-32GB", "bf16") is None
    assert [gpu_bf16(n) for n in ("Tesla T4", "Tesla V100S-PCIE-32GB", "NVIDIA A100-PCIE-40GB", "Future GPU")] == [
        False,
        False,
        True,
        True,
    ]


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
