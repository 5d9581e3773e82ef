"""Run many `python -m` commands as forks of one interpreter that has already imported the heavy libraries.

Most of a bad-input command's cost is importing torch (1.2-1.5 s), not the check it makes. This script imports
torch, NumPy, pyarrow, PyYAML, MLflow, Ray and DeepSpeed once, then runs each command in a forked child the way
CPython runs `python -m module args`: a fresh ``__main__`` module, ``runpy._run_module_as_main`` (what ``-m``
calls), ``SystemExit`` turned into the exit status, an uncaught exception printed by ``sys.excepthook`` with
status 1, the exit handlers run. Each child's stdout and stderr go to files; stdin is /dev/null. What is not the
same: the libraries above are already in ``sys.modules``, so a command that uses a submodule it never imports
could pass here. tests/project/test_cli_errors.py checks two rows against real ``python -m`` processes.

    python tests/support/warm_python.py REQUESTS.json RESULTS.json [--jobs N]

REQUESTS.json: a list of ``{"module": ..., "args": [...], "stdout": path, "stderr": path}``; RESULTS.json gets
their exit statuses, in order. Run it with the environment and working folder the commands need.
"""

from __future__ import annotations

import argparse
import atexit
import gc
import json
import os
import sys
import threading
import traceback
import types
from pathlib import Path


def _exit_status(stop: SystemExit) -> int:
    """The status CPython's own exit gives ``raise SystemExit(code)``: None 0, an int itself, else printed and 1."""
    if stop.code is None:
        return 0
    if isinstance(stop.code, int):
        return stop.code & 0xFF
    print(stop.code, file=sys.stderr)
    return 1


def run_as_main(target: str, module: bool = True) -> int:
    """Run ``target`` in this process as ``python -m target`` (``module``) or ``python target`` runs it, with
    ``sys.argv`` and ``sys.path[0]`` already set by the caller: a fresh ``__main__``, ``SystemExit`` turned into the
    exit status, an uncaught exception printed by ``sys.excepthook`` (status 1), then what the interpreter's end does
    before teardown: non-daemon threads joined and the exit handlers run. Returns the exit status."""
    import runpy

    sys.modules["__main__"] = types.ModuleType("__main__")  # not the caller's namespace
    try:
        if module:
            runpy._run_module_as_main(target, alter_argv=True)  # type: ignore[attr-defined]
        else:
            runpy.run_path(target, run_name="__main__")
        status = 0
    except SystemExit as stop:
        status = _exit_status(stop)
    except BaseException:
        sys.excepthook(*sys.exc_info())
        status = 1
    threading._shutdown()  # type: ignore[attr-defined]
    try:
        atexit._run_exitfuncs()
    except SystemExit as stop:
        status = _exit_status(stop)
    return status


def exit_now(status: int) -> None:
    """End a forked child with ``status`` once its output is flushed, without the parent's exit handlers."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(status & 0xFF)


def _child(request: dict) -> None:
    """In the forked child: become ``python -m module args`` and never return."""
    status = 1
    try:
        stdin = os.open(os.devnull, os.O_RDONLY)
        os.dup2(stdin, 0)
        for fd, key in ((1, "stdout"), (2, "stderr")):
            os.dup2(os.open(request[key], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
        sys.path[0] = os.getcwd()  # where `python -m` looks first (this script's folder is there now)
        sys.argv = [request["module"], *request["args"]]  # runpy puts the module's file in argv[0]
        status = run_as_main(request["module"])
    except BaseException:
        traceback.print_exc()
    finally:
        exit_now(status)


def run_all(requests: list[dict], jobs: int) -> list[int]:
    """Fork a child per request, ``jobs`` at a time; their exit statuses in request order."""
    statuses = [0] * len(requests)
    running: dict[int, int] = {}  # pid -> index
    pending = iter(enumerate(requests))
    while True:
        while len(running) < jobs:
            item = next(pending, None)
            if item is None:
                break
            index, request = item
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                _child(request)
            running[pid] = index
        if not running:
            return statuses
        pid, wait_status = os.wait()
        statuses[running.pop(pid)] = os.waitstatus_to_exitcode(wait_status)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("requests", type=Path)
    parser.add_argument("results", type=Path)
    parser.add_argument("--jobs", type=int, default=1, help="commands running at once")
    args = parser.parse_args()
    requests = json.loads(args.requests.read_text())
    import deepspeed  # noqa: F401  (torch, NumPy and what DeepSpeed pulls in)
    import mlflow  # noqa: F401
    import numpy  # noqa: F401
    import pyarrow.parquet  # noqa: F401
    import ray  # noqa: F401
    import torch  # noqa: F401
    import yaml  # noqa: F401

    # What is imported now is never collected: kept out of the children's collections, which otherwise walked (and
    # so copied, page by page) the whole inherited heap in every fork (docs/benchmarks/2026-11-28-test-suite.md)
    gc.freeze()
    args.results.write_text(json.dumps(run_all(requests, args.jobs)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
