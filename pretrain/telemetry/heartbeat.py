"""A rank's progress report, `<run_dir>/heartbeats/rank<r>.json`, read by the driver's hang watchdog
(docs/elastic.md, "Faults"; docs/design.md, "Rank heartbeats").

Atomic writes, at most one a second but at once on a phase change. A record: the driver's identity, pid,
``started``, ``time``, ``step``, ``phase`` (``start`` | ``step`` | ``checkpoint`` | ``switch`` | ``done``),
``step_s`` (median over the last `WINDOW` steps, saves excluded), ``data_s`` (mean batch wait), ``save_s`` (the
longest save so far) and ``data`` (the stream's counters).
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections import deque
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from data_pipeline.cli import to_stderr
from data_pipeline.paths import write_text_atomically

HEARTBEAT_DIR = "heartbeats"  # under the run folder
WINDOW = 20  # steps behind step_s and data_s


def heartbeat_path(run_dir: Path, rank: int) -> Path:
    return Path(run_dir) / HEARTBEAT_DIR / f"rank{rank}.json"


def read_heartbeats(run_dir: Path) -> list[dict[str, Any]]:
    """Every rank's latest record; unreadable ones skipped."""
    records = []
    for path in sorted((Path(run_dir) / HEARTBEAT_DIR).glob("rank*.json")):
        try:
            records.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    return records


class Heartbeat:
    """Writes one rank's record; with ``path`` None, nothing."""

    def __init__(self, path: Path | None, identity: Mapping[str, Any] | None = None, min_interval_s: float = 1.0):
        self.path, self.min_interval_s = path, min_interval_s
        self.record: dict[str, Any] = {**(identity or {}), "pid": os.getpid(), "started": time.time(), "step": 0}
        self.every_steps, self.last_step = 0, 0
        self._written = -float("inf")
        self._warned = False
        self._last_step_at: float | None = None  # previous step's end, unless a save or switch came since
        self._stepped = False  # before the first step, a save is part of the start
        self._save_began: float | None = None
        self._steps: deque[float] = deque(maxlen=WINDOW)
        self._waits: deque[float] = deque(maxlen=WINDOW)
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
        self._write("start", force=True)

    def for_run(self, last_step: int, every_steps: int) -> Heartbeat:
        """Set the save cadence: a step before a save reports ``checkpoint``."""
        self.last_step, self.every_steps = last_step, every_steps
        return self

    def step(self, step: int, data_s: float, data: Mapping[str, int]) -> None:
        """Step ``step`` is done after waiting ``data_s``; ``data``: the stream's counters."""
        now, self._stepped = time.monotonic(), True
        if self._last_step_at is not None:
            self._steps.append(now - self._last_step_at)
            self._waits.append(data_s)
        saving = bool(self.every_steps) and (step % self.every_steps == 0 or step == self.last_step)
        self._last_step_at = None if saving else now
        self._save_began = now if saving else None
        self.record.update(step=step, data={k: int(v) for k, v in data.items()})
        if self._steps:
            self.record.update(step_s=statistics.median(self._steps), data_s=statistics.fmean(self._waits))
        self._write("checkpoint" if saving else "step", force=saving)

    def busy(self, what: str) -> None:
        """Something long starts (``switch``: a resolution switch)."""
        self._last_step_at = self._save_began = None
        self._write(what, force=True)

    def saved(self) -> None:
        """The save ended: back to the step's (or, before the first step, the start's) allowance."""
        now = time.monotonic()
        if self._save_began is not None:
            self.record["save_s"] = max(self.record.get("save_s", 0.0), now - self._save_began)
        self._last_step_at, self._save_began = (now if self._stepped else None), None
        self._write("step" if self._stepped else "start", force=True)

    def end(self) -> None:
        """The loop ended: what follows is no hang."""
        self._write("done", force=True)

    def _write(self, phase: str, force: bool) -> None:
        now = time.monotonic()
        changed = phase != self.record.get("phase")
        if self.path is None or not (force or changed or now - self._written >= self.min_interval_s):
            return
        self.record.update(phase=phase, time=time.time())
        text = json.dumps(self.record)
        try:
            write_text_atomically(self.path, text)
            self._written = now
        except OSError:
            # disk full: rewriting in place needs no new block (a reader may skip it half-written)
            try:
                with open(self.path, "r+") as out:
                    out.write(text)
                    out.truncate()
                self._written = now
            except OSError as error:  # training goes on; the watchdog sees an older record
                if not self._warned:
                    self._warned = True
                    to_stderr(f"warning: cannot write the heartbeat {self.path}: {error}")
