"""The preflight's checks: measure every node of the connected Ray cluster and the collective (`measure`), then judge
each figure against what the plan needs (`judge`): one `Check`, one printed line, per check and node.

A zero-CPU `NodeProbe` actor pinned to each node measures it and answers the clock check. Why: docs/preflight.md.
"""

from __future__ import annotations

import contextlib
import math
import os
import posixpath
import time
from dataclasses import dataclass

from cluster.driver.job import worker_env
from cluster.network import EFA_DEVICES, EFA_FIX, NCCL_NET_PLUGIN, needs_efa, network_env
from cluster.plan import comms
from cluster.plan.data_wait import INPUT_BOUND_WAIT
from cluster.plan.planner import Plan
from cluster.preflight.collective import (
    BusBandwidth,
    kill_actors,
    measure_bus_bandwidth,
    start_ranks,
    stop_ranks,
    wait_placed,
    worker_bundle,
)
from cluster.preflight.node import Figure, GpuInventory, NodeFigures, NodeProbe, ProbeRequest
from cluster.preflight.replan import wait_at
from cluster.profiles import EVAL_NODE_RESOURCE, ClusterProfile
from data_pipeline.manifest import dataset_info
from data_pipeline.paths import resolve_location
from pretrain.config.ds_config import reduction_dtype
from pretrain.config.train_config import TrainConfig
from pretrain.telemetry.peak import known_gpu
from tracking.runs import tracking_credentials

READ_SHARDS = 8  # shard files each node reads (at least one per parallel stream) ...
READ_BUDGET_BYTES = 512 * 10**6  # ... or fewer, once this much is read (a large shard is read in part) ...
READ_STREAM_BYTES = 32 * 10**6  # ... or this much per stream, where more: a stream's first bytes come slower
START_TIMEOUT_S = 180.0  # for the probes to start on every node
MEASURE_TIMEOUT_S = 600.0  # for a node's measurements, and for the collective
CLOCK_SAMPLES = 5  # round trips per node; the shortest one is kept
MAX_CLOCK_SKEW_S = 1.0  # the watchdog and goodput ledger compare nodes' clocks; NTP keeps them within ms
RATE_TOLERANCE = 0.8  # a bandwidth this near the plan's is a short measurement's noise, not a slower fabric
WAIT_SLACK = 0.05  # share of a step a loader may add to the plan's data wait (at least the input-bound share)


@dataclass(frozen=True)
class Check:
    """One check's verdict on one node (``node`` "cluster" for a check of the whole cluster)."""

    name: str
    node: str
    measured: str
    needs: str
    passed: bool
    fix: str = ""

    def line(self) -> str:
        verdict = "PASS" if self.passed else f"FAIL; fix: {self.fix}"
        return f"{self.name:<17} {self.node:<17} {self.measured} vs {self.needs}: {verdict}"


@dataclass(frozen=True)
class Node:
    node_id: str
    ip: str
    resources: dict[str, float]

    @property
    def label(self) -> str:
        return f"{self.ip}/{self.node_id[:6]}"  # the IP alone is ambiguous where nodes share a machine


@dataclass(frozen=True)
class Measurements:
    """Everything measured; a node's figures are None when its probe did not answer in time."""

    nodes: tuple[Node, ...]
    figures: dict[str, NodeFigures | None]  # by node id
    skews: dict[str, tuple[float, float] | None]  # by node id: (skew s, ± half the round trip s)
    collective: BusBandwidth


def alive_nodes() -> tuple[Node, ...]:
    """The cluster's live nodes, the head first."""
    import ray

    nodes = [
        Node(n["NodeID"], n["NodeManagerAddress"], dict(n.get("Resources", {}))) for n in ray.nodes() if n["Alive"]
    ]
    return tuple(sorted(nodes, key=lambda n: ("node:__internal_head__" not in n.resources, n.ip, n.node_id)))


def holds_a_worker(node: Node, profile: ClusterProfile) -> bool:
    """Whether Ray could place a training worker on ``node``: an eval node (the workers' label selector skips it) or
    a head-only node cannot."""
    return not node.resources.get(EVAL_NODE_RESOURCE) and all(
        node.resources.get(name, 0) >= amount for name, amount in worker_bundle(profile).items()
    )


