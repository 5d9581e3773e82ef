"""The plan's compute part: precision, the per-device peak, step time, days and FLOPs."""

from __future__ import annotations

from dataclasses import dataclass

from cluster.plan.errors import PlanError
from cluster.plan.mfu import Measured
from cluster.profiles import ClusterProfile
from pretrain.config import optim
from pretrain.config.ds_config import BatchPlan
from pretrain.config.precision import StepShape, cpu_bf16_units, decide
from pretrain.config.train_config import TrainConfig
from pretrain.model import flops
from pretrain.model.vit import ViTConfig
from pretrain.telemetry.peak import Peak, cpu_peak, gpu_bf16, gpu_peak


@dataclass(frozen=True)
class ComputePlan:
    """A step takes the training FLOPs of the global batch / (world x peak x MFU)."""

    precision: str
    precision_reason: str
    forward_gflops_per_image: float
    train_gflops_per_image: float  # 3 x forward: the model FLOPs MFU counts
    recompute_factor: float  # step time with activation checkpointing / without: (3 + 1) / 3
    total_steps: int
    step_time_s: float  # with the recompute
    days: float
    total_exaflops: float
    images_per_s: float
    assumed_mfu: float  # or the one measured for this model on this GPU kind (`cluster.plan.mfu`), of peak_tflops
    peak_tflops: float  # per device; the run's MFU denominator too
    peak_source: str
    mfu_source: str = "assumed"  # or "measured on H200 <date> (...)"


def compute_plan(
    profile: ClusterProfile,
    config: TrainConfig,
    vit: ViTConfig,
    batch: BatchPlan,
    samples: int | None,
    measured: Measured | None = None,
) -> ComputePlan:
    """``samples``: the manifest's count, for `"90ep"` durations without `data.epoch_images`."""
    fwd, train = flops.forward_flops(vit), flops.train_flops(vit)
    total_steps = optim.duration_to_steps(
        config.schedule.total, batch.global_batch_size, config.data.epoch_images or samples, field="schedule.total"
    )
    if config.schedule.stop_at_step:
        total_steps = min(total_steps, config.schedule.stop_at_step)
    precision, precision_reason = precision_of(profile, config, vit)
    peak = run_peak(profile, config, precision)
    mfu, mfu_source = mfu_of(profile, precision, peak, measured)
    seconds = seconds_per_step(vit, batch, peak.tflops, mfu)
    return ComputePlan(
        precision=precision,
        precision_reason=precision_reason,
        forward_gflops_per_image=fwd / 1e9,
        train_gflops_per_image=train / 1e9,
        recompute_factor=(train + fwd) / train,
        total_steps=total_steps,
        step_time_s=seconds,
        days=total_steps * seconds / 86400,
        total_exaflops=train * batch.global_batch_size * total_steps / 1e18,
        images_per_s=batch.global_batch_size / seconds,
        assumed_mfu=mfu,
        peak_tflops=peak.tflops,
        peak_source=peak.source,
        mfu_source=mfu_source,
    )


def seconds_per_step(vit: ViTConfig, batch: BatchPlan, peak_tflops: float, mfu: float) -> float:
    fwd, train = flops.forward_flops(vit), flops.train_flops(vit)
    seconds = train * batch.global_batch_size / (batch.world_size * peak_tflops * 1e12 * mfu)
    return seconds * (train + fwd) / train if vit.grad_checkpointing else seconds


def step_time(
    profile: ClusterProfile, config: TrainConfig, vit: ViTConfig, batch: BatchPlan, measured: Measured | None
) -> tuple[str, float]:
    precision, _ = precision_of(profile, config, vit)
    peak = run_peak(profile, config, precision)
    return precision, seconds_per_step(vit, batch, peak.tflops, mfu_of(profile, precision, peak, measured)[0])


