"""Launch training ranks the way torchrun does, as forks of one interpreter that has already imported what a rank
imports.

A tiny 2-rank run of the tests spends most of its CPU starting processes: torchrun's own process and each rank import
torch, DeepSpeed and Dynamo (measured on the 2-core machine: 14.6 CPU-s for an 8-step run under torchrun, 4.7 forked
here, losses the same bit for bit). The zygote, one per pytest worker, imports them once, then for each launch forks
``nproc`` ranks with the variables torchrun gives a rank (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK,
ROLE_RANK, ROLE_WORLD_SIZE, MASTER_ADDR, MASTER_PORT). Each rank becomes ``python -m module args`` (or ``python
script args``) as CPython runs it: a fresh ``__main__``, non-daemon threads joined and exit handlers run at the end.
Their output goes to one file, as torchrun merges it; and as torchrun does, when a rank fails the others are ended
and the launch's status is 1.

What differs from torchrun: no elastic agent (no restarts), and what the libraries read when they are imported is
the zygote's: `launch` runs torchrun itself when a launch asks for another value of those variables (`IMPORT_TIME`).
Tests of the launcher's own behaviour (a rank's teardown, torchrun's message after a failed rank) run torchrun.

    python tests/support/warm_ranks.py      # the zygote: a JSON request per line on stdin, JSON answers on stdout
"""

from __future__ import annotations

import atexit
import gc
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Read by torch, libgomp or DeepSpeed when they are imported: a launch must find the zygote's values.
IMPORT_TIME = ("DS_ACCELERATOR", "OMP_NUM_THREADS", "OMP_WAIT_POLICY", "TORCH_LOGS", "PYTHONPATH")
GRACE_S = 10.0  # after a rank failed, the others get SIGTERM, then SIGKILL this much later


# ----------------------------------------------------------------------------------------------- in the zygote


def _rank(request: dict, rank: int, protocol: int) -> None:
    """In a forked child: become rank ``rank`` of the launch and never return."""
    from tests.support.warm_python import exit_now, run_as_main  # imported by the zygote (`serve`): no cost here

    status = 1
    try:
        os.setpgid(0, 0)  # its own group: ending the launch ends the rank's loader workers too
        out = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)  # in place of the requests
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.close(protocol)
        os.chdir(request["cwd"])
        nproc = request["nproc"]
        os.environ.clear()
        os.environ.update(request["env"])
        if request["ranks"]:  # what torchrun sets; a standalone `python -m pretrain.train` has none of them
            for name in ("RANK", "LOCAL_RANK", "ROLE_RANK"):
                os.environ[name] = str(rank)
            for name in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "ROLE_WORLD_SIZE"):
                os.environ[name] = str(nproc)
            os.environ.update(GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(request["port"]))
        sys.argv = [request["target"], *request["args"]]
        if request["module"]:
            sys.path[0] = request["cwd"]  # where `python -m` looks first
        else:
            sys.path[0] = str(Path(request["target"]).resolve().parent)  # where `python script` looks first
        status = run_as_main(request["target"], module=request["module"])
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        exit_now(status)


def _end(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.killpg(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _wait_all(pids: list[int]) -> list[int]:
    """Exit statuses of ``pids`` in order; when one fails, the others are ended as torchrun ends them."""
    statuses: dict[int, int] = {}
    failed_at = None
    while len(statuses) < len(pids):
        pid, wait_status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            if failed_at is not None and time.monotonic() - failed_at > GRACE_S:
                _end([p for p in pids if p not in statuses], signal.SIGKILL)
            time.sleep(0.05)
            continue
        statuses[pid] = os.waitstatus_to_exitcode(wait_status)
        if statuses[pid] != 0 and failed_at is None:
            failed_at = time.monotonic()
            _end([p for p in pids if p not in statuses], signal.SIGTERM)
    return [statuses[p] for p in pids]


def serve() -> int:
    """The zygote: import what a rank imports, then launch a rank group per request line until stdin closes."""
    import torch  # noqa: F401
    import torch._dynamo  # noqa: F401  (torch's optimizer imports it at every step)
    import torch.optim  # noqa: F401

    from pretrain.distributed import import_deepspeed

    import_deepspeed()
    import pretrain.train  # noqa: F401
    import tests.support.warm_python  # noqa: F401  (each rank runs its module through it)

    gc.freeze()  # out of each rank's collections, which would walk (and copy) the inherited heap (warm_python.main)
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # nothing else may write into the answers
    answers.write(json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pids = []
        for rank in range(request["nproc"]):
            pid = os.fork()
            if pid == 0:
                _rank(request, rank, answers.fileno())
            pids.append(pid)
        answers.write(json.dumps({"pids": pids}) + "\n")
        answers.write(json.dumps({"statuses": _wait_all(pids)}) + "\n")
    return 0


# ----------------------------------------------------------------------------------------------- in the test


class _Zygote:
    def __init__(self, env: dict[str, str]):
        command = [sys.executable, str(Path(__file__).resolve())]
        pipes = dict(stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # its stderr: the test's
        self.proc = subprocess.Popen(command, cwd=ROOT, env=env, **pipes)
        atexit.register(self.close)
        assert json.loads(self._line(300)) == {"ready": True}, "the rank zygote did not start"

    def _line(self, timeout: float) -> str:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            raise TimeoutError
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the rank zygote ended (status {self.proc.poll()})")
        return line

    def close(self) -> None:
        """End the zygote: no more requests (it returns at the end of its input), else killed."""
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc.stdout.close()

    def launch(self, request: dict, timeout: float) -> list[int]:
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        pids = json.loads(self._line(60))["pids"]
        try:
            return json.loads(self._line(timeout))["statuses"]
        except TimeoutError:
            _end(pids, signal.SIGKILL)
            json.loads(self._line(60))
            raise


_zygotes: dict[tuple, _Zygote] = {}
_lock = threading.Lock()


def launch(
    target: str,
    args: list[str],
    nproc: int,
    env: dict[str, str],
    log: Path,
    timeout: float,
    module: bool = True,
    ranks: bool = True,
) -> int:
    """Run ``python -m target args`` (``module``) or ``python target args`` as ``nproc`` ranks, their output
    appended to ``log``; 0 when every rank exited 0, else 1 (as torchrun). ``ranks=False``: one process without
    torchrun's variables (a standalone run). TimeoutError after ``timeout`` seconds, the ranks killed."""
    key = tuple(env.get(name) for name in IMPORT_TIME) + (sys.executable,)
    with _lock:
        if key not in _zygotes:
            _zygotes[key] = _Zygote(env)
        from cluster.local_head import free_port  # here: as a script (the zygote) this file starts off the path

        port = free_port()
        request = dict(target=target, args=args, nproc=nproc, env=env, cwd=str(ROOT), log=str(log), port=port)
        statuses = _zygotes[key].launch({**request, "module": module, "ranks": ranks}, timeout)
    return 0 if all(status == 0 for status in statuses) else 1


if __name__ == "__main__":
    sys.path[0] = str(ROOT)
    sys.exit(serve())
