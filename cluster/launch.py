"""Plan a recipe on a cluster profile, print the plan, submit it as a Ray job, follow it to the end.

    python -m cluster.launch --cluster local --recipe local_demo  # = `make launch`
    python -m cluster.launch --cluster a100x64 --recipe vit_h14_i21k --dry-run

Nothing is submitted until the profile, recipe, config, memory plan and cluster check out. Exit status: 0 when the
job SUCCEEDED, 1 otherwise, 2 for bad input. On `local` the built-in data is checked first (`cluster.local_data`,
dry run included); a real launch then generates what is absent and starts or reuses the local Ray head.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

from cluster import jobs, local_head
from cluster.driver.job import FaultInjection, JobSpec, job_runtime_env
from cluster.local_data import check_local_data, prepare_local_data
from cluster.plan.planner import Plan, PlanError, build_plan, resolve_run
from cluster.plan.text import format_plan
from cluster.profiles import ClusterProfile, load_profile
from data_pipeline.cli import fail, interrupted
from data_pipeline.paths import PROJECT_ROOT
from tracking.runs import tracking_credentials

# Kept out of the job's working dir (Ray also honours .gitignore).
WORKING_DIR_EXCLUDES = (
    ".venv/ data/ runs/ reports/ bench-results/ .ray-local/ .git/ mlflow.db *.egg-info/ __pycache__/".split()
)


def runtime_env(profile: ClusterProfile, spec: JobSpec) -> dict:
    """The job's runtime env: this checkout as its code, this shell's MLflow credentials, and on `local` the running
    head as the Ray its processes look up (`local_head.own_ray_vars`)."""
    credentials = tracking_credentials(os.environ)
    env = job_runtime_env(profile, spec.to_json(), str(PROJECT_ROOT), WORKING_DIR_EXCLUDES, credentials)
    if profile.is_local and (head := local_head.read_state(profile)):
        env["env_vars"].update(local_head.own_ray_vars(head.gcs_address))
    return env


def _parse_fault(text: str | None) -> FaultInjection | None:
    if not text:
        return None
    try:
        rank, step, *delay = text.split(":")
        return FaultInjection(rank=int(rank), after_step=int(step), delay_s=float(delay[0]) if delay else 0.0)
    except ValueError:
        raise ValueError(f"--inject-worker-failure={text!r}; write RANK:STEP[:DELAY_S], e.g. 1:50:2") from None


def _check_fault(fault: FaultInjection | None, plan: Plan) -> None:
    """ValueError unless the plan has the rank and a checkpoint at or after the step (the last step saves one)."""
    if fault is None:
        return
    world, steps = plan.topology.world_size, plan.compute.total_steps
    if not 0 <= fault.rank < world:
        raise ValueError(
            f"--inject-worker-failure: rank {fault.rank} is not in this run (world size {world}); give a rank "
            f"0..{world - 1}"
        )
    if not 0 <= fault.after_step <= steps:
        raise ValueError(
            f"--inject-worker-failure: step {fault.after_step} is not in this run (steps 0..{steps}, a checkpoint at "
            f"the last); give a step in 0..{steps}"
        )
    if not 0 <= fault.delay_s < math.inf:
        raise ValueError(f"--inject-worker-failure: DELAY_S {fault.delay_s} must be >= 0 seconds")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cluster.launch", description=__doc__.split("\n\n")[0])
    parser.add_argument("--cluster", default="local", help="profile: cluster/profiles/<name>.yaml")
    parser.add_argument("--recipe", help="recipe: configs/<name>.yaml (or a YAML path); default: the profile's recipe")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override, repeatable")
    parser.add_argument("--dry-run", action="store_true", help="print the plan and stop")
    parser.add_argument(
        "--run-name",
        help="run folder name under the profile's checkpoints (default <recipe>-<time>); "
        "reusing a name resumes that run and its MLflow run",
    )
    parser.add_argument("--no-follow", action="store_true", help="submit and return without streaming the logs")
    parser.add_argument(
        "--inject-worker-failure",
        metavar="RANK:STEP[:DELAY_S]",
        help="fault drill: that rank exits abruptly DELAY_S after checkpoint STEP is COMPLETE, once "
        "(0, the default: at once, before rank 0 hands that checkpoint to its evals)",
    )
    args = parser.parse_args(argv)
    try:
        profile = load_profile(args.cluster)
        recipe = profile.pick_recipe(args.recipe)
        fault = _parse_fault(args.inject_worker_failure)
        config, notes, suite = resolve_run(profile, recipe, args.set, args.run_name)
        present = check_local_data(config, suite) if profile.is_local else {}  # before the plan reads a manifest
        if profile.is_local and not args.dry_run:
            prepare_local_data(config, suite)
        plan = build_plan(profile, config)
        _check_fault(fault, plan)
        print(format_plan(plan, notes), flush=True)
        if args.dry_run:
            absent = [str(folder) for folder, complete in present.items() if not complete]
            if absent:
                print(f"data: {', '.join(absent)} absent: the launch generates {'it' if len(absent) == 1 else 'them'}")
            print("dry run: nothing submitted")
            return 0
        client = jobs.connect(profile, start_local=True)
        if running := jobs.unfinished_jobs_of(client, plan.run_name):  # two jobs would save the same checkpoints
            raise ValueError(
                f"run {plan.run_name} is still being trained by Ray job {', '.join(running)}: a second job would "
                f"write the same run folder; wait for it to end (`make status CLUSTER={profile.name}`) or stop "
                f"it (`make stop CLUSTER={profile.name}`), then launch the run name again to resume it"
            )
        env = runtime_env(profile, JobSpec.create(profile, config, plan, fault))
        job_id = jobs.submit(client, "python -m cluster.driver", env, jobs.submission_id(plan.run_name))
    except (PlanError, ValueError, jobs.RayUnreachableError, jobs.JobRefusedError) as exc:
        return fail(parser.prog, exc)
    except KeyboardInterrupt:  # planning, generating the local data, starting the local head or submitting
        return interrupted(parser.prog, f"no job submitted (`make status CLUSTER={args.cluster}` lists any)")
    print(
        f"submitted Ray job {job_id} to {jobs.cluster_address(profile)}; "
        f"`make logs CLUSTER={profile.name}` to follow, `make stop CLUSTER={profile.name}` to stop",
        flush=True,
    )
    if args.no_follow:
        return 0
    try:
        status = jobs.follow(client, job_id)
    except KeyboardInterrupt:
        return interrupted(
            parser.prog, f"stopped following; job {job_id} keeps running (`make stop CLUSTER={profile.name}` stops it)"
        )
    except jobs.JobStoppedError as exc:  # `make stop`: no error, the same end as a job that says STOPPED
        print(f"job {job_id}: STOPPED ({exc})")
        return 1
    except jobs.RayUnreachableError as exc:
        return fail(parser.prog, f"{exc}" + ("" if profile.is_local else f" (CLUSTER={profile.name})"), status=1)
    print(f"job {job_id}: {status}")
    if profile.is_local and status != "STOPPED":  # a stop is `make stop`'s, which stops the head too
        print(
            f"the local Ray head keeps running for the next launch; `make stop` stops it "
            f"(MLflow: `make ui`, store {config.logging.mlflow_tracking_uri})"
        )
    return 0 if status == "SUCCEEDED" else 1


if __name__ == "__main__":
    sys.exit(main())
