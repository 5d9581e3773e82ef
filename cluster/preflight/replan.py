"""The plan re-made at the preflight's measured figures, and one line with those beside the plan's."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from cluster.plan.data_wait import DataWait, data_wait
from cluster.plan.planner import Plan, build_plan
from cluster.preflight.collective import BusBandwidth
from cluster.profiles import ClusterProfile, NetworkSpec
from pretrain.config.train_config import TrainConfig

# A Ray address nothing connects to: the planner reads the declared loader rate, not this machine's, of a copy with it.
DECLARING_ADDRESS = "preflight-measured"


@dataclass(frozen=True)
class LoaderFigure:
    """The slowest training node's loader rate and where it was measured."""

    img_s_per_core: float
    where: str


def declaring(profile: ClusterProfile, img_s_per_core: float) -> ClusterProfile:
    """A copy of ``profile`` declaring ``img_s_per_core``, which the planner reads."""
    hardware = replace(profile.hardware, loader_img_s_per_core=img_s_per_core)
    ray = replace(profile.ray, address=DECLARING_ADDRESS)
    return replace(profile, hardware=hardware, ray=ray)


def wait_at(profile: ClusterProfile, config: TrainConfig, plan: Plan, img_s_per_core: float) -> DataWait:
    """The planner's data-wait prediction for ``plan`` at a loader rate of ``img_s_per_core``."""
    return data_wait(declaring(profile, img_s_per_core), config, plan.batch, plan.compute.images_per_s)


def carrying(profile: ClusterProfile, gb_per_s: float) -> NetworkSpec:
    """The profile's network section for which `cluster.plan.comms.bandwidth` gives ``gb_per_s``, at efficiency 1."""
    net = profile.network
    if profile.hardware.nodes == 1 and net.nvlink_gb_per_s > 0:
        return replace(net, nvlink_gb_per_s=gb_per_s, efficiency=1.0)
    return replace(net, gbps_per_node=gb_per_s * 8, efficiency=1.0)


def measured_plan(
    profile: ClusterProfile, config: TrainConfig, plan: Plan, loader: LoaderFigure | None, bus: BusBandwidth
) -> Plan:
    """``plan`` made again with the measured figures in the profile; a figure not measured stays declared."""
    copy = profile
    if bus.gb_per_s:
        copy = replace(copy, network=carrying(profile, bus.gb_per_s))
    if loader is not None:
        copy = replace(copy, hardware=replace(copy.hardware, loader_img_s_per_core=loader.img_s_per_core))
    replanned = build_plan(copy, config)
    if bus.gb_per_s:
        source = f"measured by the preflight: {bus.backend} all-reduce busbw over {bus.world} ranks"
        replanned = replace(replanned, comms=replace(replanned.comms, bandwidth_source=source))
    if loader is not None:
        wait = wait_at(copy, config, replanned, loader.img_s_per_core)
        wait = replace(wait, loader_rate_source=f"measured by the preflight on {loader.where}")
        replanned = replace(replanned, data=replace(replanned.data, **asdict(wait)))
    return replanned


def side_by_side(plan: Plan, replanned: Plan, bus: BusBandwidth) -> str:
    """One line: each measured figure and what it changes, beside the plan's declared one."""
    d, m = plan.data, replanned.data
    loader = (
        f"loader {m.loader_img_s_per_core:,.0f} images/s per core, data wait {m.predicted_data_wait:.0%} "
        f"(plan: {d.loader_img_s_per_core:,.0f}, {d.predicted_data_wait:.0%})"
    )
    declared = plan.comms.bandwidth_gb_per_s
    said = f"{declared:.3g} GB/s" if declared else "none declared"
    if bus.gb_per_s is None:
        network = f"busbw not measured ({bus.error or 'one rank'}; plan: {said})"
    else:
        planned_s = f"{plan.comms.comm_s * 1e3:.3g} ms" if plan.comms.comm_s is not None else "not estimated"
        network = (
            f"busbw {bus.gb_per_s:.3g} GB/s, communication {replanned.comms.comm_s * 1e3:.3g} ms per step "
            f"(plan: {said}, {planned_s})"
        )
    return f"  measured      {loader}; {network}"
