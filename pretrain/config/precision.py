"""`deepspeed.precision`: fp32 or bf16 for a run, decided from what the run is, never from a timing taken at start.

- ``auto`` (the default): bf16 on CUDA (tensor cores). On a CPU, bf16 only where it clearly pays, by a fixed rule on
  the CPU's native bf16 units and the shapes of the model's GEMMs (`CPU_RULES`, fitted to probe steps measured on
  each unit kind; docs/performance.md, "Precision"). The same recipe on the same kind of CPU picks the same precision on
  every run, and the plan prints the same answer before anything starts.
- ``probe``: an explicit opt-in to time one forward + backward of the model in fp32 and in bf16 and take bf16 if it is
  at least `PROBE_MIN_SPEEDUP` faster. A timing can flip between runs, so the first start of a run writes its decision
  into the run folder (``precision.json``, `pretrain.checkpoint.run_folder.PrecisionRecord`) and every later start of
  that run (a resume, or a re-run with the same ``checkpoint.dir``) repeats it without timing again.
- ``fp32`` / ``bf16``: as set.

A run that resumes from a checkpoint which recorded its precision keeps it (``trainer_state.json``): its losses then
continue the interrupted run's even when the rule or the recipe's choice changed in between.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from pretrain.model import flops
from pretrain.model.vit import ViTConfig

# /proc/cpuinfo flags of native bf16 matmul units (x86). AMX tiles do bf16 dot products; AVX512_BF16 adds vdpbf16ps.
BF16_FLAGS = ("amx_bf16", "avx512_bf16")
PROBE_REPEATS = 2  # timed fwd+bwd per precision, after one warm-up each; the faster of the repeats counts
PROBE_MIN_SPEEDUP = 1.05  # `probe`: bf16 must beat fp32 by this much


@dataclass(frozen=True)
class StepShape:
    """What the CPU rule looks at: the shapes of one micro-batch's GEMMs."""

    width: int  # D: the inner and outer size of the encoder's projections (the MLP's are 4 D)
    rows: int  # micro-batch x tokens: the M of every encoder GEMM
    patch_embed_share: float  # the patch-embedding convolution's share of the forward multiply-adds
    hybrid: bool  # a ResNet stem (convolutions, GroupNorm) in front of the encoder

    @property
    def projection_macs(self) -> int:
        return self.rows * self.width**2

    @classmethod
    def of(cls, model: ViTConfig, micro_batch_size: int) -> StepShape:
        grid = model.grid_size
        tokens = grid * grid + (model.pool == "token")
        stem_channels = flops.stem_channels(model)
        patch_embed = grid * grid * model.patch_size**2 * stem_channels * model.width
        return cls(
            width=model.width,
            rows=micro_batch_size * tokens,
            patch_embed_share=patch_embed / flops.forward_macs(model),
            hybrid=model.hybrid_stages is not None,
        )


@dataclass(frozen=True)
class CpuBf16Rule:
    """bf16 on a CPU with these units iff every condition holds; fp32 otherwise. The thresholds sit where bf16 was
    measured at least `margin` times faster than fp32 above them (docs/performance.md, "Precision"): a shape near
    the crossover gets fp32, the exact one, on every run."""

    units: str  # the /proc/cpuinfo flag that selects this rule
    min_width: int
    # rows x width²: the multiply-adds of one D x D projection of the micro-batch. Below it the fixed costs (casts,
    # element-wise kernels, small GEMM tiles) eat the GEMMs' gain.
    min_projection_macs: int = 16_000_000
    max_patch_embed_share: float = 0.15  # the patch convolution's bf16 weight gradient runs slower than fp32's
    hybrids: bool = True  # whether ResNet stems were measured to gain too
    margin: float = 1.5  # measured speedup of every shape the rule sends to bf16

    def check(self, shape: StepShape) -> str | None:
        """None when bf16 pays for ``shape``; otherwise the first condition it misses, in words."""
        if shape.width < self.min_width:
            return f"width {shape.width} < {self.min_width}"
        if shape.projection_macs < self.min_projection_macs:
            have, need = shape.projection_macs / 1e6, self.min_projection_macs / 1e6
            return f"{shape.rows} tokens x width² = {have:.1f}M < {need:.0f}M"
        if shape.patch_embed_share > self.max_patch_embed_share:
            return f"patch embedding {shape.patch_embed_share:.0%} of the FLOPs > {self.max_patch_embed_share:.0%}"
        if shape.hybrid and not self.hybrids:
            return "a ResNet stem (not measured to gain on this kind of CPU)"
        return None

    def describe(self) -> str:
        stem = "" if self.hybrids else ", no ResNet stem"
        macs, share = self.min_projection_macs / 1e6, self.max_patch_embed_share
        return (
            f"bf16 iff width >= {self.min_width}, tokens x width² >= {macs:.0f}M, patch embedding <= {share:.0%} "
            f"of the FLOPs{stem} (>= {self.margin}x measured)"
        )