def precision_of(profile: ClusterProfile, config: TrainConfig, vit: ViTConfig) -> tuple[str, str]:
    """(precision, why): the workers' own rule; fp32 for a remote CPU cluster, whose CPUs are unknown here."""
    requested = config.deepspeed.precision
    if profile.uses_gpus or profile.is_local or requested in ("fp32", "bf16"):
        shape = StepShape.of(vit, config.data.micro_batch_size)
        choice = decide(
            requested,
            profile.device_type,
            shape,
            zero_stage=config.deepspeed.zero_stage,
            cuda_bf16=gpu_bf16_of(profile),
        )
        reason = f"{choice.rule}: {choice.reason}"
        if choice.precision == "bf16" and not profile.uses_gpus and not cpu_bf16_units():
            reason += "; this CPU has no AMX/AVX512-BF16: bf16 is emulated, many times slower"
        return choice.precision, reason
    return "fp32", f"decided by the workers at start ({requested} on CPUs unknown here); the memory below assumes fp32"


def gpu_bf16_of(profile: ClusterProfile) -> bool | None:
    """Whether the workers' GPUs have bf16 tensor cores, from ``gpu_type``: the plan's process has no GPU to ask."""
    return gpu_bf16(profile.hardware.gpu_type) if profile.uses_gpus else None


def profile_peak(profile: ClusterProfile, precision: str) -> Peak | None:
    """The MFU's per-device peak (``hardware.peak_tflops``: a GPU's dense bf16 peak); None: measured on the machine."""
    hw = profile.hardware
    if hw.peak_tflops is None:
        return None
    if not profile.uses_gpus:
        return Peak(hw.peak_tflops, f"profile {profile.name}: hardware.peak_tflops")
    if precision == "bf16":
        return Peak(hw.peak_tflops, f"profile {profile.name}: {hw.gpu_type} dense bf16 peak")
    known = gpu_peak(hw.gpu_type, "fp32")
    if known is None:
        raise PlanError(
            f"profile {profile.name}: no fp32 peak is known for gpu_type {hw.gpu_type!r} (pretrain.telemetry.peak); "
            "train in bf16 (--set deepspeed.precision=auto, and --set deepspeed.zero_stage=1 if it is 0: DeepSpeed's "
            "bf16 needs ZeRO, so auto trains fp32 at ZeRO-0) or name a GPU the table lists"
        )
    return known


def run_peak(profile: ClusterProfile, config: TrainConfig, precision: str) -> Peak:
    """The run's MFU denominator, as `pretrain.telemetry.peak.device_peak` takes it: `logging.peak_tflops`, which
    `cluster.plan.planner.profile_overrides` sets to `profile_peak` unless the user's `--set` declares another."""
    declared, known = config.logging.peak_tflops, profile_peak(profile, precision)
    if not declared or (known is not None and declared == known.tflops):
        return device_peak(profile, precision)
    beside = f"; {known.source}: {known.tflops:g}" if known else ""
    return Peak(declared, f"logging.peak_tflops (declared{beside})")


def mfu_of(profile: ClusterProfile, precision: str, peak: Peak, measured: Measured | None) -> tuple[float, str]:
    """(MFU, its source): the profile's assumed share of ``peak``, or the measured rate: a share of the datasheet
    peak, so of a declared ``peak`` it is that rate's share."""
    if measured is None:
        return profile.assumed_mfu, "assumed"
    known = profile_peak(profile, precision)
    if known is None or peak.tflops == known.tflops:
        return measured.mfu, measured.mfu_source
    rescaled = f"rescaled from {measured.mfu:.1%} of {known.tflops:g} TFLOP/s {measured.mfu_source}"
    return measured.mfu * known.tflops / peak.tflops, rescaled


def device_peak(profile: ClusterProfile, precision: str) -> Peak:
    peak = profile_peak(profile, precision)
    if peak is not None:
        return peak
    if not profile.is_local:
        raise PlanError(
            f"profile {profile.name}: CPU workers without hardware.peak_tflops; only this machine's CPU can be "
            "measured here: declare the workers' peak TFLOP/s in the profile"
        )
    return cpu_peak(precision, threads=profile.workers.cpus_per_worker)
