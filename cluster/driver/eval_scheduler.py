"""Evals after COMPLETE checkpoints, as Ray tasks on their own resources, never blocking training (docs/design.md,
"Evals after every checkpoint" and "Checkpoint pins")."""

from __future__ import annotations

import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray
import yaml

from cluster.plan.evals.cadence import MAX_PINNED, EvalCadence
from data_pipeline.paths import SUITES_DIR
from pretrain.checkpoint.run_folder import TrainerState, is_complete, parse_step, pinned_checkpoints, unpin_checkpoint
from tracking import keys
from tracking.runs import RUN_RECORD
from tracking.tracker import Tracker

CLOSE_TIMEOUT_S = 60.0  # the drain's close of the scheduler's Tracker, at most (less while MLflow fails)


def run_suite_task(
    checkpoint_dir: str, suite: str | tuple[str, ...], data_root: str, run_id: str | None, tracking_uri: str | None
) -> dict[str, Any]:
    """`eval_task.run_suite_task`; several suites run as one (`merged_suite`)."""
    from cluster.driver import eval_task  # in the task's process only

    if isinstance(suite, str):
        return eval_task.run_suite_task(checkpoint_dir, suite, data_root, run_id, tracking_uri)
    with tempfile.TemporaryDirectory() as folder:
        merged = str(merged_suite(suite, Path(folder)))
        return eval_task.run_suite_task(checkpoint_dir, merged, data_root, run_id, tracking_uri)


def merged_suite(suites: tuple[str, ...], folder: Path) -> Path:
    """A suite YAML in ``folder`` named ``a+b`` with the evaluators of ``suites`` (names or YAML paths) in order."""
    evaluators = []
    for name in suites:
        path = Path(name) if Path(name).suffix in (".yaml", ".yml") else SUITES_DIR / f"{name}.yaml"
        evaluators += yaml.safe_load(path.read_text()).get("evaluators") or []
    name = "+".join(Path(s).stem for s in suites)
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump({"name": name, "evaluators": evaluators}, sort_keys=False))
    return path


def task_options(
    num_cpus: float, num_gpus: float, memory_gb: float, resources: dict[str, float] | None = None
) -> dict[str, Any]:
    """A task whose process dies runs once more; ``resources``: the eval node group's (`EvalResources.node_resources`),
    so that it never takes a training node's GPU."""
    options: dict[str, Any] = {"num_cpus": num_cpus, "num_gpus": num_gpus, "max_retries": 1}
    if memory_gb > 0:
        options["memory"] = int(memory_gb * 1e9)
    if resources:
        options["resources"] = dict(resources)
    return options


