"""Where one attempt's seconds went, as training rank 0 saw them: the worker's half of the goodput ledger.

An attempt is one start of `pretrain.train.train_worker` (a Ray Train worker group's life, or one standalone run).
Its `AttemptClock` books every second since ``train_worker`` began into one of four of the ledger's buckets
(`tracking.keys.GOODPUT_BUCKETS`): ``startup`` (config, process group, data, engine build and compile, resume load
and conversion, tracking, a resolution switch's rebuild), ``productive`` (optimizer steps: forward, backward,
update, logging), ``data_wait`` (the step waiting for its batches) and ``checkpoint`` (saves, the step-0 one
included). Rank 0 writes them to ``<run>/goodput/attempt_<n>.json`` (atomically, at every log window and after
every save, and once more when the loop ends), with the cumulative step seconds at each checkpoint it saved (what a
later attempt that resumes from it did not lose), and appends one line per log window to
``attempt_<n>.windows.jsonl`` (its time span, steps and productive seconds: what the eval-interference estimate
compares). The cluster driver turns the attempts, its own timestamps and the evals into the job's ledger
(`cluster.driver.ledger`, docs/goodput.md). Timing only: perf_counter and time.time, no device sync, nothing that
changes what is trained.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from data_pipeline.paths import write_text_atomically

GOODPUT_DIR = "goodput"  # under the run folder
WORKER_BUCKETS = ("startup", "productive", "data_wait", "checkpoint")  # what an attempt books itself


def attempt_path(run_dir: str | Path, attempt: int) -> Path:
    return Path(run_dir) / GOODPUT_DIR / f"attempt_{attempt}.json"


def windows_path(record: Path) -> Path:
    return record.with_name(record.name.removesuffix(".json") + ".windows.jsonl")


class AttemptClock:
    """One attempt's stopwatch (module docstring). Every rank keeps one (each step's time feeds the step-time tails);
    only the clock `open`ed with a path writes. `lap(bucket)` books the time since the previous lap into ``bucket``;
    `step_done` and `after_step` split a training step's time into productive, data wait and checkpoint."""

    def __init__(self) -> None:
        self.started = time.time()  # train_worker's entry, Unix time (the driver's timeline is in Unix time)
        self._mark = time.perf_counter()
        self.seconds = dict.fromkeys(WORKER_BUCKETS, 0.0)
        self.path: Path | None = None
        self.info: dict[str, Any] = {}
        self.checkpoints: list[list[float]] = []  # [step, productive_s, data_wait_s] at each save of this attempt
        self.step = 0
        self._saved_s = 0.0  # the Checkpointer's save seconds already booked
        self._window: dict[str, float] = {}
        self._warned = False

    def open(self, path: Path | None, **info: Any) -> None:
        """Start writing to ``path`` (rank 0; None: never write). ``info``: attempt, world_size, start_step,
        last_step, pid, written into the record as given."""
        self.path, self.info = path, info
        self.step = int(info.get("start_step", 0))
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
        self._new_window()

    def lap(self, bucket: str) -> float:
        """Book the seconds since the previous lap into ``bucket``; returns them."""
        now = time.perf_counter()
        seconds, self._mark = now - self._mark, now
        self.seconds[bucket] += seconds
        return seconds

    def step_done(self, step: int, data_s: float) -> float:
        """Optimizer step ``step`` just returned, having waited ``data_s`` for batches: its wall seconds since the
        previous step's bookkeeping ended (what the step-time tails see; saves are never in it)."""
        seconds = self.lap("productive")
        wait = min(max(data_s, 0.0), seconds)
        self.seconds["productive"] -= wait
        self.seconds["data_wait"] += wait
        self.step = step
        self._window["steps"] += 1
        self._window["productive_s"] += seconds - wait
        return seconds

    def after_step(self, saved_s: float, logged: bool) -> None:
        """After the step's logging and its save, if any: ``saved_s`` is the Checkpointer's cumulative save time
        (a save since the last call is booked as checkpoint, the rest as the step's own). ``logged``: a log window
        ended at this step (the record is rewritten and the window appended)."""
        seconds = self.lap("productive")
        save = min(max(saved_s - self._saved_s, 0.0), seconds)
        self._saved_s = saved_s
        self.seconds["productive"] -= save
        self.seconds["checkpoint"] += save
        self._window["productive_s"] += seconds - save
        if save > 0:
            self.checkpoints.append([self.step, self.seconds["productive"], self.seconds["data_wait"]])
        if logged:
            self._append_window()
        if logged or save > 0:
            self.write()

    def saved_before_loop(self, saved_s: float) -> None:
        """The step-0 save (`Checkpointer.save_baseline`) is done: its time is checkpoint, the rest start-up."""
        self.lap("startup")
        self.seconds["startup"] -= saved_s
        self.seconds["checkpoint"] += saved_s
        self._saved_s = saved_s
        if saved_s > 0:
            self.checkpoints.append([self.step, 0.0, 0.0])
        self._new_window()
        self.write()

    def close(self, outcome: str) -> None:
        """The loop ended (``outcome``: finished, stopped or failed): the remainder is booked and written with the
        end time."""
        self.lap("productive")  # the loop's exit; after a failure, the part of a step it interrupted
        if self._window.get("steps"):
            self._append_window()
        self.write(ended=time.time(), outcome=outcome)

    def record(self, **extra: Any) -> dict[str, Any]:
        return {
            **self.info,
            "started": self.started,
            "updated": time.time(),
            "step": self.step,
            "seconds": dict(self.seconds),
            "checkpoints": self.checkpoints,
            **extra,
        }

    def write(self, **extra: Any) -> None:
        """Atomically replace the record (a reader never sees half of one); a write error warns once, never raises:
        the ledger is bookkeeping, training goes on."""
        if self.path is None:
            return
        try:
            write_text_atomically(self.path, json.dumps(self.record(**extra)))
        except OSError as error:
            self._warn(error)

    def _new_window(self) -> None:
        self._window = {"t0": time.time(), "steps": 0, "productive_s": 0.0}

    def _append_window(self) -> None:
        if self.path is not None:
            line = {**self._window, "t1": time.time(), "step": self.step}
            try:
                with open(windows_path(self.path), "a") as out:
                    out.write(json.dumps(line) + "\n")
            except OSError as error:
                self._warn(error)
        self._new_window()

    def _warn(self, error: OSError) -> None:
        if not self._warned:
            self._warned = True
            print(f"warning: cannot write the goodput record {self.path}: {error}", flush=True)


def read_attempts(run_dir: str | Path) -> list[dict[str, Any]]:
    """Every attempt record of the run, oldest first, each with its log windows under ``windows`` (a record being
    replaced or a line cut short by a crash is skipped)."""
    records = []
    for path in (Path(run_dir) / GOODPUT_DIR).glob("attempt_*.json"):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        windows = []
        try:
            for line in windows_path(path).read_text().splitlines():
                try:
                    windows.append(json.loads(line))
                except ValueError:
                    continue
        except OSError:
            pass
        records.append({**record, "windows": windows})
    return sorted(records, key=lambda r: r.get("started", 0.0))
