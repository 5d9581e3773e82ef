"""Benchmarks (docs/benchmarks/README.md)."""

from __future__ import annotations

import json
from pathlib import Path

from data_pipeline.cli import fail, interrupted, output_file
from data_pipeline.paths import write_text_atomically


def out_file(path: str, prog: str, option: str = "--out") -> Path | None:
    """`output_file`'s path (checked before the minutes of measuring, not after), or None once its error is printed
    as ``<prog>: error: ...`` (``prog``: ``python -m <module>``)."""
    try:
        return output_file(path, option)
    except ValueError as error:
        fail(prog, error)
        return None


def write_json(out: Path, result: dict) -> None:
    """``result`` as ``out``, whole or not at all: a kill or a full disk leaves the previous file."""
    write_text_atomically(out, json.dumps(result, indent=2, default=float) + "\n")


def stopped(prog: str, out: Path) -> int:
    """Ctrl-C's one line (exit 130) for a benchmark that writes ``out`` at its end."""
    return interrupted(prog, f"nothing was written to {out}; the same command starts over")
