"""The MFU denominator: the dense peak TFLOP/s of one device at the precision a run computes in.

- Declared (``logging.peak_tflops``; the cluster profiles declare their GPUs' peak for the plan's precision): used as
  given.
- CUDA: the datasheet's dense peak by device name (`GPU_PEAK_TFLOPS`): bf16 tensor cores for bf16; for fp32 the TF32
  tensor cores when ``torch.backends.cuda.matmul.allow_tf32`` is on, the fp32 units otherwise (torch's default).
- CPU: a square GEMM at that precision, measured on this machine at this process's thread count: the most a step's
  GEMMs can get here (the "GEMM rate" of ``make bench-train``). It is measured once per CPU model, bf16 units, torch
  version, thread count and precision, and cached (``~/.cache/vitscale/gemm_peak.json``, or ``$VITSCALE_CACHE``), so
  the plan and every run on the machine divide by the same number.

A run logs the peak it used and where it came from as tags (`tracking.keys.PEAK_TFLOPS`, ``PEAK_SOURCE``), so its MFU
can be recomputed against another peak.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from data_pipeline.stream.loader_rate import cpu_model, write_atomically  # one CPU name, one writer: per-machine caches
from pretrain.config.precision import cpu_bf16_units

# Dense (not 2:4 sparse) TFLOP/s per GPU by name fragment, from NVIDIA's datasheets (SXM parts where there are two).
GPU_PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "H200": {"bf16": 989.0, "tf32": 494.7, "fp32": 66.9},
    "H100": {"bf16": 989.0, "tf32": 494.7, "fp32": 66.9},
    "A100": {"bf16": 312.0, "tf32": 156.0, "fp32": 19.5},
    "A10G": {"bf16": 125.0, "tf32": 62.5, "fp32": 31.2},
    "L4": {"bf16": 121.0, "tf32": 60.0, "fp32": 30.3},
}
GEMM_SIZE = 2048  # side of the measured square GEMM (bf16 without native units: 512, it is emulated and slow)
MEASURE_SECONDS = 0.5  # per layout, after a warm-up


@dataclass(frozen=True)
class Peak:
    tflops: float  # per device
    source: str  # one line: where the number comes from


def cache_path() -> Path:
    return Path(os.environ.get("VITSCALE_CACHE") or Path.home() / ".cache" / "vitscale") / "gemm_peak.json"


def gpu_peak(name: str, precision: str, tf32: bool = False) -> Peak | None:
    """The datasheet peak of the GPU whose name contains a known fragment ("NVIDIA H100 80GB HBM3", "A100-SXM4-80GB");
    None for an unknown GPU."""
    kind = "bf16" if precision == "bf16" else ("tf32" if tf32 else "fp32")
    for fragment, peaks in GPU_PEAK_TFLOPS.items():
        if fragment in name:
            return Peak(peaks[kind], f"{fragment} dense {kind} peak (datasheet)")
    return None


def gemm_tflops(
    precision: str, size: int, device: torch.device | str = "cpu", seconds: float = 0.0, repeats: int = 3
) -> dict[str, float]:
    """TFLOP/s of a square ``size`` matmul at ``precision`` ("fp32" | "bf16"), the best of ``repeats`` (and of at
    least ``seconds`` of calls), for both operand layouts: a @ b ("nn") and a @ bᵀ ("nt", how ``F.linear`` multiplies
    by its weight). Without native bf16 the emulated kernel's speed depends on the layout (AVX2: nt ~5 GFLOP/s, nn
    ~0.5), so a peak is the faster of the two."""
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    g = torch.Generator().manual_seed(0)  # a private generator: measuring must not shift the training RNG
    a = torch.randn(size, size, generator=g).to(device, dtype)
    b = torch.randn(size, size, generator=g).to(device, dtype)
    cuda = torch.device(device).type == "cuda"
    rates = {}
    for layout, right in (("nn", b), ("nt", b.t())):
        torch.mm(a, right)  # warm-up: thread pool, caches, kernel selection
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
    """This CPU's GEMM rate at ``precision`` with ``threads`` torch threads (default: this process's), measured on
    first use and cached (module docstring)."""
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
    if not isinstance(cache.get(key), float):
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            cache[key] = max(gemm_tflops(precision, size, seconds=MEASURE_SECONDS).values())
        finally:
            torch.set_num_threads(before)
        write_atomically(path, json.dumps(cache, indent=1, sort_keys=True))
        how = "measured now"
    else:
        how = "measured earlier"
    return Peak(cache[key], f"{precision} {size}x{size} GEMM on this CPU, {threads} thread(s) ({how}; {path})")


def device_peak(declared: float | None, device: torch.device, precision: str) -> Peak:
    """The peak a run on ``device`` computing in ``precision`` divides by (module docstring)."""
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
