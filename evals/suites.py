"""Eval suites: the registry of evaluator types, and the YAML format (``configs/evals/<name>.yaml``, big_vision style:
``name``, ``description``, ``evaluators``: a list of ``type: <EVALUATORS key>`` plus the type's options). ``load_suite``
checks a suite when read, before a job is submitted. A plug-in: ``register_evaluator``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from data_pipeline.paths import SUITES_DIR
from evals import fewshot, finetune, inspection, vtab
from evals.evaluator import EvalContext, EvalOutput
from pretrain.config import typed_yaml


@dataclass(frozen=True)
class EvaluatorType:
    options: type
    evaluate: Callable[[EvalContext, Any], EvalOutput]
    # Options that resize the model (None: its own size), checked against its patch size.
    resolutions: tuple[str, ...] = ()


EVALUATORS: dict[str, EvaluatorType] = {
    "fewshot": EvaluatorType(fewshot.FewshotOptions, fewshot.evaluate, resolutions=("image_size",)),
    "finetune": EvaluatorType(finetune.FinetuneOptions, finetune.evaluate, resolutions=("image_size",)),
    "vtab": EvaluatorType(vtab.VtabOptions, vtab.evaluate, resolutions=("image_size",)),
    "inspect": EvaluatorType(inspection.InspectConfig, inspection.evaluate),
}


def register_evaluator(name: str, options: type, resolutions: tuple[str, ...] = ()) -> Callable:
    """Decorator: ``@register_evaluator("knn", KnnOptions)`` adds ``evaluate(ctx, options)`` to ``EVALUATORS``."""

    def decorate(fn: Callable[[EvalContext, Any], EvalOutput]) -> Callable:
        EVALUATORS[name] = EvaluatorType(options, fn, resolutions)
        return fn

    return decorate


@dataclass(frozen=True)
class EvaluatorSpec:
    type: str
    name: str
    options: Any  # an EVALUATORS[type].options instance, checked at load


@dataclass(frozen=True)
class SuiteConfig:
    name: str
    evaluators: tuple[EvaluatorSpec, ...]
    description: str = ""


def suite_path(name_or_path: str | Path) -> Path:
    """``local_fewshot`` → ``configs/evals/local_fewshot.yaml``; an existing ``.yaml`` path is used as is."""
    path = Path(name_or_path)
    explicit = path.suffix in (".yaml", ".yml")
    candidate = path if explicit else SUITES_DIR / f"{name_or_path}.yaml"
    if candidate.is_file():
        return candidate
    known = sorted(p.stem for p in SUITES_DIR.glob("*.yaml"))
    if explicit:
        raise ValueError(f"eval suite file {path} does not exist or is not a file; give a YAML path or one of {known}")
    raise ValueError(f"unknown eval suite {str(name_or_path)!r}; known suites in {SUITES_DIR}: {known}")


def _check_name(name: str, setting: str, names: str) -> None:
    """A name that becomes a file or folder name: one path component."""
    if name in ("", ".", "..") or "/" in name or "\\" in name:
        raise ValueError(f"{setting} {name!r} must be a non-empty name without '/' (it names {names})")


def load_suite(name_or_path: str | Path) -> SuiteConfig:
    """Read and check a suite; ValueError naming the fix."""
    path = suite_path(name_or_path)
    example = f"a mapping with evaluators: [- type: fewshot ...]; see {SUITES_DIR / 'local_fewshot.yaml'}"
    raw = typed_yaml.read_mapping(path, "eval suite", example)
    if not isinstance(raw.get("evaluators"), list) or not raw["evaluators"]:
        raise ValueError(f"{path}: a suite needs a non-empty 'evaluators' list ({example})")
    unknown = set(raw) - {"name", "description", "evaluators"}
    if unknown:
        raise ValueError(
            f"{path}: unknown top-level keys {sorted(map(str, unknown))}; allowed: name, description, evaluators"
        )
    for key in ("name", "description"):
        if key in raw and not isinstance(raw[key], str):
            raise ValueError(f"{path}: {key} must be a string, got {raw[key]!r}")
    _check_name(raw.get("name", path.stem), f"{path}: name", "the table <name>.parquet")  # before any work
    specs, names = [], set()
    for i, entry in enumerate(raw["evaluators"]):
        if not isinstance(entry, dict) or "type" not in entry:
            raise ValueError(f"{path}: evaluators[{i}] needs a 'type' (one of {sorted(EVALUATORS)})")
        options = {k: v for k, v in entry.items() if k not in ("type", "name")}
        if not isinstance(entry["type"], str) or entry["type"] not in EVALUATORS:
            raise ValueError(f"{path}: evaluators[{i}] has unknown type {entry['type']!r}; known: {sorted(EVALUATORS)}")
        parsed = typed_yaml.build(
            EVALUATORS[entry["type"]].options, options, f"{path} ({entry['type']})", f"evaluators[{i}]."
        )
        name = str(entry.get("name", entry["type"]))
        _check_name(name, f"{path}: evaluators[{i}].name", "the entry's rows, an inspect entry's folder and metrics")
        # A repeat (two suites merged into one run: both entries named after their type) gets a suffix, so that each
        # entry keeps its own figures and metric keys.
        unique, k = name, 2
        while unique in names:
            unique, k = f"{name}_{k}", k + 1
        names.add(unique)
        specs.append(EvaluatorSpec(type=entry["type"], name=unique, options=parsed))
    return SuiteConfig(name=raw.get("name", path.stem), evaluators=tuple(specs), description=raw.get("description", ""))
