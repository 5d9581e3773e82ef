"""What a job records beyond its checkpoints: where each worker ran, and at the end `summary.json`, the summary table,
the final model in MLflow and the goodput ledger."""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cluster.driver.ledger import JobClock, current_ledger, eval_spans, finish_ledger, read_workers
from cluster.driver.summary import format_resizes, format_summary
from data_pipeline.paths import write_text_atomically
from pretrain.checkpoint import run_folder
from pretrain.checkpoint.run_folder import pinned_checkpoints, prune_checkpoints
from pretrain.weights.export import checkpoint_step, class_names, save_hf
from pretrain.weights.formats import load_checkpoint_model, read_model_config
from pretrain.weights.hf import hf_refusal
from tracking import keys
from tracking.models import log_hf_model
from tracking.runs import RUN_RECORD, finish_run, send_spooled, steps_missing
from tracking.store import PENDING_RUN, unserved
from tracking.tracker import Tracker


def record_placement(run_dir: Path, rank: int, world_size: int, job: float | None = None) -> None:
    """``job``: the job's start (its driver's mark); Ray's job id alone repeats on each fresh cluster."""
    import socket

    import psutil  # a Ray dependency
    import ray

    folder = run_dir / "workers"
    folder.mkdir(parents=True, exist_ok=True)
    ctx = ray.get_runtime_context()
    record = {
        "rank": rank,
        "pid": os.getpid(),
        "node_id": ctx.get_node_id(),
        "hostname": socket.gethostname(),
        "started": time.time(),
        "process_started": psutil.Process().create_time(),  # for the goodput ledger
        "job_id": ctx.get_job_id(),
        "job": job,
        "world_size": world_size,
        "niceness": os.getpriority(os.PRIO_PROCESS, 0),
    }
    # the node too: identical containers number their processes alike, and a rank moved to another node may repeat a pid
    name = f"rank{rank}-pid{os.getpid()}-{record['node_id'][:12]}.json"
    write_text_atomically(folder / name, json.dumps(record))


def count_restarts(placements: list[dict[str, Any]]) -> int:
    """Rank-0 attempts beyond each job's first, less an elastic group growing."""
    rank0 = sorted((p for p in placements if p.get("rank") == 0), key=lambda p: p.get("started", 0))
    attempts = Counter(_job(p) for p in rank0)
    grown = 0
    for job in attempts:
        sizes = [p.get("world_size") for p in rank0 if _job(p) == job]
        grown += sum(1 for a, b in zip(sizes, sizes[1:]) if a is not None and b is not None and b > a)
    return sum(n - 1 for n in attempts.values()) - grown


def _job(placement: dict[str, Any]) -> tuple[Any, Any]:
    """A job of the run: Ray numbers jobs from 1 on every new cluster, so a run launched again after its cluster
    was brought up anew has the job id of its earlier job."""
    return placement.get("job_id"), placement.get("job")


@dataclass(frozen=True)
class JobEnd:
    status: str  # FINISHED or FAILED
    train_seconds: float
    evals: dict[int, dict[str, Any]]  # by checkpoint step
    clock: JobClock | None = None  # None: no ledger
    evals_shared: bool = False
    plan: dict[str, Any] = field(default_factory=dict)


def finish_job(run_dir: Path, keep_last: int, uri: str, run: str, end: JobEnd) -> bool:
    """Whether the MLflow run holds the job's end and is marked with its status. ``run``: the run's id, or its pending
    reference while MLflow has not answered. Where it does not answer, what is logged here waits in the spool for the
    job's courier (cluster.driver.courier)."""
    run_id = None if run.startswith(PENDING_RUN) else run
    down = unserved(uri, run_id) if run_id else ""
    if down:  # MLflow's own retries would hold the job's end for minutes a call
        print(f"MLflow run {run_id} is not reachable at the job's end: {down}", flush=True)
        run_id = None
    train_result = _train_result(run_dir / "train_result.json", end.clock.started if end.clock else None)
    # up to the step the job ended at: a newer checkpoint is a damaged one its resume skipped, not one to count
    pruned = prune_checkpoints(run_dir, keep_last, upto=train_result.get("steps"))
    print(format_summary(end.evals), flush=True)
    unended = [folder.name for folder in pinned_checkpoints(run_dir)]
    if unended:  # saved, but the job ended before rank 0 handed them to the eval scheduler
        print(
            f"checkpoint(s) {', '.join(unended)} stay pinned: their evals did not run; the run's next job runs them",
            flush=True,
        )
    workers = read_workers(run_dir)  # a worker killed in its write (a full disk) left one unreadable
    restarts = count_restarts(workers)
    if restarts:
        print(f"the worker group was restarted {restarts} time(s) after a worker failed", flush=True)
    history = run_folder.world_size_history(run_dir)
    resizes = run_folder.resize_events(history)
    resize_lines = format_resizes(resizes)
    for line in resize_lines:
        print(f"resize: {line}", flush=True)
    summary = {
        "status": end.status,
        "train_seconds": end.train_seconds,
        "train_result": train_result,
        "restarts": restarts,
        "world_sizes": history,
        "resizes": resizes,
        "resize_lines": resize_lines,
        "workers": workers,
        "checkpoints": {str(k): v for k, v in end.evals.items()},
        "pruned_after_evals": [p.name for p in pruned],
    }
    tracker = Tracker(uri, run, rank=0, record=run_dir / RUN_RECORD)
    tracker.set_tags({keys.RESTARTS: restarts})
    try:  # a full disk must not keep the run from its status
        write_text_atomically(run_dir / "summary.json", json.dumps(summary, indent=2, default=str))
        tracker.log_artifact(str(run_dir / "summary.json"))
    except OSError as error:
        print(f"warning: {run_dir / 'summary.json'} not written: {error}", file=sys.stderr, flush=True)
    if run_id is not None:
        send_the_rest(run_dir, uri, run_id, end.evals, end.status, tracker)
    if end.clock is not None:  # last: the wall-clock ends when the ledger closes
        try:
            ledger = current_ledger(run_dir, end.clock, time.time(), eval_spans(end.evals), end.evals_shared)
            step = ledger.step or int(train_result.get("steps") or 0)
            print(finish_ledger(run_dir, ledger, end.plan, tracker, step), flush=True)
        except Exception as error:  # noqa: BLE001 — the job's outcome stays training's
            print(f"warning: no goodput ledger: {type(error).__name__}: {error}", file=sys.stderr, flush=True)
    tracker.close()  # where `down`, within tracking.tracker.UNANSWERED_CLOSE_S: the call that failed counts
    return run_id is not None and finish_run(uri, run_id, end.status)


