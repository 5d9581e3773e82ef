"""One eval task: run the suite on one checkpoint; imported only in the task's process."""

from __future__ import annotations

import time
import traceback
from typing import Any

import ray
import torch

from evals.evaluator import mlflow_metrics
from evals.runner import run_suite
from pretrain.checkpoint.run_folder import is_complete, unpin_checkpoint


def task_device(assigned: dict[str, float], cuda_available: bool) -> str:
    """``cuda`` when Ray gave the task a GPU, else ``cpu``; RuntimeError when torch cannot use that GPU."""
    if assigned.get("GPU", 0) <= 0:
        return "cpu"
    if not cuda_available:
        raise RuntimeError(
            "Ray gave this eval task a GPU but torch sees no CUDA device (a CPU build of torch on the eval nodes?); "
            "install a CUDA build there, or set evals.num_gpus: 0 in the profile to evaluate on CPUs"
        )
    return "cuda"


def run_suite_task(
    checkpoint_dir: str, suite: str, data_root: str, run_id: str | None, tracking_uri: str | None
) -> dict[str, Any]:
    """{metrics | error (+ traceback), seconds, started}; never raises. Unpins the checkpoint once it has an outcome,
    not when its process is stopped (Ray's SIGTERM is a SystemExit: the job was stopped, and its next job runs it)."""
    started, began = time.monotonic(), time.time()
    try:
        if not is_complete(checkpoint_dir):
            unpin_checkpoint(checkpoint_dir)
            return {
                "error": f"{checkpoint_dir} is gone or incomplete although pinned for this eval: deleted by hand, "
                "or by another job writing the same run folder",
                "seconds": 0.0,
                "started": began,
            }
        resources = ray.get_runtime_context().get_assigned_resources()
        torch.set_num_threads(max(1, int(resources.get("CPU", 1))))
        device = task_device(resources, torch.cuda.is_available())
        table = run_suite(
            checkpoint_dir, suite, data_root=data_root, mlflow_run_id=run_id, tracking_uri=tracking_uri, device=device
        )
        outcome = {"metrics": mlflow_metrics(table.to_pylist())}
    except Exception as exc:
        outcome = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    unpin_checkpoint(checkpoint_dir)
    return outcome | {"seconds": time.monotonic() - started, "started": began}
