"""A rank's progress report: `<run_dir>/heartbeats/rank<r>.json`, rewritten as training goes, read by the driver's
watchdog (`cluster.driver.watchdog`) to find a rank that stopped making progress without dying.

Why a file, not a Ray actor or a collective: the run folder is already on storage every node and the driver share,
a write costs ~0.1 ms on a local disk, and a rank that hangs (stopped, stuck in a collective or a read) cannot answer
a call anyway: the watchdog only needs to see when the file stopped changing. A file also survives the process and
names its pid and node, so the watchdog can signal exactly that process. Writes are atomic (a temporary file
renamed over the old one) and at most one a second, except when the phase changes (before a checkpoint save or a
resolution switch, which are legitimately long, and back to training after it), so the watchdog always knows
which allowance applies.

Each record: rank, world size, pid, host, node (the identity the driver gave), ``started`` (when this process began
the attempt), ``time`` (of this write), ``step`` (optimizer steps done), ``phase`` (``start`` until the first step is
done, ``step``, ``checkpoint`` or ``switch`` while one is in progress, ``done`` once the loop has ended),
``step_s`` (median seconds per step over the last steps, saves excluded), ``data_s`` (mean seconds per step this
rank waited for batches, same steps), ``save_s`` (the longest checkpoint save of this attempt so far, from the
report before it to the one after it; absent until one ended: the watchdog's save allowance follows it) and
``data`` (the stream's cumulative counters: read retries and failures, damaged samples; `data_pipeline.stream.shards`).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from collections import deque
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from data_pipeline.paths import write_text_atomically

HEARTBEAT_DIR = "heartbeats"  # under the run folder
WINDOW = 20  # steps the reported step time and data wait are taken over


def heartbeat_path(run_dir: Path, rank: int) -> Path:
    return Path(run_dir) / HEARTBEAT_DIR / f"rank{rank}.json"


def read_heartbeats(run_dir: Path) -> list[dict[str, Any]]:
    """Every rank's latest record (a file being replaced or damaged is skipped: the next poll reads it)."""
    records = []
    for path in sorted((Path(run_dir) / HEARTBEAT_DIR).glob("rank*.json")):
        try:
            records.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    return records


class Heartbeat:
    """Writes one rank's record (module docstring); with ``path`` None every method is a no-op (a run without a
    watchdog: `python -m pretrain.train`)."""

    def __init__(self, path: Path | None, identity: Mapping[str, Any] | None = None, min_interval_s: float = 1.0):
        self.path, self.min_interval_s = path, min_interval_s
        self.record: dict[str, Any] = {**(identity or {}), "pid": os.getpid(), "started": time.time(), "step": 0}
        self.every_steps, self.last_step = 0, 0
        self._written = -float("inf")
        self._warned = False
        self._last_step_at: float | None = None  # when the previous step ended, if no save or switch came between
        self._stepped = False  # a step was done in this attempt (before it, a save is part of the start)
        self._save_began: float | None = None  # when the save after the last step began (its report was written)
        self._steps: deque[float] = deque(maxlen=WINDOW)
        self._waits: deque[float] = deque(maxlen=WINDOW)
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
        self._write("start", force=True)

    def for_run(self, last_step: int, every_steps: int) -> Heartbeat:
        """The checkpoint cadence (`pretrain.checkpointer.Checkpointer`): a step after which a save comes is reported
        as phase ``checkpoint`` before the save starts."""
        self.last_step, self.every_steps = last_step, every_steps
        return self

    def step(self, step: int, data_s: float, data: Mapping[str, int]) -> None:
        """Optimizer step ``step`` is done (``data_s``: the seconds it waited for batches; ``data``: the stream's
        counters)."""
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
        """Something legitimately long starts now (``switch``: a resolution switch rebuilding the engine)."""
        self._last_step_at = self._save_began = None
        self._write(what, force=True)

    def saved(self) -> None:
        """The checkpoint save after the last step ended: back to the training allowance (or, for the step-0 save
        before the first step, to the start's). Its duration counts in ``save_s`` (a step-0 save is the start's)."""
        now = time.monotonic()
        if self._save_began is not None:
            self.record["save_s"] = max(self.record.get("save_s", 0.0), now - self._save_began)
        self._last_step_at, self._save_began = (now if self._stepped else None), None
        self._write("step" if self._stepped else "start", force=True)

    def end(self) -> None:
        """The loop ended (finished, stopped or failed): what this rank does next is no hang."""
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
            # A full disk (a new file needs a block): rewrite the existing file in place, which needs none, so that
            # the watchdog does not take a training group for hung. A reader may catch it half-written and skip it.
            try:
                with open(self.path, "r+") as out:
                    out.write(text)
                    out.truncate()
                self._written = now
            except OSError as error:  # training goes on; the watchdog sees an older record
                if not self._warned:
                    self._warned = True
                    print(f"warning: cannot write the heartbeat {self.path}: {error}", file=sys.stderr, flush=True)
