"""Per-device memory of data-parallel ViT training under DeepSpeed ZeRO: the arithmetic, and the plan's memory part.

Model states follow the ZeRO paper's accounting (Rajbhandari et al., 2020) for mixed precision with Adam, but for
DeepSpeed's ZeRO-1 in bf16: with our `grad_accum_dtype: fp32` it trains with its `BF16_Optimizer`, which sums the
gradients into a full-size fp32 buffer on every rank (the paper's ZeRO-1 keeps none). In fp32, DeepSpeed's ZeRO
optimizers still clone their partition of the weights as the fp32 master (stage 3's alias of it compares a device with
a string, never equal); only ZeRO-0, plain AdamW, keeps m and v alone.

| state                         | bytes/param | replicated until           | fp32 training                  |
|-------------------------------|-------------|----------------------------|--------------------------------|
| training weights (bf16)       | 2           | stage 3                    | 4                              |
| gradients (bf16)              | 2           | stage 2                    | 4                              |
| fp32 gradients                | 4           | stage 2 (none at stage 0)  | none: the gradients are fp32   |
| optimizer: fp32 master + m, v | 12          | stage 1                    | 12; at stage 0 m, v only: 8    |
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace
from typing import Protocol

from cluster.profiles import ClusterProfile
from pretrain.config.ds_config import BatchPlan
from pretrain.model.resnet import root_width, same_padding
from pretrain.model.vit import ViTConfig

GB = 1e9  # decimal, as GPU data sheets count
GPU_OVERHEAD_GB = 3.0  # what no formula counts: CUDA context, NCCL buffers, buckets, fragmentation
CPU_OVERHEAD_GB = 1.5  # the same on CPU, the processes
COMFORTABLE_FRACTION = 0.85  # of device memory: beyond, the plan is tight (allocator peaks in backward left out)
MIN_EFFICIENT_MICRO_BATCH = 16  # the checkpointing advice's least: below, smaller GEMMs cost more than recomputing


@dataclass(frozen=True)
class ModelStateMemory:
    params: float
    grads: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer


def model_state_bytes(num_params: int, zero_stage: int, world_size: int, precision: str) -> ModelStateMemory:
    """Per-GPU model states for Adam at ZeRO stage 0-3 (the table above)."""
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage={zero_stage}; use 0, 1, 2 or 3")
    if precision not in ("bf16", "fp32"):
        raise ValueError(f"precision={precision!r}; use 'bf16' or 'fp32'")
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be >= 1")
    P, N = float(num_params), float(world_size)
    # bytes/param: weights, gradients, their fp32 copy (a partition at ZeRO-2/3, whole at ZeRO-1), optimizer (fp32
    # master + m, v; in fp32 without ZeRO, plain AdamW's m and v)
    fp32_opt_b = 12.0 if zero_stage else 8.0
    weight_b, grad_b, fp32_grad_b, opt_b = (2.0, 2.0, 4.0, 12.0) if precision == "bf16" else (4.0, 4.0, 0.0, fp32_opt_b)
    return ModelStateMemory(
        params=P * weight_b / (N if zero_stage >= 3 else 1.0),
        grads=P * (grad_b + fp32_grad_b) / (N if zero_stage >= 2 else 1.0) if zero_stage else P * grad_b,
        optimizer=P * opt_b / (N if zero_stage >= 1 else 1.0),
    )


def activation_bytes_per_image(
    *,
    tokens: int,
    width: int,
    mlp_dim: int,
    depth: int,
    num_heads: int,
    precision: str,
    dropout: float = 0.0,
    activation_checkpointing: bool = False,
    sdpa: bool = True,
) -> float:
    """Bytes of activations one image keeps for backward (encoder only).

    Per token per layer (Korthikanti et al., 2022, §4.1, re-derived): the inputs of LN1, qkv, SDPA (q, k, v), proj,
    LN2 and fc1 (8·D elements), of GELU and fc2 (2·m); eager attention adds the softmax (heads · N), dropout one-byte
    masks (2·D). Checkpointing keeps each block's input (D), plus one block's activations (docs/reference.md §7).
    """
    elem = 2.0 if precision == "bf16" else 4.0
    per_token_layer = elem * (8 * width + 2 * mlp_dim)
    if not sdpa:
        per_token_layer += elem * num_heads * tokens
    if dropout > 0:
        per_token_layer += 2 * width
    one_layer = per_token_layer * tokens
    if activation_checkpointing:
        return elem * width * tokens * depth + one_layer
    return one_layer * depth


def vit_activation_bytes(vit: ViTConfig, precision: str, **options) -> float:
    """`activation_bytes_per_image` of ``vit``; ``options`` may set depth and the other keywords."""
    shape = {"depth": vit.depth, "width": vit.width, "mlp_dim": vit.mlp_dim, "num_heads": vit.num_heads}
    return activation_bytes_per_image(
        tokens=vit.num_patches + (vit.pool == "token"), precision=precision, **shape | options
    )


def stem_activation_bytes(vit: ViTConfig, precision: str) -> float:
    """Bytes of activations one image keeps for backward in a hybrid's ResNet stem (0 without one), as `ResNetStem`
    runs: each StdConv's padded input, each GroupNorm's input, each ReLU's output (the next conv's input where it is
    unpadded), the max-pool's padded input and int64 indices. Activation checkpointing recomputes the blocks alone."""
    if vit.hybrid_stages is None:
        return 0.0
    elem = 2.0 if precision == "bf16" else 4.0
    width, size = root_width(vit.hybrid_width), vit.image_size
    elements = vit.in_chans * _padded(size, 7, 2) ** 2  # conv_root's input
    size = math.ceil(size / 2)
    elements += 2 * width * size**2 + width * _padded(size, 3, 2) ** 2  # GN and ReLU; the max-pool's input
    size = math.ceil(size / 2)
    indices, elements = width * size**2, elements + width * size**2  # the max-pool's indices and output
    cin = width
    for s, units in enumerate(vit.hybrid_stages):
        features, cout = width * 2**s, 4 * width * 2**s
        for u in range(units):
            stride = 2 if s > 0 and u == 0 else 1
            out = math.ceil(size / stride)
            projected = cin != cout or stride != 1
            # GN1, ReLU1, conv2's padded input, GN2, ReLU2 (conv3's input); GN3, GN_proj, the unit's ReLU
            elements += features * (2 * size**2 + _padded(size, 3, stride) ** 2 + 2 * out**2)
            elements += cout * out**2 * (2 + projected)
            cin, size = cout, out
    return elem * elements + 8.0 * indices


