"""Benchmarks (docs/benchmarks/README.md)."""

from __future__ import annotations

import sys
from pathlib import Path

from data_pipeline.cli import output_file


def out_file(path: str, prog: str, option: str = "--out") -> Path | None:
    """`output_file`'s path, or None once its error is printed as ``<prog>: error: ...``."""
    try:
        return output_file(path, option)
    except ValueError as error:
        print(f"{prog}: error: {error}", file=sys.stderr)
        return None
