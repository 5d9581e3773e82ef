"""The MFU denominator, `device_peak`: one device's dense peak TFLOP/s at the run's precision.

A declared ``logging.peak_tflops`` wins. CUDA: the datasheet peak (TF32 only when torch allows it). CPU: a square
GEMM, measured once per CPU, torch version, threads and precision, cached in ``$VITSCALE_CACHE/gemm_peak.json``.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from data_pipeline.paths import cache_dir
from data_pipeline.stream.loader_rate import cpu_model, write_atomically  # shared per-machine cache helpers
from pretrain.config.precision import cpu_bf16_units

# Dense TFLOP/s by GPU name fragment, NVIDIA datasheets; "H100 PCIe": a name with H100 and PCIe, checked before H100
# (the SXM's). Pre-Ampere GPUs have no bf16 or TF32 tensor cores: fp32 only.
GPU_PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "H200 NVL": {"bf16": 835.5, "tf32": 417.5, "fp32": 60.0},
    "H200": {"bf16": 989.0, "tf32": 494.7, "fp32": 66.9},
    "H100 NVL": {"bf16": 835.5, "tf32": 417.5, "fp32": 60.0},
    "H100 PCIe": {"bf16": 756.0, "tf32": 378.0, "fp32": 51.2},
    "H100": {"bf16": 989.0, "tf32": 494.7, "fp32": 66.9},
    "A100": {"bf16": 312.0, "tf32": 156.0, "fp32": 19.5},
    "A10G": {"bf16": 125.0, "tf32": 62.5, "fp32": 31.2},
    "L4": {"bf16": 121.0, "tf32": 60.0, "fp32": 30.3},
    "V100 PCIe": {"fp32": 14.0},
    "V100": {"fp32": 15.7},
    "V100S": {"fp32": 16.4},
    "T4": {"fp32": 8.1},
}
GEMM_SIZE = 2048  # measured GEMM side (emulated bf16: 512)
MEASURE_SECONDS = 0.5  # per layout, after a warm-up


@dataclass(frozen=True)
class Peak:
    tflops: float  # per device
    source: str  # where the number comes from


def cache_path() -> Path:
    return cache_dir() / "gemm_peak.json"


def known_gpu(name: str) -> str | None:
    """The `GPU_PEAK_TFLOPS` key a device name holds ("NVIDIA H100 80GB HBM3" -> "H100", "H100-PCIE-80GB" -> "H100
    PCIe"), None for an unknown one; a key followed by a letter or digit is another GPU ("L4" is not "NVIDIA L40S")."""
    return next((k for k in GPU_PEAK_TFLOPS if _holds(name, k)), None)


def _holds(name: str, key: str) -> bool:
    gpu, _, variant = key.partition(" ")
    if not re.search(re.escape(gpu) + r"(?![0-9A-Za-z])", name):
        return False
    return not variant or bool(re.search(rf"(?<![0-9A-Za-z]){variant}(?![0-9A-Za-z])", name, re.IGNORECASE))


def gpu_bf16(name: str) -> bool:
    """Whether a GPU by name has bf16 tensor cores: not one the table lists without (V100, T4: compute capability
    < 8.0); an unknown one is assumed to, as `cuda_bf16_units` assumes in a process without CUDA."""
    known = known_gpu(name)
    return known is None or "bf16" in GPU_PEAK_TFLOPS[known]


def gpu_peak(name: str, precision: str, tf32: bool = False) -> Peak | None:
    """The datasheet peak of a GPU by name; None for an unknown one, or bf16 on one without bf16 tensor cores."""
    kind = "bf16" if precision == "bf16" else ("tf32" if tf32 else "fp32")
    fragment = known_gpu(name)
    if fragment is None:
        return None
    peaks = GPU_PEAK_TFLOPS[fragment]
    if kind == "tf32" and kind not in peaks:  # no TF32 units: allowing TF32 leaves fp32 matmuls fp32
        kind = "fp32"
    return Peak(peaks[kind], f"{fragment} dense {kind} peak (datasheet)") if kind in peaks else None


def gemm_tflops(
    precision: str, size: int, device: torch.device | str = "cpu", seconds: float = 0.0, repeats: int = 3
) -> dict[str, float]:
    """Best TFLOP/s of a square matmul per layout, "nn" (a @ b) and "nt" (a @ bᵀ, as ``F.linear``)."""
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    g = torch.Generator().manual_seed(0)  # not the training RNG
    a = torch.randn(size, size, generator=g).to(device, dtype)
    b = torch.randn(size, size, generator=g).to(device, dtype)
    cuda = torch.device(device).type == "cuda"
    rates = {}
    for layout, right in (("nn", b), ("nt", b.t())):
        torch.mm(a, right)  # warm-up
        best, count, began = float("inf"), 0, time.perf_counter()
        while count < repeats or time.perf_counter() - began < seconds:
            if cuda:
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            torch.mm(a, right)
            if cuda:
                torch.cuda.synchronize(device)
            best, count = min(best, time.perf_counter() - start), count + 1
        rates[layout] = 2 * size**3 / best / 1e12
    return rates


def cpu_peak(precision: str, threads: int | None = None) -> Peak:
    """This CPU's cached GEMM rate with ``threads`` torch threads (default: this process's)."""
    threads = threads or torch.get_num_threads()
    units = cpu_bf16_units()
    size = GEMM_SIZE if precision == "fp32" or units else 512
    key = f"{cpu_model()} | {'+'.join(units) or 'no bf16 units'} | torch {torch.__version__} | {threads} threads"
    key += f" | {precision} {size}x{size}"
    path = cache_path()
    try:
        cache = json.loads(path.read_text())
    except (OSError, ValueError):
        cache = {}
    how = "measured earlier"
    if not isinstance(cache.get(key), float):
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            cache[key] = max(gemm_tflops(precision, size, seconds=MEASURE_SECONDS).values())
        finally:
            torch.set_num_threads(before)
        write_atomically(path, json.dumps(cache, indent=1, sort_keys=True))
        how = "measured now"
    return Peak(cache[key], f"{precision} {size}x{size} GEMM on this CPU, {threads} thread(s) ({how}; {path})")


def device_peak(declared: float | None, device: torch.device, precision: str) -> Peak:
    """The peak a run divides by."""
    if declared:
        return Peak(declared, "logging.peak_tflops (declared)")
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        known = gpu_peak(name, precision, tf32=torch.backends.cuda.matmul.allow_tf32)
        if known is not None:
            return known
        rate = max(gemm_tflops(precision, 8192, device).values())
        return Peak(rate, f"{precision} 8192x8192 GEMM measured on this {name} (no datasheet entry)")
    return cpu_peak(precision)
