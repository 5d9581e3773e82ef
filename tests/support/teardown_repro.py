"""One torchrun rank of `python -m pretrain.train` that ends with a NORMAL interpreter exit (docs/reference.md §7).

    torchrun --nproc-per-node 2 tests/support/teardown_repro.py REPORT_DIR --config RECIPE [pretrain.train arguments]

It runs `pretrain.train.main` (training, then the project's teardown, `finish_distributed`), collects garbage, and
writes the names of the gloo threads still alive in this process (`/proc/self/task/*/comm`: `pt_gloo_runloop`,
`gloo_tcp_loop`) to REPORT_DIR/rank<RANK>.json. Then it leaves through `sys.exit`, not `exit_rank`: Python finalizes
the interpreter and the C++ runtime runs its exit-time destructors, which is where a process group that outlived
the teardown used to abort a finished rank ("terminate called without an active exception", SIGABRT).
``tests/pretrain/test_rank_teardown.py`` runs it; run it by hand in a loop, with the other core busy, to look for that
abort.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import threading
from pathlib import Path

GLOO_THREADS = ("pt_gloo_runloop", "gloo_tcp_loop")  # ProcessGroupGloo's workers and gloo's TCP event loop


def thread_names() -> list[str]:
    """The names of this process's threads (Linux)."""
    names = []
    for task in sorted(Path("/proc/self/task").iterdir()):
        try:
            names.append((task / "comm").read_text().strip())
        except OSError:  # the thread ended meanwhile
            pass
    return names


def gloo_threads() -> list[str]:
    return [name for name in thread_names() if name.startswith(GLOO_THREADS)]


def main() -> int:
    report_dir, argv = Path(sys.argv[1]), sys.argv[2:]
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from pretrain.train import main as train_main

    code = train_main(argv)  # ends with finish_distributed(), the project's teardown
    gc.collect()
    report = {
        "rank": int(os.environ.get("RANK", "0")),
        "code": code,
        "gloo_threads": gloo_threads(),
        "threads": thread_names(),  # every native thread, by name
        "python_threads": [f"{t.name}{' (daemon)' if t.daemon else ''}" for t in threading.enumerate()],
    }
    report_dir.mkdir(parents=True, exist_ok=True)
    (report_dir / f"rank{report['rank']}.json").write_text(json.dumps(report))
    print(f"teardown_repro rank {report['rank']}: gloo threads alive before exit: {report['gloo_threads']}", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())  # a normal exit, with the interpreter's and the C++ runtime's teardown
