"""The Ray job: one MLflow run, Ray Train workers running `train_worker`, evals after each checkpoint (docs/design.md,
"The Ray job"; docs/elastic.md, "Faults")."""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from cluster.driver.courier import hand_over
from cluster.driver.eval_scheduler import EvalScheduler
from cluster.driver.ledger import GoodputMonitor, JobClock, evals_share_training_cores
from cluster.driver.record import JobEnd, finish_job, record_placement
from cluster.driver.watchdog import FinalFailure, Watchdog, final_failures_callback, identity, install_stack_dump
from cluster.local_head import environ
from cluster.network import EFA_DEVICES, EFA_FIX, EfaMissingError, efa_missing, needs_efa, network_env
from cluster.plan.evals.cadence import EvalCadence
from cluster.plan.planner import Plan, runtime_pip
from cluster.profiles import EVAL_NODE_RESOURCE, ClusterProfile, HangSpec, profile_from_dict, profile_to_dict
from data_pipeline.paths import write_text_atomically
from pretrain import collector
from pretrain.checkpoint import run_folder
from pretrain.checkpoint.writes import SaveAttempt
from pretrain.config.train_config import TrainConfig
from pretrain.loop import train_worker
from pretrain.telemetry.heartbeat import Heartbeat, heartbeat_path
from tracking import keys
from tracking.runs import RUN_RECORD, JobRun, run_tags, start_job_run
from tracking.tracker import Tracker

PLAN_ENV = "VITSCALE_PLAN"
STOP_WAIT_S = 30.0  # the job's end waits this long for a run creation in flight
SUBMIT_WAIT_S = 60.0  # rank 0's wait for the eval scheduler to take its checkpoints


@dataclass(frozen=True)
class FaultInjection:
    """Chaos hook: `delay_s` after checkpoint step >= `after_step` is COMPLETE, rank `rank` exits ("exit": a lost
    worker) or SIGSTOPs itself ("stop": a hung rank), once per run folder; at 0 s before rank 0 submits that step's
    evals. `full_disk_after`: its later saves fail (ENOSPC)."""

    rank: int
    after_step: int
    delay_s: float = 0.0
    kind: Literal["exit", "stop"] = "exit"
    full_disk_after: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("exit", "stop"):
            raise ValueError(f"fault kind {self.kind!r}: use 'exit' (a lost worker) or 'stop' (a hung rank)")


@dataclass(frozen=True)
class JobSpec:
    """What `cluster.launch` submits, as JSON."""

    profile: ClusterProfile
    config: TrainConfig
    plan: dict[str, Any]
    fault: FaultInjection | None = None
    tags: dict[str, str] = field(default_factory=dict)

    @classmethod
    def create(
        cls, profile: ClusterProfile, config: TrainConfig, plan: Plan, fault: FaultInjection | None = None
    ) -> JobSpec:
        """Tagged here: the job's copy of the code has no git."""
        world = plan.topology.world_size
        tags = run_tags(config.recipe, config.model.name, world, profile=profile.name, run_dir=config.checkpoint.dir)
        return cls(profile, config, plan.to_dict(), fault, tags)

    def to_json(self) -> str:
        return json.dumps(
            {
                "profile": profile_to_dict(self.profile),
                "config": self.config.to_dict(),
                "plan": self.plan,
                "fault": vars(self.fault) if self.fault else None,
                "tags": self.tags,
            }
        )

    @classmethod
    def from_json(cls, text: str) -> JobSpec:
        d = json.loads(text)
        fault = FaultInjection(**d["fault"]) if d.get("fault") else None
        config = TrainConfig.from_dict(d["config"]).resolved()
        return cls(profile_from_dict(d["profile"]), config, d["plan"], fault, d.get("tags", {}))


def worker_env(profile: ClusterProfile) -> dict[str, str]:
    env = {
        "OMP_NUM_THREADS": str(profile.workers.cpus_per_worker),
        "PYTHONUNBUFFERED": "1",
        "RAY_TRAIN_ENABLE_PRINT_PATCH": "0",  # it printed every line twice
        "RAY_worker_niceness": "0",  # Ray's 15 starves a rank; evals stay at 15
    }
    if not profile.uses_gpus:
        env["DS_ACCELERATOR"] = "cpu"
    else:
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    env["TORCHINDUCTOR_COMPILE_THREADS"] = str(profile.workers.cpus_per_worker)
    env.update(network_env(profile))
    return env


