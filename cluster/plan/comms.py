"""What a training step sends between ranks, its time on the profile's network, and the DeepSpeed reduction settings
chosen from that arithmetic (docs/network.md, "A step's bytes" and "Their time", states every formula).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from cluster.network import describe_network, network_env
from cluster.profiles import ClusterProfile
from pretrain.config.ds_config import BatchPlan

ELEMENT_BYTES = {"bf16": 2, "fp32": 4}
MIN_BUCKET, MAX_BUCKET = 50_000_000, 200_000_000  # elements, within docs/reference.md §7's 5e7-2e8
LATENCY_SHARE = 0.1  # a bucket is large enough when a collective's start-up costs at most this share of its transfer
BUCKET_REASON = f"each rank's share of a bucket takes >= {1 / LATENCY_SHARE:g} x the latency, within 5e7..2e8"
FP32_REDUCTION_BUDGET = 0.10  # the most fp32 gradient reductions may add to the step over bf16 ones, as a share
ENGINE_ALLREDUCE_ELEMENTS = 500_000_000  # DeepSpeed's MEMORY_OPT_ALLREDUCE_SIZE bucket: ZeRO-0 and bf16 ZeRO-1


@dataclass(frozen=True)
class Collective:
    what: str  # "reduce to owners", "all-gather", ...
    tensor: str
    bytes_per_gpu: float  # per optimizer step
    calls: int  # per optimizer step


@dataclass(frozen=True)
class Bandwidth:
    gb_per_s: float | None  # None: the profile gives none
    latency_s: float
    source: str


def bandwidth(profile: ClusterProfile) -> Bandwidth:
    """Between nodes the network per node, on one node NVLink per GPU, x efficiency."""
    net = profile.network
    latency = net.latency_us * 1e-6
    if profile.hardware.nodes == 1 and net.nvlink_gb_per_s > 0:
        line, source = net.nvlink_gb_per_s, f"NVLink {net.nvlink_gb_per_s:g} GB/s per GPU"
    else:
        line, source = net.gbps_per_node / 8, f"{net.gbps_per_node / 8:g} GB/s per node between nodes"
    if not line > 0:
        return Bandwidth(None, latency, "no bandwidth in the profile (network.gbps_per_node)")
    return Bandwidth(line * net.efficiency, latency, f"{source} x efficiency {net.efficiency:g}")


def seconds(collectives: tuple[Collective, ...], bw: Bandwidth) -> float | None:
    """None without a bandwidth."""
    if bw.gb_per_s is None:
        return None
    return sum(c.bytes_per_gpu / (bw.gb_per_s * 1e9) + c.calls * bw.latency_s for c in collectives)


def step_collectives(
    zero_stage: int,
    precision: str,
    reduce_dtype: str,
    world: int,
    accumulation: int,
    num_params: int,
    buckets: tuple[int, int],
) -> tuple[Collective, ...]:
    """One optimizer step's collectives; ``buckets``: (reduce, all-gather) elements."""
    if world == 1:
        return ()
    f, P, A = (world - 1) / world, num_params, accumulation
    g, w = ELEMENT_BYTES[reduce_dtype], ELEMENT_BYTES[precision]
    reduce_calls, gather_calls = math.ceil(P / buckets[0]), math.ceil(P / buckets[1])
    grads = f"{reduce_dtype} gradients"
    gather = Collective("all-gather", f"updated {precision} weights", f * P * w, gather_calls)
    if zero_stage == 0 or (zero_stage == 1 and precision == "bf16"):
        allreduce = Collective("all-reduce", grads, 2 * f * P * g, math.ceil(P / ENGINE_ALLREDUCE_ELEMENTS))
        return (allreduce, gather) if zero_stage == 1 else (allreduce,)
    each = f" x {A} micro-batches" if A > 1 else ""
    if zero_stage == 3:
        scatter = Collective("reduce-scatter", grads + each, A * f * P * g, A * reduce_calls)
        weights = f"{precision} weights in forward and backward{each}"
        return scatter, Collective("all-gather", weights, 2 * A * f * P * w, 2 * A * gather_calls)
    if zero_stage == 1:
        return Collective("reduce to owners", grads, f * P * g, world * reduce_calls), gather
    return Collective("reduce to owners", grads + each, A * f * P * g, A * world * reduce_calls), gather


