"""The driver's watchdog: a worker group that stops making progress without dying is restarted in minutes, not at
the collective timeout; it also logs stragglers and data counters (docs/elastic.md, "Faults").
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import socket
import statistics
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from cluster.profiles import HangSpec
from pretrain.telemetry.heartbeat import read_heartbeats
from tracking import keys
from tracking.tracker import Tracker

STACKS_DIR = "stacks"  # under the run folder
EVENTS_FILE = "watchdog.jsonl"
DATA_COUNTERS = (
    "read_retries",
    "read_failures",
    "read_errors",
    "missing_shards",
    "truncated_shards",
    "missing_samples",
    "corrupt_samples",
    "incomplete_samples",
    "bad_labels",
    "label_out_of_range",
    "unsafe_members",
)
_STOPPED_STATES = ("T", "t")  # stopped or traced
_STUCK_STATES = ("D",)  # uninterruptible sleep


def install_stack_dump(run_dir: Path, rank: int) -> IO[str]:
    """SIGUSR1 appends all threads' stacks (even in C code) to `<run_dir>/stacks/rank<r>.txt`; keep the file open."""
    folder = Path(run_dir) / STACKS_DIR
    folder.mkdir(parents=True, exist_ok=True)
    out = open(folder / f"rank{rank}.txt", "a")  # noqa: SIM115 (kept open for faulthandler)
    faulthandler.register(signal.SIGUSR1, file=out, all_threads=True, chain=False)
    return out


def step_bound(spec: HangSpec, step_s: float | None) -> float:
    return max(spec.floor_s, spec.factor * step_s) if step_s else spec.floor_s


def save_bound(spec: HangSpec, save_s: float | None) -> float:
    """``checkpoint_s`` until a save is measured."""
    return max(spec.save_floor_s, spec.factor * save_s) if save_s else spec.checkpoint_s


def allowance(spec: HangSpec, phase: str, step_s: float | None, save_s: float | None = None) -> float:
    """Seconds a rank in ``phase`` may go without a report; never shorter in a save or a switch than in a step."""
    if phase == "start":
        return spec.startup_s
    if phase == "checkpoint":
        return max(save_bound(spec, save_s), step_bound(spec, step_s))
    if phase == "switch":
        return max(spec.checkpoint_s, step_bound(spec, step_s))
    return step_bound(spec, step_s)


def explain(spec: HangSpec, phase: str, step_s: float | None, save_s: float | None = None) -> str:
    training = f"max(floor {spec.floor_s:g} s, {spec.factor:g} x median step {step_s or 0:.2f} s)"
    if phase == "start":
        return f"phase start: the start allowance {spec.startup_s:g} s (the plan's, at least hang.startup_s)"
    if phase == "checkpoint" and save_s:
        saving = f"max(save floor {spec.save_floor_s:g} s, {spec.factor:g} x longest save {save_s:.2f} s)"
    elif phase in ("checkpoint", "switch"):
        saving = f"{spec.checkpoint_s:g} s before a save is measured (the plan's, at least hang.checkpoint_s)"
    else:
        return f"phase {phase}: {training}"
    return f"phase {phase}: {saving}, at least {training}"


@dataclass(frozen=True)
class Verdict:
    hung: bool
    idle_s: float
    bound_s: float
    ranks: list[dict[str, Any]]
    why: str = ""


def active_reports(beats: list[dict[str, Any]], retired: set[tuple[str, int]]) -> list[dict[str, Any]]:
    """Reports not of a retired process, within the newest report's world size."""
    live = [b for b in beats if _process(b) not in retired]
    if not live:
        return []
    world = max(live, key=lambda b: b.get("started", 0)).get("world_size", len(live))
    return [b for b in live if b.get("rank", 0) < world]


def _process(b: dict[str, Any]) -> tuple[str, int]:
    return b.get("host", ""), b.get("pid", -1)