# Fitted to one fwd+bwd of ViT shapes at 1 thread (the table: docs/benchmarks/2026-11-26-precision.md; the rule:
# docs/performance.md, "Precision"). AMX (Sapphire Rapids): every shape sent to bf16 measured 1.53-3.5x, every one
# sent to fp32 0.5-1.51x (vit_tiny_debug: 1.03x at micro-batch 8, 1.35x at 32, 1.51x at 64). AVX512-BF16 without
# AMX (Zen 4): 1.7x at S/16 and B/16, ~1.0x at vit_tiny_debug; nothing was measured between, nor a hybrid, so the
# rule keeps those in fp32.
CPU_RULES: dict[str, CpuBf16Rule] = {
    "amx_bf16": CpuBf16Rule("amx_bf16", min_width=128),
    "avx512_bf16": CpuBf16Rule("avx512_bf16", min_width=384, min_projection_macs=64_000_000, hybrids=False),
}


@dataclass(frozen=True)
class PrecisionChoice:
    precision: str  # "fp32" | "bf16"
    rule: str  # which rule decided: recipe | cuda | cpu:<units> | cpu:none | probe | run-record | checkpoint
    reason: str  # one line: why

    def line(self, requested: str) -> str:
        return f"precision {requested} -> {self.precision} ({self.rule}): {self.reason}"


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


def cpu_rule(shape: StepShape, flags: set[str] | None = None) -> PrecisionChoice:
    """`auto` on a CPU: the rule of its best bf16 unit kind (AMX over AVX512-BF16) applied to ``shape``."""
    units = cpu_bf16_units(flags)
    if not units:
        return PrecisionChoice(
            "fp32",
            "cpu:none",
            f"this CPU ({cpu_name() if flags is None else 'flags given'}) has no AMX/AVX512-BF16; bf16 matmul would "
            "be emulated (many times slower than fp32)",
        )
    rule = CPU_RULES[units[0]]
    missed = rule.check(shape)
    verdict = "fp32" if missed else "bf16"
    why = missed or f"width {shape.width}, {shape.rows} tokens x width² = {shape.projection_macs / 1e6:.0f}M"
    return PrecisionChoice(verdict, f"cpu:{rule.units}", f"{why}; rule: {rule.describe()}")


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


def probe_choice(fp32: float, bf16: float) -> PrecisionChoice:
    speedup = fp32 / bf16
    return PrecisionChoice(
        "bf16" if speedup >= PROBE_MIN_SPEEDUP else "fp32",
        "probe",
        f"probe step fp32 {fp32 * 1e3:.0f} ms vs bf16 {bf16 * 1e3:.0f} ms (bf16 {speedup:.2f}x, needs >= "
        f"{PROBE_MIN_SPEEDUP}x)",
    )


def decide(
    requested: str,
    device_type: str,
    shape: StepShape | None = None,
    *,
    flags: set[str] | None = None,
    resumed: tuple[str, str] | None = None,
    recorded: PrecisionChoice | None = None,
    probe: Callable[[], tuple[float, float]] | None = None,
    zero_stage: int | None = None,
) -> PrecisionChoice:
    """The precision of a run (module docstring). ``shape``: the micro-batch's GEMM shapes, which `auto` on a CPU
    needs; ``resumed``: (precision, checkpoint name) of the checkpoint the run resumes from, when it recorded one;
    ``recorded``: the `probe` decision in the run folder; ``probe`` (→ fp32 s, bf16 s): times the model, for
    `probe` on a CPU with bf16 units when nothing is recorded (None: the plan, which times nothing); ``zero_stage``:
    at 0 DeepSpeed has no bf16 with fp32 master weights, so auto and probe pick fp32 there."""
    choice = _decide(requested, device_type, shape, flags, resumed, recorded, probe)
    if zero_stage == 0 and choice.precision == "bf16" and choice.rule not in ("recipe", "checkpoint"):
        return PrecisionChoice(
            "fp32",
            choice.rule,
            f"ZeRO-0: DeepSpeed's bf16 needs zero_stage >= 1 for fp32 master weights (else: {choice.reason})",
        )
    return choice


def _decide(requested, device_type, shape, flags, resumed, recorded, probe) -> PrecisionChoice:
    if requested in ("fp32", "bf16"):
        return PrecisionChoice(requested, "recipe", "set in the recipe")
    if resumed is not None:
        kept, checkpoint = resumed
        return PrecisionChoice(kept, "checkpoint", f"kept from {checkpoint}, which trained in {kept}")
    if requested not in ("auto", "probe"):
        raise ValueError(f"deepspeed.precision={requested!r}; use auto, probe, fp32 or bf16")
    if device_type == "cuda":
        return PrecisionChoice("bf16", "cuda", "CUDA: bf16 tensor cores")
    if requested == "probe":
        if recorded is not None:
            return recorded
        if not cpu_bf16_units(flags):
            return cpu_rule(StepShape(0, 0, 0.0, False), flags)  # no units: nothing to time
        if probe is None:
            return PrecisionChoice("fp32", "probe", "timed by the run at its first start (fp32 assumed here)")
        return probe_choice(*probe())
    if shape is None:
        raise ValueError("precision auto on a CPU needs the model's step shape (StepShape.of(model, micro_batch))")
    return cpu_rule(shape, flags)


def decide_on_rank0(decide_here: Callable[[], PrecisionChoice]) -> PrecisionChoice:
    """`decide_here()` on rank 0, broadcast to every rank (a probe's timing must not differ between ranks)."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return decide_here()
    box: list[PrecisionChoice | None] = [decide_here() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    choice = box[0]
    assert choice is not None  # rank 0's, received
    return choice