def send_the_rest(run_dir: Path, uri: str, run_id: str, evals: dict, status: str, tracker: Tracker) -> None:
    """What the job's processes left in the spool, the eval metrics the run still lacks and, after a success, the
    final model: the job's end, or its courier once MLflow answers."""
    sent, left = send_spooled(run_dir / RUN_RECORD)
    if sent or left:
        unsent = f"; {left} spool file(s) not sent, kept in {run_dir}" if left else ""
        print(f"MLflow run {run_id}: {sent} records sent that the job's processes had spooled{unsent}", flush=True)
    _send_late_evals(uri, run_id, evals, tracker)
    if status == "FINISHED":
        log_final_model(run_dir, uri, run_id)


def _train_result(path: Path, job: float | None) -> dict[str, Any]:
    """What rank 0 of the job started at ``job`` wrote; {} for an earlier job's of the run (a resumed run whose job
    failed first). Known by the mark the rank writes, not by the file's time: shared storage's clock is not ours."""
    try:
        result = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return {k: v for k, v in result.items() if k != "job"} if job is None or result.get("job") == job else {}


def _send_late_evals(uri: str, run_id: str, evals: dict, tracker: Tracker) -> None:
    """Metrics of evals that ended before the run existed (docs/design.md, "Tracking at a job's start")."""
    try:
        late = steps_missing(uri, run_id, {int(s): r["metrics"] for s, r in evals.items() if r.get("metrics")})
    except Exception as error:  # noqa: BLE001
        print(f"warning: could not check the run's eval metrics: {type(error).__name__}: {error}", file=sys.stderr)
        return
    for step, metrics in sorted(late.items()):
        tracker.log_metrics(metrics, step=step)
    if late:
        print(f"evals of step(s) {sorted(late)}: metrics sent by the driver (their tasks ended before the run existed)")


def log_final_model(run_dir: Path, uri: str, run_id: str) -> str | None:
    """The newest checkpoint as the run's MLflow model (HF), unless the run holds it already; its URI or None. Never
    raises."""
    checkpoint = run_folder.latest_checkpoint(run_dir)
    if checkpoint is None:
        return None
    try:
        refusal = hf_refusal(read_model_config(checkpoint))
        if refusal is not None:  # the plan said so: an outcome, not a warning, and no weights read
            print(f"final model: not logged to MLflow ({checkpoint.name}): {refusal}", flush=True)
            return None
        from mlflow import MlflowClient  # heavy

        tags = MlflowClient(tracking_uri=uri).get_run(run_id).data.tags
        if tags.get(keys.MODEL_STEP) == str(checkpoint_step(checkpoint)) and keys.MODEL_URI in tags:
            print(f"final model: {tags[keys.MODEL_URI]} ({checkpoint.name}), already in MLflow run {run_id}")
            return tags[keys.MODEL_URI]
        model = load_checkpoint_model(checkpoint).eval()
        with tempfile.TemporaryDirectory(prefix="vitscale-model-") as tmp:
            folder = save_hf(model, Path(tmp) / "hf", class_names(checkpoint, model.config.num_classes))
            model_uri = log_hf_model(folder, run_id, uri, step=checkpoint_step(checkpoint), source=checkpoint)
    except Exception as error:  # noqa: BLE001 — it never fails the job
        reason = " ".join(str(error).split())[:400]
        print(
            f"warning: final model not logged to MLflow ({checkpoint.name}): {type(error).__name__}: {reason}",
            file=sys.stderr,
            flush=True,
        )
        return None
    print(f"final model: {model_uri} ({checkpoint.name}, in MLflow run {run_id})", flush=True)
    return model_uri
