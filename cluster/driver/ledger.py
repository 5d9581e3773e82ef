"""The job's goodput ledger: every second of its wall-clock in exactly one bucket, per attempt and in total.

The driver's half of docs/goodput.md, "How the ledger is built". `build_ledger` is pure: a cursor walks the job's
timeline, so that no second is booked twice or skipped:

    job start ─ startup ─▶ fit() ─ resource_wait (first attempt) | restart (later ones) ─▶ worker process start
      ─ startup ─▶ train_worker ─ the attempt's own buckets ─▶ its last record ─ ... ─▶ other ─▶ ledger closed

`GoodputMonitor` logs the ledger so far while training runs; `finish_ledger` writes, prints and logs the final one.
"""

from __future__ import annotations

import json
import math
import statistics
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cluster.profiles import ClusterProfile
from pretrain.telemetry.attempt_clock import GOODPUT_DIR, read_attempts
from tracking import keys
from tracking.tracker import Tracker

BUCKETS = keys.GOODPUT_BUCKETS


@dataclass
class JobClock:
    """The driver's timestamps (Unix time): the job's start and when it asked Ray Train for the worker group."""

    started: float
    fit_at: float | None = None


@dataclass(frozen=True)
class EvalSpan:
    """When one eval task ran (Unix time)."""

    start: float
    end: float


@dataclass
class Ledger:
    """Seconds per bucket in total and per row (``job start``, ``attempt <n>``, ``job end``); each sums to
    ``wall_s`` exactly."""

    wall_s: float
    total: dict[str, float]
    rows: list[tuple[str, dict[str, float]]]
    notes: list[str] = field(default_factory=list)
    data_wait_measured: float | None = None  # data wait / (step compute + data wait), over every attempt
    step: int = 0  # the newest step trained
    started: float | None = None  # the job's start and the ledger's close (Unix time)
    ended: float | None = None

    @property
    def fraction(self) -> float:
        return self.total["productive"] / self.wall_s if self.wall_s > 0 else 0.0

    def metrics(self) -> dict[str, float]:
        out = {keys.GOODPUT_WALL_S: self.wall_s, keys.GOODPUT_FRACTION: self.fraction}
        out.update({keys.goodput_bucket(b): self.total[b] for b in BUCKETS})
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "wall_s": self.wall_s,
            "fraction": self.fraction,
            "total": self.total,
            "attempts": [{"row": name, **row} for name, row in self.rows],
            "notes": self.notes,
            "data_wait_measured": self.data_wait_measured,
            "step": self.step,
            "started": self.started,
            "ended": self.ended,
        }


def evals_share_training_cores(profile: ClusterProfile) -> bool:
    """Whether evals run on the training cores: no GPU or node group of their own, and a node's workers plus one
    eval ask for more CPUs than it has."""
    e, w, hw = profile.evals, profile.workers, profile.hardware
    if e.num_gpus > 0 or e.instance_type:
        return False
    per_node = math.ceil(w.max_workers / max(hw.nodes, 1))
    return per_node * w.cpus_per_worker + e.num_cpus > hw.cpus_per_node


def eval_spans(evals: dict[int, dict[str, Any]]) -> list[EvalSpan]:
    """The spans of the eval results (`EvalScheduler.drain`) that have them."""
    spans = []
    for row in evals.values():
        start, seconds = row.get("started"), row.get("seconds")
        if isinstance(start, (int, float)) and isinstance(seconds, (int, float)):
            spans.append(EvalSpan(float(start), float(start) + float(seconds)))
    return spans


class _Cursor:
    """Each `take` books the seconds from the cursor to ``until`` (clipped to the end, never negative) and moves on."""

    def __init__(self, start: float, end: float):
        self.at, self.end = start, end

    def take(self, until: float | None) -> float:
        if until is None:
            return 0.0
        seconds = max(0.0, min(until, self.end) - self.at)
        self.at += seconds
        return seconds


def _row() -> dict[str, float]:
    return dict.fromkeys(BUCKETS, 0.0)