def assess(reports: list[dict[str, Any]], now: float, spec: HangSpec) -> Verdict:
    """Hung when no rank still training has reported for longer than the longest allowance among them."""
    ranks = [b for b in reports if b.get("phase") != "done"]
    if not ranks:
        return Verdict(False, 0.0, 0.0, [])
    steps, saves = [b["step_s"] for b in ranks if b.get("step_s")], [b["save_s"] for b in ranks if b.get("save_s")]
    step_s, save_s = statistics.median(steps) if steps else None, max(saves) if saves else None
    phases = {b.get("phase", "step") for b in ranks}
    longest = max(sorted(phases), key=lambda p: allowance(spec, p, step_s, save_s))
    bound = allowance(spec, longest, step_s, save_s)
    idle = now - max(b.get("time", now) for b in ranks)
    return Verdict(idle > bound, idle, bound, ranks, explain(spec, longest, step_s, save_s))


def pick_culprit(ranks: list[dict[str, Any]], states: dict[int, str]) -> dict[str, Any]:
    """A stopped process, else one stuck in the kernel, else the one whose report is oldest."""

    def order(b: dict[str, Any]) -> tuple:
        state = states.get(b["rank"], "")
        return (state not in _STOPPED_STATES, state not in _STUCK_STATES, b.get("step", 0), b.get("time", 0))

    return min(ranks, key=order)


def stragglers(reports: list[dict[str, Any]], fraction: float) -> dict[int, str]:
    """{rank: why} for ranks waiting for data ``fraction`` of a step longer than the median rank."""
    timed = [b for b in reports if b.get("phase") == "step" and b.get("step_s") and "data_s" in b]
    if len(timed) < 2:
        return {}
    wait = statistics.median(b["data_s"] for b in timed)
    step = statistics.median(b["step_s"] for b in timed)
    return {
        b["rank"]: f"rank {b['rank']}: waits {b['data_s']:.3f} s per step for data (median rank {wait:.3f} s, "
        f"step {step:.3f} s)"
        for b in timed
        if b["data_s"] - wait > fraction * step
    }


def data_totals(reports: list[dict[str, Any]]) -> dict[str, int]:
    return {name: sum(int((b.get("data") or {}).get(name, 0)) for b in reports) for name in DATA_COUNTERS}


def final_failure(errors: Mapping[int, BaseException]) -> tuple[int, BaseException] | None:
    """(rank, error) of the first worker error with ``retryable = False``, or None."""
    return next(((r, errors[r]) for r in sorted(errors) if getattr(errors[r], "retryable", True) is False), None)


class FinalFailure(RuntimeError):
    """Fails the job with the worker's message (as `ControllerError.controller_failure`)."""


def final_failures_callback() -> Any:
    """A Ray Train callback that ends the job on an error `final_failure` finds, whatever `max_failures` allows
    (Ray Train V2 retries every worker error)."""
    from ray.train.v2._internal.execution.callback import ControllerCallback, WorkerGroupCallback

    class FinalFailures(ControllerCallback, WorkerGroupCallback):
        def __init__(self) -> None:
            self.final: tuple[int, BaseException] | None = None

        def after_worker_group_poll_status(self, worker_group_status: Any) -> None:
            self.final = final_failure(worker_group_status.errors)

        def before_controller_execute_failure_decision(self, failure_decision: Any) -> None:
            if self.final is not None and failure_decision.value in ("RETRY", "RAISE"):
                raise FinalFailure(f"{self.final[1]} (not restarted: a restart would fail the same way)")

    return FinalFailures()


def process_state(pid: int) -> str:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return "gone"
    state = text.rsplit(")", 1)[-1].split()[0]  # "(comm)" may hold spaces
    return "gone" if state in ("Z", "X") else state


def dump_and_state(pid: int, stack_file: str, header: str, wait_s: float = 3.0) -> str:
    """Have ``pid`` append its stacks to ``stack_file``; its state before. A stopped process is continued. Each use of
    the file waits at most ``wait_s``: a full disk or a stalled shared filesystem must not stop the kill."""
    state = process_state(pid)
    if state == "gone":
        return state
    path = Path(stack_file)
    size = _within(wait_s, _mark, path, f"\n{header} (process state {state})\n")
    try:
        os.kill(pid, signal.SIGUSR1)
        if state in _STOPPED_STATES:
            os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        return "gone"
    if size is not None:
        _within(wait_s, _grown, path, size, wait_s)
    return state


