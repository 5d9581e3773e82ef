"""Evals after every COMPLETE checkpoint, as Ray tasks on their own resources, never blocking training.

Why an actor rather than Ray Train V2's `ValidationConfig`: our checkpoints are written by `train_worker` itself
into the run folder on shared storage (so a restarted worker group resumes from them with its own resume order),
while `ValidationConfig` only sees checkpoints handed to `ray.train.report(checkpoint=...)` — which would copy
every checkpoint a second time into Ray's storage. With all CPUs taken by workers, validations also queue until
training ends unless they ask for zero CPUs (REFERENCE §7), which on a CPU box means evals fighting training
for cores without Ray knowing. Here, rank 0's `on_checkpoint` hands the folder to this actor (a fire-and-forget
`.remote()` call: training goes on at once); the actor starts `evals.run.run_suite` as a Ray task with the
profile's eval resources (`EvalResources`: e.g. 1 CPU on `local`, whose head advertises one CPU more than the
workers take; a GPU of the eval node group on `a100x64`). Each task logs its metrics to the job's MLflow run
with `step` = the checkpoint step. The driver calls `drain()` after training to wait for what is pending.

A restarted worker group may report the same checkpoint again: each step is evaluated once.
"""

from __future__ import annotations

import time
import traceback
from pathlib import Path
from typing import Any

import ray


def _table_to_metrics(table: Any) -> dict[str, float]:
    """The suite runner's pyarrow table → {metric key: value} (rows with a `metric` and a `value` column)."""
    rows = table.to_pylist() if hasattr(table, "to_pylist") else list(table)
    metrics: dict[str, float] = {}
    for row in rows:
        key, value = row.get("metric"), row.get("value")
        if key is not None and isinstance(value, (int, float)):
            metrics[str(key)] = float(value)
    return metrics


def run_suite_task(
    checkpoint_dir: str, suite: str, data_root: str, run_id: str | None, tracking_uri: str | None
) -> dict[str, Any]:
    """Body of one eval task: run the suite on one checkpoint; return its metrics, or the error as text."""
    started = time.monotonic()
    if not (Path(checkpoint_dir) / "COMPLETE").exists():
        return {
            "error": f"{checkpoint_dir} is gone or incomplete (pruned by checkpoint.keep_last before its eval "
            "ran? raise keep_last)",
            "seconds": 0.0,
        }
    try:
        import torch

        from evals.run import run_suite

        # Eval tasks share the machine with training: stay within the CPUs Ray gave this task.
        torch.set_num_threads(max(1, int(ray.get_runtime_context().get_assigned_resources().get("CPU", 1))))
        table = run_suite(checkpoint_dir, suite, data_root=data_root, mlflow_run_id=run_id, tracking_uri=tracking_uri)
        return {"metrics": _table_to_metrics(table), "seconds": time.monotonic() - started}
    except Exception as exc:  # an eval failure is reported in the summary; it never fails the training job
        return {
            "error": f"{type(exc).__name__}: {exc}",
            "traceback": traceback.format_exc(),
            "seconds": time.monotonic() - started,
        }


@ray.remote(num_cpus=0, max_concurrency=4)
class EvalScheduler:
    """Receives (checkpoint folder, step, training metrics); launches one eval task per new step."""

    def __init__(
        self,
        suite: str | None,
        data_root: str,
        run_id: str | None,
        tracking_uri: str | None,
        num_cpus: float = 1,
        num_gpus: float = 0,
    ):
        self.suite, self.data_root, self.run_id, self.tracking_uri = suite, data_root, run_id, tracking_uri
        self._task = ray.remote(run_suite_task).options(num_cpus=num_cpus, num_gpus=num_gpus, max_retries=1)
        self._pending: dict[int, ray.ObjectRef] = {}
        self._results: dict[int, dict[str, Any]] = {}
        self._train: dict[int, dict[str, float]] = {}
        self._paths: dict[int, str] = {}

    def submit(self, checkpoint_dir: str, step: int, train_metrics: dict[str, float] | None = None) -> bool:
        """Record the checkpoint and start its eval; False if this step was already submitted."""
        self._train[step] = dict(train_metrics or {})
        if step in self._paths:
            return False
        self._paths[step] = checkpoint_dir
        if self.suite:
            self._pending[step] = self._task.remote(
                checkpoint_dir, self.suite, self.data_root, self.run_id, self.tracking_uri
            )
        return True

    def pending(self) -> list[int]:
        return sorted(self._pending)

    def drain(self, timeout_s: float | None = None) -> dict[int, dict[str, Any]]:
        """Wait for every pending eval (up to timeout_s); return {step: {checkpoint, train, evals | error}}."""
        refs = list(self._pending.values())
        if refs:
            ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        for step, ref in list(self._pending.items()):
            ready, _ = ray.wait([ref], timeout=0)
            if ready:
                try:
                    self._results[step] = ray.get(ref)
                except Exception as exc:  # the task itself died (e.g. OOM-killed twice)
                    self._results[step] = {"error": f"eval task failed: {exc}"}
                del self._pending[step]
        summary = {}
        for step in sorted(self._paths):
            result = self._results.get(step, {"error": "still running"} if step in self._pending else {})
            summary[step] = {"checkpoint": self._paths[step], "train": self._train.get(step, {}), **result}
        return summary
