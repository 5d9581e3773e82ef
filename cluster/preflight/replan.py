"""The plan at the preflight's measured figures: `build_plan` again, on a copy of the profile that declares the
slowest training node's loader rate (`hardware.loader_img_s_per_core`) and the measured bus bandwidth (its
`network` section, at efficiency 1), and one line with the measured figures beside the plan's.
"""

from __future__ import annotations

import dataclasses

from cluster.plan.data_wait import DataWait, data_wait
from cluster.plan.planner import Plan, build_plan
from cluster.preflight.collective import BusBandwidth
from cluster.profiles import ClusterProfile, NetworkSpec
from pretrain.config.train_config import TrainConfig

# The planner measures a local profile's loader rate on this machine instead of reading its declaration
# (`cluster.plan.data_wait.profile_loader_rate`); a copy with this Ray address makes it read the declared figure.
# Nothing connects to it.
DECLARING_ADDRESS = "preflight-measured"


@dataclasses.dataclass(frozen=True)
class LoaderFigure:
    """The slowest training node's loader rate and where it was measured."""

    img_s_per_core: float
    where: str


def declaring(profile: ClusterProfile, img_s_per_core: float) -> ClusterProfile:
    """A copy of ``profile`` whose hardware declares ``img_s_per_core`` and which the planner reads it from."""
    hardware = dataclasses.replace(profile.hardware, loader_img_s_per_core=img_s_per_core)
    ray = dataclasses.replace(profile.ray, address=DECLARING_ADDRESS)
    return dataclasses.replace(profile, hardware=hardware, ray=ray)


def wait_at(profile: ClusterProfile, config: TrainConfig, plan: Plan, img_s_per_core: float) -> DataWait:
    """The planner's data-wait prediction for ``plan`` at a loader rate of ``img_s_per_core``."""
    return data_wait(declaring(profile, img_s_per_core), config, plan.batch, plan.compute.images_per_s)


def carrying(profile: ClusterProfile, gb_per_s: float) -> NetworkSpec:
    """The profile's network section with `cluster.plan.comms.bandwidth` giving ``gb_per_s``: NVLink's figure where
    the planner reads NVLink (one node), else the per-node line rate in Gb/s; efficiency 1, as measured."""
    net = profile.network
    if profile.hardware.nodes == 1 and net.nvlink_gb_per_s > 0:
        return dataclasses.replace(net, nvlink_gb_per_s=gb_per_s, efficiency=1.0)
    return dataclasses.replace(net, gbps_per_node=gb_per_s * 8, efficiency=1.0)


def measured_plan(
    profile: ClusterProfile, config: TrainConfig, plan: Plan, loader: LoaderFigure | None, bus: BusBandwidth
) -> Plan:
    """``plan`` made again with the measured figures in the profile; a figure not measured stays declared."""
    copy = profile
    if bus.gb_per_s:
        copy = dataclasses.replace(copy, network=carrying(profile, bus.gb_per_s))
    if loader is not None:
        hardware = dataclasses.replace(copy.hardware, loader_img_s_per_core=loader.img_s_per_core)
        copy = dataclasses.replace(copy, hardware=hardware)
    replanned = build_plan(copy, config)
    if bus.gb_per_s:
        source = f"measured by the preflight: {bus.backend} all-reduce busbw over {bus.world} ranks"
        replanned = dataclasses.replace(replanned, comms=dataclasses.replace(replanned.comms, bandwidth_source=source))
    if loader is not None:
        wait = wait_at(copy, config, replanned, loader.img_s_per_core)
        wait = dataclasses.replace(wait, loader_rate_source=f"measured by the preflight on {loader.where}")
        replanned = dataclasses.replace(replanned, data=dataclasses.replace(replanned.data, **dataclasses.asdict(wait)))
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
