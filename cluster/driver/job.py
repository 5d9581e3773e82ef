"""The Ray job entrypoint: one MLflow run, Ray Train workers running `train_worker`, evals after each checkpoint.

    python -m cluster.driver --plan plan.json      # or the plan in $VITSCALE_PLAN (what cluster.launch submits)

Order of work (all on the Ray head, inside the job):
1. Read the plan (resolved profile + resolved TrainConfig + the printed numbers).
2. Create the ONE MLflow run of this job (`tracking.runs.open_job_run`) — params = flattened resolved config, tags
   = profile / recipe / model / world size / git commit, plan as artifact — or continue the run recorded in
   `<run_dir>/mlflow_run.json` when the same run is launched again (training then resumes from its newest
   COMPLETE checkpoint as well). The run id goes into the config the workers get (which they do not rebuild).
3. Start the eval scheduler actor (`cluster.driver.eval_scheduler`), then `TorchTrainer(train_loop, ScalingConfig from
   the profile, FailureConfig(max_failures), RunConfig(storage_path = profile checkpoints))`. Each worker runs
   `pretrain.train.train_worker(config, on_checkpoint)`; rank 0's `on_checkpoint` hands every COMPLETE checkpoint
   to the scheduler without waiting. When a worker dies, Ray Train restarts the whole worker group and
   `train_worker` resumes from the newest COMPLETE checkpoint in the run folder: same run folder, same MLflow run
   (the steps it redoes are not logged to MLflow again; the run's tag `vitscale.restarts` counts the restarts).
   Rank 0 pins each checkpoint until its evals end, so `checkpoint.keep_last` never deletes one they still need.
   With a suite (and `evals.baseline`, on by default) a fresh run first saves and submits step 0, the weights
   before the first update: every transfer curve starts at its random-initialisation baseline. A restart resumes
   from a checkpoint, so it never evaluates step 0 again.
   Elastic profiles (`workers: {min, max}`) give Ray Train `ScalingConfig(num_workers=(min, max))`: it starts with
   as many workers as the cluster holds; a lost node fails the group (charged to `max_failures`, like any worker
   failure; a node drained for preemption is charged to `max_preemption_failures` instead) and Ray restarts it with
   the survivors if at least `min` are left; every `elastic_resize_monitor_interval_s` it looks for capacity and,
   when more workers fit, stops the group and starts a larger one (not a failure). Each start resumes from the
   newest COMPLETE checkpoint at its own world size (docs/elastic.md). The resizes are tagged on the run and listed
   in the summary from `<run_dir>/world_sizes.jsonl` (pretrain.train tags them at every start).
   A rank that hangs without dying (SIGSTOP, a stuck collective or read) would hold the group until the collective
   timeout: each worker reports its progress (`pretrain.telemetry.heartbeat`) and the driver's watchdog thread
   (`cluster.driver.watchdog`, the profile's `hang` section) dumps the ranks' stacks and kills the culprit once no rank
   has progressed within the allowance, so that the same restart path takes over; its allowances at the start and in a
   first save are the plan's (`cluster.plan.checkpoint_costs.startup_allowance`), a later save's follow the saves
   measured. A worker error that a restart would only repeat (a checkpoint save that failed: a full disk) is not
   retried: the job fails at once with the save's message, in the log and in the MLflow tag `vitscale.failure`
   (`cluster.driver.watchdog.final_failures_callback`).
4. Wait for pending evals (at most `evals.timeout_s`; an eval that failed is recorded as such), then
   `cluster.driver.record.finish_job`: prune the checkpoints their pins kept, print the summary table (step, loss, eval
   metrics, the headline metric's gain over step 0), print and log the goodput ledger (`cluster.driver.ledger`, logged
   over time by a driver thread while training runs; docs/goodput.md), close the MLflow run; exit 0 only if training
   succeeded.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from cluster.driver.eval_scheduler import EvalScheduler
from cluster.driver.ledger import GoodputMonitor, JobClock, evals_share_training_cores
from cluster.driver.record import JobEnd, finish_job, record_placement
from cluster.driver.watchdog import FinalFailure, Watchdog, final_failures_callback, identity, install_stack_dump
from cluster.plan.planner import Plan
from cluster.profiles import ClusterProfile, HangSpec, profile_from_dict, profile_to_dict
from data_pipeline.paths import write_text_atomically
from pretrain import collector
from pretrain.checkpoint import run_folder
from pretrain.checkpoint.run_folder import pin_checkpoint, release_pins
from pretrain.checkpoint.writes import SaveAttempt
from pretrain.config.train_config import TrainConfig
from pretrain.telemetry.heartbeat import Heartbeat, heartbeat_path
from pretrain.train import train_worker
from tracking import keys
from tracking.runs import open_job_run, run_tags
from tracking.tracker import Tracker

PLAN_ENV = "VITSCALE_PLAN"
SUBMIT_WAIT_S = 60.0  # how long rank 0 waits at its end for the eval scheduler to take its checkpoints


@dataclass(frozen=True)
class FaultInjection:
    """Chaos hook for tests and drills: `delay_s` after checkpoint step >= `after_step`, rank `rank` exits abruptly
    (`kind` "exit": a lost worker) or stops itself with SIGSTOP ("stop": a hung rank, which only the watchdog
    notices), once per run folder (a marker file there, saying when, makes the restarted worker group run through).
    Besides, with `full_disk_after` set, every save after checkpoint step `full_disk_after` fails on rank `rank` as on
    a full disk, in every attempt (its writes go to /dev/full, whose writes fail with the kernel's ENOSPC)."""

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
    """What `cluster.launch` submits: it travels as JSON (the config as one dict), and the job builds the config
    once, in `from_json`."""

    profile: ClusterProfile
    config: TrainConfig  # the resolved config
    plan: dict[str, Any]  # cluster.plan.planner.Plan.to_dict()
    fault: FaultInjection | None = None
    tags: dict[str, str] = field(default_factory=dict)

    @classmethod
    def create(
        cls, profile: ClusterProfile, config: TrainConfig, plan: Plan, fault: FaultInjection | None = None
    ) -> JobSpec:
        """The job of `plan`, tagged on this (the launching) machine: the job's copy of the code has no git."""
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
    """Environment every training worker sets before importing torch/DeepSpeed."""
    env = {
        "OMP_NUM_THREADS": str(profile.workers.cpus_per_worker),
        "PYTHONUNBUFFERED": "1",
        # Ray Train V2 routes a worker's print() to the root logger, whose console handler writes it out, and also
        # prints it itself whenever sys.stdout is not sys.__stdout__ — always so in a Ray worker, which replaces
        # sys.stdout. Every line of a training worker came out twice; off, print() writes once, to the worker's
        # stdout, which Ray streams to the job log.
        "RAY_TRAIN_ENABLE_PRINT_PATCH": "0",
        # Ray starts task and actor processes at nice 15 (its `worker_niceness`); a rank at 15 beside any work at 0
        # gets ~3% of a core: a fresh clone's `make launch` beside two busy processes sat in step 0 until the start
        # allowance killed it (docs/benchmarks/2026-12-02-first-launch.md). The ranks run at the priority of the
        # job; the evals stay at 15, so that on shared CPUs they yield to training.
        "RAY_worker_niceness": "0",
    }
    if not profile.uses_gpus:
        env["DS_ACCELERATOR"] = "cpu"
    return env


def _train_loop(loop_config: dict[str, Any]) -> None:
    """Runs in each Ray Train worker (Ray created the process group and set RANK / WORLD_SIZE / LOCAL_RANK)."""
    collector.pause()  # the start ahead (DeepSpeed's imports, the engine) without collector passes: `train_worker`
    try:  # resumes it before the first step; a start that fails must not leave the worker without it
        _train_rank(loop_config)
    finally:
        collector.resume()


def _train_rank(loop_config: dict[str, Any]) -> None:
    os.environ.update(loop_config["env"])
    import ray.train  # heavy: only the driver and cluster commands need Ray
    import torch

    torch.set_num_threads(int(loop_config["env"]["OMP_NUM_THREADS"]))
    config = loop_config["config"]  # the driver's TrainConfig, as Ray pickled it: not rebuilt here
    context = ray.train.get_context()
    rank, world_size = context.get_world_rank(), context.get_world_size()
    run_dir = Path(config.checkpoint.dir)
    record_placement(run_dir, rank, world_size)
    # The watchdog's view of this rank: a stack dump on SIGUSR1 (the file kept open while training; registered before
    # the first report names this pid), and progress reports.
    stacks = install_stack_dump(run_dir, rank)  # noqa: F841 (faulthandler writes to it until the process ends)
    heartbeat = Heartbeat(heartbeat_path(run_dir, rank), identity(rank, world_size))
    scheduler = loop_config["scheduler"]
    fault = loop_config.get("fault")
    if fault and fault.get("full_disk_after") is not None and rank == fault["rank"]:
        _fill_disk(fault["full_disk_after"])

    submits: list = []  # rank 0's submit calls not yet seen done: awaited before this rank ends (below)

    def on_checkpoint(checkpoint_dir: Path, step: int, metrics: dict) -> None:
        heartbeat.saved()
        if rank == 0:
            if config.evals.suite:
                # Pinned here, synchronously, before the next save's prune can run; the scheduler only gets the
                # folder later (an async call), and releases the pin when the eval ends.
                pin_checkpoint(checkpoint_dir, f"evals {config.evals.suite} pending on step {step}")
            submits.append(scheduler.submit.remote(str(checkpoint_dir), int(step), _floats(metrics)))
            submits[:] = ray.wait(submits, num_returns=len(submits), timeout=0)[1]
        if fault and rank == fault["rank"] and step >= fault["after_step"]:
            _inject(fault, run_dir / ".fault_injected", rank, step)

    summary = train_worker(config, on_checkpoint=on_checkpoint, heartbeat=heartbeat)
    _await_submits(submits)
    if rank == 0:  # Ray Train V2 keeps metrics only with checkpoints: hand the summary over in the run folder
        keep = ("start", "start_step", "steps", "final_loss", "images_seen", "world_size", "checkpoints")
        result = json.dumps({k: summary.to_dict()[k] for k in keep}, default=str)
        write_text_atomically(Path(config.checkpoint.dir) / "train_result.json", result)


def _await_submits(refs: list, timeout_s: float = SUBMIT_WAIT_S) -> None:
    """Wait until the eval scheduler has taken rank 0's checkpoints. The driver drains the scheduler once the worker
    group has ended, so a submit still in flight then (this process gone, or the call arriving after the drain took
    its list) would lose the final checkpoint's eval: in CI the elastic test once ended without step 200's."""
    import ray

    if not refs:
        return
    _, late = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    if late:
        print(
            f"warning: the eval scheduler did not take {len(late)} checkpoint(s) within {timeout_s:g} s; "
            "their evals may be missing from the run",
            flush=True,
        )


def _inject(fault: dict[str, Any], marker: Path, rank: int, step: int) -> None:
    """The fault, once per run folder: the marker says what happened and when (unix time), for drills and tests."""
    if marker.exists():
        return
    kind = fault.get("kind", "exit")

    def strike() -> None:
        verb = "stopped (SIGSTOP)" if kind == "stop" else "killed"
        marker.write_text(
            f"rank {rank} {verb} {fault['delay_s']} s after checkpoint step {step} at {time.time():.3f}\n"
        )
        if kind == "stop":  # hang like a stuck rank: alive, silent, holding the others in their next collective
            os.kill(os.getpid(), signal.SIGSTOP)
        else:  # die like a lost node would: no exception, no cleanup, in the middle of later training steps
            os._exit(1)

    marker.write_text(f"rank {rank}: {kind} pending\n")  # at once: a restarted group must not strike again
    threading.Timer(fault["delay_s"], strike).start()


def _fill_disk(after_step: int) -> None:
    """This process's saves of checkpoints after step ``after_step`` fail as on a full disk: each of their writes
    (`pretrain.checkpoint.writes.SaveAttempt.write`) becomes a write to /dev/full, which the kernel fails with
    ENOSPC. Only the fault's rank, in its own process: the save's agreement makes every rank fail alike."""

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
    """Steps 2-4 of the module docstring; returns the process exit code (0 = training succeeded). ``started_at``:
    the job's start (Unix time) for its goodput ledger, the driver process's start under `main`; default now."""
    clock = JobClock(time.time() if started_at is None else started_at)
    import ray  # heavy: only the driver and cluster commands need Ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    profile, config = spec.profile, spec.config
    run_dir = Path(config.checkpoint.dir)
    uri = config.logging.mlflow_tracking_uri
    if not ray.is_initialized():
        ray.init(address=address or "auto")
    run_id = open_job_run(run_dir, uri, config.recipe or "vitscale", config.to_dict(), spec.tags, spec.plan)
    config = config.replace(logging=replace(config.logging, mlflow_run_id=run_id))
    print(f"MLflow run {run_id} ({uri}); run folder {run_dir}", flush=True)
    stale = release_pins(run_dir)  # one job per run folder: pins found now belong to a job that died
    if stale:
        print(f"released {len(stale)} checkpoint pins left by an earlier job of this run", flush=True)

    # On the driver's own node (the head): an actor with no CPU could land on any node, and a lost node would take
    # the job's eval bookkeeping with it (an elastic job outlives its nodes).
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    scheduler = EvalScheduler.options(scheduling_strategy=here).remote(
        config.evals.suite,
        config.evals.data_root,
        run_id,
        uri,
        num_cpus=profile.evals.num_cpus,
        num_gpus=profile.evals.num_gpus,
    )
    trainer = _torch_trainer(spec, config, scheduler)
    watchdog = Watchdog(run_dir, job_hang(spec), Tracker(uri, run_id, rank=0)).start()
    clock.fit_at = time.time()  # from here Ray Train places the worker group (docs/goodput.md)
    goodput = GoodputMonitor(run_dir, clock, Tracker(uri, run_id, rank=0)).start()
    started = time.monotonic()
    status, error = "FINISHED", None
    try:
        result = trainer.fit()
        error = getattr(result, "error", None)
    except Exception as exc:  # TrainingFailedError after max_failures restarts, or a setup error
        error = exc
    finally:
        watchdog.stop()
        goodput.stop()
    if error is not None:
        status = "FAILED"
        why = failure_line(error)
        print(f"training failed: {why}", file=sys.stderr, flush=True)
        tracker = Tracker(uri, run_id, rank=0)
        tracker.set_tags({keys.FAILURE: why[:4000]})
        tracker.close()
    train_s = time.monotonic() - started
    print(f"training {status.lower()} after {train_s:.0f} s; waiting for pending evals", flush=True)
    # Evals never hold the job's end beyond evals.timeout_s: what is still running then is recorded as failed.
    evals = ray.get(scheduler.drain.remote(config.evals.timeout_s if eval_timeout_s is None else eval_timeout_s))
    end = JobEnd(status, train_s, evals, clock, evals_share_training_cores(profile), spec.plan)
    finish_job(run_dir, config.checkpoint.keep_last, uri, run_id, end)
    return 0 if status == "FINISHED" else 1


def job_hang(spec: JobSpec) -> HangSpec:
    """The watchdog's allowances for this job: the profile's `hang` section with the plan's start and first-save
    allowances (`cluster.plan.checkpoint_costs.startup_allowance`, at least the profile's; a plan without them keeps the
    profile's)."""
    hang, startup = spec.profile.hang, spec.plan.get("startup") or {}
    return replace(
        hang,
        startup_s=startup.get("startup_s", hang.startup_s),
        checkpoint_s=startup.get("first_save_s", hang.checkpoint_s),
    )


def failure_line(error: BaseException) -> str:
    """Why training failed, for the log and the MLflow run: a final worker error's own message (Ray Train hands it
    over as a `ControllerError`, `cluster.driver.watchdog.FinalFailure`), else the error as Ray raised it."""
    cause = getattr(error, "controller_failure", None)
    if isinstance(cause, FinalFailure):
        return str(cause)
    return f"{type(error).__name__}: {error}"


def _torch_trainer(spec: JobSpec, config: TrainConfig, scheduler: Any) -> Any:
    """Ray Train's TorchTrainer for the job: the profile's workers and resources, each running `_train_loop`."""
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    profile, run_dir = spec.profile, Path(config.checkpoint.dir)
    w = profile.workers
    resources = {"CPU": w.cpus_per_worker, **({"GPU": w.gpus_per_worker} if w.gpus_per_worker else {}), **w.resources}
    # Elastic: Ray Train may run at any count in min..max that the cluster holds (the plan checked each keeps the
    # global batch); it looks for returned capacity every elastic_resize_monitor_interval_s.
    elastic = {"elastic_resize_monitor_interval_s": w.elastic_resize_monitor_interval_s} if w.elastic else {}
    return TorchTrainer(
        _train_loop,
        train_loop_config={
            "config": config,
            "scheduler": scheduler,
            "env": worker_env(profile),
            "fault": vars(spec.fault) if spec.fault else None,
        },
        torch_config=TorchConfig(backend=profile.comm_backend, timeout_s=config.deepspeed.timeout_minutes * 60),
        scaling_config=ScalingConfig(
            num_workers=(w.min_workers, w.max_workers) if w.elastic else w.num_workers,
            **elastic,
            use_gpu=profile.uses_gpus,
            resources_per_worker=resources,
            placement_strategy=w.placement_strategy,
        ),
        run_config=RunConfig(
            name=run_dir.name,
            storage_path=str(run_dir.parent),
            failure_config=FailureConfig(max_failures=profile.max_failures),
            # A worker error a restart would only repeat (a failed checkpoint save) ends the job at once.
            callbacks=[final_failures_callback()],
            # Before the worker process imports anything: thread counts, and print() said once (worker_env).
            worker_runtime_env={"env_vars": worker_env(profile)},
        ),
    )