def build_ledger(
    clock: JobClock,
    end: float,
    attempts: list[dict[str, Any]],
    process_starts: dict[int, float] | None = None,
    evals: list[EvalSpan] | None = None,
    evals_shared: bool = False,
) -> Ledger:
    """The ledger from ``clock.started`` to ``end``. ``attempts``: this job's records, oldest first;
    ``process_starts``: {pid: when that worker process started}. Lost work moves to ``restart``, eval interference
    to ``eval_interference``; ``other`` is what no record explains, never negative."""
    cursor, notes = _Cursor(clock.started, end), []
    head = _row()
    head["startup"] = cursor.take(clock.fit_at if clock.fit_at is not None else end)
    rows = [("job start", head)]
    for i, attempt in enumerate(attempts):
        row = _row()
        process_start = (process_starts or {}).get(int(attempt.get("pid") or 0), attempt["started"])
        if i > 0 and process_start <= cursor.at:
            # A worker process Ray Train kept across the restart or resize: all until train_worker is the restart.
            row["restart"] += cursor.take(attempt["started"])
        else:
            row["resource_wait" if i == 0 else "restart"] += cursor.take(min(process_start, attempt["started"]))
            row["startup"] += cursor.take(attempt["started"])  # imports, Ray Train's setup
        span = cursor.take(attempt.get("ended") or attempt.get("updated"))
        booked = {b: max(0.0, float(attempt.get("seconds", {}).get(b, 0.0))) for b in row if b in attempt["seconds"]}
        scale, total_booked = 1.0, sum(booked.values())
        if total_booked > span:  # clocks of two machines, or a record written after the driver's end
            scale = span / total_booked
            notes.append(
                f"attempt {attempt.get('attempt', i + 1)}: its booked seconds exceed its span on the "
                f"driver's clock; scaled by {scale:.3f}"
            )
        for bucket, seconds in booked.items():
            row[bucket] += seconds * scale
        row["other"] += max(0.0, span - total_booked * scale)  # never below zero (rounding)
        later = attempts[i + 1] if i + 1 < len(attempts) else None
        _move_lost_work(row, attempt, later, scale, notes)
        if evals_shared and evals:
            moved = min(row["productive"], interference(attempt, evals, later) * scale)
            row["productive"] -= moved
            row["eval_interference"] += moved
        rows.append((f"attempt {attempt.get('attempt', i + 1)}", row))
    tail = _row()
    tail["other"] = cursor.take(end)
    rows.append(("job end", tail))
    if evals_shared and not evals:
        notes.append("evals share the training cores, but no eval span is known yet: eval_interference is 0")
    total = {b: sum(r[b] for _, r in rows) for b in BUCKETS}
    steps = sum(float(a["seconds"].get("productive", 0)) + float(a["seconds"].get("data_wait", 0)) for a in attempts)
    waited = sum(float(a["seconds"].get("data_wait", 0)) for a in attempts)
    return Ledger(
        wall_s=max(0.0, end - clock.started),
        total=total,
        rows=rows,
        notes=notes,
        data_wait_measured=waited / steps if steps > 0 else None,
        step=max((int(a.get("step", 0)) for a in attempts), default=0),
        started=clock.started,
        ended=end,
    )


def _move_lost_work(row: dict[str, float], attempt: dict, later: dict | None, scale: float, notes: list[str]) -> None:
    """Move a failed (or resized) attempt's step seconds after the checkpoint the next one resumed from to
    ``restart``: that work was lost."""
    if later is None:
        return
    resumed = int(later.get("start_step", 0))
    kept_p, kept_d = _kept_at(attempt, resumed)
    lost_p = max(0.0, float(attempt["seconds"].get("productive", 0)) - kept_p) * scale
    lost_d = max(0.0, float(attempt["seconds"].get("data_wait", 0)) - kept_d) * scale
    lost_p, lost_d = min(lost_p, row["productive"]), min(lost_d, row["data_wait"])
    row["productive"] -= lost_p
    row["data_wait"] -= lost_d
    row["restart"] += lost_p + lost_d
    if int(attempt.get("step", 0)) > resumed:
        notes.append(
            f"attempt {attempt.get('attempt')}: steps {resumed + 1}-{attempt.get('step')} were trained again "
            f"by the next attempt (it resumed from step {resumed}): {lost_p + lost_d:.1f} s lost"
        )


