"""An elastic job on a simulated 2-node Ray cluster: one node is removed mid-run and added back.

    python -m cluster.elastic_demo  # = `make elastic-demo`; output in runs/elastic-demo-<time>

`run_demo` runs `local_demo` on `local_elastic` through the real driver on an in-process Ray cluster (auth off) while
`run_scenario` removes a worker node and adds it back (docs/elastic.md, "Elastic jobs on Ray").
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from cluster import local_head
from cluster.driver.job import JobSpec, autoscaling_coordinator, run_job
from cluster.local_data import prepare_local_data
from cluster.plan.planner import build_plan, resolve_config
from cluster.profiles import ClusterProfile, load_profile
from data_pipeline.cli import fail, file_in_the_way, interrupted
from data_pipeline.paths import PROJECT_ROOT
from evals.suites import load_suite
from pretrain.checkpoint import run_folder
from pretrain.telemetry.attempt_clock import GOODPUT_DIR
from tracking import keys

PROFILE = "local_elastic"
TRAINER_RESOURCE = "vitscale_trainer"  # worker nodes only; 1 per training worker
# No node_ip_address: a worker node would swap 127.0.0.1 for the machine's IP and miss a head bound to it.
NODE_ARGS = {"object_store_memory": 100 * 1024**2, "include_dashboard": False}
NODE_HEALTH = {  # docs/elastic.md, "Health checks"
    "health_check_initial_delay_ms": 1000,
    "health_check_period_ms": 1000,
    "health_check_timeout_ms": 10000,
    "health_check_failure_threshold": 3,
}
DEMO_ENV = {"RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "20"}  # Ray Train's default: 60 s
COORDINATOR_TICK_S = 1.0  # how often the demo has it re-read the nodes (Ray: every 20 s)
# Without a dashboard there is no state API: Ray Train's PlacementGroupCleaner, which asks it whether the controller
# lives, would warn every second of the run. Its cleanup matters only to a cluster that outlives the job.
PG_CLEANER_LOGGER = "ray.train.v2._internal.execution.controller.placement_group_cleaner"


@dataclass(frozen=True)
class DemoSettings:
    steps: int = 200  # still training at world size 1 when the node returns
    every: int = 20  # checkpoint (and eval) interval
    interval_s: float = 3.0  # elastic_resize_monitor_interval_s
    timeout_s: float = 900.0  # each wait of the scenario
    record_sample_keys: bool = True


@dataclass
class DemoResult:
    rc: int  # run_job's exit code
    run_dir: Path
    tracking_uri: str
    events: list[str] = field(default_factory=list)  # timed scenario lines
    error: str | None = None  # a wait that timed out, or the job's exception
    job_s: float | None = None  # run_job's wall-clock, measured here


def demo_spec(out: Path, settings: DemoSettings, recipe: str = "local_demo") -> JobSpec:
    """`local_demo` on local_elastic, storage under ``out``, a tiny few-shot suite."""
    base = load_profile(PROFILE)
    storage = replace(base.storage, shards=str(out / "data"), checkpoints=str(out / "runs"))
    storage = replace(storage, mlflow_tracking_uri=f"sqlite:///{out}/mlflow.db")
    workers = replace(
        base.workers, elastic_resize_monitor_interval_s=settings.interval_s, resources={TRAINER_RESOURCE: 1}
    )
    profile: ClusterProfile = replace(base, storage=storage, workers=workers, max_failures=2)  # the node loss is one
    suite = out / "tiny_fewshot.yaml"
    evaluator = {"type": "fewshot", "datasets": ["digits"], "shots": [1, 5], "seeds": [0]}
    about = "few-shot on digits, 2 shot counts, 1 seed (elastic demo)"
    suite.write_text(yaml.safe_dump({"name": "tiny_fewshot", "description": about, "evaluators": [evaluator]}))
    sets = [
        f"schedule.total={settings.steps}",
        f"schedule.warmup={max(1, settings.steps // 10)}",
        f"checkpoint.every_steps={settings.every}",
        "checkpoint.keep_last=2",
        f"evals.suite={suite}",
        "logging.progress_bar=false",
        "logging.log_every=1",
        f"logging.record_sample_keys={str(settings.record_sample_keys).lower()}",
        # In bf16 the run may end before Ray Train regrows the group (docs/elastic.md, "Elastic jobs on Ray").
        "deepspeed.precision=fp32",
    ]
    config = resolve_config(profile, recipe, sets, "elastic-demo")
    prepare_local_data(config, load_suite(suite))
    plan = build_plan(profile, config)
    spec = JobSpec(profile, config, plan.to_dict(), None, {"vitscale.profile": PROFILE, "vitscale.recipe": recipe})
    return JobSpec.from_json(spec.to_json())  # exactly what travels to a Ray job


def start_cluster(temp_dir: Path, workers: int = 2):
    """Head (1 CPU: the eval slot) + ``workers`` worker nodes (1 CPU + 1 trainer slot each, no memory for evals)."""
    cluster = local_head.in_process_cluster(**NODE_ARGS, num_cpus=1, temp_dir=str(temp_dir), _system_config=NODE_HEALTH)
    try:
        nodes = [add_worker_node(cluster, temp_dir) for _ in range(workers)]
        cluster.wait_for_nodes()
    except BaseException:
        cluster.shutdown()
        raise
    return cluster, nodes


def add_worker_node(cluster, temp_dir: Path):
    """No `memory` to hand out (an eval task reserves some: local_elastic's evals.memory_gb), so evals run on the
    head's CPU: an eval on a worker node held the CPU that Ray Train's next worker group needed, and the group's start
    waited for it (2.5 s at the restart, 10 s at the regrowth), or timed out and began again."""
    return cluster.add_node(**NODE_ARGS, num_cpus=1, memory=0, resources={TRAINER_RESOURCE: 1}, temp_dir=str(temp_dir))


def refresh_ray_train_view(job: threading.Thread, log: Callable[[str], None] = print) -> None:
    """While ``job`` runs, have Ray Train's coordinator (`autoscaling_coordinator`) re-read the nodes every
    `COORDINATOR_TICK_S` (docs/elastic.md)."""
    import ray

    coordinator = autoscaling_coordinator()
    if coordinator is None:
        log("Ray Train's view of the nodes is not refreshed (this Ray has no AutoscalingCoordinator)")
        return
    try:
        while job.is_alive():
            ray.get(coordinator._tick.remote(), timeout=30)
            time.sleep(COORDINATOR_TICK_S)
    except Exception as error:  # Ray's internals: the demo then waits for Ray's own ticks
        log(f"stopped refreshing Ray Train's view of the nodes ({type(error).__name__}: {error})")


def _attempts(run_dir: Path) -> list[dict[str, Any]]:
    """Rank 0's placement records (cluster.driver.job), one per worker-group start, oldest first."""
    records = []
    for path in (run_dir / "workers").glob("rank0-*.json"):
        try:
            records.append(json.loads(path.read_text()))
        except (OSError, ValueError):  # being written
            pass
    return sorted(records, key=lambda r: r["started"])


def _checkpoint_steps(run_dir: Path) -> list[int]:
    return [run_folder.parse_step(p.name) for p in run_folder.complete_checkpoints(run_dir)]


def run_scenario(cluster, nodes, spec: JobSpec, settings: DemoSettings, log: Callable[[str], None] = print):
    """Run the job in a thread and drive the scenario; the job always runs to its end."""
    import ray

    run_dir = Path(spec.config.checkpoint.dir)
    result = DemoResult(rc=1, run_dir=run_dir, tracking_uri=spec.config.logging.mlflow_tracking_uri)
    t0 = time.monotonic()
    removed: set[str] = set()

    def note(text: str) -> None:
        line = f"[{time.monotonic() - t0:6.1f} s] {text}"
        result.events.append(line)
        log(line)

    def wait(what: str, done: Callable[[], bool]) -> None:
        deadline = time.monotonic() + settings.timeout_s
        while not done():
            if not thread.is_alive():
                raise RuntimeError(f"the job ended while waiting for {what}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {what} within {settings.timeout_s:.0f} s")
            time.sleep(0.5)

    def attempt_since(world_size: int, since: float) -> bool:
        return any(a["world_size"] == world_size and a["started"] > since for a in _attempts(run_dir))

    def job() -> None:
        started = time.time()
        try:
            result.rc = run_job(spec, address=cluster.address, eval_timeout_s=settings.timeout_s, started_at=started)
            result.job_s = time.time() - started
        except BaseException as exc:  # reported, not raised in a thread
            result.error = f"job: {type(exc).__name__}: {exc}"
            log(f"the job raised {type(exc).__name__}: {exc}")

    if not ray.is_initialized():
        env = local_head.own_ray_vars(cluster.address)  # not the newest Ray on the machine (a `make launch` head)
        ray.init(address=cluster.address, runtime_env={"worker_process_setup_hook": quiet_pg_cleaner, "env_vars": env})
    thread = threading.Thread(target=job, name="elastic-demo-job", daemon=True)
    thread.start()
    threading.Thread(target=refresh_ray_train_view, args=(thread, log), name="coordinator-ticks", daemon=True).start()
    try:
        wait("first checkpoint past step 0", lambda: any(s > 0 for s in _checkpoint_steps(run_dir)))
        at = max(_checkpoint_steps(run_dir))
        # Never this driver's node (all nodes share one IP: it may be a worker node)
        driver_node = ray.get_runtime_context().get_node_id()
        victim = next(n for n in reversed(nodes) if n.node_id != driver_node)
        note(f"checkpoint step {at} is complete; removing worker node {victim.node_id[:8]}")
        removed_at = time.time()
        removed.add(victim.node_id)
        cluster.remove_node(victim, allow_graceful=False)  # like a lost machine
        wait("restart at world size 1", lambda: attempt_since(1, removed_at))
        note("the worker group restarted at world size 1; waiting for a checkpoint written at world size 1")
        wait("checkpoint at world size 1", lambda: max(_checkpoint_steps(run_dir)) > at)
        at = max(_checkpoint_steps(run_dir))
        note(f"checkpoint step {at} written at world size 1; adding a worker node back")
        added_at = time.time()
        nodes[nodes.index(victim)] = add_worker_node(cluster, Path(cluster.head_node.get_temp_dir_path()))
        wait("regrowth to world size 2", lambda: attempt_since(2, added_at))
        note("Ray Train grew the worker group back to world size 2; letting the job finish")
    except (TimeoutError, RuntimeError) as exc:
        result.error = "; ".join(filter(None, (result.error, str(exc))))
        note(f"scenario stopped: {exc}; waiting for the job to end")
    thread.join(settings.timeout_s)
    if thread.is_alive():
        result.error = (result.error or "") + f"; the job did not end within {settings.timeout_s:.0f} s"
    if result.error:
        result.error += _unplanned_node_deaths(removed)
    note(f"job ended with exit code {result.rc}")
    return result


def quiet_pg_cleaner() -> None:
    """Every Ray worker's setup hook on the demo's cluster: `PG_CLEANER_LOGGER` to errors only."""
    logging.getLogger(PG_CLEANER_LOGGER).setLevel(logging.ERROR)


def _alive(node_id: str) -> bool:
    import ray

    return any(n["Alive"] for n in ray.nodes() if n["NodeID"] == node_id)


def _unplanned_node_deaths(removed: set[str]) -> str:
    """A note naming nodes Ray declared dead that the scenario did not remove, or ""."""
    import ray

    try:
        dead = [n["NodeID"][:8] for n in ray.nodes() if not n["Alive"] and n["NodeID"] not in removed]
    except Exception:  # the GCS is gone too
        return ""
    if not dead:
        return ""
    return (
        f"; Ray declared node(s) {', '.join(dead)} dead although the demo did not remove them: their raylet "
        'missed its health checks (an overloaded machine? docs/elastic.md, "Health checks")'
    )


def world_size_ranges(run_id: str, uri: str) -> list[tuple[int, int, int]]:
    """(first step, last step, world size) runs of `train/world_size`, in step order."""
    from mlflow import MlflowClient

    history = sorted(
        (m.step, int(m.value)) for m in MlflowClient(uri).get_metric_history(run_id, keys.WORLD_SIZE_METRIC)
    )
    ranges: list[tuple[int, int, int]] = []
    for step, size in history:
        if ranges and ranges[-1][2] == size:
            ranges[-1] = (ranges[-1][0], step, size)
        else:
            ranges.append((step, step, size))
    return ranges


def describe(result: DemoResult) -> dict[str, Any]:
    from mlflow import MlflowClient

    summary_path = result.run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    ledger_path = result.run_dir / GOODPUT_DIR / "ledger.json"  # written at the job's end
    run_id = json.loads((result.run_dir / "mlflow_run.json").read_text())["run_id"]
    client = MlflowClient(result.tracking_uri)
    run = client.get_run(run_id)
    evals = sorted({m.step for m in client.get_metric_history(run_id, "fewshot/digits/5shot")})
    return {
        "status": summary.get("status"),
        "mlflow_run_id": run_id,
        "world_size_ranges": world_size_ranges(run_id, result.tracking_uri),
        "resizes": summary.get("resize_lines", []),
        "restarts": summary.get("restarts"),
        "tags": {k: run.data.tags.get(k) for k in (keys.RESIZES, keys.WORLD_SIZES, keys.RESTARTS)},
        "eval_steps": evals,
        "checkpoint_steps": sorted(int(s) for s in summary.get("checkpoints", {})),
        "goodput": json.loads(ledger_path.read_text()) if ledger_path.exists() else None,
    }


def format_report(result: DemoResult, report: dict[str, Any]) -> str:
    lines = ["elastic demo:", *(f"  {e}" for e in result.events)]
    ranges = ", ".join(f"steps {a}-{b}: {n}" for a, b, n in report["world_size_ranges"]) or "none logged"
    lines += [
        f"  status            {report['status']} (exit code {result.rc}); MLflow run {report['mlflow_run_id']}",
        f"  world size        {ranges}",
        f"  resizes           {'; '.join(report['resizes']) or 'none'}",
        f"  tags              {report['tags']}; failure restarts {report['restarts']}",
        f"  evals at steps    {report['eval_steps']} (checkpoints evaluated: {report['checkpoint_steps']})",
    ]
    ledger = report.get("goodput")
    if ledger:
        buckets = ", ".join(f"{k} {v:.0f} s" for k, v in ledger["total"].items() if v >= 0.5)
        measured = f" (measured around the job: {result.job_s:.1f} s)" if result.job_s else ""
        lines.append(f"  goodput           {ledger['fraction']:.1%} of {ledger['wall_s']:.1f} s{measured}: {buckets}")
    if result.error:
        lines.append(f"  PROBLEM           {result.error}")
    return "\n".join(lines)


@contextlib.contextmanager
def cluster_auth() -> Iterator[None]:
    """Token authentication for the clusters started in the block, as the local head has it (RAY_AUTH_MODE=disabled
    turns it off): their nodes listen on the machine's address, not on 127.0.0.1 alone."""
    mode = local_head.auth_mode_from_env()
    if mode == "token":
        local_head.ensure_auth_token()
    with local_head.ray_auth_mode(mode):
        yield


def run_demo(out: Path, settings: DemoSettings, log: Callable[[str], None] = print) -> tuple[DemoResult, dict]:
    """The whole demo in ``out``; the cluster and its temp folder are gone when it returns."""
    import ray

    spec = demo_spec(out, settings)
    temp_dir = Path(tempfile.mkdtemp(prefix="vsray-"))  # short: Ray's socket paths stay under 107 bytes
    cluster = None
    try:  # the Train controller inherits DEMO_ENV
        with local_head.environ({**DEMO_ENV, "RAY_ADDRESS": None}), cluster_auth():
            try:
                cluster, nodes = start_cluster(temp_dir)
                result = run_scenario(cluster, nodes, spec, settings, log)
            finally:
                ray.shutdown()
                if cluster is not None:
                    cluster.shutdown()
    finally:
        shutil.rmtree(temp_dir, ignore_errors=True)
    return result, describe(result)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cluster.elastic_demo", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="output folder (default runs/elastic-demo-<time>)")
    parser.add_argument("--steps", type=int, default=DemoSettings.steps, help="training steps")
    parser.add_argument("--every", type=int, default=DemoSettings.every, help="checkpoint interval in steps")
    parser.add_argument(
        "--interval", type=float, default=DemoSettings.interval_s, help="elastic_resize_monitor_interval_s (seconds)"
    )
    args = parser.parse_args(argv)
    out = args.out or PROJECT_ROOT / "runs" / f"elastic-demo-{time.strftime('%Y%m%d-%H%M%S')}"
    problem = None
    if args.every < 1 or args.steps < 3 * args.every:
        problem = (
            f"--steps {args.steps} --every {args.every}: need --every >= 1 and --steps >= 3 x --every "
            "(a checkpoint before the node loss, one at world size 1, and steps left to grow back)"
        )
    elif not args.interval > 0:
        problem = f"--interval {args.interval}: give a positive number of seconds, e.g. 3"
    elif (blocker := file_in_the_way(out)) is not None:
        problem = f"--out {out}: {blocker} is a file; give a new or empty folder"
    elif out.exists() and any(out.iterdir()):
        problem = f"--out {out} is not empty; give a new or empty folder"
    else:
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as error:  # read-only, no permission, under /proc
            problem = f"--out {out}: cannot create it ({error.strerror or error}); give a writable folder path"
    if problem:
        return fail(parser.prog, problem)
    settings = DemoSettings(steps=args.steps, every=args.every, interval_s=args.interval)
    try:
        result, report = run_demo(out.resolve(), settings)
    except ValueError as error:  # a recipe or plan the profile cannot run
        return fail(parser.prog, error)
    except KeyboardInterrupt:  # `run_demo` stopped the simulated cluster on its way out
        return interrupted(parser.prog, f"what the job wrote stays in {out}")
    print(format_report(result, report), flush=True)
    return 0 if result.rc == 0 and result.error is None else 1


if __name__ == "__main__":
    sys.exit(main())