@ray.remote(num_cpus=0, max_concurrency=4)
class EvalScheduler:
    """A zero-CPU actor on the driver's node; rank 0 submits each checkpoint fire-and-forget."""

    def __init__(
        self,
        suites: EvalCadence | str | None,  # a suite name: that suite at every checkpoint
        data_root: str,
        run_id: str | None,
        tracking_uri: str | None,
        num_cpus: float = 1,
        num_gpus: float = 0,
        max_pinned: int = MAX_PINNED,
        task: Callable[..., dict[str, Any]] = run_suite_task,  # tests pass a stand-in
        memory_gb: float = 0,
        run_dir: str | None = None,  # where `catch_up` looks; None: it finds nothing
        resources: dict[str, float] | None = None,  # the eval node group's custom resource, where there is one
    ):
        if not isinstance(suites, EvalCadence):
            suites = EvalCadence(((suites, 1),) if suites else ())
        self.cadence, self.data_root, self.run_id, self.tracking_uri = suites, data_root, run_id, tracking_uri
        self.max_pinned = max_pinned
        self._task = ray.remote(task).options(**task_options(num_cpus, num_gpus, memory_gb, resources))
        # Failures and skips. What MLflow has not taken when `drain` closes it waits in the run folder's spool (a
        # pending run's, or the one its record names), for the job's end or its courier to send.
        record = Path(run_dir) / RUN_RECORD if run_dir else None
        self._tracker = Tracker(tracking_uri, run_id, rank=0, record=record)
        self._tracker.connect_in_background()
        self._failures = self._skips = 0
        self._lock = threading.Lock()  # a threaded actor
        self._pending: dict[int, ray.ObjectRef] = {}  # pinned
        self._results: dict[int, dict[str, Any]] = {}
        self._train: dict[int, dict[str, float]] = {}
        self._paths: dict[int, str] = {}
        self._due: dict[int, tuple[str, ...]] = {}
        self._run_dir = run_dir

    def submit(self, checkpoint_dir: str, step: int, train_metrics: dict[str, float] | None = None) -> bool:
        """False if this step was already submitted. The caller's pin stays while the eval is pending."""
        with self._lock:
            self._collect(timeout_s=0)
            self._train[step] = dict(train_metrics or {})
            if step in self._paths:
                if step not in self._pending:
                    unpin_checkpoint(checkpoint_dir)
                return False
            self._paths[step] = checkpoint_dir
            due = self._due[step] = self.cadence.due(step)
            if not due:
                unpin_checkpoint(checkpoint_dir)
                return True
            # The last step is never skipped: every suite evaluates it, and no checkpoint comes after its pin.
            if len(self._pending) >= self.max_pinned and step != self.cadence.last_step:
                unpin_checkpoint(checkpoint_dir)
                self._fail(
                    step,
                    {
                        "error": f"eval skipped: the evals of {len(self._pending)} checkpoints were still waiting or "
                        f"running (their checkpoints pinned; at most {self.max_pinned}). Evals are slower than "
                        "checkpointing: give them more resources (the profile's evals section), or raise their "
                        "cadence (evals.every, evals.extra_suites[].every) or checkpoint.every_steps",
                        "skipped": True,
                    },
                )
                return True
            suite = due[0] if len(due) == 1 else due
            self._pending[step] = self._task.remote(
                checkpoint_dir, suite, self.data_root, self.run_id, self.tracking_uri
            )
            return True

    def catch_up(self) -> list[int]:
        """Submit the pinned COMPLETE checkpoints not yet submitted; returns the steps due for evals. Rank 0 calls it
        at every start of the worker group. A save pins its checkpoint before COMPLETE when evals are due on it, so a
        pin nobody submitted is a hand-over lost: a worker group (Ray Train regrowing it, a lost node) or a whole job
        stopped between the save and rank 0's `submit`, and training resumes from that checkpoint without saving it
        again."""
        if self._run_dir is None:
            return []
        caught = []
        for folder in pinned_checkpoints(self._run_dir):
            step = parse_step(folder.name)
            with self._lock:
                if step is None or step in self._paths or not is_complete(folder):
                    continue
            try:
                metrics = TrainerState.read(folder).metrics
            except (OSError, ValueError):
                metrics = {}
            if self.submit(str(folder), step, metrics) and self._due.get(step):
                caught.append(step)
        return caught

    def pending(self) -> list[int]:
        with self._lock:
            self._collect(timeout_s=0)
            return sorted(self._pending)

    def _collect(self, timeout_s: float | None) -> None:
        """Move finished evals to the results and unpin them; caller holds _lock."""
        refs = list(self._pending.values())
        if not refs:
            return
        done = set(ray.wait(refs, num_returns=len(refs), timeout=timeout_s)[0])
        for step, ref in [(s, r) for s, r in self._pending.items() if r in done]:
            try:
                self._results[step] = ray.get(ref)
            except Exception as exc:
                self._results[step] = {"error": f"eval task failed: {type(exc).__name__}: {exc}"}
            del self._pending[step]
            unpin_checkpoint(self._paths[step])
            if "error" in self._results[step]:
                self._fail(step, self._results[step])

    def _fail(self, step: int, result: dict[str, Any]) -> None:
        """Record an eval that failed for good or was skipped; caller holds _lock."""
        self._results[step] = result
        suites = [Path(s).stem for s in self._due.get(step, ())] or ["evals"]
        reason = f"step {step}: {result['error']}\n\n{result.get('traceback', '')}".rstrip() + "\n"
        if result.get("skipped"):
            self._skips += 1
            self._tracker.log_metrics({keys.eval_skipped(suite): 1.0 for suite in suites}, step=step)
            self._tracker.set_tags({keys.EVAL_SKIPPED: self._skips})
        else:
            self._failures += 1
            self._tracker.log_metrics({keys.eval_failed(suite): 1.0 for suite in suites}, step=step)
            self._tracker.set_tags({keys.EVAL_FAILURES: self._failures})
        path = Path(self._paths[step]).parent.parent / keys.EVAL_FAILURES_DIR / f"step_{step:08d}.txt"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(reason)
            self._tracker.log_artifact(str(path), keys.EVAL_FAILURES_DIR)
        except OSError as error:
            print(f"eval scheduler: could not write the reason of step {step}'s failure: {error}", flush=True)

    def _by_hand(self, step: int) -> str:
        """The command that scores ``step``'s checkpoint into the run, while retention keeps it (keep_last)."""
        suites = self._due.get(step) or ("SUITE",)
        uri = f" --tracking-uri {self.tracking_uri}" if self.tracking_uri else ""  # else the project's store
        run = f" --mlflow-run-id {self.run_id}{uri}" if self.run_id else ""
        command = (
            f"python -m evals.run --checkpoint {self._paths[step]} --suite {suites[0]} --data-root {self.data_root}"
        )
        each = f" (once per suite: {', '.join(suites)})" if len(suites) > 1 else ""
        return f"while the checkpoint is kept, `{command}{run}` scores it{each}"

    def drain(self, timeout_s: float | None = None) -> dict[int, dict[str, Any]]:
        """Wait up to timeout_s, then cancel; {step: {checkpoint, train, metrics | error}}. The job's end: the
        scheduler's Tracker is closed, what MLflow did not take left in the spool; later failures reach no run."""
        with self._lock:
            refs = list(self._pending.values())
        if refs:  # outside the lock: a late submit must not block behind the wait
            ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        with self._lock:
            self._collect(timeout_s=0)
            for step, ref in list(self._pending.items()):
                ray.cancel(ref, force=True)  # its process goes now, not with the job
                del self._pending[step]
                unpin_checkpoint(self._paths[step])
                self._fail(
                    step,
                    {
                        "error": f"eval still running when the job's end had waited {timeout_s} s for "
                        "evals (evals.timeout_s); cancelled. Raise evals.timeout_s, or give evals more "
                        f"resources (the profile's evals section); {self._by_hand(step)}"
                    },
                )
            self._tracker.close(timeout=CLOSE_TIMEOUT_S)  # the actor dies with the job: no atexit close
            return {
                step: {"checkpoint": path, "train": self._train.get(step, {}), **self._results.get(step, {})}
                for step, path in sorted(self._paths.items())
            }
