"""Evals after every COMPLETE checkpoint, as Ray tasks on their own resources, never blocking training.

Why an actor rather than Ray Train V2's `ValidationConfig`: our checkpoints are written by `train_worker` itself
into the run folder on shared storage (so a restarted worker group resumes from them with its own resume order),
while `ValidationConfig` only sees checkpoints handed to `ray.train.report(checkpoint=...)` — which would copy
every checkpoint a second time into Ray's storage. With all CPUs taken by workers, validations also queue until
training ends unless they ask for zero CPUs (docs/reference.md §7), which on a CPU box means evals fighting training
for cores without Ray knowing. Here, rank 0's `on_checkpoint` hands the folder to this actor (a fire-and-forget
`.remote()` call: training goes on at once); the actor starts `evals.run.run_suite` as a Ray task with the
profile's eval resources (`EvalResources`: e.g. 1 CPU on `local`, whose head advertises one CPU more than the
workers take; a GPU of the eval node group on `a100x64`). Each task logs its metrics to the job's MLflow run
with `step` = the checkpoint step. The driver calls `drain()` after training to wait for what is pending.

A restarted worker group may report the same checkpoint again: each step is evaluated once. Step 0 (the weights
before the first update, `evals.baseline`) comes like any other checkpoint and is logged at MLflow step 0.

Pins: `checkpoint.keep_last` must not delete a checkpoint whose eval has not run yet. Rank 0 pins each checkpoint
(`pretrain.checkpoint.run_folder.pin_checkpoint`, a file in its folder) right after saving it, before any later save can
prune; the pin is released when its eval ends — by the eval task (in a `finally`), or by this actor when it sees
the task finished or died — and the next prune (or the driver's, after `drain`) deletes it. Pins stay bounded:
at most `max_pinned` checkpoints wait for evals at once — when evals fall that far behind training, the eval of
a new checkpoint is skipped (said in the summary) rather than letting pinned checkpoints fill the disk — and the
driver clears what a job leaves behind (at its end, and a dead job's at the next start).

Failures: an eval task killed (out of memory, a lost node) is run once more by Ray's task retry (`max_retries=1`);
an eval that fails for good — an exception in the suite, a damaged checkpoint the evals refuse, a task killed twice,
one skipped (too many waiting), or one still running when the job's end has waited `evals.timeout_s` (`drain`; it
is cancelled then) — is recorded in the MLflow run as failed for that checkpoint: the metric `eval_failed/<suite>`
= 1 at its step, the reason in the artifact `eval_failures/step_XXXXXXXX.txt` (also kept in the run folder), and
the tag `vitscale.eval_failures` counting them. Training never waits for an eval: the scheduler only hears of
checkpoints (fire-and-forget), and nothing an eval does reaches the training workers.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray

from pretrain.checkpoint.run_folder import unpin_checkpoint
from tracking import keys
from tracking.tracker import Tracker

# Checkpoints kept (pinned) for evals that have not ended, at most: beyond this, evals are skipped.
MAX_PINNED = 8


def run_suite_task(
    checkpoint_dir: str, suite: str, data_root: str, run_id: str | None, tracking_uri: str | None
) -> dict[str, Any]:
    """Body of one eval task (`cluster.driver.eval_task.run_suite_task`), imported here, in the task's own process: the
    scheduler actor only submits this function, so it never imports torch and the evals (3.5 of its 4.7 CPU-s)."""
    from cluster.driver import eval_task  # deferred on purpose (docstring; docs/design.md, "Imports go at the top")

    return eval_task.run_suite_task(checkpoint_dir, suite, data_root, run_id, tracking_uri)


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
        max_pinned: int = MAX_PINNED,
        task: Callable[..., dict[str, Any]] = run_suite_task,  # the body of an eval task (tests pass a stand-in)
    ):
        self.suite, self.data_root, self.run_id, self.tracking_uri = suite, data_root, run_id, tracking_uri
        self.max_pinned = max_pinned
        # A task whose process dies (killed, out of memory) runs once more; an exception is returned, not retried.
        self._task = ray.remote(task).options(num_cpus=num_cpus, num_gpus=num_gpus, max_retries=1)
        self._tracker = Tracker(tracking_uri, run_id, rank=0)  # failures only: each eval task logs its own metrics
        self._failures = 0
        self._lock = threading.Lock()  # submit / drain / pending may run concurrently (threaded actor)
        self._pending: dict[int, ray.ObjectRef] = {}  # steps whose eval has not ended: their checkpoints are pinned
        self._results: dict[int, dict[str, Any]] = {}
        self._train: dict[int, dict[str, float]] = {}
        self._paths: dict[int, str] = {}

    def submit(self, checkpoint_dir: str, step: int, train_metrics: dict[str, float] | None = None) -> bool:
        """Record the checkpoint and start its eval; False if this step was already submitted.

        Training rank 0 pinned the checkpoint before calling; the pin stays while its eval is pending, and is
        released at once otherwise (step seen before, no suite, or its eval skipped: `max_pinned` already waiting).
        """
        with self._lock:
            self._collect(timeout_s=0)
            self._train[step] = dict(train_metrics or {})
            if step in self._paths:
                if step not in self._pending:  # its eval already ended: nothing needs this folder any more
                    unpin_checkpoint(checkpoint_dir)
                return False
            self._paths[step] = checkpoint_dir
            if not self.suite:
                unpin_checkpoint(checkpoint_dir)
                return True
            if len(self._pending) >= self.max_pinned:
                unpin_checkpoint(checkpoint_dir)
                self._fail(
                    step,
                    {
                        "error": f"eval skipped: the evals of {len(self._pending)} checkpoints were still waiting or "
                        f"running (their checkpoints pinned; at most {self.max_pinned}). Evals are slower than "
                        "checkpointing: give them more resources (the profile's evals section) or raise "
                        "checkpoint.every_steps"
                    },
                )
                return True
            self._pending[step] = self._task.remote(
                checkpoint_dir, self.suite, self.data_root, self.run_id, self.tracking_uri
            )
            return True

    def pending(self) -> list[int]:
        """Steps whose eval has not ended (their checkpoints are pinned)."""
        with self._lock:
            self._collect(timeout_s=0)
            return sorted(self._pending)

    def _collect(self, timeout_s: float | None) -> None:
        """Move finished evals (up to timeout_s waiting) to the results and release their pins; caller holds _lock.

        The task unpins its checkpoint itself; this covers a task that died (e.g. OOM-killed twice) and so never
        reached its `finally`.
        """
        refs = list(self._pending.values())
        if not refs:
            return
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        done = set(done)
        for step, ref in list(self._pending.items()):
            if ref not in done:
                continue
            try:
                self._results[step] = ray.get(ref)
            except Exception as exc:  # the task itself died twice (e.g. OOM-killed), beyond Ray's one retry
                self._results[step] = {"error": f"eval task failed: {type(exc).__name__}: {exc}"}
            del self._pending[step]
            unpin_checkpoint(self._paths[step])
            if "error" in self._results[step]:
                self._fail(step, self._results[step])

    def _fail(self, step: int, result: dict[str, Any]) -> None:
        """Record an eval that failed for good: its result here, and in MLflow (module docstring); caller holds
        _lock."""
        self._results[step] = result
        self._failures += 1
        suite = Path(self.suite).stem if self.suite else "evals"  # a suite given as a YAML path: its file name
        reason = f"step {step}: {result['error']}\n\n{result.get('traceback', '')}".rstrip() + "\n"
        self._tracker.log_metrics({keys.eval_failed(suite): 1.0}, step=step)
        self._tracker.set_tags({keys.EVAL_FAILURES: self._failures})
        folder = Path(self._paths[step]).parent.parent / keys.EVAL_FAILURES_DIR  # <run_dir>/eval_failures
        try:
            folder.mkdir(parents=True, exist_ok=True)
            (folder / f"step_{step:08d}.txt").write_text(reason)
            self._tracker.log_artifact(str(folder / f"step_{step:08d}.txt"), keys.EVAL_FAILURES_DIR)
        except OSError as error:  # a full disk: the metric and the summary still say it failed
            print(f"eval scheduler: could not write the reason of step {step}'s failure: {error}", flush=True)

    def drain(self, timeout_s: float | None = None) -> dict[int, dict[str, Any]]:
        """Wait for every pending eval (up to timeout_s; the job's end passes `evals.timeout_s`); those still running
        then are cancelled and recorded as failed. Returns {step: {checkpoint, train, metrics | error}}."""
        with self._lock:
            refs = list(self._pending.values())
        if refs:  # wait outside the lock: a late submit from training must not block behind the wait
            ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        with self._lock:
            self._collect(timeout_s=0)
            for step, ref in list(self._pending.items()):
                ray.cancel(ref, force=True)  # the job ends: its worker process goes now, not with the job
                del self._pending[step]
                unpin_checkpoint(self._paths[step])
                self._fail(
                    step,
                    {
                        "error": f"eval still running when the job's end had waited {timeout_s} s for "
                        "evals (evals.timeout_s); cancelled. Raise evals.timeout_s, or give evals more "
                        "resources (the profile's evals section)"
                    },
                )
            self._tracker.flush(timeout=60)
            summary = {}
            for step in sorted(self._paths):
                result = self._results.get(step, {})
                summary[step] = {"checkpoint": self._paths[step], "train": self._train.get(step, {}), **result}
            return summary