def _padded(size: int, kernel: int, stride: int) -> int:
    return size + sum(same_padding(size, kernel, stride))


class StepTime(Protocol):
    """What the memory part reads of `cluster.plan.compute.ComputePlan`."""

    @property
    def precision(self) -> str: ...

    @property
    def recompute_factor(self) -> float: ...

    @property
    def step_time_s(self) -> float: ...

    @property
    def days(self) -> float: ...


@dataclass(frozen=True)
class MemoryPlan:
    """Memory per device in GB, and whether activation checkpointing pays for its recompute."""

    zero_stage: int
    activation_checkpointing: bool
    params_gb: float
    grads_gb: float
    optimizer_gb: float
    activation_mb_per_image: float
    activations_gb: float
    overhead_gb: float
    total_gb: float
    capacity_gb: float
    activations_gb_checkpointed: float
    activations_gb_not_checkpointed: float
    total_gb_not_checkpointed: float
    checkpointing_advice: str  # "" when the run does not fit
    memory_source: str = ""  # else the measured correction of the activations


def plan_memory(
    profile: ClusterProfile,
    batch: BatchPlan,
    vit: ViTConfig,
    compute: StepTime,
    zero_stage: int,
    num_params: int,
    correction: tuple[float, str] | None = None,
    per_rank: int | None = None,
    max_stage: int = 3,
) -> tuple[MemoryPlan, str | None]:
    """(part, None) if it fits, else (part, why not, the fixes); ``correction``: the activations' (factor, source);
    ``per_rank``: what a micro-batch must divide at every world size the run may take (default: this one's);
    ``max_stage``: the highest ZeRO stage the run may take (a fix offers none above it)."""
    micro = batch.micro_batch_size
    states = model_state_bytes(num_params, zero_stage, batch.world_size, compute.precision)
    per_image = functools.partial(vit_activation_bytes, vit, compute.precision, dropout=vit.dropout)
    stem = stem_activation_bytes(vit, compute.precision)
    scale, source = correction or (1.0, "")
    act_on = scale * (per_image(activation_checkpointing=True) + stem)
    act_off = scale * (per_image(activation_checkpointing=False) + stem)
    act_per_image = act_on if vit.grad_checkpointing else act_off
    activations = act_per_image * micro
    capacity, overhead = _device_memory(profile, batch.world_size)
    total = states.total + activations + overhead
    part = MemoryPlan(
        zero_stage=zero_stage,
        activation_checkpointing=vit.grad_checkpointing,
        params_gb=states.params / GB,
        grads_gb=states.grads / GB,
        optimizer_gb=states.optimizer / GB,
        activation_mb_per_image=act_per_image / 1e6,
        activations_gb=activations / GB,
        overhead_gb=overhead / GB,
        total_gb=total / GB,
        capacity_gb=capacity / GB,
        activations_gb_checkpointed=act_on * micro / GB,
        activations_gb_not_checkpointed=act_off * micro / GB,
        total_gb_not_checkpointed=(states.total + overhead + act_off * micro) / GB,
        checkpointing_advice="",
        memory_source=source,
    )
    fixed = states.total + overhead
    per_rank = per_rank or batch.global_batch_size // batch.world_size
    if not total <= capacity:
        at = f" (at world size {batch.world_size}, the elastic group's largest)" if profile.workers.elastic else ""
        stages = range(zero_stage, max(zero_stage, max_stage) + 1)
        rooms = _rooms(profile, stages, batch.world_size, num_params, compute.precision)
        return part, _does_not_fit(part, batch, compute, act_per_image, rooms, per_rank) + at
    return replace(
        part, checkpointing_advice=_checkpointing_advice(part, batch, compute, act_off, fixed, capacity, per_rank)
    ), None


