"""The environment a profile's network needs in every training worker, and the network in words (docs/network.md)."""

from __future__ import annotations

import ctypes
from pathlib import Path

from cluster.profiles import ClusterProfile

# EFA through libfabric and aws-ofi-nccl: (variable, value, why); docs/network.md, "The workers' environment".
EFA_ENV = (
    ("FI_PROVIDER", "efa", "use the EFA provider, never a silent fallback to TCP"),
    ("FI_EFA_USE_DEVICE_RDMA", "1", "GPUDirect RDMA: NIC to GPU memory without a host copy"),
    ("NCCL_PROTO", "simple", "EFA delivers out of order; LL/LL128 rely on ordered stores"),
    ("RDMAV_FORK_SAFE", "1", "registered memory stays correct across a fork"),
)


EFA_DEVICES = Path("/dev/infiniband")  # the uverbs devices: the EFA device plugin's (KubeRay), `docker --device`'s
NCCL_NET_PLUGIN = "libnccl-net.so"  # the network plugin NCCL loads by this name: aws-ofi-nccl's, on EFA


# EFA interfaces a training node attaches (one per network card): what cluster.render asks EC2 and Kubernetes for.
EFA_INTERFACES = {"p4d.24xlarge": 4, "p4de.24xlarge": 4, "p5.48xlarge": 32, "p5e.48xlarge": 32, "p5en.48xlarge": 16}


def efa_interfaces(profile: ClusterProfile) -> int:
    """A training node's EFA interfaces; 0 where its ranks need none (`needs_efa`)."""
    if not needs_efa(profile):
        return 0
    count = EFA_INTERFACES.get(profile.hardware.instance_type)
    if count is None:
        raise ValueError(
            f"profile {profile.name}: network.kind efa on hardware.instance_type={profile.hardware.instance_type!r}, "
            f"whose EFA interfaces cluster.render does not know ({', '.join(EFA_INTERFACES)}); add its count to "
            "cluster.network.EFA_INTERFACES"
        )
    return count


def needs_efa(profile: ClusterProfile) -> bool:
    """Ranks on several nodes talk over EFA: without it NCCL falls back to TCP sockets, without an error."""
    return profile.network.kind == "efa" and profile.hardware.nodes > 1


EFA_FIX = (
    "run the image ./Dockerfile builds (libfabric, aws-ofi-nccl) with the nodes' EFA devices, as cluster.render's "
    "files do, or set network.kind: sockets to train over TCP knowingly (docs/network.md)"
)


def efa_missing(devices: Path = EFA_DEVICES) -> str | None:
    """Why NCCL in this process would not reach EFA (no device, or no plugin that loads); None where it would. The
    fix: `EFA_FIX`."""
    if not any(devices.glob("uverbs*")):
        return f"no EFA device in this container ({devices}/uverbs* missing)"
    try:
        ctypes.CDLL(NCCL_NET_PLUGIN)
    except OSError as error:
        return f"NCCL's network plugin {NCCL_NET_PLUGIN} does not load ({error})"
    return None


class EfaMissingError(RuntimeError):
    """A training worker of a multi-node EFA profile without EFA. Not ``retryable``: a restarted worker group starts
    from the same image with the same devices, so under Ray the job fails at once (`cluster.driver.watchdog`)."""

    retryable = False


def network_env(profile: ClusterProfile) -> dict[str, str]:
    """What each training worker needs set before torch is imported; {} where NCCL's or gloo's defaults are right.
    `network.socket_ifname` pins the bootstrap interface."""
    net = profile.network
    env = {name: value for name, value, _ in EFA_ENV} if net.kind == "efa" else {}
    if net.socket_ifname:
        env["NCCL_SOCKET_IFNAME" if profile.comm_backend == "nccl" else "GLOO_SOCKET_IFNAME"] = net.socket_ifname
    return env


def describe_network(profile: ClusterProfile) -> str:
    """The interconnect in words, as the plan prints it."""
    net, nodes = profile.network, profile.hardware.nodes
    nvlink = f"NVLink {net.nvlink_gb_per_s:g} GB/s per GPU each way" if net.nvlink_gb_per_s else ""
    if net.kind == "nvlink":
        return f"one node: NCCL over {nvlink} (no network between ranks)"
    if net.kind == "sockets":
        rate = f"{net.gbps_per_node:.3g} Gb/s per node" if net.gbps_per_node else "no bandwidth in the profile"
        return f"sockets: {profile.comm_backend} over TCP, {rate}"
    fabric = {"efa": "EFA (libfabric, GPUDirect RDMA)", "infiniband": "InfiniBand (NCCL's IB transport)"}[net.kind]
    within = f"; {nvlink} within a node" if nvlink else ""
    return f"{fabric}, {net.gbps_per_node:g} Gb/s per node between {nodes} node(s){within}"
