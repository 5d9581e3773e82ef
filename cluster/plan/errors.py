"""The plan's one error type, shared by its parts."""

from __future__ import annotations


class PlanError(ValueError):
    """The plan cannot run as configured; the message names the problem and the fix."""
