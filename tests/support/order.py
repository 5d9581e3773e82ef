"""The suite's order without `--shuffle`: longest first, and the tests marked `waits` kept apart.

`make test` runs 3 pytest-xdist workers on 2 cores, each taking the next test as it frees up. A test marked `waits`
spends most of its time waiting (on a timeout, an outage, a server's start) at a small share of a core; beside two
busy workers it costs nothing, but two of them at once leave a core idle (measured on the 2-core machine: 20-25
core-seconds at a time, when three such tests of similar length sat side by side in the longest-first order). So
`order` replays the run with the recorded seconds (`tests/durations.json`) and starts a waiting test only where no
other one would be running, else the next test that does not wait.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence

UNRECORDED_S = 1.0  # what the replay counts for a test shorter than the recorded ones


def order(names: Sequence[str], seconds: Mapping[str, float], waiting: set[str], workers: int) -> list[str]:
    """``names`` longest first (the rest in their given order), with no two ``waiting`` ones at the same time in a
    replay on ``workers`` workers."""
    pending = sorted(names, key=lambda name: -seconds.get(name, 0.0))  # stable
    free = [0.0] * max(1, workers)  # when each worker takes its next test
    waiting_until = 0.0
    ordered = []
    while pending:
        now = heapq.heappop(free)
        pick = next((n for n in pending if now >= waiting_until or n not in waiting), pending[0])
        pending.remove(pick)
        ordered.append(pick)
        end = now + seconds.get(pick, UNRECORDED_S)
        if pick in waiting:
            waiting_until = max(waiting_until, end)
        heapq.heappush(free, end)
    return ordered
