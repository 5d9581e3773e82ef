"""The job's goodput ledger: every second of its wall-clock in exactly one bucket, per attempt and in total
(docs/goodput.md, "How the ledger is built")."""

from __future__ import annotations

import json
import math
import statistics
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cluster.driver.summary import aligned
from cluster.profiles import ClusterProfile
from pretrain.telemetry.attempt_clock import GOODPUT_DIR, read_attempts
from tracking import keys
from tracking.tracker import Tracker

BUCKETS = keys.GOODPUT_BUCKETS


@dataclass
class JobClock:
    started: float
    fit_at: float | None = None


@dataclass(frozen=True)
class EvalSpan:
    start: float
    end: float


@dataclass
class Ledger:
    """Seconds per bucket in total and per row; each sums to ``wall_s``."""

    wall_s: float
    total: dict[str, float]
    rows: list[tuple[str, dict[str, float]]]
    notes: list[str] = field(default_factory=list)
    data_wait_measured: float | None = None  # data wait / (step compute + data wait)
    step: int = 0  # the newest step trained
    started: float | None = None
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
    """A node's workers plus one eval ask for more CPUs than it has."""
    e, w, hw = profile.evals, profile.workers, profile.hardware
    if e.num_gpus > 0 or e.instance_type:
        return False
    per_node = math.ceil(w.max_workers / max(hw.nodes, 1))
    return per_node * w.cpus_per_worker + e.num_cpus > hw.cpus_per_node


def eval_spans(evals: dict[int, dict[str, Any]]) -> list[EvalSpan]:
    spans = []
    for row in evals.values():
        start, seconds = row.get("started"), row.get("seconds")
        if isinstance(start, (int, float)) and isinstance(seconds, (int, float)):
            spans.append(EvalSpan(float(start), float(start) + float(seconds)))
    return spans


class _Cursor:
    """`take` books the seconds from the cursor to ``until`` (clipped to the end, never negative)."""

    def __init__(self, start: float, end: float):
        self.at, self.end = start, end

    def take(self, until: float | None) -> float:
        if until is None:
            return 0.0
        seconds = max(0.0, min(until, self.end) - self.at)
        self.at += seconds
        return seconds


def _row(**seconds: float) -> dict[str, float]:
    return dict.fromkeys(BUCKETS, 0.0) | seconds


def build_ledger(
    clock: JobClock,
    end: float,
    attempts: list[dict[str, Any]],
    process_starts: dict[int, float] | None = None,
    evals: list[EvalSpan] | None = None,
    evals_shared: bool = False,
) -> Ledger:
    """From ``clock.started`` to ``end``; ``attempts`` oldest first. ``other`` is never negative."""
    cursor, notes = _Cursor(clock.started, end), []
    rows = [("job start", _row(startup=cursor.take(clock.fit_at if clock.fit_at is not None else end)))]
    for i, attempt in enumerate(attempts):
        row = _row()
        process_start = attempt.get("process_started") or (process_starts or {}).get(
            int(attempt.get("pid") or 0), attempt["started"]
        )
        if i > 0 and process_start <= cursor.at:
            # a worker process kept across the restart
            row["restart"] += cursor.take(attempt["started"])
        else:
            row["resource_wait" if i == 0 else "restart"] += cursor.take(min(process_start, attempt["started"]))
            row["startup"] += cursor.take(attempt["started"])
        span = cursor.take(attempt.get("ended") or attempt.get("updated"))
        booked = {b: max(0.0, float(attempt.get("seconds", {}).get(b, 0.0))) for b in row if b in attempt["seconds"]}
        scale, total_booked = 1.0, sum(booked.values())
        if total_booked > span:
            scale = span / total_booked
            notes.append(
                f"attempt {attempt.get('attempt', i + 1)}: its booked seconds exceed its span on the "
                f"driver's clock; scaled by {scale:.3f}"
            )
        for bucket, seconds in booked.items():
            row[bucket] += seconds * scale
        row["other"] += max(0.0, span - total_booked * scale)
        later = attempts[i + 1] if i + 1 < len(attempts) else None
        _move_lost_work(row, attempt, later, scale, notes)
        if evals_shared and evals:
            moved = min(row["productive"], interference(attempt, evals, later) * scale)
            row["productive"] -= moved
            row["eval_interference"] += moved
        rows.append((f"attempt {attempt.get('attempt', i + 1)}", row))
    rows.append(("job end", _row(other=cursor.take(end))))
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
    """Step seconds after the checkpoint the next attempt resumed from go to ``restart``."""
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
    """(productive, data wait) seconds up to ``step``, else interpolated."""
    start = int(attempt.get("start_step", 0))
    for saved_step, productive, data_wait in attempt.get("checkpoints", []):
        if int(saved_step) == step:
            return float(productive), float(data_wait)
    if step <= start:
        return 0.0, 0.0
    share = min(1.0, (step - start) / max(int(attempt.get("step", 0)) - start, 1))
    return share * float(attempt["seconds"].get("productive", 0)), share * float(attempt["seconds"].get("data_wait", 0))


