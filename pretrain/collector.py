"""CPython's cyclic garbage collector over a training process's start: paused, then told to skip what the start made.

A rank's start makes millions of objects that live as long as the process and next to no cyclic garbage, yet the
collector walks them all each time the heap grows by a quarter (docs/performance.md, "A rank's start"). `pause()` at
the entry point stops those passes; `resume()`, before the first step, collects once, freezes the survivors out of
later passes (`gc.freeze`) and restarts the collector. The numerics are unaffected.
"""

from __future__ import annotations

import gc

_paused = False


def pause() -> None:
    """Stop the collector until `resume`; a no-op where it is already off."""
    global _paused
    if gc.isenabled():
        gc.disable()
        _paused = True


def resume() -> None:
    """Collect once, freeze the survivors and restart the collector; only where `pause` stopped it."""
    global _paused
    if _paused:
        gc.collect()
        gc.freeze()
        gc.enable()
        _paused = False
