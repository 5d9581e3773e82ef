"""CPU load for the tests that must pass on a busy machine."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator


@contextlib.contextmanager
def cpu_burners(n: int, measuring: bool) -> Iterator[None]:
    """`n` processes spinning on a core each while the block runs. In the suite (``measuring`` false) they run at
    nice 19: its other tests keep the cores busy, and a burner must not take their CPU. Measuring, they run at the
    priority of the commands they load."""
    spin = f"import os; os.nice({0 if measuring else 19})\nwhile True: pass"
    procs = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(n)]
    try:
        yield
    finally:
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait(timeout=30)
