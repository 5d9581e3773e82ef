"""The hang watchdog after a rank's process is gone: it retires only what is gone and judges the live processes again
once Ray Train's restart had time to end them; a restarted group's rank stuck at its start is still found.

Real processes (one that waits, like a rank stuck at its start, one that has exited), records the test writes, and
the watchdog's poll driven with a given clock: no waits of minutes.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from cluster.driver.watchdog import Watchdog
from cluster.profiles import HangSpec
from pretrain.telemetry.heartbeat import HEARTBEAT_DIR
from tracking.tracker import Tracker

ROOT = Path(__file__).resolve().parents[2]
SPEC = HangSpec(floor_s=30, factor=10, startup_s=60, checkpoint_s=60, poll_s=1)
WAITER = """
import sys, time
from pathlib import Path
from cluster.driver.watchdog import install_stack_dump
stacks = install_stack_dump(Path(sys.argv[1]), int(sys.argv[2]))
print("ready", flush=True)
time.sleep(600)
"""


def _waiter(run_dir: Path, rank: int) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", WAITER, str(run_dir), str(rank)],
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline().strip() == "ready"
    return proc


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def _write(run_dir: Path, rank: int, pid: int, started: float, t: float, phase: str) -> None:
    record = {"rank": rank, "world_size": 2, "host": socket.gethostname(), "pid": pid, "started": started}
    record.update(time=t, phase=phase, step=10, step_s=0.5, data_s=0.01)
    (run_dir / HEARTBEAT_DIR / f"rank{rank}.json").write_text(json.dumps(record))


def _watchdog(run_dir: Path) -> Watchdog:
    (run_dir / HEARTBEAT_DIR).mkdir(parents=True)
    return Watchdog(run_dir, SPEC, Tracker(None, None, enabled=False))


@pytest.mark.timeout(120)
def test_a_gone_rank_next_to_a_restarted_group_stuck_at_its_start_does_not_blind_the_watchdog(tmp_path):
    """The restarted group's rank 0 waits at its start for rank 1, stuck before its first report (a stalled shared
    filesystem); rank1.json still holds the previous group's rank 1, whose process is gone. The first verdict finds
    that process gone (no hang); once Ray Train's restart had its grace, the live rank 0 is killed, not left to the
    collective timeout (30 min)."""
    watchdog = _watchdog(tmp_path)
    live = _waiter(tmp_path, 0)
    try:
        now = 100_000.0
        _write(tmp_path, 0, live.pid, started=now - 100, t=now - 100, phase="start")
        _write(tmp_path, 1, _dead_pid(), started=now - 500, t=now - 200, phase="step")
        assert watchdog.poll(now).hung
        assert [(e["event"], "[1]" in e["text"]) for e in watchdog.events] == [("gone", True)]
        assert live.poll() is None
        watchdog.poll(now + SPEC.floor_s / 2)  # Ray Train may still be ending the group: no kill yet
        assert [e["event"] for e in watchdog.events] == ["gone"] and live.poll() is None
        assert watchdog.poll(now + 1000).hung
        assert [e["event"] for e in watchdog.events] == ["gone", "hung"]
        hung = watchdog.events[-1]
        assert (hung["rank"], hung["pid"]) == (0, live.pid) and "phase start" in hung["text"]
        assert live.wait(timeout=30) == -signal.SIGKILL
        assert "watchdog: no progress" in (tmp_path / "stacks" / "rank0.txt").read_text()
    finally:
        if live.poll() is None:
            live.kill()
            live.wait()


@pytest.mark.timeout(120)
def test_survivors_that_ray_trains_restart_ends_are_no_hang_and_the_next_group_is_judged(tmp_path):
    """A worker dies mid-training; the others wait in a collective until Ray Train ends them: no hang is counted and
    nothing is killed. The next group's processes are judged as any group's."""
    watchdog = _watchdog(tmp_path)
    survivor = _waiter(tmp_path, 0)
    try:
        now = 100_000.0
        _write(tmp_path, 0, survivor.pid, started=now - 900, t=now - 40, phase="step")
        _write(tmp_path, 1, _dead_pid(), started=now - 900, t=now - 45, phase="step")
        assert watchdog.poll(now).hung and [e["event"] for e in watchdog.events] == ["gone"]
        watchdog.poll(now + 2)
        assert survivor.poll() is None  # left to Ray Train's restart, which ends it:
        survivor.kill()
        survivor.wait()
        watchdog.poll(now + SPEC.floor_s + 1)  # what is gone only: no hang
        assert [e["event"] for e in watchdog.events] == ["gone", "gone"]
        assert not watchdog.poll(now + 2000).hung  # nothing left to judge
        # The next group: both ranks report, then stop making progress: a hang, judged as usual.
        fresh = [_waiter(tmp_path, 0), _waiter(tmp_path, 1)]
        try:
            for rank, proc in enumerate(fresh):
                _write(tmp_path, rank, proc.pid, started=now + 2000, t=now + 2050 - rank, phase="step")
            assert not watchdog.poll(now + 2060).hung
            assert watchdog.poll(now + 2100).hung and [e["event"] for e in watchdog.events][-1] == "hung"
            assert watchdog.events[-1]["pid"] == fresh[1].pid and fresh[1].wait(timeout=30) == -signal.SIGKILL
        finally:
            for proc in fresh:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
    finally:
        if survivor.poll() is None:
            survivor.kill()
            survivor.wait()


DEAF = """
import signal, sys, time
signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # no stacks come: a process in the kernel (D state) takes no signal
print("ready", flush=True)
time.sleep(600)
"""


def _deaf() -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", DEAF], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def _poll_within(watchdog: Watchdog, now: float, limit_s: float) -> float:
    """Seconds `poll` took; it fails the test past ``limit_s`` instead of hanging it."""
    started = time.monotonic()
    thread = threading.Thread(target=watchdog.poll, args=(now,), daemon=True)
    thread.start()
    thread.join(limit_s)
    assert not thread.is_alive(), f"the watchdog's poll still runs after {limit_s} s"
    return time.monotonic() - started


@pytest.mark.timeout(120)
def test_a_stalled_stacks_file_does_not_hold_up_the_kill(tmp_path):
    """The shared filesystem stalls on rank 0's stacks file (a FIFO without a reader: its open blocks, as on a stuck
    Lustre target): the watchdog still kills the hung rank within seconds instead of blocking on the dump forever."""
    watchdog = _watchdog(tmp_path)
    (tmp_path / "stacks").mkdir()
    os.mkfifo(tmp_path / "stacks" / "rank0.txt")
    hung, waiting = _waiter(tmp_path / "own", 0), _waiter(tmp_path, 1)
    try:
        now = 100_000.0
        _write(tmp_path, 0, hung.pid, started=now - 900, t=now - 100, phase="step")
        _write(tmp_path, 1, waiting.pid, started=now - 900, t=now - 90, phase="step")
        _poll_within(watchdog, now, 20)
        assert [(e["event"], e.get("rank")) for e in watchdog.events] == [("hung", 0)]
        assert hung.wait(timeout=30) == -signal.SIGKILL and waiting.poll() is None
        assert "watchdog: no progress" in (tmp_path / "stacks" / "rank1.txt").read_text()
    finally:
        os.close(os.open(tmp_path / "stacks" / "rank0.txt", os.O_RDONLY | os.O_NONBLOCK))  # frees the blocked open
        for proc in (hung, waiting):
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.mark.timeout(120)
def test_ranks_whose_stacks_do_not_come_are_waited_for_together(tmp_path):
    """Eight hung ranks none of which writes its stacks (each dump waits its 3 s): the kill comes after one wait, not
    after eight in a row (64 ranks: over 3 minutes)."""
    watchdog = _watchdog(tmp_path)
    (tmp_path / "stacks").mkdir()  # the ranks' stacks files, as `install_stack_dump` leaves them
    procs = [_deaf() for _ in range(8)]
    try:
        now = 100_000.0
        for rank, proc in enumerate(procs):
            record = {"rank": rank, "world_size": 8, "host": socket.gethostname(), "pid": proc.pid, "started": 1.0}
            record.update(time=now - 100 + rank, phase="step", step=10, step_s=0.5)
            (tmp_path / HEARTBEAT_DIR / f"rank{rank}.json").write_text(json.dumps(record))
        took = _poll_within(watchdog, now, 60)
        assert [(e["event"], e.get("rank")) for e in watchdog.events] == [("hung", 0)]
        assert procs[0].wait(timeout=30) == -signal.SIGKILL
        assert took < 12, f"the dumps took {took:.1f} s before the kill"
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
