"""Measure a profile's Ray cluster against a recipe's plan, minutes before the paid run.

    python -m cluster.preflight --cluster local                      # = `make preflight`
    python -m cluster.preflight --cluster a100x64 --recipe vit_h14_i21k

One line per check and node, then the plan at the measured figures. `local` runs here against the embedded head
(started or reused as `make launch` does); a remote profile's preflight is a Ray job, measuring from the head as the
run's driver will. Exit status: 0 when every check passes, 1 when one fails, 2 on bad input. docs/preflight.md.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

from cluster import jobs, local_head
from cluster.driver.job import PLAN_ENV, JobSpec
from cluster.launch import runtime_env
from cluster.local_data import prepare_local_data
from cluster.plan.planner import Plan, PlanError, build_plan, resolve_with_notes
from cluster.plan.text import format_plan
from cluster.preflight.checks import Measurements, holds_a_worker, judge, measure
from cluster.preflight.replan import LoaderFigure, measured_plan, side_by_side
from cluster.profiles import ClusterProfile, load_profile
from data_pipeline.cli import fail, interrupted
from pretrain.config.train_config import TrainConfig

RUN_NAME = "preflight"  # the run folder the plan is made for; nothing is written there
IN_CLUSTER = "--in-cluster"  # the Ray job's own invocation: the spec comes in PLAN_ENV


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cluster.preflight", description=__doc__.split("\n\n")[0])
    parser.add_argument("--cluster", default="local", help="profile: cluster/profiles/<name>.yaml (or a YAML path)")
    parser.add_argument("--recipe", help="recipe: configs/<name>.yaml (or a YAML path); default: the profile's recipe")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override, repeatable")
    parser.add_argument(IN_CLUSTER, action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        if args.in_cluster:
            return _in_cluster()
        profile = load_profile(args.cluster)
        config, notes = resolve_with_notes(profile, profile.pick_recipe(args.recipe), args.set, RUN_NAME)
        for line in notes:  # as `make launch` prints them: what the checks measure against
            print(f"note: {line}", flush=True)
        if profile.is_local:
            prepare_local_data(config, None)  # the training set only: the evals' sets are not read
        plan = build_plan(profile, config)
        if profile.is_local:
            return _on_local_head(profile, config, plan)
        return _as_job(profile, config, plan)
    except (PlanError, ValueError, jobs.RayUnreachableError, jobs.JobRefusedError) as exc:
        return fail(parser.prog, exc)
    except KeyboardInterrupt:
        kept = f"no verdict; a preflight job submitted runs on (`make stop CLUSTER={args.cluster}` stops it)"
        return interrupted(parser.prog, kept)


def _on_local_head(profile: ClusterProfile, config: TrainConfig, plan: Plan) -> int:
    import ray
    from ray.exceptions import RayError

    info = jobs._ensure_local_head(profile)
    with local_head.ray_auth_mode(info.auth_mode):
        try:
            ray.init(address=info.gcs_address, logging_level=logging.WARNING, log_to_driver=False)
        except (ConnectionError, RuntimeError, RayError) as exc:
            raise jobs.RayUnreachableError(f"cannot join the local Ray head at {info.gcs_address}: {exc}") from exc
        try:
            return _report(profile, config, plan)
        finally:
            ray.shutdown()


def _in_cluster() -> int:
    """The Ray job's side: the launching machine's spec, the plan re-made here (where the manifest is readable)."""
    import ray

    spec = JobSpec.from_json(os.environ[PLAN_ENV])
    ray.init(address="auto", logging_level=logging.WARNING, log_to_driver=False)
    try:
        return _report(spec.profile, spec.config, build_plan(spec.profile, spec.config))
    finally:
        ray.shutdown()


def _as_job(profile: ClusterProfile, config: TrainConfig, plan: Plan) -> int:
    client = jobs.connect(profile)
    env = runtime_env(profile, JobSpec.create(profile, config, plan))
    job_id = jobs.submit(
        client, f"python -m cluster.preflight {IN_CLUSTER}", env, f"vitscale-preflight-{int(time.time())}"
    )
    print(f"submitted the preflight as Ray job {job_id} to {jobs.cluster_address(profile)}", flush=True)
    return 0 if jobs.follow(client, job_id) == "SUCCEEDED" else 1


def _report(profile: ClusterProfile, config: TrainConfig, plan: Plan) -> int:
    """0 when every check passed, else 1."""
    print(
        f"preflight: recipe {plan.recipe} on profile {profile.name} (world size {plan.topology.world_size}); "
        "measuring every node",
        flush=True,
    )
    measured = measure(profile, config, plan)
    checks = judge(measured, profile, config, plan)
    for check in checks:
        print(check.line(), flush=True)
    replanned = measured_plan(profile, config, plan, _slowest_loader(measured, profile), measured.collective)
    print("plan at the measured figures (the slowest node's loader rate per core, the measured bus bandwidth):")
    print(format_plan(replanned))
    print(side_by_side(plan, replanned, measured.collective))
    failed = [c for c in checks if not c.passed]
    verdict = "every check passed" if not failed else f"FAILED: {', '.join(sorted({c.name for c in failed}))}"
    print(f"preflight: {len(checks) - len(failed)} of {len(checks)} checks passed; {verdict}", flush=True)
    return 1 if failed else 0


def _slowest_loader(measured: Measurements, profile: ClusterProfile) -> LoaderFigure | None:
    """The slowest training node's loader rate (it sets a synchronous step's pace); None if unmeasured."""
    rates = [
        (figures.loader_img_s_per_core.value, node.label)
        for node in measured.nodes
        if holds_a_worker(node, profile)
        and (figures := measured.figures[node.node_id]) is not None
        and figures.loader_img_s_per_core.value is not None
    ]
    if not rates:
        return None
    rate, where = min(rates)
    return LoaderFigure(rate, f"{where}, the slowest of {len(rates)} node(s)")


if __name__ == "__main__":
    sys.exit(main())
