"""What an evaluator is: it receives an `EvalContext` and its parsed options, and returns `ResultRow`s once.

The rows are the record: ``evals.run`` writes them to ``<suite>.parquet`` and logs ``mlflow_metrics(rows)`` — the
only place MLflow metrics come from — at the checkpoint's step. The registry of types is ``evals.suites``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# The columns of ``evals/<suite>.parquet`` — one row per reported number (see ``ResultRow``).
RESULT_COLUMNS = ("suite", "evaluator", "dataset", "metric", "value", "std", "count", "status", "detail", "step")


@dataclass(frozen=True)
class ResultRow:
    """One reported number; ``metric`` is its MLflow key (``fewshot/digits/10shot``).

    ``status``: ``ok`` (logged to MLflow when ``value`` is finite), ``missing`` (a task without data: ``value`` is
    NaN and ``detail`` says why) or ``sweep`` (one point of a hyperparameter search, e.g. the held-out accuracy of
    each lr: the table only, as MLflow keeps one value per key and step). ``count`` is what the number averages
    over (seeds, tasks); ``std`` is NaN when there is no spread to report.
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
    """``{metric: value}`` of the ``ok`` rows with a finite value (rows as `ResultRow`s or parquet records); a key
    repeated by a later row takes the later value, as MLflow would."""
    metrics = {}
    for row in rows:
        row = row if isinstance(row, Mapping) else vars(row)
        if row["status"] == "ok" and row["metric"] and math.isfinite(row["value"]):
            metrics[row["metric"]] = float(row["value"])
    return metrics


@dataclass
class EvalOutput:
    """What an evaluator returns: its table rows, and files to log to MLflow beside them (figures; optional)."""

    rows: list[ResultRow] = field(default_factory=list)
    artifacts: list[Path] = field(default_factory=list)


@dataclass
class EvalContext:
    """What every evaluator gets from the runner for one checkpoint.

    ``load_model(image_size=None)`` returns a *fresh* copy of the checkpoint's model (resized position
    embeddings when ``image_size`` differs), for evaluators that train; ``model`` is one shared instance in eval
    mode for frozen-feature evaluators, which must not modify it. ``feature_cache`` lives for one ``run_suite``
    call only, so nothing computed for one checkpoint is reused for another.
    """

    model: Any
    load_model: Callable[..., Any]
    data_root: Path
    step: int
    out_dir: Path  # where evaluators may write files (figures); the checkpoint's ``evals/`` folder
    num_threads: int | None = None
    device: str = "cpu"
    log: Callable[[str], None] = print
    feature_cache: dict = field(default_factory=dict)
