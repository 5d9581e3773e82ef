"""What a job leaves in its run folder beyond the checkpoints: where each worker ran (`workers/*.json`), and at the
end, `summary.json` (status, restarts, resizes, every checkpoint's eval metrics) with the summary table printed, the
final model logged to the MLflow run, the goodput ledger printed and logged (`cluster.driver.ledger`) and the run closed
(`finish_job`)."""

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

from cluster.driver.ledger import JobClock, current_ledger, eval_spans, finish_ledger
from cluster.driver.summary import format_resizes, format_summary
from pretrain.checkpoint import run_folder
from pretrain.checkpoint.run_folder import prune_checkpoints, release_pins
from pretrain.weights.export import checkpoint_step, class_names, save_hf
from pretrain.weights.formats import load_checkpoint_model
from tracking import keys
from tracking.models import log_hf_model
from tracking.runs import finish_run
from tracking.tracker import Tracker


def record_placement(run_dir: Path, rank: int, world_size: int) -> None:
    """`<run_dir>/workers/rank<r>-pid<pid>.json`: where each attempt of each rank ran (node, pid, time, Ray job,
    world size)."""
    import socket

    import psutil  # a Ray dependency
    import ray  # heavy: only the driver and cluster commands need Ray

    folder = run_dir / "workers"
    folder.mkdir(parents=True, exist_ok=True)
    ctx = ray.get_runtime_context()
    record = {
        "rank": rank,
        "pid": os.getpid(),
        "node_id": ctx.get_node_id(),
        "hostname": socket.gethostname(),
        "started": time.time(),
        "process_started": psutil.Process().create_time(),  # before it: Ray placing the group (the goodput ledger)
        "job_id": ctx.get_job_id(),
        "world_size": world_size,
        "niceness": os.getpriority(os.PRIO_PROCESS, 0),  # 0: the job's priority (driver.worker_env), not Ray's 15
    }
    (folder / f"rank{rank}-pid{os.getpid()}.json").write_text(json.dumps(record))


def count_restarts(placements: list[dict[str, Any]]) -> int:
    """Worker-group restarts after a failure, from a run's placement records: every attempt's rank 0 writes one,
    so the attempts of a Ray job beyond its first are restarts (summed over the jobs that continued the run) —
    except those at a larger world size than the attempt before: an elastic group growing into returned capacity,
    which Ray does without a failure."""
    attempts = Counter(p.get("job_id") for p in placements if p.get("rank") == 0)
    grown = 0
    for job in attempts:
        sizes = [p.get("world_size") for p in _rank0_attempts(placements, job)]
        grown += sum(1 for a, b in zip(sizes, sizes[1:]) if a is not None and b is not None and b > a)
    return sum(n - 1 for n in attempts.values()) - grown


def _rank0_attempts(placements: list[dict[str, Any]], job_id: str | None) -> list[dict[str, Any]]:
    rank0 = [p for p in placements if p.get("rank") == 0 and p.get("job_id") == job_id]
    return sorted(rank0, key=lambda p: p.get("started", 0))


@dataclass(frozen=True)
class JobEnd:
    """How training ended, as the driver saw it, and what its goodput ledger needs (`cluster.driver.ledger`)."""

    status: str  # MLflow's: FINISHED or FAILED
    train_seconds: float
    evals: dict[int, dict[str, Any]]  # the eval scheduler's results by checkpoint step
    clock: JobClock | None = None  # the job's start and when it asked for workers; None: no ledger
    evals_shared: bool = False  # evals ran on the training cores (`evals_share_training_cores`)
    plan: dict[str, Any] = field(default_factory=dict)  # the job's plan (its predicted data wait, if any)


def finish_job(run_dir: Path, keep_last: int, uri: str, run_id: str, end: JobEnd) -> None:
    """Step 4 of the driver: prune what pins kept, print the summary, write `summary.json`, close the MLflow run."""
    train_result = {}
    if (run_dir / "train_result.json").exists():  # rank 0's train_worker summary (steps, loss, where it resumed)
        train_result = json.loads((run_dir / "train_result.json").read_text())
    # The job ends here: an eval still running past the timeout dies with it, so no pin needs to outlive it, and
    # the checkpoints pins kept beyond checkpoint.keep_last go now.
    release_pins(run_dir)
    pruned = prune_checkpoints(run_dir, keep_last)
    print(format_summary(end.evals), flush=True)
    workers = [json.loads(p.read_text()) for p in sorted((run_dir / "workers").glob("*.json"))]
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
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    tracker = Tracker(uri, run_id, rank=0)
    # vitscale.resizes and vitscale.world_sizes are set by train_worker's rank 0 at every start, from the same history.
    tracker.set_tags({keys.RESTARTS: restarts})
    tracker.log_artifact(str(run_dir / "summary.json"))
    if end.status == "FINISHED":
        log_final_model(run_dir, uri, run_id)
    if end.clock is not None:  # last: the job's wall-clock ends when its ledger closes
        try:
            ledger = current_ledger(run_dir, end.clock, time.time(), eval_spans(end.evals), end.evals_shared)
            step = ledger.step or int(train_result.get("steps") or 0)  # the job's own newest step
            print(finish_ledger(run_dir, ledger, end.plan, tracker, step), flush=True)
        except Exception as error:  # noqa: BLE001 — bookkeeping; the job's outcome stays training's
            print(f"warning: no goodput ledger: {type(error).__name__}: {error}", file=sys.stderr, flush=True)
    tracker.close()
    finish_run(uri, run_id, end.status)


def log_final_model(run_dir: Path, uri: str, run_id: str) -> str | None:
    """The run's newest checkpoint, exported to an HF folder and logged as the run's MLflow model
    (`tracking.models.log_hf_model`); its URI, or None. Never raises: a model HF cannot hold (pre-logits, gap,
    hybrid), a missing transformers or a store that fails is one warning line, and the job's outcome stays
    training's. Costs one load and one write of the weights, plus MLflow's check that the logged model loads."""
    checkpoint = run_folder.latest_checkpoint(run_dir)
    if checkpoint is None:
        return None
    try:
        model = load_checkpoint_model(checkpoint).eval()
        with tempfile.TemporaryDirectory(prefix="vitscale-model-") as tmp:
            folder = save_hf(model, Path(tmp) / "hf", class_names(checkpoint, model.config.num_classes))
            model_uri = log_hf_model(folder, run_id, uri, step=checkpoint_step(checkpoint), source=checkpoint)
    except Exception as error:  # noqa: BLE001 — the model in MLflow is a convenience; it never fails the job
        reason = " ".join(str(error).split())[:400]
        print(
            f"warning: final model not logged to MLflow ({checkpoint.name}): {type(error).__name__}: {reason}",
            file=sys.stderr,
            flush=True,
        )
        return None
    print(f"final model: {model_uri} ({checkpoint.name}, in MLflow run {run_id})", flush=True)
    return model_uri
