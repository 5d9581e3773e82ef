"""The collective's bus bandwidth across all training ranks, as nccl-tests' all_reduce_perf reports it.

One Ray actor per rank, placed as Ray Train places the workers (a placement group of the profile's worker bundles
and strategy), joins a torch.distributed group on the profile's backend and all-reduces one bucket of the plan's
size and dtype (docs/network.md).
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from cluster.profiles import ClusterProfile

WARMUP = 2  # all-reduces before the timing: NCCL builds its rings and gloo its pairs in the first ones
TARGET_S = 0.5  # timed seconds of all-reduces, whatever the bucket's size ...
MIN_ITERS, MAX_ITERS = 5, 2000  # ... within these counts
INIT_TIMEOUT_S = 120.0  # the process group's rendezvous
TORCH_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


@dataclass(frozen=True)
class BusBandwidth:
    """One all-reduce measurement; ``gb_per_s`` None with one rank (nothing to reduce) or an ``error``."""

    world: int
    nodes: int  # the nodes the ranks ran on
    nbytes: int  # one bucket
    seconds: float  # per all-reduce, on the slowest rank
    gb_per_s: float | None  # busbw
    backend: str
    error: str = ""


def bus_gb_per_s(nbytes: int, seconds: float, world: int) -> float:
    """nccl-tests' busbw for all-reduce, GB/s: algbw (bytes / time) x 2(n - 1)/n, comparable across world sizes."""
    return nbytes / seconds / 1e9 * 2 * (world - 1) / world


def worker_bundle(profile: ClusterProfile) -> dict[str, float]:
    """One training worker's Ray resources (Ray refuses a bundle with a zero amount)."""
    w = profile.workers
    bundle = {"CPU": float(w.cpus_per_worker), "GPU": float(w.gpus_per_worker), **w.resources}
    return {name: amount for name, amount in bundle.items() if amount > 0}


class CollectiveRank:
    """One rank (the caller applies `ray.remote`): its rendezvous address, its node, its timed all-reduces."""

    def __init__(self) -> None:
        import torch.distributed  # noqa: F401 - loaded now, while the node probes measure, not in the timed part

    def rendezvous(self) -> str:
        """``tcp://ip:port`` of a port free on this node, for rank 0's store."""
        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return f"tcp://{ray.util.get_node_ip_address()}:{port}"

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def all_reduce(self, rank: int, world: int, init_method: str, backend: str, elements: int, dtype: str) -> float:
        """Seconds per all-reduce of ``elements`` of ``dtype``, after `WARMUP`; the slowest rank's first time sets
        the count of timed ones for all."""
        import torch
        import torch.distributed as dist

        timeout = timedelta(seconds=INIT_TIMEOUT_S)
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world, timeout=timeout)
        try:
            device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
            bucket = torch.zeros(elements, dtype=getattr(torch, TORCH_DTYPES[dtype]), device=device)
            for _ in range(WARMUP):
                dist.all_reduce(bucket)
            one = torch.tensor([_timed(bucket, 1, device)], dtype=torch.float64, device=device)
            dist.all_reduce(one, op=dist.ReduceOp.MAX)  # every rank takes the same count
            iters = min(MAX_ITERS, max(MIN_ITERS, round(TARGET_S / max(one.item(), 1e-9))))
            return _timed(bucket, iters, device)
        finally:
            dist.destroy_process_group()


def _timed(bucket, iters: int, device) -> float:
    """Seconds per all-reduce of ``bucket`` over ``iters``, the device drained at both ends."""
    import torch
    import torch.distributed as dist

    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(bucket)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) / iters


@dataclass(frozen=True)
class Ranks:
    group: Any
    actors: tuple
    world: int
    bundle: dict[str, float]


def start_ranks(profile: ClusterProfile, env: dict[str, str]) -> Ranks | None:
    """Ask Ray for the ranks without waiting (they start while the caller works on); None with one rank."""
    from ray.util.placement_group import placement_group

    world = profile.workers.num_workers
    if world == 1:
        return None
    bundle = worker_bundle(profile)
    selector = profile.training_label_selector  # as Ray Train's: never on an eval node
    group = placement_group(
        [bundle] * world,
        strategy=profile.workers.placement_strategy,
        **({"bundle_label_selector": [selector] * world} if selector else {}),
    )
    return Ranks(group, tuple(_start_actors(group, bundle, world, env)), world, bundle)


def stop_ranks(ranks: Ranks | None) -> None:
    from ray.util.placement_group import remove_placement_group

    if ranks is not None:
        kill_actors(ranks.actors)
        remove_placement_group(ranks.group)


def kill_actors(actors) -> None:
    import ray

    for actor in actors:
        ray.kill(actor)


def wait_placed(ranks: Ranks, timeout_s: float) -> tuple[str, ...] | None:
    """The node of each rank once all are placed and started (torch imported); None after ``timeout_s``."""
    import ray

    ready, _ = ray.wait([ranks.group.ready()], timeout=timeout_s)
    if not ready:
        return None
    try:
        return tuple(ray.get([r.node_id.remote() for r in ranks.actors], timeout=timeout_s))
    except Exception:  # a rank that died starting: the measurement's error says so
        return None


def measure_bus_bandwidth(
    ranks: Ranks | None,
    nodes: tuple[str, ...] | None,
    profile: ClusterProfile,
    elements: int,
    dtype: str,
    timeout_s: float,
) -> BusBandwidth:
    """All-reduce busbw over ``ranks`` (`start_ranks`) on ``nodes`` (`wait_placed`; None: not placed in time)."""
    import ray

    backend = profile.comm_backend
    nbytes = elements * (2 if dtype == "bf16" else 4)
    if ranks is None:
        return BusBandwidth(1, 1, nbytes, 0.0, None, backend)
    world = ranks.world
    if nodes is None:
        error = (
            f"{world} ranks of {ranks.bundle} ({profile.workers.placement_strategy}) were not placed and started in "
            "time: the cluster lacks the resources, or a rank failed to start (its Ray worker log says why)"
        )
        return BusBandwidth(world, 0, nbytes, 0.0, None, backend, error)
    try:
        init_method = ray.get(ranks.actors[0].rendezvous.remote(), timeout=timeout_s)
        calls = [
            r.all_reduce.remote(i, world, init_method, backend, elements, dtype) for i, r in enumerate(ranks.actors)
        ]
        seconds = max(ray.get(calls, timeout=timeout_s))
    except Exception as exc:  # a rank that dies or hangs: the check's line says so
        return BusBandwidth(world, 0, nbytes, 0.0, None, backend, f"{type(exc).__name__}: {exc}"[:300])
    return BusBandwidth(world, len(set(nodes)), nbytes, seconds, bus_gb_per_s(nbytes, seconds, world), backend)


def _start_actors(group, bundle: dict[str, float], world: int, env: dict[str, str]) -> list:
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    custom = {name: amount for name, amount in bundle.items() if name not in ("CPU", "GPU")}
    actor = ray.remote(CollectiveRank)
    return [
        actor.options(
            num_cpus=bundle.get("CPU", 0),
            num_gpus=bundle.get("GPU", 0),
            resources=custom,
            scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=i),
            runtime_env={"env_vars": env},
        ).remote()
        for i in range(world)
    ]