def probe_env(profile: ClusterProfile) -> dict[str, str]:
    return {**worker_env(profile), **network_env(profile), **tracking_credentials(os.environ)}


def measure(profile: ClusterProfile, config: TrainConfig, plan: Plan) -> Measurements:
    """Probe every live node, then the collective, on the connected cluster; the ranks start beside the probes, so no
    start-up disturbs a measurement, and are timed once the probes are gone."""
    nodes = alive_nodes()
    env = probe_env(profile)
    urls = _shard_urls(config)
    probes = _start_probes(nodes, env)
    ranks = start_ranks(profile, env)
    try:
        try:
            started = _answers({n.node_id: p.identity.remote() for n, p in zip(nodes, probes)}, START_TIMEOUT_S)
            placed = wait_placed(ranks, START_TIMEOUT_S) if ranks is not None else None
            skews, figures = _probe(nodes, probes, started, config, profile, plan, urls)
        finally:
            kill_actors(probes)
        elements = min(config.deepspeed.reduce_bucket_size, plan.model.num_params)
        dtype = reduction_dtype(config.deepspeed, plan.compute.precision)
        collective = measure_bus_bandwidth(ranks, placed, profile, elements, dtype, MEASURE_TIMEOUT_S)
    finally:
        stop_ranks(ranks)
    return Measurements(nodes, {n.node_id: figures.get(n.node_id) for n in nodes}, skews, collective)


def _probe(
    nodes: tuple[Node, ...], probes: list, started: dict, config: TrainConfig, profile: ClusterProfile, plan: Plan, urls
):
    """(clock skews, figures) by node id, of the probes that ``started``: the clocks first, while they are idle."""
    skews = {n.node_id: _clock_skew(p) if started[n.node_id] else None for n, p in zip(nodes, probes)}
    requests = {
        n.node_id: p.measure.remote(_request(config, profile, urls, k, n, read_streams(plan)))
        for k, (n, p) in enumerate(zip(nodes, probes))
        if started[n.node_id]
    }
    return skews, _answers(requests, MEASURE_TIMEOUT_S)


def _start_probes(nodes: tuple[Node, ...], env: dict[str, str]) -> list:
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    actor = ray.remote(NodeProbe)
    return [
        actor.options(
            num_cpus=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node.node_id, soft=False),
            runtime_env={"env_vars": env},
        ).remote()
        for node in nodes
    ]


def _answers(refs: dict[str, object], timeout_s: float) -> dict[str, object]:
    """Each ref's value by key, None where it did not answer within ``timeout_s`` or raised."""
    import ray

    if not refs:
        return {}
    done = set(ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)[0])
    out: dict[str, object] = dict.fromkeys(refs)
    for key, ref in refs.items():
        with contextlib.suppress(Exception):  # the actor died (a lost node): no figures from it
            out[key] = ray.get(ref) if ref in done else None
    return out


def _clock_skew(probe) -> tuple[float, float] | None:
    """(the node's clock minus the driver's at a round trip's midpoint, half that round trip) of the shortest of
    `CLOCK_SAMPLES` round trips; None when the probe stops answering."""
    import ray

    best = (0.0, math.inf)
    for _ in range(CLOCK_SAMPLES):
        before = time.time()
        try:
            remote = ray.get(probe.now.remote(), timeout=START_TIMEOUT_S)
        except Exception:  # the node was lost: its clock line says "no answer"
            return None
        after = time.time()
        if (after - before) / 2 < best[1]:
            best = (remote - (before + after) / 2, (after - before) / 2)
    return best


def _shard_urls(config: TrainConfig) -> tuple[str, ...]:
    """Every training shard's URL from the manifest; () where it is not readable (each node's read check fails)."""
    try:
        return tuple(s.url for s in dataset_info(resolve_location(config.data.train)).shards)
    except Exception:  # the nodes' reads say why
        return ()


def read_streams(plan: Plan) -> int:
    """The shards a training node reads at once: a stream per loader worker (the rank itself without any)."""
    ranks = math.ceil(plan.topology.world_size / plan.topology.nodes)
    return ranks * max(1, plan.data.loader_workers)


