"""A job's courier: when MLflow does not answer at the job's end, a detached Ray actor creates the run (unless it
exists) once it does, sends what the job's processes left in the spool, the late eval metrics and the final model,
marks the run's status and exits; the job ends when training does (docs/design.md, "Tracking at a job's start").
`cluster.driver.deliver` (``python -m cluster.driver.deliver RUN_FOLDER``) does the same in the foreground.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from cluster.driver.record import send_the_rest
from data_pipeline.paths import write_text_atomically
from pretrain.telemetry.heartbeat import read_heartbeats
from tracking.runs import RUN_RECORD, RunGoneError, await_job_run, finish_run
from tracking.store import COURIER_FILE, DELIVER_COMMAND, read_run_record, spool_dir
from tracking.tracker import Tracker

COURIER_DEADLINE_S = 24 * 3600.0  # how long a courier waits for MLflow; its records then stay in the spool
# Set on the rendered RayJob's pods: KubeRay deletes the RayCluster, and a courier with it, this long after the job.
CLUSTER_TTL_ENV = "VITSCALE_CLUSTER_TTL_S"
NAMESPACE = "vitscale"
START_TIMEOUT_S = 120.0  # the courier's process start, on a busy node


def deliver(
    run_dir: Path,
    uri: str,
    run: Mapping[str, Any],
    evals: dict,
    status: str,
    deadline_s: float = COURIER_DEADLINE_S,
    since: float | None = None,
) -> str | None:
    """The run's id once everything is sent; None when MLflow did not answer within ``deadline_s``, answered that
    the run is deleted or did not take its status (the records and the work stay, for `cluster.driver.deliver`).
    ``run``: the creation's ``experiment``, ``config`` and ``tags``, as the job's start had them. ``since``: the
    hand-over's time; a job of the run folder started after it marks the run and logs its model, not this work."""
    spool = spool_dir(run_dir / RUN_RECORD)
    try:
        run_id = await_job_run(run_dir, uri, run["experiment"], run["config"], run["tags"], deadline_s)
    except RunGoneError as error:
        print(f"courier: {error}; the records stay in {spool}", flush=True)
        return None
    if run_id is None:
        print(f"courier: MLflow at {uri} did not answer in {deadline_s:g} s; the records stay in {spool}", flush=True)
        return None
    later = _later_job(run_dir, since)
    tracker = Tracker(uri, run_id, rank=0)
    evals = {int(step): e for step, e in evals.items()}
    send_the_rest(run_dir, uri, run_id, evals, "RUNNING" if later else status, tracker)  # RUNNING: no model
    tracker.close()
    if later:
        print(f"courier: MLflow run {run_id} holds the job's records; {later}: its end marks the run", flush=True)
    elif not finish_run(uri, run_id, status):  # the work stays: sent again, nothing logs twice
        print(f"courier: MLflow run {run_id} is not marked {status}; `{DELIVER_COMMAND} {run_dir}` does it", flush=True)
        return None
    else:
        print(f"courier: MLflow run {run_id} holds the job's records, marked {status}", flush=True)
    _drop_work(run_dir, since)
    return run_id


def _later_job(run_dir: Path, since: float | None) -> str | None:
    """Where a rank of the run folder started after ``since``: a line saying so; else None."""
    started = max((b.get("started", 0.0) for b in read_heartbeats(run_dir)), default=0.0)
    if since is None or started <= since:
        return None
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started))
    return f"a later job of the run folder trains (a rank of it started at {when})"


def _drop_work(run_dir: Path, since: float | None) -> None:
    """Remove the work file unless it holds a later hand-over's work."""
    path = run_dir / COURIER_FILE
    try:
        if json.loads(path.read_text()).get("handed_over") != since:
            return
    except (OSError, ValueError, AttributeError):
        pass
    path.unlink(missing_ok=True)


class Courier:
    """The Ray actor around `deliver`. `start` returns at once, so the job's driver knows the work was taken before
    it exits (a call it leaves in flight dies with it); the work runs on a thread, and the actor then ends itself."""

    def start(self, *args: Any) -> None:
        threading.Thread(target=self._deliver, args=args, name="vitscale-courier", daemon=True).start()

    def _deliver(self, *args: Any) -> None:
        import ray

        try:
            deliver(*args)
        finally:
            ray.kill(ray.get_runtime_context().current_actor, no_restart=True)


def hand_over(run_dir: Path, uri: str, run: Mapping[str, Any], evals: dict, status: str) -> str:
    """Start the courier, detached from the job (it outlives it), on no CPU; the line to print about it."""
    import ray

    spool = spool_dir(run_dir / RUN_RECORD)
    since = time.time()
    work = {"tracking_uri": uri, "run": dict(run), "evals": evals, "status": status, "handed_over": since}
    write_text_atomically(run_dir / COURIER_FILE, json.dumps(work, default=str))
    record = read_run_record(run_dir / RUN_RECORD, uri)
    if record.get("refused"):
        return (
            f"MLflow at {uri} refuses the job's credentials: the run's records stay in {spool}; with the right "
            f"ones, `{DELIVER_COMMAND} {run_dir}` sends them"
        )
    name = f"vitscale-courier-{run_dir.name}-{time.time_ns()}"
    try:
        actor = ray.remote(num_cpus=0)(Courier).options(name=name, namespace=NAMESPACE, lifetime="detached").remote()
        work_args = (run_dir, uri, dict(run), evals, status, COURIER_DEADLINE_S, since)
        ray.get(actor.start.remote(*work_args), timeout=START_TIMEOUT_S)
    except Exception as error:  # noqa: BLE001 — the job's outcome stays training's
        return (
            f"warning: MLflow at {uri} has not answered and its courier did not start ({type(error).__name__}: "
            f"{error}): the run's records stay in {spool}; `{DELIVER_COMMAND} {run_dir}` sends them"
        )
    creates = "" if record.get("run_id") else "creates the run and "
    return (
        f"MLflow at {uri} has not answered: the job ends now, and Ray actor {name} (namespace {NAMESPACE}) {creates}"
        f"sends the run's records, kept in {spool} meanwhile, and marks it {status} once MLflow answers "
        f"({_lifetime(run_dir)})"
    )


def _lifetime(run_dir: Path) -> str:
    """How long the courier waits: its deadline, or the cluster's life where that ends first."""
    try:
        ttl_s = float(os.environ.get(CLUSTER_TTL_ENV, "inf"))
    except ValueError:
        ttl_s = float("inf")
    if not ttl_s < COURIER_DEADLINE_S:
        return f"for up to {COURIER_DEADLINE_S / 3600:g} h"
    return (
        f"until KubeRay deletes the RayCluster, {ttl_s / 60:g} min after the job's end; if MLflow answers later, "
        f"`{DELIVER_COMMAND} {run_dir}` sends them"
    )
