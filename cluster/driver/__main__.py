"""The Ray job's entry point: read the job spec `cluster.launch` wrote (or plan the recipe here), join the cluster,
run the job.

python -m cluster.driver [--plan SPEC.json] [--address ADDR]     # the plan defaults to $VITSCALE_PLAN
python -m cluster.driver --cluster a100x64 --recipe vit_h14_i21k [--set KEY=VALUE] [--run-name NAME] [--dry-run]

The second form is for `ray job submit` on a cluster already up (README, "Quick start").
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from pathlib import Path

from cluster import local_head
from cluster.driver.job import PLAN_ENV, JobSpec, run_job
from cluster.plan.planner import PlanError, build_plan, resolve_run
from cluster.plan.text import format_plan
from cluster.profiles import load_profile
from data_pipeline.cli import fail, interrupted
from pretrain.checkpoint.run_folder import is_complete, pinned_checkpoints
from pretrain.checkpointer import nothing_to_train
from pretrain.config.train_config import TrainConfig
from tracking.runs import RUN_RECORD, finish_run
from tracking.store import recorded_run_id, unserved

PROG = "python -m cluster.driver"


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except KeyboardInterrupt:  # before the job started; `_main` says what a started one keeps
        return interrupted(PROG, "nothing was started")


def _main(argv: list[str] | None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("--plan", help=f"job spec JSON written by cluster.launch (default: ${PLAN_ENV})")
    parser.add_argument("--address", help="Ray address (default: the job's cluster)")
    parser.add_argument("--cluster", help="plan here: the profile (cluster/profiles/<name>.yaml)")
    parser.add_argument("--recipe", help="with --cluster: the recipe (configs/<name>.yaml, a YAML path; the profile's)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override, repeatable")
    parser.add_argument("--run-name", help="run folder name (default <recipe>-<time>); reuse resumes")
    parser.add_argument("--dry-run", action="store_true", help="with --cluster: print the plan and stop")
    args = parser.parse_args(argv)
    if args.recipe and not args.cluster:
        parser.error("--recipe needs --cluster: the job plans that recipe on that profile")
    if args.cluster and args.plan:
        parser.error("pass either --plan (a spec cluster.launch wrote) or --cluster/--recipe (plan here), not both")
    if args.dry_run and not args.cluster:
        parser.error("--dry-run plans a recipe: pass --cluster (and --recipe)")
    if not args.cluster:
        spec = _read_spec(parser, args.plan)
    else:
        spec = _plan_here(args)
        if spec is not None and args.dry_run:
            print("dry run: nothing trained")
            return 0
    if spec is None:
        return 2
    try:
        done = nothing_left(spec.config)  # a finished run launched again: no Ray Train, no MLflow run
        if done is None:
            spec.config.data.ensure_builtin()  # a folder of other settings is refused before Ray and MLflow
    except ValueError as error:
        return fail(PROG, error)
    if done is not None:
        print(done)
        return 0
    import ray

    try:
        address, auth_mode = ray_address(args.address, spec)
    except ConnectionError as error:
        return _no_cluster(args.address, error)
    with local_head.ray_auth_mode(auth_mode) if auth_mode else contextlib.nullcontext():
        try:
            ray.init(address=address, runtime_env=own_ray_env(address))
        except ConnectionError as error:
            return _no_cluster(args.address, error)
        import psutil  # a Ray dependency

        try:
            return run_job(spec, address=address, started_at=psutil.Process().create_time())
        except (KeyboardInterrupt, SystemExit):  # SystemExit: `ray job stop`'s SIGTERM, through `ray.init`'s handler
            return _interrupted(spec)
        finally:
            ray.shutdown()  # in the head's auth mode


def _no_cluster(address: str | None, error: ConnectionError) -> int:
    return fail(
        PROG,
        f"no Ray cluster{f' at {address}' if address else ''} ({error}); the driver runs as a Ray job: start it with "
        "`python -m cluster.launch` (make launch), or pass --address of a running head",
    )


def own_ray_env(address: str) -> dict | None:
    """The runtime env whose processes look up the Ray at ``address`` (`local_head.own_ray_vars`); None for "auto" (a
    Ray job, whose launch set it)."""
    return None if address == "auto" else {"env_vars": local_head.own_ray_vars(address)}


def ray_address(given: str | None, spec: JobSpec) -> tuple[str, str | None]:
    """(address, auth mode to connect in; None: this process's): --address, else the Ray job's own (RAY_ADDRESS), else
    on a local profile its running head's GCS in the head's auth mode (by hand: Ray's "auto" takes any Ray running on
    this machine). ConnectionError where that head is not running."""
    profile = spec.profile
    if given or os.environ.get("RAY_ADDRESS") or not profile.is_local:
        return given or "auto", None
    head = local_head.read_state(profile)
    if head is None or not local_head.serves(head, head.dashboard_url):
        raise ConnectionError(
            f"no Ray head of this project is running for profile {profile.name} (none recorded in "
            f"{profile.ray.temp_dir}/{local_head.STATE_FILE}, or it does not answer)"
        )
    return head.gcs_address, head.auth_mode


def _interrupted(spec: JobSpec) -> int:
    """Ctrl-C or a stop in the job: its MLflow run marked KILLED where MLflow answers (it stayed RUNNING), then one
    line."""
    uri, run_dir = spec.config.logging.mlflow_tracking_uri, Path(spec.config.checkpoint.dir)
    run_id = recorded_run_id(run_dir / RUN_RECORD, uri)
    if run_id and not unserved(uri, run_id):
        finish_run(uri, run_id, "KILLED")
    return interrupted(PROG, f"{run_dir} keeps its complete checkpoints; the run name {run_dir.name} resumes the run")


def nothing_left(config: TrainConfig) -> str | None:
    """`nothing_to_train`'s line, unless a job of the run left evals that never ran (pinned checkpoints): the job
    then goes on, for its rank 0 to run them (with no step to train), and this says so."""
    done = nothing_to_train(config)
    pinned = pinned_checkpoints(Path(config.checkpoint.dir)) if done else []
    if not (left := [folder.name for folder in pinned if is_complete(folder)]):  # as the job's `catch_up` takes them
        return done
    print(f"the run is done, but the evals of {', '.join(left)} never ran: this job runs those still due", flush=True)
    return None


def _read_spec(parser: argparse.ArgumentParser, plan: str | None) -> JobSpec | None:
    """None (said) when it is not a job spec."""
    if not plan and not os.environ.get(PLAN_ENV):
        parser.error(
            f"no plan: pass --plan FILE or set ${PLAN_ENV} (python -m cluster.launch does), or plan here with "
            "--cluster [--recipe]"
        )
    source = f"--plan {plan}" if plan else f"${PLAN_ENV}"
    try:
        return JobSpec.from_json(Path(plan).read_text() if plan else os.environ[PLAN_ENV])
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        fail(
            PROG,
            f"{source} is not a job spec ({type(error).__name__}: {error}); the spec is the JSON that "
            f"`python -m cluster.launch` writes into ${PLAN_ENV} of the Ray job it submits",
        )
        return None


def _plan_here(args: argparse.Namespace) -> JobSpec | None:
    """Plan and print as `cluster.launch` does; None (said) on bad input."""
    try:
        profile = load_profile(args.cluster)
        config, notes, _ = resolve_run(profile, profile.pick_recipe(args.recipe), args.set, args.run_name)
        plan = build_plan(profile, config)
    except (PlanError, ValueError) as error:
        fail(PROG, error)
        return None
    print(format_plan(plan, notes), flush=True)
    return JobSpec.create(profile, config, plan)


if __name__ == "__main__":
    sys.exit(main())