def bucket_elements(world: int, element_bytes: int, bw: Bandwidth) -> int:
    """The smallest bucket whose per-rank share takes latency / LATENCY_SHARE to send, rounded up to a million
    elements, in [MIN_BUCKET, MAX_BUCKET]."""
    if bw.gb_per_s is None:
        return MIN_BUCKET
    need = world * bw.latency_s * bw.gb_per_s * 1e9 / (element_bytes * LATENCY_SHARE)
    return min(MAX_BUCKET, max(MIN_BUCKET, math.ceil(need / 1e6) * 1_000_000))


def buckets(profile: ClusterProfile, world: int, reduce_dtype: str, precision: str) -> tuple[int, int]:
    """(reduce_bucket_size, allgather_bucket_size)."""
    bw = bandwidth(profile)
    return bucket_elements(world, ELEMENT_BYTES[reduce_dtype], bw), bucket_elements(world, ELEMENT_BYTES[precision], bw)


@dataclass(frozen=True)
class Reduction:
    communication_data_type: str  # "fp32", or "auto": the training precision
    reduce_bucket_size: int
    allgather_bucket_size: int
    dtype_reason: str
    bucket_reason: str


def choose_reduction(
    profile: ClusterProfile,
    zero_stage: int,
    precision: str,
    world: int,
    accumulation: int,
    num_params: int,
    step_s: float,
) -> Reduction:
    """fp32 gradient reductions when they cost at most FP32_REDUCTION_BUDGET of the step more than bf16 ones."""
    bw = bandwidth(profile)

    def made(dtype: str, why: str) -> Reduction:
        reduce, gather = buckets(profile, world, precision if dtype == "auto" else dtype, precision)
        return Reduction(dtype, reduce, gather, why, BUCKET_REASON)

    def cost(dtype: str) -> float | None:
        sizes = buckets(profile, world, dtype, precision)
        return seconds(step_collectives(zero_stage, precision, dtype, world, accumulation, num_params, sizes), bw)

    if precision == "fp32" or world == 1:
        return made("auto", "the gradients are fp32" if precision == "fp32" else "one rank: nothing is reduced")
    t32, t16 = cost("fp32"), cost("bf16")
    if t32 is None or t16 is None:
        return made("auto", "no bandwidth in the profile to weigh fp32 against")
    extra = (t32 - t16) / step_s
    if extra <= FP32_REDUCTION_BUDGET:
        why = f"+{(t32 - t16) * 1e3:.3g} ms over bf16 = {extra:.1%} of the step, within {FP32_REDUCTION_BUDGET:.0%}"
        return made("fp32", why)
    return made("auto", f"fp32 would add {extra:.1%} of the step, over {FP32_REDUCTION_BUDGET:.0%}")


@dataclass(frozen=True)
class CommPlan:
    interconnect: str
    env: tuple[str, ...]  # NAME=value
    bandwidth_gb_per_s: float | None
    bandwidth_source: str
    latency_us: float
    collectives: tuple[Collective, ...]
    bytes_per_gpu: float
    comm_s: float | None
    compute_s: float
    verdict: str
    settings: tuple[tuple[str, str], ...]  # DeepSpeed's reduction keys, with why


