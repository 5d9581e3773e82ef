"""Ctrl-C as a terminal sends it: SIGINT to a command's whole process group (the command and its workers)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

PROJECT = Path(__file__).resolve().parents[2]


@dataclass
class Interrupted:
    returncode: int
    stdout: str
    stderr: str
    processes: int  # the command's, workers included, when Ctrl-C came
    left: list[str]  # its process group's processes still alive after it exited


def _group(pgid: int) -> list[psutil.Process]:
    found = []
    for process in psutil.process_iter():
        try:
            if os.getpgid(process.pid) == pgid and process.status() != psutil.STATUS_ZOMBIE:
                found.append(process)
        except (ProcessLookupError, psutil.NoSuchProcess):
            pass
    return found


def ctrl_c(
    command: list[str], ready: Callable[[Path], bool], logs: Path, wait_s: float = 30, env: dict | None = None
) -> Interrupted:
    """Run ``command`` in a process group of its own (a terminal's foreground job); once ``ready(stdout file)``,
    SIGINT the group, as Ctrl-C does. Fails when it exits first, or is still running ``wait_s`` after."""
    out, err = logs / "stdout.txt", logs / "stderr.txt"
    env = {**(os.environ if env is None else env), "PYTHONUNBUFFERED": "1"}
    # A SIGINT this process ignores (a background shell's, say) is inherited: Python would then ignore Ctrl-C.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with open(out, "w") as stdout, open(err, "w") as stderr:
            pipes = dict(stdout=stdout, stderr=stderr, start_new_session=True)
            proc = subprocess.Popen(command, cwd=PROJECT, env=env, **pipes)
    finally:
        signal.signal(signal.SIGINT, previous)
    try:
        deadline = time.monotonic() + 60
        while not ready(out):
            assert proc.poll() is None, f"exited {proc.returncode} before Ctrl-C: {err.read_text()[-2000:]}"
            assert time.monotonic() < deadline, f"not ready in 60 s: {err.read_text()[-2000:]}"
            time.sleep(0.02)
        # Frozen while its processes are counted (a scan of every process, slow on a loaded machine): the count is
        # of those the signal reaches, and no work finishes in between (a writer 1.8 s from done did, once).
        os.killpg(proc.pid, signal.SIGSTOP)
        processes = len(_group(proc.pid))
        os.killpg(proc.pid, signal.SIGINT)  # pending until they go on
        os.killpg(proc.pid, signal.SIGCONT)
        try:
            proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running {wait_s} s after Ctrl-C: {err.read_text()[-2000:]}")
        deadline = time.monotonic() + 5  # a worker the command stopped may take a moment to go
        while _group(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = [" ".join(p.cmdline()) for p in _group(proc.pid)]
    finally:
        if proc.poll() is None or _group(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return Interrupted(proc.returncode, out.read_text(), err.read_text(), processes, left)


def assert_one_line(done: Interrupted, prog: str) -> str:
    """Exit 130 and one line on stderr, ``prog: interrupted; ...``, with no process left: the line."""
    assert done.returncode == 130, (done.returncode, done.stderr[-3000:])
    assert "Traceback" not in done.stderr and done.stderr.count("\n") == 1, done.stderr[-3000:]
    assert done.stderr.startswith(f"{prog}: interrupted; ") and not done.left, (done.stderr, done.left)
    return done.stderr