def _request(
    config: TrainConfig, profile: ClusterProfile, urls: tuple[str, ...], k: int, node: Node, streams: int = 1
) -> ProbeRequest:
    """Node ``k`` reads shards of its own where there are enough: a shared filesystem's cache then serves none.
    ``streams``: a training node's parallel readers (`read_streams`); a node that holds no worker reads one."""
    streams = streams if holds_a_worker(node, profile) else 1
    count = min(max(READ_SHARDS, streams), len(urls))
    mine = tuple(urls[(k * count + i) % len(urls)] for i in range(count)) if urls else ()
    return ProbeRequest(
        shard_urls=mine or (config.data.train,),
        read_budget_bytes=max(READ_BUDGET_BYTES, streams * READ_STREAM_BYTES),
        config=config,
        checkpoint_root=_checkpoint_root(config),
        tracking_uri=_tracking_uri(config, profile),
        label=node.label,
        check_efa=needs_efa(profile) and holds_a_worker(node, profile),
        device_type=profile.device_type,
        read_streams=streams,
    )


def _checkpoint_root(config: TrainConfig) -> str:
    """The folder the run folder goes in: the profile's storage.checkpoints, or where `--set checkpoint.dir` puts it."""
    return posixpath.dirname(config.checkpoint.dir.rstrip("/"))


def _tracking_uri(config: TrainConfig, profile: ClusterProfile) -> str:
    """The store the run logs to: the profile's, or the `--set logging.mlflow_tracking_uri` one."""
    return config.logging.mlflow_tracking_uri or profile.storage.mlflow_tracking_uri


def judge(measured: Measurements, profile: ClusterProfile, config: TrainConfig, plan: Plan) -> list[Check]:
    """Every check's verdict, grouped by check: the nodes, then each node check over the nodes, the collective."""
    checks = [_nodes_check(measured.nodes, profile)]
    for name, check in NODE_CHECKS:
        for node in measured.nodes:
            figures = measured.figures[node.node_id]
            checks.append(_silent(name, node) if figures is None else check(node, figures, profile, config, plan))
    checks += [_clock_check(node, measured.skews[node.node_id]) for node in measured.nodes]
    checks.append(_collective_check(measured.collective, profile))
    return checks


def _silent(name: str, node: Node) -> Check:
    fix = "the node is lost or overloaded: `ray status` and the node's Ray logs (<temp dir>/session_latest/logs)"
    return Check(name, node.label, "no answer", f"the node's probe within {MEASURE_TIMEOUT_S:.0f} s", False, fix)


def _nodes_check(nodes: tuple[Node, ...], profile: ClusterProfile) -> Check:
    want, hold = profile.hardware.nodes, sum(holds_a_worker(n, profile) for n in nodes)
    measured = f"{hold} node(s) that can hold a worker ({worker_bundle(profile)}), {len(nodes)} in all"
    fix = "start the missing nodes (`ray status` on the head lists those up) or lower hardware.nodes"
    return Check("nodes", "cluster", measured, f"hardware.nodes={want}", hold >= want, fix)


def _describe_gpus(inv: GpuInventory) -> str:
    if inv.error:
        return f"GPU query failed ({inv.source}: {inv.error})"
    if inv.count == 0:
        return "0 GPUs"
    kinds = ", ".join(sorted(set(inv.names)))
    return f"{inv.count} x {kinds} ({min(inv.memory_gb):.1f} GB), driver {inv.driver or 'unknown'}"


def _same_kind(gpu_type: str, name: str) -> bool:
    """Whether the driver's ``name`` ("NVIDIA A100-SXM4-80GB") is a ``gpu_type``: a kind the planner prices by its
    own rule ("L4" is not "NVIDIA L40S"), else the type's first part ("A100" of "A100-SXM4-80GB"), spaces aside."""
    if known := known_gpu(gpu_type):
        return known_gpu(name) == known
    return gpu_type.split("-")[0].upper().replace(" ", "") in name.upper().replace(" ", "")