def _rooms(profile: ClusterProfile, stages: range, world: int, num_params: int, precision: str) -> dict[int, float]:
    """Bytes per device left for activations at each of ``stages``: the first at this world size, each higher one at
    the fewest ranks the run may take too (an elastic group's smallest holds the largest partitions). The precision
    stays: above ZeRO-0 no stage changes it, and from ZeRO-0 `auto`'s bf16 only shrinks the states and activations."""

    def room(stage: int, n: int) -> float:
        capacity, overhead = _device_memory(profile, n)
        return capacity - overhead - model_state_bytes(num_params, stage, n, precision).total

    worlds = {world, profile.workers.min_workers}
    return {s: room(s, world) if s == stages[0] else min(room(s, n) for n in worlds) for s in stages}


def _device_memory(profile: ClusterProfile, world: int) -> tuple[float, float]:
    """(capacity, overhead) in bytes; a CPU worker has its share of its node's."""
    if profile.uses_gpus:
        return profile.hardware.gpu_memory_gb * GB, GPU_OVERHEAD_GB * GB
    per_node = math.ceil(world / profile.hardware.nodes)
    return profile.hardware.memory_gb_per_node * GB / per_node, CPU_OVERHEAD_GB * GB


def _checkpointing_advice(
    m: MemoryPlan, batch: BatchPlan, compute: StepTime, act_off: float, fixed: float, capacity: float, per_rank: int
) -> str:
    comfortable = COMFORTABLE_FRACTION * capacity
    recompute = compute.recompute_factor
    slower = f"one more forward per step: step time x {recompute:.2f}"
    if not m.activation_checkpointing:
        if m.total_gb * GB <= comfortable:
            return (
                f"not needed: {m.total_gb:.1f} GB of {m.capacity_gb:.0f} GB per device without it; keep "
                f"model.grad_checkpointing=false (it would cut activations to {m.activations_gb_checkpointed:.2f} GB "
                f"at {slower})"
            )
        return (
            f"tight: {m.total_gb:.1f} GB is over {COMFORTABLE_FRACTION:.0%} of {m.capacity_gb:.0f} GB; if it runs out "
            f"of memory, --set model.grad_checkpointing=true cuts activations to {m.activations_gb_checkpointed:.2f} "
            f"GB at {slower}"
        )
    micro, here = batch.micro_batch_size, batch.global_batch_size // batch.world_size
    step_time, days = compute.step_time_s, compute.days
    faster = (
        f"{step_time / recompute:.3g} s/step instead of {step_time:.3g}, {days / recompute:.3g} days instead of "
        f"{days:.3g}"
    )
    if fixed + act_off * micro <= comfortable:
        return (
            f"not needed: without it activations take {m.activations_gb_not_checkpointed:.1f} GB and the device "
            f"{m.total_gb_not_checkpointed:.1f} GB of {m.capacity_gb:.0f} GB; recomputing costs {slower}. Faster: "
            f"--set model.grad_checkpointing=false: {faster}"
        )
    fitting = [n for n in range(1, micro) if per_rank % n == 0 and fixed + act_off * n <= comfortable]
    if fitting and max(fitting) >= MIN_EFFICIENT_MICRO_BATCH:
        n = max(fitting)
        return (
            f"needed at micro-batch {micro} (without it {m.total_gb_not_checkpointed:.1f} GB of "
            f"{m.capacity_gb:.0f} GB), but micro-batch {n} x accumulation {here // n} fits without it "
            f"({(fixed + act_off * n) / GB:.1f} GB) and skips the recompute ({slower}). Faster: "
            f"--set model.grad_checkpointing=false --set data.micro_batch_size={n}: {faster}"
        )
    return (
        f"needed: without it {m.total_gb_not_checkpointed:.1f} GB of {m.capacity_gb:.0f} GB per device at "
        f"micro-batch {micro}; it costs {slower}"
    )


