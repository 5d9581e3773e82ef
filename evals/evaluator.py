"""The evaluator contract: `EvalContext` and parsed options in, `ResultRow`s out.

The rows are the record; ``mlflow_metrics(rows)`` is the only source of MLflow metrics. Types: ``evals.suites``.
"""

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
    """One reported number; ``metric`` is its MLflow key (``fewshot/digits/10shot``).

    ``status``: ``ok`` (logged if finite), ``missing`` (no data: NaN, ``detail`` says why) or ``sweep`` (a point of a
    hyperparameter search: table only, as MLflow keeps one value per key and step). ``count``: how many values
    (seeds, tasks) it averages.
    """

    evaluator: str
    dataset: str
    metric: str
    value: float
    std: float = math.nan
    count: int = 1
    status: str = "ok"
    detail: str = ""


def mlflow_metrics(rows: Iterable[ResultRow | Mapping[str, Any]]) -> dict[str, float]:
    """``{metric: value}`` of the ``ok`` rows with a finite value (`ResultRow`s or parquet records); a repeated key
    takes the later row's value, as MLflow would."""
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
    """What an evaluator gets for one checkpoint.

    ``model`` is shared and in eval mode: do not modify it. ``load_model(image_size=None)`` returns a fresh copy
    (position embeddings resized) for evaluators that train. ``feature_cache`` lives for one ``run_suite`` call.
    """

    model: Any
    load_model: Callable[..., Any]
    data_root: str | Path  # a local folder, or a remote URL as a string (`evals.features.data_location`)
    step: int
    out_dir: Path  # for files (figures): the checkpoint's ``evals/`` folder
    num_threads: int | None = None
    device: str = "cpu"
    log: Callable[[str], None] = print
    feature_cache: dict = field(default_factory=dict)