def _gpu_check(node: Node, figures: NodeFigures, profile: ClusterProfile, config: TrainConfig, plan: Plan) -> Check:
    hw, inv, seen = profile.hardware, figures.gpus, _describe_gpus(figures.gpus)
    fix = "check the node's driver (`nvidia-smi`) and Ray's GPU count (`ray status`), or correct hardware.gpu_*"
    if not holds_a_worker(node, profile):
        return Check("gpus", node.label, seen, "none (no training worker fits here)", not inv.error, fix)
    if hw.gpus_per_node == 0:
        return Check("gpus", node.label, seen, "none (CPU workers)", True)
    ok = (
        not inv.error
        and inv.count >= hw.gpus_per_node
        and all(_same_kind(hw.gpu_type, name) for name in inv.names)
        and all(gb >= hw.gpu_memory_gb for gb in inv.memory_gb)
    )
    needs = f"{hw.gpus_per_node} x {hw.gpu_type} (>= {hw.gpu_memory_gb:g} GB each)"
    return Check("gpus", node.label, seen, needs, ok, fix)


def _efa_check(node: Node, figures: NodeFigures, profile: ClusterProfile, config: TrainConfig, plan: Plan) -> Check:
    """What a training worker checks before NCCL starts (`cluster.network.efa_missing`), where it would refuse to."""
    net, nodes = profile.network, profile.hardware.nodes
    if not needs_efa(profile):
        why = f"network.kind {net.kind}" if net.kind != "efa" else "one node: no rank reaches another node"
        return Check("efa", node.label, "not checked", f"none ({why})", True)
    if not holds_a_worker(node, profile):
        return Check("efa", node.label, "not checked", "none (no training worker fits here)", True)
    problem = figures.efa_missing
    needs = f"{EFA_DEVICES}/uverbs* and {NCCL_NET_PLUGIN} loading (network.kind efa on {nodes} nodes)"
    measured = problem or f"{EFA_DEVICES}/uverbs* present, {NCCL_NET_PLUGIN} loads"
    return Check("efa", node.label, measured, needs, problem is None, EFA_FIX)


def _judged(name: str, node: Node, figure: Figure, needs: str, fix: str, verdict) -> Check:
    """The check of ``verdict(value)``'s (measured, passed); failed when ``figure`` could not be measured."""
    if figure.value is None:
        return Check(name, node.label, f"not measured: {figure.error}", needs, False, fix)
    measured, passed = verdict(figure.value)
    return Check(name, node.label, measured, needs, passed, fix)


def _read_check(node: Node, figures: NodeFigures, profile: ClusterProfile, config: TrainConfig, plan: Plan) -> Check:
    need = plan.data.read_mb_per_s / plan.topology.nodes
    needs = f"{need:,.3g} MB/s per node (the plan's {plan.data.read_mb_per_s:,.3g} MB/s over {plan.topology.nodes})"
    fix = (
        f"make {config.data.train} readable from every node (credentials, the vitscale[s3]/[gcs] extra), or move the "
        "shards nearer the nodes (same region/filesystem)"
    )
    figure = figures.read_mb_per_s
    if not holds_a_worker(node, profile):  # an eval or head-only node reads no training shard
        measured = f"{figure.value:,.1f} MB/s ({figure.detail})" if figure.value is not None else figure.error
        return Check("shard read", node.label, measured, "none (no training worker reads here)", True)
    return _judged("shard read", node, figure, needs, fix, lambda v: (f"{v:,.1f} MB/s ({figure.detail})", v >= need))


def _loader_check(node: Node, figures: NodeFigures, profile: ClusterProfile, config: TrainConfig, plan: Plan) -> Check:
    """A slower loader than planned fails only where the run would wait for data beyond the plan's allowance."""
    d = plan.data
    limit = max(d.predicted_data_wait, INPUT_BOUND_WAIT) + WAIT_SLACK
    needs = (
        f"a data wait <= {limit:.0%} (the plan's {d.predicted_data_wait:.0%} at {d.loader_img_s_per_core:,.0f} "
        f"images/s per core, {d.loader_rate_source.split(' (')[0]}, + {WAIT_SLACK:.0%})"
    )
    fix = (
        "more loader cores (workers.cpus_per_worker, data.num_workers) or a decoded cache (data.cache_mb) keep the "
        "run fed; set hardware.loader_img_s_per_core to the measured rate so the plan says so"
    )
    figure = figures.loader_img_s_per_core

    def verdict(rate: float) -> tuple[str, bool]:
        wait = wait_at(profile, config, plan, rate).predicted_data_wait
        return f"{rate:,.0f} images/s per core ({figure.detail}): data wait {wait:.0%}", wait <= limit

    return _judged("loader", node, figure, needs, fix, verdict)