def _kept_at(attempt: dict, step: int) -> tuple[float, float]:
    """(productive, data wait) seconds of ``attempt`` up to ``step``: as recorded at that checkpoint, else
    interpolated by steps."""
    start = int(attempt.get("start_step", 0))
    for saved_step, productive, data_wait in attempt.get("checkpoints", []):
        if int(saved_step) == step:
            return float(productive), float(data_wait)
    if step <= start:
        return 0.0, 0.0
    share = min(1.0, (step - start) / max(int(attempt.get("step", 0)) - start, 1))
    return share * float(attempt["seconds"].get("productive", 0)), share * float(attempt["seconds"].get("data_wait", 0))


def interference(attempt: dict[str, Any], evals: list[EvalSpan], later: dict | None = None) -> float:
    """The step seconds evals cost ``attempt`` (an estimate, docs/goodput.md): per log window an eval overlapped,
    the productive seconds beyond the clean windows' median per step, times the share overlapped. Windows a later
    attempt redid are skipped; 0 without a clean window."""
    limit = int(later["start_step"]) if later is not None else None
    clean: list[tuple[dict[str, Any], float]] = []
    touched: list[tuple[dict[str, Any], float]] = []
    for w in attempt.get("windows", []):
        if not w.get("steps") or (limit is not None and int(w.get("step", 0)) > limit):
            continue
        span = max(float(w["t1"]) - float(w["t0"]), 1e-9)
        overlap = sum(max(0.0, min(e.end, w["t1"]) - max(e.start, w["t0"])) for e in evals)
        (touched if overlap > 0 else clean).append((w, min(1.0, overlap / span)))
    if not clean or not touched:
        return 0.0
    per_step = statistics.median(w["productive_s"] / w["steps"] for w, _ in clean)
    return sum(max(0.0, w["productive_s"] - w["steps"] * per_step) * share for w, share in touched)


def format_ledger(ledger: Ledger) -> str:
    """The table printed at the job's end (``goodput/ledger.txt``): seconds per bucket and row, total, share."""
    names = [name for name, _ in ledger.rows]
    header = ["bucket", *names, "total", "share"]
    table = []
    for bucket in BUCKETS:
        cells = [f"{row[bucket]:.1f}" for _, row in ledger.rows]
        share = ledger.total[bucket] / ledger.wall_s if ledger.wall_s > 0 else 0.0
        table.append([bucket, *cells, f"{ledger.total[bucket]:.1f}", f"{share:.1%}"])
    sums = [f"{sum(row.values()):.1f}" for _, row in ledger.rows]
    table.append(["sum", *sums, f"{sum(ledger.total.values()):.1f}", f"{ledger.wall_s:.1f} s wall"])
    widths = [max(len(h), *(len(r[i]) for r in table)) for i, h in enumerate(header)]
    fmt = "  ".join(f"{{:>{w}}}" for w in widths)
    lines = [
        f"goodput {ledger.fraction:.1%}: {ledger.total['productive']:.1f} s productive of {ledger.wall_s:.1f} s "
        "wall-clock (seconds per bucket; docs/goodput.md):",
        fmt.format(*header),
        fmt.format(*("-" * w for w in widths)),
        *(fmt.format(*r) for r in table),
    ]
    return "\n".join(lines + [f"  note: {n}" for n in ledger.notes])


def data_wait_line(plan: dict[str, Any], ledger: Ledger) -> str | None:
    """ "data wait: predicted X%, measured Y%" when the plan predicted it, else None."""
    predicted = (plan.get("data") or {}).get("predicted_data_wait")
    if not isinstance(predicted, (int, float)) or ledger.data_wait_measured is None:
        return None
    return f"data wait: predicted {predicted:.1%}, measured {ledger.data_wait_measured:.1%} of step time"


