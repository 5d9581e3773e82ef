"""`deepspeed.precision: auto`, decided once per run: bf16 where it is faster for this model on this hardware.

On CUDA bf16 is native (tensor cores): auto → bf16. On a CPU, bf16 pays only with native bf16 matmul units
(AMX-BF16 or AVX512-BF16); elsewhere PyTorch emulates it and a bf16 step runs many times slower than fp32 (an AVX2
EPYC here: 14-100x on matmuls). Even with the units, small models lose: the casts and the narrow GEMMs of a tiny
ViT cost more than they save (issue #13 measured 0.5x for vit_tiny_debug at 32 px and 1.7x at width 384). So on a
CPU auto → bf16 only when the flags are there AND a short probe of this model (one forward + backward of one
micro-batch at the training resolution, fp32 against bf16 weights as DeepSpeed's bf16 mode runs them) says bf16 is
faster; fp32 otherwise, with one line saying why.

The decision is made by rank 0 and broadcast (`decide_on_rank0`): the probe is a timing, and ranks that timed
differently would build different engines. It is made once per run, not once per start: a checkpoint records the
precision it was trained in (``trainer_state.json``), and a resumed auto run keeps it without probing. A probe near
the threshold could otherwise resume a run in the other precision, and its losses would no longer continue the
interrupted run's.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

# /proc/cpuinfo flags of native bf16 matmul units (x86). AMX tiles do bf16 dot products; AVX512_BF16 adds vdpbf16ps.
BF16_FLAGS = ("amx_bf16", "avx512_bf16")
PROBE_REPEATS = 2  # timed fwd+bwd per precision, after one warm-up each; the faster of the repeats counts
MIN_SPEEDUP = 1.05  # bf16 must beat fp32 by this much: within timing noise fp32 wins (it is exact and simpler)


@dataclass(frozen=True)
class PrecisionChoice:
    precision: str  # "fp32" | "bf16"
    reason: str  # one line: why

    def line(self, requested: str) -> str:
        return f"precision {requested} -> {self.precision}: {self.reason}"


def cpu_flags(cpuinfo: str | Path = "/proc/cpuinfo") -> set[str] | None:
    """The CPU's feature flags from /proc/cpuinfo (first processor); None where there is no such file."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            return set(line.split(":", 1)[1].split())
    return set()


def cpu_bf16_units(flags: set[str] | None = None) -> tuple[str, ...]:
    """The native bf16 matmul units of this CPU (a subset of `BF16_FLAGS`); () when it has none.

    Without /proc/cpuinfo (not Linux) PyTorch's own detection answers (the same CPUID bits).
    """
    flags = cpu_flags() if flags is None else flags
    if flags is not None:
        return tuple(f for f in BF16_FLAGS if f in flags)
    found = []
    if getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)():
        found.append("amx_bf16")
    if getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)():
        found.append("avx512_bf16")
    return tuple(found)


def cpu_name() -> str:
    """What the fallback line calls this CPU: PyTorch's kernel level (AVX2, AVX512, ...)."""
    return torch.backends.cpu.get_cpu_capability()


def probe_bf16_speedup(
    build: Callable[[], torch.nn.Module], batch: int, image_size: int, repeats: int = PROBE_REPEATS
) -> tuple[float, float]:
    """(fp32 seconds, bf16 seconds) of one forward + backward of ``build()`` on a ``batch`` of random images.

    ``build`` returns a fresh task module (images, labels) -> (loss, metrics). The global RNG states are put back
    afterwards, so the probe changes nothing the run draws (its model and batch come from forked generators).
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        task = build()
        images = torch.randn(batch, 3, image_size, image_size)
        labels = torch.zeros(batch, dtype=torch.long)
        fp32 = _time_step(task, images, labels, repeats)
        bf16 = _time_step(task.to(torch.bfloat16), images.to(torch.bfloat16), labels, repeats)
    return fp32, bf16


def _time_step(task: torch.nn.Module, images: torch.Tensor, labels: torch.Tensor, repeats: int) -> float:
    best = float("inf")
    for i in range(repeats + 1):  # the first is a warm-up (allocations, kernel selection)
        task.zero_grad(set_to_none=True)
        start = time.perf_counter()
        loss, _ = task(images, labels)
        loss.backward()
        if i:
            best = min(best, time.perf_counter() - start)
    return best


def decide(
    requested: str,
    device_type: str,
    probe: Callable[[], tuple[float, float]] | None = None,
    flags: set[str] | None = None,
    resumed: tuple[str, str] | None = None,
) -> PrecisionChoice:
    """The precision of a run. ``probe`` (→ fp32 s, bf16 s) runs only on a CPU with bf16 units; without it (the
    plan, which has no model to time) such a CPU is reported as "bf16 if the probe at start says it is faster".
    ``resumed``: (precision, checkpoint name) of the checkpoint a run resumes from, when it recorded one; auto keeps
    that precision."""
    if requested != "auto":
        return PrecisionChoice(requested, "set in the recipe")
    if resumed is not None:
        kept, checkpoint = resumed
        return PrecisionChoice(kept, f"kept from {checkpoint}, which trained in {kept} (auto decides once per run, "
                                     "when it begins)")  # fmt: skip
    if device_type == "cuda":
        return PrecisionChoice("bf16", "CUDA: bf16 tensor cores")
    units = cpu_bf16_units(flags)
    if not units:
        return PrecisionChoice(
            "fp32",
            f"this CPU ({cpu_name() if flags is None else 'flags given'}) has no AMX/AVX512-BF16; bf16 matmul would be "
            "emulated (many times slower than fp32)",
        )
    if probe is None:
        reason = (f"memory planned for fp32, the larger; this CPU has {'+'.join(units)}, so the run picks bf16 if "
                  "a probe step of the model at start is faster in bf16")  # fmt: skip
        return PrecisionChoice("fp32", reason)
    fp32, bf16 = probe()
    speedup = fp32 / bf16
    verdict = "bf16" if speedup >= MIN_SPEEDUP else "fp32"
    return PrecisionChoice(
        verdict,
        f"this CPU has {'+'.join(units)}; probe step fp32 {fp32 * 1e3:.0f} ms vs bf16 {bf16 * 1e3:.0f} ms "
        f"(bf16 {speedup:.2f}x, needs >= {MIN_SPEEDUP}x)",
    )


def decide_on_rank0(decide_here: Callable[[], PrecisionChoice]) -> PrecisionChoice:
    """`decide_here()` on rank 0, broadcast to every rank (a probe's timing must not differ between ranks)."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return decide_here()
    box = [decide_here() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]
