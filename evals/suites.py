"""Eval suites: the YAML format, the registry of evaluator types, and what an evaluator receives and returns.

A suite is ``configs/evals/<name>.yaml``, big_vision style — a list of evaluators, each chosen by ``type``::

    name: local_fewshot
    description: few-shot ridge on the built-in sets
    evaluators:
      - type: fewshot            # a key of EVALUATORS
        datasets: [digits, dsprites_loc]
        shots: [1, 5, 10]

Everything except ``type`` (and an optional display ``name``) is the evaluator's own options; each evaluator
parses them into its frozen dataclass with ``parse_options``, which rejects unknown keys.

Registering a new type (e.g. ``inspect``): ``EVALUATORS["inspect"] = my_fn`` or decorate with
``@register_evaluator("inspect")``. Built-ins are registered lazily (module path strings resolved on first use)
so importing this module, and ``evals.run``, stays cheap. The contract of an evaluator::

    fn(ctx: EvalContext, options: dict) -> EvalOutput
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from data_pipeline.cli import read_yaml

PROJECT_ROOT = Path(__file__).resolve().parent.parent
SUITES_DIR = PROJECT_ROOT / "configs" / "evals"

# The columns of ``evals/<suite>.parquet`` — one row per reported number (see ``ResultRow``).
RESULT_COLUMNS = ("suite", "evaluator", "dataset", "metric", "value", "std", "count", "status", "detail", "step")


@dataclass(frozen=True)
class ResultRow:
    """One reported number. ``metric`` is the MLflow key (``fewshot/digits/10shot``) when it is logged.

    ``status`` is ``ok`` or ``missing`` (a task without data: ``value`` is NaN and ``detail`` says why);
    ``count`` is what the number averages over (seeds, tasks); ``std`` is NaN when there is no spread to report.
    """

    evaluator: str
    dataset: str
    metric: str
    value: float
    std: float = math.nan
    count: int = 1
    status: str = "ok"
    detail: str = ""


@dataclass
class EvalOutput:
    """What an evaluator returns: table rows, and the metrics to log to MLflow (key → value, at the ckpt step)."""

    rows: list[ResultRow] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)
    artifacts: list[Path] = field(default_factory=list)  # files to log to MLflow (figures); optional

    def extend(self, other: EvalOutput) -> None:
        self.rows.extend(other.rows)
        self.metrics.update(other.metrics)
        self.artifacts.extend(other.artifacts)


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


Evaluator = Callable[[EvalContext, dict], EvalOutput]

# name → callable, or "module:function" resolved on first use (keeps imports cheap).
EVALUATORS: dict[str, Evaluator | str] = {
    "fewshot": "evals.fewshot:evaluate",
    "finetune": "evals.finetune:evaluate",
    "vtab": "evals.vtab:evaluate",
    "inspect": "evals.inspect:evaluate",
}


def register_evaluator(name: str) -> Callable[[Evaluator], Evaluator]:
    """Decorator: ``@register_evaluator("inspect")`` adds a function to ``EVALUATORS``."""

    def decorate(fn: Evaluator) -> Evaluator:
        EVALUATORS[name] = fn
        return fn

    return decorate


def get_evaluator(name: str) -> Evaluator:
    if name not in EVALUATORS:
        raise ValueError(f"unknown evaluator type {name!r}; registered types: {sorted(EVALUATORS)}")
    entry = EVALUATORS[name]
    if isinstance(entry, str):
        module_name, _, attr = entry.partition(":")
        entry = getattr(importlib.import_module(module_name), attr)
        EVALUATORS[name] = entry
    return entry


@dataclass(frozen=True)
class EvaluatorSpec:
    type: str
    name: str
    options: dict


@dataclass(frozen=True)
class SuiteConfig:
    name: str
    evaluators: tuple[EvaluatorSpec, ...]
    description: str = ""


def suite_path(name_or_path: str | Path) -> Path:
    """``local_fewshot`` → ``configs/evals/local_fewshot.yaml``; an existing ``.yaml`` path is used as is."""
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml"):
        if not path.is_file():
            known = sorted(p.stem for p in SUITES_DIR.glob("*.yaml"))
            raise ValueError(
                f"eval suite file {path} does not exist or is not a file; give a YAML path or one of {known}"
            )
        return path
    candidate = SUITES_DIR / f"{name_or_path}.yaml"
    if not candidate.is_file():
        known = sorted(p.stem for p in SUITES_DIR.glob("*.yaml"))
        raise ValueError(f"unknown eval suite {str(name_or_path)!r}; known suites in {SUITES_DIR}: {known}")
    return candidate


def load_suite(name_or_path: str | Path) -> SuiteConfig:
    """Read and check a suite: a name, and a non-empty list of evaluators of registered types."""
    path = suite_path(name_or_path)
    raw = read_yaml(path, "eval suite") or {}
    if not isinstance(raw, dict) or not isinstance(raw.get("evaluators"), list) or not raw["evaluators"]:
        raise ValueError(
            f"{path}: a suite needs a non-empty 'evaluators' list (a mapping with evaluators: [- type: fewshot ...]); "
            f"see {SUITES_DIR / 'local_fewshot.yaml'}"
        )
    unknown = set(raw) - {"name", "description", "evaluators"}
    if unknown:
        raise ValueError(
            f"{path}: unknown top-level keys {sorted(map(str, unknown))}; allowed: name, description, evaluators"
        )
    for key in ("name", "description"):
        if key in raw and not isinstance(raw[key], str):
            raise ValueError(f"{path}: {key} must be a string, got {raw[key]!r}")
    specs = []
    for i, entry in enumerate(raw["evaluators"]):
        if not isinstance(entry, dict) or "type" not in entry:
            raise ValueError(f"{path}: evaluator #{i} needs a 'type' (one of {sorted(EVALUATORS)})")
        options = {k: v for k, v in entry.items() if k not in ("type", "name")}
        if not isinstance(entry["type"], str) or entry["type"] not in EVALUATORS:
            raise ValueError(f"{path}: evaluator #{i} has unknown type {entry['type']!r}; known: {sorted(EVALUATORS)}")
        bad_keys = [k for k in options if not isinstance(k, str)]
        if bad_keys:
            raise ValueError(f"{path}: evaluator #{i} ({entry['type']}) has non-text option names {bad_keys}")
        specs.append(EvaluatorSpec(type=entry["type"], name=str(entry.get("name", entry["type"])), options=options))
    return SuiteConfig(name=raw.get("name", path.stem), evaluators=tuple(specs), description=raw.get("description", ""))


def parse_options(cls, options: dict, where: str):
    """Build the frozen options dataclass ``cls`` from a suite entry; unknown keys are an error, not ignored."""
    from pretrain.config import coerce_value  # lazily: evaluators import torch anyway, evals.run itself need not

    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(options) - names
    if unknown:
        raise ValueError(f"{where}: unknown option(s) {sorted(map(str, unknown))}; allowed: {sorted(names)}")
    hints = typing.get_type_hints(cls)
    converted = {
        f.name: coerce_value(options[f.name], hints[f.name], f"{where}: {f.name}")
        for f in dataclasses.fields(cls)
        if f.name in options
    }
    return cls(**converted)