def job_runtime_env(
    profile: ClusterProfile,
    spec_json: str,
    working_dir: str,
    excludes: list[str] | None = None,
    credentials: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """MLflow's ``credentials`` go beside the spec, never in it: the job prints and logs the spec."""
    env = {PLAN_ENV: spec_json, **worker_env(profile), **(credentials or {})}
    env.pop("OMP_NUM_THREADS")  # workers set their own
    runtime: dict[str, Any] = {"working_dir": working_dir}
    if excludes is not None:
        runtime["excludes"] = excludes
    runtime["env_vars"] = env
    pip = runtime_pip(json.loads(spec_json)["plan"])
    if pip:
        runtime["pip"] = pip
    return runtime


def _train_loop(loop_config: dict[str, Any]) -> None:
    collector.pause()  # no GC during the start; `train_worker` resumes it
    try:
        _train_rank(loop_config)
    finally:
        collector.resume()


def refuse_without_efa(devices: Path = EFA_DEVICES) -> None:
    """A multi-node EFA profile's worker stops where NCCL would silently pick TCP instead (`efa_missing`)."""
    if problem := efa_missing(devices):
        raise EfaMissingError(f"the profile's network is EFA, but on {socket.gethostname()}: {problem}; {EFA_FIX}")


def _train_rank(loop_config: dict[str, Any]) -> None:
    os.environ.update(loop_config["env"])
    import ray.train
    import torch

    torch.set_num_threads(int(loop_config["env"]["OMP_NUM_THREADS"]))
    config = loop_config["config"]
    context = ray.train.get_context()
    rank, world_size = context.get_world_rank(), context.get_world_size()
    run_dir = Path(config.checkpoint.dir)
    # first: the summary names the node of a worker refused below
    record_placement(run_dir, rank, world_size, loop_config["job"])
    if loop_config.get("needs_efa"):
        refuse_without_efa()
    # before the first heartbeat names this pid
    stacks = install_stack_dump(run_dir, rank)  # noqa: F841 (faulthandler writes to it until the process ends)
    heartbeat = Heartbeat(heartbeat_path(run_dir, rank), identity(rank, world_size))
    scheduler, cadence = loop_config["scheduler"], loop_config["eval_cadence"]
    fault = loop_config.get("fault")
    if fault and fault.get("full_disk_after") is not None and rank == fault["rank"]:
        _fill_disk(fault["full_disk_after"])

    if rank == 0:  # before this group saves
        _catch_up(scheduler)
    submits: list = []

    def on_checkpoint(checkpoint_dir: Path, step: int, metrics: dict) -> None:
        heartbeat.saved()
        if fault and rank == fault["rank"] and step >= fault["after_step"]:
            _inject(fault, run_dir / ".fault_injected", rank, step)
        if rank == 0:  # the save pinned it where evals are due; the scheduler unpins
            submits.append(scheduler.submit.remote(str(checkpoint_dir), int(step), _floats(metrics)))
            submits[:] = ray.wait(submits, num_returns=len(submits), timeout=0)[1]

    summary = train_worker(config, on_checkpoint=on_checkpoint, heartbeat=heartbeat, pin=cadence.pin_reason)
    _await_submits(submits)
    if rank == 0:  # Ray Train V2 keeps metrics only with checkpoints
        keep = ("start", "start_step", "steps", "final_loss", "images_seen", "world_size", "checkpoints")
        result = json.dumps({"job": loop_config["job"]} | {k: summary.to_dict()[k] for k in keep}, default=str)
        write_text_atomically(run_dir / "train_result.json", result)


def _catch_up(scheduler: Any) -> None:
    """Evals of checkpoints saved but never evaluated, a worker group or a job having stopped first
    (`EvalScheduler.catch_up`)."""
    import ray

    ref = scheduler.catch_up.remote()
    caught = [] if _await_submits([ref]) else ray.get(ref)
    if caught:
        print(
            f"evals of checkpoint step(s) {', '.join(map(str, caught))} submitted now: saved, but a worker group or "
            "a job stopped before their evals ran",
            flush=True,
        )


def _await_submits(refs: list, timeout_s: float = SUBMIT_WAIT_S) -> list:
    """A submit still in flight at the drain would be lost; returns those not taken in time."""
    import ray

    if not refs:
        return []
    _, late = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    if late:
        print(
            f"warning: the eval scheduler did not take {len(late)} checkpoint(s) within {timeout_s:g} s; "
            "their evals may be missing from the run",
            flush=True,
        )
    return late


def _inject(fault: dict[str, Any], marker: Path, rank: int, step: int) -> None:
    """Once per run folder."""
    if marker.exists():
        return
    kind = fault.get("kind", "exit")

    def strike() -> None:
        verb = "stopped (SIGSTOP)" if kind == "stop" else "killed"
        marker.write_text(
            f"rank {rank} {verb} {fault['delay_s']} s after checkpoint step {step} at {time.time():.3f}\n"
        )
        if kind == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        else:
            os._exit(1)

    marker.write_text(f"rank {rank}: {kind} pending\n")  # a restarted group must not strike again
    if fault["delay_s"] > 0:
        threading.Timer(fault["delay_s"], strike).start()
    else:  # before rank 0 submits this checkpoint's evals
        strike()


def _fill_disk(after_step: int) -> None:
    """Saves after step ``after_step`` write to /dev/full (ENOSPC), in this process only."""

    def full() -> None:
        with open("/dev/full", "wb") as out:
            out.write(b"\0" * 4096)
            out.flush()

    write = SaveAttempt.write

    def write_or_fail(attempt: SaveAttempt, path: Path, action: Callable[[], object], record: bool = True) -> None:
        step = run_folder.parse_step(attempt.staging.name.removesuffix(run_folder.STAGING_SUFFIX))
        write(attempt, path, full if step is not None and step > after_step else action, record)

    SaveAttempt.write = write_or_fail  # type: ignore[method-assign]


def _floats(d: dict) -> dict[str, float]:
    return {str(k): float(v) for k, v in (d or {}).items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def run_job(
    spec: JobSpec, address: str | None = None, eval_timeout_s: float | None = None, started_at: float | None = None
) -> int:
    """The exit code (0 = training succeeded). ``started_at``: the job's start, for the goodput ledger."""
    clock = JobClock(time.time() if started_at is None else started_at)
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    profile = spec.profile
    run_dir = Path(spec.config.checkpoint.dir)
    uri = spec.config.logging.mlflow_tracking_uri
    if not ray.is_initialized():
        ray.init(address=address or "auto")
    spec.config.data.ensure_builtin()  # ranks never generate data; before the MLflow run, which a refusal would strand
    mlflow_run, config = open_tracking(spec)
    run_id = mlflow_run.ref
    cadence = eval_cadence(spec)
    # One job per run folder: a pin left behind marks evals an earlier job never ended; this job runs them.
    pinned = (run_folder.parse_step(folder.name) for folder in run_folder.pinned_checkpoints(run_dir))
    unended = [step for step in pinned if step is not None and cadence.due(step)]
    if unended:
        steps = ", ".join(map(str, unended))
        print(f"an earlier job of this run ended before the evals of step(s) {steps}: this job runs them", flush=True)

    for line in resource_shortfall(profile, ray.nodes(), evals=bool(config.evals.schedule())):
        print(f"warning: {line}", flush=True)

    autoscaling_coordinator()  # its process starts while the job sets up
    # a lost node must not take the eval bookkeeping
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    ev = profile.evals
    scheduler = EvalScheduler.options(scheduling_strategy=here).remote(
        cadence,
        config.evals.data_root,
        run_id,
        uri,
        num_cpus=ev.num_cpus,
        num_gpus=ev.num_gpus,
        memory_gb=ev.memory_gb,
        run_dir=str(run_dir),
        resources=ev.node_resources,
    )
    trainer = _torch_trainer(spec, config, scheduler, cadence, clock.started)
    record = run_dir / RUN_RECORD  # the driver's Trackers spool there what MLflow did not take
    watchdog = Watchdog(run_dir, job_hang(spec), Tracker(uri, run_id, rank=0, record=record)).start()
    clock.fit_at = time.time()
    goodput = GoodputMonitor(run_dir, clock, Tracker(uri, run_id, rank=0, record=record)).start()
    started = time.monotonic()
    status, error = "FINISHED", None
    try:
        with ray_train_env(profile):
            result = fit(trainer)
        error = getattr(result, "error", None)
    except Exception as exc:
        error = exc
    finally:
        watchdog.stop()
        goodput.stop()
    if error is not None:
        status = "FAILED"
        why = failure_line(error)
        print(f"training failed: {why}", file=sys.stderr, flush=True)
        tracker = Tracker(uri, run_id, rank=0, record=record)
        tracker.set_tags({keys.FAILURE: why[:4000]})
        tracker.close()
    train_s = time.monotonic() - started
    print(f"training {status.lower()} after {train_s:.0f} s; waiting for pending evals", flush=True)
    wait_s = config.evals.timeout_s if eval_timeout_s is None else eval_timeout_s
    _warn_unplaceable_evals(profile, ray.get(scheduler.pending.remote()), wait_s)
    evals = ray.get(scheduler.drain.remote(wait_s))
    end = JobEnd(status, train_s, evals, clock, evals_share_training_cores(profile), spec.plan)
    mlflow_run.stop(STOP_WAIT_S)  # an attempt in flight ends first: the courier must not make a second run
    if not finish_job(run_dir, config.checkpoint.keep_last, uri, mlflow_run.run_id or mlflow_run.ref, end):
        print(hand_over(run_dir, uri, job_run_args(spec), end.evals, status), flush=True)
    return 0 if status == "FINISHED" else 1


def _warn_unplaceable_evals(profile: ClusterProfile, pending: list[int], wait_s: float) -> None:
    """Before the job's end waits for ``pending`` evals: a line where no live node can run an eval task."""
    import ray

    if pending and (short := _evals_short(profile, _live(ray.nodes()))):
        print(
            f"warning: the evals of step(s) {', '.join(map(str, pending))} may never start: {short}. The job's end "
            f"waits up to {wait_s:g} s for them (evals.timeout_s); `make stop` ends it now, their checkpoints stay "
            "pinned and the run's next job runs them",
            flush=True,
        )


def resource_shortfall(profile: ClusterProfile, nodes: list[dict[str, Any]], evals: bool) -> list[str]:
    """A line per part of the job that the cluster's live nodes (``ray.nodes()``) cannot hold now: Ray waits for the
    resources without end and says little (Ray Train that its worker group's start timed out, every minute; an eval
    task nothing at all)."""
    live = _live(nodes)
    return [line for line in (_workers_short(profile, live), _evals_short(profile, live) if evals else None) if line]


def _live(nodes: list[dict[str, Any]]) -> list[dict[str, float]]:
    return [node.get("Resources") or {} for node in nodes if node.get("Alive")]


def _workers_short(profile: ClusterProfile, live: list[dict[str, float]]) -> str | None:
    w = profile.workers
    worker = {"CPU": w.cpus_per_worker, "GPU": w.gpus_per_worker, **w.resources}
    held = sum(_holds(node, worker) for node in live if not node.get(EVAL_NODE_RESOURCE))  # no rank goes there
    if held >= w.min_workers:
        return None
    return (
        f"the cluster's {len(live)} live nodes hold {held} of the {w.min_workers} training workers ({_amounts(worker)} "
        "each): Ray Train waits for nodes with these resources to join, saying that its worker group's start timed "
        "out every minute meanwhile"
    )


def _evals_short(profile: ClusterProfile, live: list[dict[str, float]]) -> str | None:
    ev = profile.evals
    task = {"CPU": ev.num_cpus, "GPU": ev.num_gpus, "memory": ev.memory_gb * 1e9, **ev.node_resources}
    if any(_holds(node, task) for node in live):
        return None
    return (
        f"no live node of the cluster can run an eval task ({_amounts(task)}): the evals wait for one to join (the "
        "profile's evals section)"
    )


def _holds(node: dict[str, float], needs: dict[str, float]) -> int:
    """How many sets of ``needs`` a node's resources hold."""
    return min((int(node.get(name, 0) // amount) for name, amount in needs.items() if amount > 0), default=sys.maxsize)


def _amounts(needs: dict[str, float]) -> str:
    return ", ".join(
        f"memory {amount / 1e9:g} GB" if name == "memory" else f"{name} {amount:g}"
        for name, amount in needs.items()
        if amount > 0
    )


def autoscaling_coordinator() -> Any:
    """Ray Train's resource coordinator (a detached actor; Ray 2.60's internals), made on this node if it is not yet;
    None where this Ray lacks it. Made at Ray Train's first resource request, its process start outlasted that
    request's 5 s timeout on a busy head, and the first worker group started one retry (~7 s) later."""
    try:
        from ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator import (
            get_or_create_autoscaling_coordinator,
        )

        return get_or_create_autoscaling_coordinator()
    except Exception:
        return None


def fit(trainer: Any) -> Any:
    """``trainer.fit()``, Ctrl-C raising KeyboardInterrupt. Ray Train's SIGINT handler aborts the run, then exits the
    process (SystemExit) without a word, and stays installed after the fit, where it ignored Ctrl-C."""
    before = signal.getsignal(signal.SIGINT)
    try:
        return trainer.fit()
    except SystemExit:
        raise KeyboardInterrupt from None
    finally:
        if before is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, before)


PREEMPTION_WATCHER_VAR = "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"  # read by Ray Train's controller, from the driver


def ray_train_env(profile: ClusterProfile) -> AbstractContextManager[None]:
    """The driver's environment while Ray Train starts the controller, which takes Ray Train's variables from it."""
    return environ({} if profile.ray.preemption_watcher else {PREEMPTION_WATCHER_VAR: "0"})


def eval_cadence(spec: JobSpec) -> EvalCadence:
    config = spec.config
    last_step = (spec.plan.get("compute") or {}).get("total_steps")
    return EvalCadence(config.evals.schedule(), config.checkpoint.every_steps, last_step)


def open_tracking(spec: JobSpec) -> tuple[JobRun, TrainConfig]:
    """The job's MLflow run, and the config naming it (while MLflow does not answer, by a reference)."""
    config = spec.config
    run_dir, uri = Path(config.checkpoint.dir), config.logging.mlflow_tracking_uri
    args = job_run_args(spec)
    run = start_job_run(run_dir, uri, args["experiment"], args["config"], args["tags"], spec.plan)
    named = run.ref if run.ref == run.run_id else "being created in the background"
    print(f"MLflow run {named} ({uri}); run folder {run_dir}", flush=True)
    return run, config.replace(logging=replace(config.logging, mlflow_run_id=run.ref))


def job_run_args(spec: JobSpec) -> dict[str, Any]:
    """What creating the job's MLflow run takes, at the job's start or by its courier."""
    return {"experiment": spec.config.recipe or "vitscale", "config": spec.config.to_dict(), "tags": spec.tags}


def job_hang(spec: JobSpec) -> HangSpec:
    hang, startup = spec.profile.hang, spec.plan.get("startup") or {}
    return replace(
        hang,
        startup_s=startup.get("startup_s", hang.startup_s),
        checkpoint_s=startup.get("first_save_s", hang.checkpoint_s),
    )


def failure_line(error: BaseException) -> str:
    """A `FinalFailure`'s own message (inside Ray's `ControllerError`), else the error."""
    cause = getattr(error, "controller_failure", None)
    if isinstance(cause, FinalFailure):
        return str(cause)
    return f"{type(error).__name__}: {error}"


def _torch_trainer(spec: JobSpec, config: TrainConfig, scheduler: Any, cadence: EvalCadence, job: float) -> Any:
    """``job``: the job's start, which rank 0 writes into ``train_result.json`` as the job's mark."""
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    profile, run_dir = spec.profile, Path(config.checkpoint.dir)
    w = profile.workers
    resources = {"CPU": w.cpus_per_worker, **({"GPU": w.gpus_per_worker} if w.gpus_per_worker else {}), **w.resources}
    elastic = {"elastic_resize_monitor_interval_s": w.elastic_resize_monitor_interval_s} if w.elastic else {}
    return TorchTrainer(
        _train_loop,
        train_loop_config={
            "config": config,
            "scheduler": scheduler,
            "eval_cadence": cadence,
            "env": worker_env(profile),
            "fault": vars(spec.fault) if spec.fault else None,
            "needs_efa": needs_efa(profile),
            "job": job,
        },
        torch_config=TorchConfig(backend=profile.comm_backend, timeout_s=config.deepspeed.timeout_minutes * 60),
        scaling_config=ScalingConfig(
            num_workers=(w.min_workers, w.max_workers) if w.elastic else w.num_workers,
            **elastic,
            use_gpu=profile.uses_gpus,
            resources_per_worker=resources,
            placement_strategy=w.placement_strategy,
            label_selector=profile.training_label_selector,  # never on an eval node
        ),
        run_config=RunConfig(
            name=run_dir.name,
            storage_path=str(run_dir.parent),
            failure_config=FailureConfig(max_failures=profile.max_failures),
            callbacks=[final_failures_callback()],
            worker_runtime_env={"env_vars": worker_env(profile)},
        ),
    )