def comm_plan(profile: ClusterProfile, ds_json: dict, batch: BatchPlan, num_params: int, compute_s: float) -> CommPlan:
    zero, bw = ds_json["zero_optimization"], bandwidth(profile)
    zero_stage, world, accumulation = zero["stage"], batch.world_size, batch.grad_accum_steps
    precision = "bf16" if ds_json["bf16"]["enabled"] else "fp32"
    reduce_dtype = ds_json["communication_data_type"]
    sizes = (zero["reduce_bucket_size"], zero["allgather_bucket_size"])
    colls = step_collectives(zero_stage, precision, reduce_dtype, world, accumulation, num_params, sizes)
    comm_s = seconds(colls, bw)
    chosen = choose_reduction(profile, zero_stage, precision, world, accumulation, num_params, compute_s)
    return CommPlan(
        interconnect=describe_network(profile),
        env=tuple(f"{k}={v}" for k, v in network_env(profile).items()),
        bandwidth_gb_per_s=bw.gb_per_s,
        bandwidth_source=bw.source,
        latency_us=bw.latency_s * 1e6,
        collectives=colls,
        bytes_per_gpu=sum(c.bytes_per_gpu for c in colls),
        comm_s=comm_s,
        compute_s=compute_s,
        verdict=_verdict(comm_s, compute_s, colls, zero["overlap_comm"]) + _one_rank_zero(zero_stage, world, profile),
        settings=_settings(ds_json, chosen, buckets(profile, world, reduce_dtype, precision), profile.uses_gpus),
    )


def _one_rank_zero(zero_stage: int, world: int, profile: ClusterProfile) -> str:
    """Advice where ZeRO-2/3 partition over one GPU: the gradient hooks still run (docs/benchmarks/gpu.md)."""
    if world > 1 or zero_stage < 2 or not profile.uses_gpus:
        return ""
    return (
        f"; ZeRO-{zero_stage} partitions nothing at one rank and still costs its step (ZeRO-2 measured 30-46% over "
        "ZeRO-1 on one H200, docs/benchmarks/gpu.md): --set deepspeed.zero_stage=1"
    )


def _verdict(comm_s: float | None, compute_s: float, colls: tuple[Collective, ...], overlap: bool) -> str:
    """docs/network.md, "Overlap"."""
    if not colls:
        return "one rank: no collectives"
    if comm_s is None:
        return "time not estimated"
    share = f"{comm_s / compute_s:.0%} of the {compute_s:.3g} s compute step"
    bound = "communication-bound" if comm_s > compute_s else "not communication-bound"
    gradients = colls[0].what
    if gradients == "reduce-scatter" and overlap:
        return f"{share}: {bound}; can hide behind compute (ZeRO-3 prefetches weights, overlap_comm on)"
    if gradients == "reduce to owners" and overlap:
        why = "overlap_comm is on, but DeepSpeed synchronizes the device before each owner's reduce"
    elif gradients == "all-reduce":
        why = "gradients all-reduced after the backward pass"
    else:
        why = "gradients reduced on the compute stream (overlap_comm off)"
    return f"{share}: {bound}; does not hide behind compute ({why})"


def _settings(
    ds_json: dict, chosen: Reduction, planned_buckets: tuple[int, int], gpus: bool
) -> tuple[tuple[str, str], ...]:
    """The keys with the plan's reason where it chose the value (``planned_buckets``: for the dtype in force)."""
    zero, dtype = ds_json["zero_optimization"], ds_json["communication_data_type"]
    sizes = (zero["reduce_bucket_size"], zero["allgather_bucket_size"])
    if gpus:
        precision = "bf16" if ds_json["bf16"]["enabled"] else "fp32"
        planned = precision if chosen.communication_data_type == "auto" else chosen.communication_data_type
        dtype_why = _why(dtype == planned, chosen.dtype_reason)
        bucket_why = _why(sizes == planned_buckets, chosen.bucket_reason)
    else:
        dtype_why, bucket_why = " (the training precision)", ""
    multi = str(zero["use_multi_rank_bucket_allreduce"]).lower()
    return (
        ("communication_data_type", dtype + dtype_why),
        ("reduce/allgather_bucket_size", f"{sizes[0] / 1e6:g}M/{sizes[1] / 1e6:g}M elements{bucket_why}"),
        ("use_multi_rank_bucket_allreduce", f"{multi} (a bucket's slices go to their owners: half an all-reduce)"),
        ("overlap_comm", str(zero["overlap_comm"]).lower()),
        ("contiguous_gradients", str(zero["contiguous_gradients"]).lower()),
    )


def _why(planned: bool, reason: str) -> str:
    return f" ({reason})" if planned else " (the recipe's or --set's)"
