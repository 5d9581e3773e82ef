"""The garbage collector paused over a rank's start (docs/performance.md, "A rank's start")."""

from __future__ import annotations

import gc

_paused = False


def pause() -> None:
    """Stop the collector until `resume`, if it is on."""
    global _paused
    if gc.isenabled():
        gc.disable()
        _paused = True


def resume() -> None:
    """Collect once, freeze the survivors and restart the collector, if `pause` stopped it."""
    global _paused
    if _paused:
        gc.collect()
        gc.freeze()
        gc.enable()
        _paused = False