def _does_not_fit(
    m: MemoryPlan, batch: BatchPlan, compute: StepTime, act_per_image: float, rooms: dict[int, float], per_rank: int
) -> str:
    """The message, with each setting that alone makes the plan fit (``rooms``: `_rooms`), else one combination."""
    micro, room, activations = batch.micro_batch_size, rooms[m.zero_stage], m.activations_gb * GB
    max_micro = int(room // act_per_image) if room > 0 else 0
    fixes = []
    if max_micro >= 1:
        fixes.append(
            f"lower the micro-batch: --set data.micro_batch_size={_largest_divisor(per_rank, max_micro)} (the largest "
            f"divisor of {per_rank} that fits)"
        )
    if not m.activation_checkpointing and m.activations_gb_checkpointed * GB <= room:
        fixes.append(
            f"recompute activations: --set model.grad_checkpointing=true (activations "
            f"{m.activations_gb_checkpointed:.1f} GB; step time x {compute.recompute_factor:.2f})"
        )
    stage = next((s for s in rooms if s > m.zero_stage and rooms[s] >= activations), None)
    if stage is not None:
        fixes.append(
            f"partition more model state: --set deepspeed.zero_stage={stage} (model states and overhead then leave "
            f"{rooms[stage] / GB:.1f} GB for the {m.activations_gb:.1f} GB of activations)"
        )
    return (
        f"plan does not fit: {m.total_gb:.1f} GB per device needed, {m.capacity_gb:.1f} GB available "
        f"(model states {m.params_gb + m.grads_gb + m.optimizer_gb:.2f} GB, activations "
        f"{m.activations_gb:.1f} GB = {micro} x {m.activation_mb_per_image:.0f} MB/image, "
        f"overhead {m.overhead_gb:.1f} GB). Fix: " + ("; or ".join(fixes) or _combined(m, micro, rooms, per_rank))
    )


def _combined(m: MemoryPlan, micro: int, rooms: dict[int, float], per_rank: int) -> str:
    """No one setting fits: the stage with the most room, activation checkpointing and the micro-batch that fits."""
    stage = max(rooms, key=lambda s: (rooms[s], -s))  # ties: the lower stage
    per_image = m.activations_gb_checkpointed * GB / micro
    most = int(rooms[stage] // per_image) if rooms[stage] > 0 else 0
    if most < 1:
        return (
            f"none: even at ZeRO-{stage}, model states and overhead leave {max(rooms[stage], 0) / GB:.1f} GB per "
            f"device for activations, less than one image's {per_image / 1e6:.3g} MB with activation checkpointing; "
            "use devices with more memory"
        )
    sets = [f"deepspeed.zero_stage={stage}"] if stage != m.zero_stage else []
    sets += [] if m.activation_checkpointing else ["model.grad_checkpointing=true"]
    n = _largest_divisor(per_rank, most)
    sets += [f"data.micro_batch_size={n}"] if n < micro else []
    return "no one setting fits; together: " + " ".join(f"--set {s}" for s in sets)


def _largest_divisor(n: int, most: int) -> int:
    """The largest divisor of ``n`` up to ``most`` (>= 1)."""
    return max(d for d in range(1, min(most, n) + 1) if n % d == 0)