def _space_check(node: Node, figures: NodeFigures, profile: ClusterProfile, config: TrainConfig, plan: Plan) -> Check:
    keep, size, pinned = config.checkpoint.keep_last, plan.startup.checkpoint_gb, plan.checkpoints_pinned
    need = (keep + 1 + pinned) * size
    count = f"checkpoint.keep_last + 1 = {keep + 1}"
    if pinned:  # as the plan counts them (`pinned_beyond_kept`)
        count = f"{count} + {pinned} pinned for pending evals (the plan's estimate) = {keep + 1 + pinned}"
    needs = f"{need:,.3g} GB ({count} checkpoints of {size:.3g} GB)"
    fix = f"free space at {_checkpoint_root(config)}, lower checkpoint.keep_last or move storage.checkpoints" + (
        "; or pin fewer: evals that keep up (a faster eval device, a cheaper or rarer suite)" if pinned else ""
    )
    figure = figures.free_gb

    def verdict(free: float) -> tuple[str, bool]:
        return f"{'no limit' if math.isinf(free) else f'{free:,.1f} GB free'} ({figure.detail})", free >= need

    return _judged("checkpoint space", node, figure, needs, fix, verdict)


def _tracking_check(
    node: Node, figures: NodeFigures, profile: ClusterProfile, config: TrainConfig, plan: Plan
) -> Check:
    uri = _tracking_uri(config, profile)
    needs = f"a store this node can write ({uri})"
    fix = (
        "start the tracking server or make it reachable from the nodes, export MLFLOW_TRACKING_TOKEN (or _USERNAME/"
        "_PASSWORD) before the preflight, or correct storage.mlflow_tracking_uri"
    )
    figure = figures.tracking_s
    return _judged("tracking", node, figure, needs, fix, lambda s: (f"{figure.detail} in {s:.2g} s", True))


def _clock_check(node: Node, skew: tuple[float, float] | None) -> Check:
    needs = f"|skew| <= {MAX_CLOCK_SKEW_S * 1e3:.0f} ms"
    fix = "run NTP on the node (`chronyc tracking` shows its offset) and re-check"
    if skew is None:
        return Check("clock", node.label, "no answer", needs, False, fix)
    offset, half_trip = skew
    measured = f"{offset * 1e3:+.1f} ms ± {half_trip * 1e3:.1f} ms off the driver's clock"
    return Check("clock", node.label, measured, needs, abs(offset) <= MAX_CLOCK_SKEW_S, fix)


def _collective_check(bus: BusBandwidth, profile: ClusterProfile) -> Check:
    declared = comms.bandwidth(profile)
    where = f"{bus.world} ranks on {bus.nodes} node(s)" if bus.nodes else f"{bus.world} ranks"
    fix = (
        "check the fabric (nccl-tests all_reduce_perf, network.kind, network.socket_ifname) or lower "
        "network.efficiency to the measured share so the plan says the truth"
    )
    if declared.gb_per_s is None:
        needs = "no figure: the profile declares no bandwidth (network.gbps_per_node)"
    else:
        needs = f">= {RATE_TOLERANCE:g} x the profile's {declared.gb_per_s:.3g} GB/s ({declared.source})"
    if bus.error:
        return Check("collective", "cluster", f"{where}: {bus.error}", needs, False, fix)
    if bus.gb_per_s is None:
        return Check("collective", "cluster", "one rank: nothing is reduced", "no collective", True)
    took = f"{bus.backend} all-reduce of {bus.nbytes / 1e6:.3g} MB in {bus.seconds * 1e3:.3g} ms, {where}"
    ok = declared.gb_per_s is None or bus.gb_per_s >= RATE_TOLERANCE * declared.gb_per_s
    return Check("collective", "cluster", f"busbw {bus.gb_per_s:.3g} GB/s ({took})", needs, ok, fix)


# (printed name, check) of each node check, in printing order.
NODE_CHECKS = (
    ("gpus", _gpu_check),
    ("efa", _efa_check),
    ("shard read", _read_check),
    ("loader", _loader_check),
    ("checkpoint space", _space_check),
    ("tracking", _tracking_check),
)