def job_attempts(run_dir: Path, since: float) -> list[dict[str, Any]]:
    """The attempt records that started after ``since`` (the job's start)."""
    return [a for a in read_attempts(run_dir) if a.get("started", 0.0) >= since and isinstance(a.get("seconds"), dict)]


def process_starts(workers: list[dict[str, Any]]) -> dict[int, float]:
    """{pid: its process start} from the placement records."""
    return {int(w["pid"]): float(w["process_started"]) for w in workers if w.get("process_started") is not None}


def read_workers(run_dir: Path) -> list[dict[str, Any]]:
    workers = []
    for path in sorted((run_dir / "workers").glob("*.json")):
        try:
            workers.append(json.loads(path.read_text()))
        except (OSError, ValueError):  # being written
            continue
    return workers


def current_ledger(
    run_dir: Path, clock: JobClock, end: float, evals: list[EvalSpan] | None = None, evals_shared: bool = False
) -> Ledger:
    """The ledger from what the run folder holds now."""
    attempts = job_attempts(run_dir, clock.started)
    return build_ledger(clock, end, attempts, process_starts(read_workers(run_dir)), evals, evals_shared)


def finish_ledger(run_dir: Path, ledger: Ledger, plan: dict[str, Any], tracker: Tracker, step: int) -> str:
    """Write ``<run>/goodput/ledger.json`` and ``ledger.txt``, log the totals at ``step`` (the job's last) and both
    files; returns the text to print."""
    folder = run_dir / GOODPUT_DIR
    folder.mkdir(parents=True, exist_ok=True)
    text = format_ledger(ledger)
    line = data_wait_line(plan, ledger)
    if line:
        text += "\n" + line
    (folder / "ledger.json").write_text(json.dumps({**ledger.to_dict(), "data_wait_line": line}, indent=2))
    (folder / "ledger.txt").write_text(text + "\n")
    metrics = ledger.metrics()
    if ledger.data_wait_measured is not None:
        metrics[keys.GOODPUT_DATA_WAIT_MEASURED] = ledger.data_wait_measured
    predicted = (plan.get("data") or {}).get("predicted_data_wait")
    if isinstance(predicted, (int, float)):
        metrics[keys.GOODPUT_DATA_WAIT_PREDICTED] = float(predicted)
    tracker.log_metrics(metrics, step=step)
    for name in ("ledger.json", "ledger.txt"):
        tracker.log_artifact(str(folder / name), keys.GOODPUT_ARTIFACT)
    return text


class GoodputMonitor:
    """Logs the ledger so far every ``interval_s`` at the newest step, when it advanced; never at the run's last
    step, which holds the final ledger. Eval spans are unknown until the end: ``eval_interference`` stays 0."""

    def __init__(self, run_dir: Path, clock: JobClock, tracker: Tracker, interval_s: float = 5.0):
        self.run_dir, self.clock, self.tracker, self.interval_s = run_dir, clock, tracker, interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._logged_step = 0

    def start(self) -> GoodputMonitor:
        self._thread = threading.Thread(target=self._run, name="goodput-monitor", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop polling and send what was logged (the tracker is the monitor's own)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        self.tracker.close(timeout=30)

    def poll(self) -> bool:
        """Log the ledger so far if training advanced; whether it did."""
        attempts = job_attempts(self.run_dir, self.clock.started)
        if not attempts:
            return False
        step = max(int(a.get("step", 0)) for a in attempts)
        last = max(int(a.get("last_step", 0)) for a in attempts)
        if step <= self._logged_step or step >= last:
            return False
        ledger = build_ledger(self.clock, time.time(), attempts, process_starts(read_workers(self.run_dir)))
        self.tracker.log_metrics(ledger.metrics(), step=step)
        self._logged_step = step
        return True

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.poll()
            except Exception as error:  # noqa: BLE001 — bookkeeping never stops a job
                print(f"warning: goodput monitor: {type(error).__name__}: {error}", flush=True)
