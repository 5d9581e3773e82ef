"""CPython's cyclic garbage collector over a training process's start: paused, then told to skip what the start made.

A rank's start (torch, DeepSpeed and what it pulls in: MLflow, torch._dynamo, torch._inductor; the engine, the data)
makes a few million objects that live as long as the process, and next to no cyclic garbage. The collector walks
every tracked object again each time the heap has grown by a quarter: eight full passes while a 2-rank `torchrun` of
`pretrain.train` starts, 1.3 s of each rank's CPU on the 2-core test machine, 3 of its 18 CPU-seconds in all
(docs/benchmarks/2026-11-28-test-suite.md). `pause()` at the entry point stops those passes; `resume()`, before the
first step, collects once (whatever cyclic garbage the start left is freed, not kept), moves the survivors into the
permanent generation (`gc.freeze`: later passes skip them) and starts the collector again. Garbage collection never
touches the numerics: the losses are bit-identical either way.
"""

from __future__ import annotations

import gc

_paused = False


def pause() -> None:
    """Stop the collector until `resume` (a no-op where it is already off: someone else's choice, left alone)."""
    global _paused
    if gc.isenabled():
        gc.disable()
        _paused = True


def resume() -> None:
    """After the start: collect once, freeze the survivors out of later passes, collect again from here on. Only
    where `pause` stopped the collector; elsewhere (a process that never paused it) nothing changes."""
    global _paused
    if _paused:
        gc.collect()
        gc.freeze()
        gc.enable()
        _paused = False