def _within(timeout_s: float, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, or None after ``timeout_s``; its thread is left where a filesystem blocks it."""
    result: list[Any] = [None]
    thread = threading.Thread(target=lambda: result.__setitem__(0, fn(*args)), name="vitscale-dump", daemon=True)
    thread.start()
    thread.join(timeout_s)
    return result[0]


def _mark(path: Path, text: str) -> int | None:
    """The file's size once ``text`` is appended; None where it cannot be."""
    try:
        with open(path, "a") as out:
            out.write(text)
        return path.stat().st_size
    except OSError:
        return None


def _grown(path: Path, size: int, wait_s: float) -> None:
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and _size(path) == size:
        time.sleep(0.05)


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return -1


def kill(pid: int) -> bool:
    try:
        os.kill(pid, signal.SIGKILL)
        return True
    except ProcessLookupError:
        return False


def on_node(report: dict[str, Any], fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` on the node of ``report``'s process; None when that node cannot be reached."""
    if report.get("host") in (None, socket.gethostname()) or report.get("node_id") is None:
        return fn(*args)
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    task = ray.remote(num_cpus=0, max_retries=0)(fn)
    where = NodeAffinitySchedulingStrategy(report["node_id"], soft=False)
    try:
        return ray.get(task.options(scheduling_strategy=where).remote(*args), timeout=30)
    except Exception as error:
        print(f"watchdog: cannot reach rank {report.get('rank')}'s node {report['node_id']}: {error}", flush=True)
        return None


@dataclass
class _Seen:
    retired: set[tuple[str, int]] = field(default_factory=set)  # processes whose reports no longer count
    hangs: int = 0
    hang_at: float | None = None  # until training resumed
    gone_at: float | None = None  # a process was found gone: Ray Train's restart may be ending the others
    slow: dict[int, int] = field(default_factory=dict)  # rank: successive slow polls
    reported_slow: frozenset[int] = frozenset()
    last_step: int = -1
    data: dict[str, int] = field(default_factory=dict)


class Watchdog:
    """The driver's thread: ``start()`` before `TorchTrainer.fit()`, ``stop()`` after."""

    def __init__(self, run_dir: Path, spec: HangSpec, tracker: Tracker):
        self.run_dir, self.spec, self.tracker = Path(run_dir), spec, tracker
        self.events: list[dict[str, Any]] = []
        self._seen = _Seen(retired={_process(b) for b in read_heartbeats(self.run_dir)})
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="vitscale-watchdog", daemon=True)

    def start(self) -> Watchdog:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=60)
        self.tracker.close()

    def _run(self) -> None:
        while not self._stop.wait(self.spec.poll_s):
            try:
                self.poll(time.time())
            except Exception as error:  # the watchdog must never take the job down
                print(f"watchdog: error while checking progress: {type(error).__name__}: {error}", flush=True)

    def poll(self, now: float) -> Verdict:
        reports = active_reports(read_heartbeats(self.run_dir), self._seen.retired)
        verdict = assess(reports, now, self.spec)
        self._note_resume(verdict.ranks, now)
        if verdict.hung and self.spec.enabled:
            if self._seen.gone_at is None or now - self._seen.gone_at >= self.spec.floor_s:
                self._act(verdict, now)
        elif verdict.ranks:
            self._report_progress(reports)
        return verdict

    def _note_resume(self, ranks: list[dict[str, Any]], now: float) -> None:
        training = [b for b in ranks if b.get("phase") != "start"]
        if self._seen.hang_at is None or not training:
            return
        step = min(b.get("step", 0) for b in training)
        self._event(
            "resumed",
            f"training resumed at step {step}, {now - self._seen.hang_at:.0f} s after the hang was acted on",
            step=step,
        )
        self._seen.hang_at = None

    def _act(self, verdict: Verdict, now: float) -> None:
        """Dump every rank's stacks and kill the culprit, unless a process is gone already: then retire only what is
        gone (its record may be a previous group's, next to a live rank of the new one) and judge the others again
        after ``floor_s``, time for Ray Train's restart to end them (it kills a group seconds after a worker died)."""
        ranks = verdict.ranks
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(now))

        def dump(b: dict[str, Any]) -> str:
            header = (
                f"=== {stamp} UTC watchdog: no progress for {verdict.idle_s:.0f} s; rank {b['rank']} pid {b['pid']}"
            )
            stack_file = str(self.run_dir / STACKS_DIR / f"rank{b['rank']}.txt")
            return on_node(b, dump_and_state, b["pid"], stack_file, header) or "gone"

        # a wait per rank, all at once
        with ThreadPoolExecutor(max(1, len(ranks)), thread_name_prefix="vitscale-dump") as pool:
            states = dict(zip((b["rank"] for b in ranks), pool.map(dump, ranks)))
        gone = sorted(r for r, s in states.items() if s == "gone")
        if gone:
            self._seen.retired |= {_process(b) for b in ranks if states[b["rank"]] == "gone"}
            self._seen.gone_at = now
            self._event("gone", f"ranks {gone} are gone (a worker failure Ray Train handles); not a hang")
            return
        self._seen.retired |= {_process(b) for b in ranks}
        culprit = pick_culprit(ranks, states)
        rank, pid, step = culprit["rank"], culprit["pid"], culprit.get("step", 0)
        state = states[rank]
        what = "stopped (SIGSTOP or a debugger)" if state in _STOPPED_STATES else f"state {state}"
        line = (
            f"rank {rank} (pid {pid} on {culprit.get('host', '?')}) hung at step {step}: no progress from any rank "
            f"for {verdict.idle_s:.0f} s > {verdict.bound_s:.0f} s ({verdict.why}); process {what}; stacks in "
            f"{self.run_dir / STACKS_DIR}; killing it so that Ray Train restarts the group from the newest complete "
            "checkpoint"
        )
        killed = on_node(culprit, kill, pid)
        self._seen.hangs += 1
        self._seen.hang_at = now
        text = line if killed else line + " (it was gone already)"
        self._event("hung", text, rank=rank, pid=pid, step=step, state=state, idle_s=verdict.idle_s)
        self.tracker.set_tags({keys.HANGS: self._seen.hangs, keys.LAST_HANG: line[:4000]})
        self.tracker.log_metrics({keys.HANGS_METRIC: self._seen.hangs}, step=int(step))

    def _report_progress(self, reports: list[dict[str, Any]]) -> None:
        seen = self._seen
        step = min(b.get("step", 0) for b in reports)
        if step != seen.last_step:
            slow = stragglers(reports, self.spec.straggler_fraction)
            seen.slow = {r: seen.slow.get(r, 0) + 1 for r in slow}
            persistent = frozenset(r for r, n in seen.slow.items() if n >= self.spec.straggler_polls)
            if persistent != seen.reported_slow:
                seen.reported_slow = persistent
                text = "; ".join(slow[r] for r in sorted(persistent)) or "none"
                self.tracker.set_tags({keys.STRAGGLERS: text[:4000]})
                self.tracker.log_metrics({keys.STRAGGLERS_METRIC: len(persistent)}, step=step)
                if persistent:
                    print(f"watchdog: straggler {text}", flush=True)
            seen.last_step = step
        totals = data_totals(reports)
        if totals != seen.data and any(totals.values()):
            changed = {keys.data_count(k): v for k, v in totals.items() if v != seen.data.get(k, 0)}
            self.tracker.log_metrics(changed, step=step)
        seen.data = totals

    def _event(self, kind: str, text: str, **fields: Any) -> None:
        event = {"event": kind, "time": time.time(), "text": text, **fields}
        self.events.append(event)
        print(f"watchdog: {text}", flush=True)
        try:
            with open(self.run_dir / EVENTS_FILE, "a") as out:
                out.write(json.dumps(event) + "\n")
        except OSError:
            pass


def identity(rank: int, world_size: int) -> dict[str, Any]:
    import ray

    return {
        "rank": rank,
        "world_size": world_size,
        "host": socket.gethostname(),
        "node_id": ray.get_runtime_context().get_node_id(),
    }
