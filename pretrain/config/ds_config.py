"""The recipe section ``deepspeed``, the DeepSpeed JSON made from it, and the batch arithmetic (`batch_plan`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from data_pipeline.cli import positive
from pretrain.config.optim import OptimConfig

Precision = Literal["auto", "probe", "fp32", "bf16"]  # resolved by `pretrain.config.precision.decide`
DistBackend = Literal["auto", "nccl", "gloo"]  # "auto": `resolve_backend`


@dataclass(frozen=True)
class DeepSpeedConfig:
    """Recipe section ``deepspeed``: the ZeRO engine."""

    zero_stage: int = 2  # 0 (plain DDP) … 3 (parameters partitioned too)
    # auto | probe | fp32 | bf16
    precision: Precision = field(default="auto", metadata={"hint": "fp16 loss scaling is not supported; use bf16"})
    reduce_bucket_size: int = 50_000_000  # elements; the 5e8 default allocates two ~1 GB buffers
    allgather_bucket_size: int = 50_000_000  # elements
    overlap_comm: bool = False  # overlap gradient reduction with backward (worth it on GPUs)
    communication_data_type: Literal["auto", "fp32", "bf16"] = "auto"  # gradient reduction dtype (docs/network.md)
    dist_backend: DistBackend = "auto"  # auto: nccl on CUDA, gloo on CPU
    timeout_minutes: int = 30  # collective timeout, when this worker creates the process group


class BatchSizes(Protocol):
    """What the batch arithmetic reads of ``DataConfig``."""

    @property
    def global_batch_size(self) -> int: ...

    @property
    def micro_batch_size(self) -> int: ...

    @property
    def streams(self) -> int: ...


class EngineSettings(Protocol):
    """What `engine_config` reads of a ``TrainConfig``."""

    @property
    def data(self) -> BatchSizes: ...

    @property
    def optim(self) -> OptimConfig: ...

    @property
    def deepspeed(self) -> DeepSpeedConfig: ...


@dataclass(frozen=True)
class BatchPlan:
    global_batch_size: int  # images per optimizer step, all ranks
    micro_batch_size: int  # images per rank per forward/backward
    grad_accum_steps: int  # micro-batches per rank per optimizer step
    world_size: int  # ranks


def valid_world_sizes(data: BatchSizes, upto: int) -> list[int]:
    """World sizes in [1, upto] that divide `data.streams` and the micro-batches of a global batch."""
    return [
        w
        for w in range(1, upto + 1)
        if data.streams % w == 0 and data.global_batch_size % (w * data.micro_batch_size) == 0
    ]


def batch_plan(data: BatchSizes, world_size: int) -> BatchPlan:
    """Split the global batch over ranks and accumulation (docs/design.md, "The training stream contract")."""
    positive(data.streams, "data.streams")
    if data.global_batch_size % data.streams:
        raise ValueError(
            f"data.global_batch_size={data.global_batch_size} is not divisible by data.streams={data.streams}; "
            "set data.streams to a divisor of the global batch that the world sizes you run at divide"
        )
    if data.streams % world_size:
        valid = valid_world_sizes(data, max(world_size, data.streams))
        raise ValueError(
            f"world size {world_size} does not divide data.streams={data.streams}: each rank reads a contiguous "
            f"block of streams; run at a world size in {valid}, or change data.streams (a new run: it changes "
            "the data order)"
        )
    per_step = world_size * data.micro_batch_size
    if data.global_batch_size % per_step:
        per_rank = data.global_batch_size // world_size
        valid = [m for m in range(1, per_rank + 1) if data.global_batch_size % (m * world_size) == 0]
        hint = (
            f"valid data.micro_batch_size values at world size {world_size}: {valid[-6:]}"
            if valid
            else f"data.global_batch_size must be a multiple of the world size {world_size}"
        )
        raise ValueError(
            f"data.global_batch_size={data.global_batch_size} is not divisible by world size {world_size} × "
            f"data.micro_batch_size={data.micro_batch_size} (= {per_step}); {hint}"
        )
    return BatchPlan(data.global_batch_size, data.micro_batch_size, data.global_batch_size // per_step, world_size)


def check_config(ds: DeepSpeedConfig) -> None:
    """Check the deepspeed section (its Literals are checked when typed)."""
    if isinstance(ds.zero_stage, bool) or ds.zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"deepspeed.zero_stage={ds.zero_stage} is not a ZeRO stage; use 0, 1, 2 or 3 (2 is usual)")
    if ds.precision == "bf16" and ds.zero_stage == 0:
        raise ValueError(
            "deepspeed.precision=bf16 needs deepspeed.zero_stage >= 1: without ZeRO, DeepSpeed trains bf16 without "
            "fp32 master weights or fp32 gradient accumulation; use zero_stage=1 (its only cost over plain data "
            "parallelism is the partitioned optimizer state) or precision=fp32"
        )
    if ds.precision == "fp32":  # auto decides at the start, where `reduction_dtype` asks again
        reduction_dtype(ds, "fp32")
    positive(ds.reduce_bucket_size, "deepspeed.reduce_bucket_size")
    positive(ds.allgather_bucket_size, "deepspeed.allgather_bucket_size")
    positive(ds.timeout_minutes, "deepspeed.timeout_minutes")


def resolve_backend(ds: DeepSpeedConfig, device_type: str) -> str:
    if ds.dist_backend == "auto":
        return "nccl" if device_type == "cuda" else "gloo"
    return ds.dist_backend


def reduction_dtype(ds: DeepSpeedConfig, precision: str) -> str:
    """The dtype gradients are reduced in at the decided ``precision``."""
    if ds.communication_data_type == "auto":
        return precision
    if ds.communication_data_type == "bf16" and precision == "fp32":
        raise ValueError(
            "deepspeed.communication_data_type=bf16 with fp32 training rounds every gradient to bf16 before the sum; "
            "use auto or fp32"
        )
    return ds.communication_data_type


def deepspeed_config(
    ds: DeepSpeedConfig, optim: OptimConfig, plan: BatchPlan, precision: str, steps_per_print: int = 10**9
) -> dict[str, Any]:
    """The dict for `deepspeed.initialize(config=...)` at the decided ``precision``; optimizer and lr are ours."""
    if precision not in ("fp32", "bf16"):
        raise ValueError(f"precision={precision!r}: pass the decided precision (pretrain.config.precision.decide)")
    zero: dict[str, Any] = {
        "stage": ds.zero_stage,
        "overlap_comm": ds.overlap_comm,
        "contiguous_gradients": True,
        "use_multi_rank_bucket_allreduce": False,  # reduce to owners (docs/network.md)
        # explicit: the defaults moved between releases
        "reduce_bucket_size": ds.reduce_bucket_size,
        "allgather_bucket_size": ds.allgather_bucket_size,
    }
    if ds.zero_stage == 3:
        zero.update(
            stage3_prefetch_bucket_size=ds.allgather_bucket_size,
            stage3_param_persistence_threshold=10_000,
            stage3_gather_16bit_weights_on_model_save=False,  # pretrain.checkpointer gathers
        )
    return {
        "train_batch_size": plan.global_batch_size,
        "train_micro_batch_size_per_gpu": plan.micro_batch_size,
        "gradient_accumulation_steps": plan.grad_accum_steps,
        "gradient_clipping": optim.grad_clip,
        "zero_optimization": zero,
        "bf16": {"enabled": precision == "bf16"},
        "communication_data_type": reduction_dtype(ds, precision),
        "fp16": {"enabled": False},
        "data_types": {"grad_accum_dtype": "fp32"},  # a bf16 sum of many micro-batches loses bits
        "zero_allow_untested_optimizer": True,  # torch AdamW
        "steps_per_print": steps_per_print,
        "wall_clock_breakdown": False,
    }


def engine_config(
    config: EngineSettings, world_size: int, precision: str, load_universal: bool = False
) -> dict[str, Any]:
    """The engine's DeepSpeed JSON; ``load_universal``: to load a universal checkpoint."""
    plan = batch_plan(config.data, world_size)
    ds = deepspeed_config(config.deepspeed, config.optim, plan, precision)
    if load_universal:
        ds["checkpoint"] = {"load_universal": True}
    return ds
