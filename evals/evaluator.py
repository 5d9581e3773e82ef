"""The evaluator contract: `EvalContext` and parsed options in, `ResultRow`s out; ``mlflow_metrics(rows)`` is the
only source of MLflow metrics. Types: ``evals.suites``."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# The columns of ``evals/<suite>.parquet``.
RESULT_COLUMNS = ("suite", "evaluator", "dataset", "metric", "value", "std", "count", "status", "detail", "step")


@dataclass(frozen=True)
class ResultRow:
    """One reported number; ``metric``: its MLflow key. ``status``: ``ok`` (logged if finite), ``missing`` (NaN,
    ``detail`` says why) or ``sweep`` (a search point: table only). ``count``: values (seeds, tasks) averaged."""

    evaluator: str
    dataset: str
    metric: str
    value: float
    std: float = math.nan
    count: int = 1
    status: str = "ok"
    detail: str = ""


def mlflow_metrics(rows: Iterable[ResultRow | Mapping[str, Any]]) -> dict[str, float]:
    """``{metric: value}`` of the finite ``ok`` rows (`ResultRow`s or records); a repeated key keeps the later value."""
    metrics = {}
    for row in rows:
        row = row if isinstance(row, Mapping) else vars(row)
        if row["status"] == "ok" and row["metric"] and math.isfinite(row["value"]):
            metrics[row["metric"]] = float(row["value"])
    return metrics


@dataclass
class EvalOutput:
    """An evaluator's rows, and files (figures) to log to MLflow beside them."""

    rows: list[ResultRow] = field(default_factory=list)
    artifacts: list[Path] = field(default_factory=list)


@dataclass
class EvalContext:
    """``model`` is shared, in eval mode: do not modify it; ``load_model(image_size=None)`` returns a fresh copy to
    train. ``feature_cache`` lives for one ``run_suite``."""

    model: Any
    load_model: Callable[..., Any]
    data_root: str | Path  # a `evals.features.data_location`
    step: int
    out_dir: Path  # for figures: the checkpoint's ``evals/`` folder
    num_threads: int | None = None
    device: str = "cpu"
    log: Callable[[str], None] = print
    feature_cache: dict = field(default_factory=dict)
    entry: str = ""  # the suite entry's (unique) name; "": its type's. Outputs of a non-default entry carry it.
