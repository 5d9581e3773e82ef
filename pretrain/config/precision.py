"""`deepspeed.precision`: fp32 or bf16 for a run (`decide`), from what the run is, never from a timing at start
(docs/performance.md, "Precision")."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from pretrain.model import flops
from pretrain.model.vit import ViTConfig

BF16_FLAGS = ("amx_bf16", "avx512_bf16")  # /proc/cpuinfo flags of native bf16 matmul units (x86)
PROBE_REPEATS = 2  # timed steps per precision after a warm-up; the fastest counts
PROBE_MIN_SPEEDUP = 1.05  # `probe`: bf16 must beat fp32 by this much


@dataclass(frozen=True)
class StepShape:
    """The shapes of one micro-batch's GEMMs, which the CPU rule looks at."""

    width: int  # D, the encoder's projection size
    rows: int  # micro-batch x tokens: every encoder GEMM's M
    patch_embed_share: float  # the patch convolution's share of the forward multiply-adds
    hybrid: bool  # a ResNet stem before the encoder

    @property
    def projection_macs(self) -> int:
        return self.rows * self.width**2

    @classmethod
    def of(cls, model: ViTConfig, micro_batch_size: int) -> StepShape:
        grid = model.grid_size
        tokens = grid * grid + (model.pool == "token")
        patch_embed = grid * grid * model.patch_size**2 * flops.stem_channels(model) * model.width
        return cls(
            width=model.width,
            rows=micro_batch_size * tokens,
            patch_embed_share=patch_embed / flops.forward_macs(model),
            hybrid=model.hybrid_stages is not None,
        )


@dataclass(frozen=True)
class CpuBf16Rule:
    """bf16 on a CPU with these units iff every condition holds (with a margin against noise)."""

    units: str  # the /proc/cpuinfo flag that selects this rule
    min_width: int
    min_projection_macs: int = 16_000_000  # rows x width²; below it fixed costs eat the gain
    max_patch_embed_share: float = 0.15  # the patch convolution's bf16 weight gradient is slow
    hybrids: bool = True  # whether ResNet stems were measured to gain too
    margin: float = 1.5  # least measured speedup of a shape sent to bf16

    def check(self, shape: StepShape) -> str | None:
        """None when bf16 pays for ``shape``, else the first condition it misses."""
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


# fitted at 1 thread (docs/performance.md, "Precision")
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
    """The first processor's flags; None without the file."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            return set(line.split(":", 1)[1].split())
    return set()


def cpu_bf16_units(flags: set[str] | None = None) -> tuple[str, ...]:
    """This CPU's bf16 matmul units among `BF16_FLAGS`."""
    flags = cpu_flags() if flags is None else flags
    if flags is not None:
        return tuple(f for f in BF16_FLAGS if f in flags)
    checks = {"amx_bf16": "_is_amx_tile_supported", "avx512_bf16": "_is_avx512_bf16_supported"}
    return tuple(f for f, check in checks.items() if getattr(torch.cpu, check, lambda: False)())


def cuda_bf16_units() -> bool:
    """Whether this process's GPU has bf16 tensor cores (compute capability >= 8.0, or ROCm). True in a process that
    has not set up CUDA (a planner: asking would hold a CUDA context on a GPU a worker may use); a rank has."""
    if torch.version.hip or not torch.cuda.is_initialized():
        return True
    return torch.cuda.get_device_capability()[0] >= 8


def cpu_rule(shape: StepShape, flags: set[str] | None = None) -> PrecisionChoice:
    """`auto` on a CPU: its best bf16 unit kind's rule applied to ``shape``."""
    units = cpu_bf16_units(flags)
    if not units:
        return PrecisionChoice(
            "fp32",
            "cpu:none",
            f"this CPU ({torch.backends.cpu.get_cpu_capability() if flags is None else 'flags given'}) has no "
            "AMX/AVX512-BF16; bf16 matmul would be emulated (many times slower than fp32)",
        )
    rule = CPU_RULES[units[0]]
    missed = rule.check(shape)
    verdict = "fp32" if missed else "bf16"
    why = missed or f"width {shape.width}, {shape.rows} tokens x width² = {shape.projection_macs / 1e6:.0f}M"
    return PrecisionChoice(verdict, f"cpu:{rule.units}", f"{why}; rule: {rule.describe()}")


def probe_bf16_speedup(
    build: Callable[[], torch.nn.Module], batch: int, image_size: int, repeats: int = PROBE_REPEATS
) -> tuple[float, float]:
    """(fp32 s, bf16 s) of a forward + backward of ``build()``; the global RNG is kept."""
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
    for i in range(repeats + 1):  # the first is a warm-up
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
    cuda_bf16: bool | None = None,
) -> PrecisionChoice:
    """The precision of a run. ``resumed``: (precision, checkpoint name); ``recorded``: the run folder's `probe`
    answer; ``probe`` (→ fp32 s, bf16 s): None in the plan; ``cuda_bf16``: None → `cuda_bf16_units`."""
    choice = _decide(requested, device_type, shape, flags, resumed, recorded, probe, cuda_bf16)
    if zero_stage == 0 and choice.precision == "bf16" and choice.rule not in ("recipe", "checkpoint"):
        return PrecisionChoice(
            "fp32",
            choice.rule,
            f"ZeRO-0: DeepSpeed's bf16 needs zero_stage >= 1 for fp32 master weights (else: {choice.reason})",
        )
    return choice


def _decide(requested, device_type, shape, flags, resumed, recorded, probe, cuda_bf16) -> PrecisionChoice:
    if requested in ("fp32", "bf16"):
        return PrecisionChoice(requested, "recipe", f"deepspeed.precision={requested}, in the recipe or --set")
    if resumed is not None:
        kept, checkpoint = resumed
        return PrecisionChoice(kept, "checkpoint", f"kept from {checkpoint}, which trained in {kept}")
    if requested not in ("auto", "probe"):
        raise ValueError(f"deepspeed.precision={requested!r}; use auto, probe, fp32 or bf16")
    if device_type == "cuda":
        if not (cuda_bf16_units() if cuda_bf16 is None else cuda_bf16):
            return PrecisionChoice(
                "fp32", "cuda", "this GPU (compute capability < 8.0) has no bf16 tensor cores: bf16 would be emulated"
            )
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
    """`decide_here()` on rank 0, broadcast."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return decide_here()
    box: list[PrecisionChoice | None] = [decide_here() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    choice = box[0]
    assert choice is not None
    return choice
