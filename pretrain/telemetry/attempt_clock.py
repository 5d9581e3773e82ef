"""The worker's half of the goodput ledger: `AttemptClock` books each second of a `train_worker` start into
`WORKER_BUCKETS`, as training rank 0 saw it, and rank 0 writes ``<run>/goodput/attempt_<n>.json`` and
``.windows.jsonl`` (docs/goodput.md, "How the ledger is built"). No device sync."""

from __future__ import annotations

import contextlib
import json
import socket
import time
from pathlib import Path
from typing import Any

import psutil  # a Ray dependency

from data_pipeline.paths import write_text_atomically

GOODPUT_DIR = "goodput"  # under the run folder
WORKER_BUCKETS = ("startup", "productive", "data_wait", "checkpoint")


def attempt_path(run_dir: str | Path, attempt: int) -> Path:
    return Path(run_dir) / GOODPUT_DIR / f"attempt_{attempt}.json"


def windows_path(record: Path) -> Path:
    return record.with_name(record.name.removesuffix(".json") + ".windows.jsonl")


class AttemptClock:
    """One attempt's stopwatch; only one `open`ed with a path writes."""

    def __init__(self) -> None:
        self.started = time.time()  # as the driver's timeline
        # the ledger's own: a placement record matched by pid may be another node's process of the same pid
        self.process = {"host": socket.gethostname(), "process_started": psutil.Process().create_time()}
        self._mark = time.perf_counter()
        self.seconds = dict.fromkeys(WORKER_BUCKETS, 0.0)
        self.path: Path | None = None
        self.info: dict[str, Any] = {}
        self.checkpoints: list[list[float]] = []  # [step, productive_s, data_wait_s] per save
        self.step = 0
        self._saved_s = 0.0  # save seconds already booked
        self._window: dict[str, float] = {}
        self._warned = False

    def open(self, path: Path | None, **info: Any) -> None:
        """Write to ``path`` (None: never), ``info`` in the record."""
        self.path, self.info = path, info
        self.step = int(info.get("start_step", 0))
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
        self._new_window()

    def lap(self, bucket: str) -> float:
        """Book and return the seconds since the last lap."""
        now = time.perf_counter()
        seconds, self._mark = now - self._mark, now
        self.seconds[bucket] += seconds
        return seconds

    @property
    def overhead_s(self) -> float:
        """The seconds booked so far to start-up (resolution switches included) and saves: not training."""
        return self.seconds["startup"] + self.seconds["checkpoint"]

    def step_done(self, step: int, data_s: float) -> float:
        """Step ``step`` returned after waiting ``data_s``; returns its seconds."""
        seconds = self.lap("productive")
        wait = min(max(data_s, 0.0), seconds)
        self.seconds["productive"] -= wait
        self.seconds["data_wait"] += wait
        self.step = step
        self._window["steps"] += 1
        self._window["productive_s"] += seconds - wait
        return seconds

    def after_step(self, saved_s: float, logged: bool) -> None:
        """After the step's logging and save; ``saved_s``: cumulative save time; ``logged``: a window ended."""
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
        """The step-0 save is done: its time is checkpoint, the rest startup."""
        self.lap("startup")
        self.seconds["startup"] -= saved_s
        self.seconds["checkpoint"] += saved_s
        self._saved_s = saved_s
        if saved_s > 0:
            self.checkpoints.append([self.step, 0.0, 0.0])
        self._new_window()
        self.write()

    def close(self, outcome: str) -> None:
        """The loop ended (``outcome``: finished, stopped or failed)."""
        self.lap("productive")  # after a failure, the interrupted step
        if self._window.get("steps"):
            self._append_window()
        self.write(ended=time.time(), outcome=outcome)

    def record(self, **extra: Any) -> dict[str, Any]:
        return {
            **self.info,
            **self.process,
            "started": self.started,
            "updated": time.time(),
            "step": self.step,
            "seconds": dict(self.seconds),
            "checkpoints": self.checkpoints,
            **extra,
        }

    def write(self, **extra: Any) -> None:
        """Atomically replace the record; an error warns once, never raises."""
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
    """The run's attempt records with ``windows``, oldest first; unreadable ones skipped."""
    records = []
    for path in (Path(run_dir) / GOODPUT_DIR).glob("attempt_*.json"):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        windows = []
        with contextlib.suppress(OSError):
            for line in windows_path(path).read_text().splitlines():
                with contextlib.suppress(ValueError):
                    windows.append(json.loads(line))
        records.append({**record, "windows": windows})
    return sorted(records, key=lambda r: r.get("started", 0.0))