def interference(attempt: dict[str, Any], evals: list[EvalSpan], later: dict | None = None) -> float:
    """The step seconds evals cost ``attempt`` (an estimate, docs/goodput.md); 0 without a clean window."""
    limit = int(later["start_step"]) if later is not None else None
    clean, touched = [], []
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
    header = ["bucket", *(name for name, _ in ledger.rows), "total", "share"]
    table = []
    for bucket in BUCKETS:
        cells = [f"{row[bucket]:.1f}" for _, row in ledger.rows]
        share = ledger.total[bucket] / ledger.wall_s if ledger.wall_s > 0 else 0.0
        table.append([bucket, *cells, f"{ledger.total[bucket]:.1f}", f"{share:.1%}"])
    sums = [f"{sum(row.values()):.1f}" for _, row in ledger.rows]
    table.append(["sum", *sums, f"{sum(ledger.total.values()):.1f}", f"{ledger.wall_s:.1f} s wall"])
    lines = [
        f"goodput {ledger.fraction:.1%}: {ledger.total['productive']:.1f} s productive of {ledger.wall_s:.1f} s "
        "wall-clock (seconds per bucket; docs/goodput.md):",
        *aligned(header, table),
    ]
    return "\n".join(lines + [f"  note: {n}" for n in ledger.notes])


def data_wait_line(plan: dict[str, Any], ledger: Ledger) -> str | None:
    predicted = (plan.get("data") or {}).get("predicted_data_wait")
    if not isinstance(predicted, (int, float)) or ledger.data_wait_measured is None:
        return None
    return f"data wait: predicted {predicted:.1%}, measured {ledger.data_wait_measured:.1%} of step time"


def job_attempts(run_dir: Path, since: float) -> list[dict[str, Any]]:
    return [a for a in read_attempts(run_dir) if a.get("started", 0.0) >= since and isinstance(a.get("seconds"), dict)]


def process_starts(workers: list[dict[str, Any]]) -> dict[int, float]:
    """By pid, of rank 0's processes: they write the attempts; other nodes' processes may have the same pids."""
    return {
        int(w["pid"]): float(w["process_started"])
        for w in workers
        if w.get("rank") == 0 and w.get("process_started") is not None
    }


def read_workers(run_dir: Path) -> list[dict[str, Any]]:
    workers = []
    for path in sorted((run_dir / "workers").glob("*.json")):
        try:
            workers.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    return workers


def current_ledger(
    run_dir: Path, clock: JobClock, end: float, evals: list[EvalSpan] | None = None, evals_shared: bool = False
) -> Ledger:
    attempts = job_attempts(run_dir, clock.started)
    return build_ledger(clock, end, attempts, process_starts(read_workers(run_dir)), evals, evals_shared)


def finish_ledger(run_dir: Path, ledger: Ledger, plan: dict[str, Any], tracker: Tracker, step: int) -> str:
    """Write and log ``<run>/goodput/ledger.json`` and ``ledger.txt``; the text to print."""
    folder = run_dir / GOODPUT_DIR
    folder.mkdir(parents=True, exist_ok=True)
    line = data_wait_line(plan, ledger)
    text = format_ledger(ledger) + ("\n" + line if line else "")
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
    """Logs the ledger so far every ``interval_s`` when the step advanced, one poll late: the newest step's values wait
    for a newer step, since a job that ends there logs its totals at that step (`finish_ledger`), and never the last."""

    def __init__(self, run_dir: Path, clock: JobClock, tracker: Tracker, interval_s: float = 5.0):
        self.run_dir, self.clock, self.tracker, self.interval_s = run_dir, clock, tracker, interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._logged_step = 0
        self._held: dict[str, float] = {}  # the ledger at _logged_step, not sent yet

    def start(self) -> GoodputMonitor:
        self._thread = threading.Thread(target=self._run, name="goodput-monitor", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        self.tracker.close(timeout=30)

    def poll(self) -> bool:
        """Whether training advanced."""
        attempts = job_attempts(self.run_dir, self.clock.started)
        if not attempts:
            return False
        step = max(int(a.get("step", 0)) for a in attempts)
        last = max(int(a.get("last_step", 0)) for a in attempts)
        if step <= self._logged_step or step >= last:
            return False
        ledger = build_ledger(self.clock, time.time(), attempts, process_starts(read_workers(self.run_dir)))
        if self._held:
            self.tracker.log_metrics(self._held, step=self._logged_step)
        self._held, self._logged_step = ledger.metrics(), step
        return True

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.poll()
            except Exception as error:  # noqa: BLE001
                print(f"warning: goodput monitor: {type(error).__name__}: {error}", flush=True)
