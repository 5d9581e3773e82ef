"""Which checkpoints each eval suite evaluates: every N-th checkpoint, the step-0 baseline and the last step.

The one rule for the plan, rank 0 and the eval scheduler (docs/design.md, "Evals after every checkpoint").
"""

from __future__ import annotations

from dataclasses import dataclass

# Checkpoints the eval scheduler pins for pending evals, at most: beyond, a due one is skipped (never the last step's)
MAX_PINNED = 8


@dataclass(frozen=True)
class EvalCadence:
    suites: tuple[tuple[str, int], ...]  # (suite, every N-th checkpoint), in the order they run
    checkpoint_every: int = 1  # checkpoint.every_steps
    last_step: int | None = None  # evaluated by every suite; None: not known

    def due(self, step: int) -> tuple[str, ...]:
        """The suites whose period (every x checkpoint.every_steps) divides ``step``, all at the last step."""
        return tuple(
            s for s, every in self.suites if step == self.last_step or step % (every * self.checkpoint_every) == 0
        )

    def pin_reason(self, step: int) -> str | None:
        """What a checkpoint's ``PINNED`` says while its evals wait; None where no suite is `due`."""
        due = self.due(step)
        return f"evals {'+'.join(due)} pending on step {step}" if due else None

    def evaluations(self, every: int, baseline: bool) -> int:
        """Checkpoints a suite evaluates: the baseline when saved, each multiple of its period, the last step."""
        if self.last_step is None:
            raise ValueError("counting a suite's evaluations needs the run's last step")
        period = every * self.checkpoint_every
        return int(baseline) + self.last_step // period + (self.last_step % period != 0)
