"""Side-by-side comparison of pre-training runs, read back from MLflow: ``python -m evals.compare``.

Answers "which model / recipe gives the best transfer per exaFLOP?" (the paper's Figure 5 and Table 6): a table of
runs (model, patch, recipe, steps, images seen, exaFLOPs, final loss, few-shot 10-shot mean, fine-tune accuracy,
VTAB mean with its task count) and two figures (training loss vs images seen; few-shot 10-shot accuracy vs
pre-training exaFLOPs). Everything comes from the tracking store, never from memory, so a report can be rebuilt
for any past run. Written to ``reports/<name>/`` (index.html, PNGs, runs.csv) and logged to MLflow.

Where the report is logged: a dedicated run tagged ``vitscale.kind=comparison`` in the compared experiment (or in
the ``comparisons`` experiment when runs of several experiments are compared). The training runs stay the
untouched record of their job, re-running a comparison does not pile reports into every run, and the comparison
run's tags list exactly which runs it read. Comparison runs are never themselves compared.

Usage::

    python -m evals.compare [--experiment NAME] [--runs ID,ID] [--tracking-uri URI] [--out reports] [--name N]
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from data_pipeline.cli import output_folder
from pretrain.tracking import default_tracking_uri, sqlite_path

COMPARISON_KIND_TAG = "vitscale.kind"
COMPARISON_KIND = "comparison"
COMPARISONS_EXPERIMENT = "comparisons"
MAX_RUNS = 100  # newest runs kept when no selection is given; the report says when it cut
FEWSHOT_KEY = "fewshot/mean/10shot"
VTAB_MEAN_KEY = "vtab/mean"
VTAB_COUNT_KEY = "vtab/num_tasks"
VTAB_EXPECTED_KEY = "vtab/num_tasks_expected"
_FINETUNE_KEY = re.compile(r"^finetune/([^/]+)/accuracy$")
_EVAL_PREFIXES = ("fewshot/", "finetune/", "vtab/")


@dataclass(frozen=True)
class RunSummary:
    """One row of the comparison: the latest value of each metric (MLflow's "latest" = highest step)."""

    run_id: str
    run_name: str
    experiment: str
    status: str
    model: str | None
    patch: int | None
    recipe: str | None
    steps: int | None
    images_seen: float | None
    exaflops: float | None
    final_loss: float | None
    fewshot_10shot: float | None
    finetune_accuracy: float | None  # mean over datasets in finetune_datasets
    finetune_datasets: tuple[str, ...]
    vtab_mean: float | None
    vtab_num_tasks: int | None
    vtab_num_tasks_expected: int | None
    start_time_ms: int
    # Curves for the figures: (images_seen, loss) per logged step; (exaFLOPs, accuracy, step) per checkpoint.
    loss_curve: tuple[tuple[float, float], ...] = ()
    fewshot_curve: tuple[tuple[float, float, int], ...] = ()
    notes: tuple[str, ...] = field(default=())

    @property
    def label(self) -> str:
        parts = [p for p in (self.model, self.recipe) if p]
        return f"{self.run_name} ({', '.join(parts)})" if parts else self.run_name


@dataclass(frozen=True)
class Comparison:
    """What the report shows: the runs, where they came from, and notes about the selection itself."""

    title: str
    tracking_uri: str
    experiments: tuple[str, ...]
    runs: tuple[RunSummary, ...]
    notes: tuple[str, ...] = ()


def _latest(metrics: dict, key: str) -> float | None:
    value = metrics.get(key)
    return None if value is None or not math.isfinite(value) else float(value)


def _history(client, run_id: str, key: str) -> list[tuple[int, float]]:
    """(step, value) sorted by step; for a step logged twice (a resumed run) the later value wins."""
    by_step: dict[int, tuple[int, float]] = {}
    for m in client.get_metric_history(run_id, key):
        if math.isfinite(m.value) and (m.step not in by_step or m.timestamp >= by_step[m.step][0]):
            by_step[m.step] = (m.timestamp, m.value)
    return [(step, by_step[step][1]) for step in sorted(by_step)]


def _interp(step: int, table: list[tuple[int, float]]) -> float:
    """Value of a cumulative counter (exaFLOPs, images seen) at ``step``, linear between logged steps."""
    import numpy as np

    steps, values = zip(*table)
    return float(np.interp(step, steps, values))


def _patch_size(model: str | None, params: dict) -> int | None:
    if "model.patch_size" in params:
        return int(params["model.patch_size"])
    if not model:
        return None
    try:
        from pretrain.model import model_config

        return int(model_config(model).patch_size)
    except (ImportError, ValueError, TypeError):
        match = re.search(r"(\d+)$", model)
        return int(match.group(1)) if match else None


def _effective_status(mlflow_status: str, vitscale_status: str) -> str:
    """The run's status, trusting the trainer's ``vitscale.status`` tag over an MLflow run left RUNNING.

    A standalone ``python -m pretrain.train`` run tags its outcome but nobody calls ``set_terminated``; only a
    run RUNNING in both places is really running (or died without a word).
    """
    if mlflow_status != "RUNNING":
        return mlflow_status
    return {"finished": "FINISHED", "failed": "FAILED", "stopped": "STOPPED"}.get(vitscale_status.lower(), "RUNNING")


def summarize_run(client, run, experiment_name: str) -> RunSummary:
    """Read one MLflow run (metrics, histories, params, tags) into a :class:`RunSummary` with notes."""
    data, info = run.data, run.info
    metrics, params, tags = data.metrics, data.params, data.tags
    model = tags.get("vitscale.model") or params.get("model.name")
    loss = _history(client, info.run_id, "train/loss")
    seen = _history(client, info.run_id, "train/images_seen")
    flops = _history(client, info.run_id, "train/exaflops")
    fewshot = _history(client, info.run_id, FEWSHOT_KEY)
    steps = max((s for s, _ in loss + seen), default=None)

    loss_curve: tuple = ()
    if loss and seen:
        loss_curve = tuple((_interp(step, seen), value) for step, value in loss)
    fewshot_curve: tuple = ()
    if fewshot and flops:
        fewshot_curve = tuple((_interp(step, flops), value, step) for step, value in fewshot)

    finetune = {m.group(1): v for k, v in metrics.items() if (m := _FINETUNE_KEY.match(k)) and math.isfinite(v)}
    vtab_count = _latest(metrics, VTAB_COUNT_KEY)
    vtab_expected = _latest(metrics, VTAB_EXPECTED_KEY)

    notes: list[str] = []
    status = _effective_status(info.status, tags.get("vitscale.status", ""))
    if status == "FAILED":
        notes.append(f"run FAILED (crashed) at step {steps if steps is not None else '?'}; numbers are from then")
    elif status == "RUNNING":
        where = "no step logged yet" if steps is None else f"last logged step {steps}"
        notes.append(f"run still RUNNING (or crashed without reporting); {where}")
    elif status == "STOPPED":
        notes.append(f"run stopped before the end of its schedule, at step {steps}")
    elif status != "FINISHED":
        notes.append(f"run status {status}; last logged step {steps}")
    if not loss:
        notes.append("no training metrics (train/loss) logged")
    elif not seen:
        notes.append("train/images_seen not logged: left out of the loss plot")
    if not any(k.startswith(_EVAL_PREFIXES) for k in metrics):
        notes.append("no eval metrics logged (no checkpoint evaluated yet)")
    else:
        if fewshot and not flops:
            notes.append("train/exaflops not logged: left out of the few-shot vs compute plot")
        if vtab_count is not None and vtab_expected is not None and vtab_count < vtab_expected:
            notes.append(f"VTAB mean covers {int(vtab_count)} of {int(vtab_expected)} tasks")
    return RunSummary(
        run_id=info.run_id,
        run_name=info.run_name or info.run_id[:8],
        experiment=experiment_name,
        status=status,
        model=model,
        patch=_patch_size(model, params),
        recipe=tags.get("vitscale.recipe"),
        steps=steps,
        images_seen=seen[-1][1] if seen else None,
        exaflops=flops[-1][1] if flops else None,
        final_loss=loss[-1][1] if loss else None,
        fewshot_10shot=_latest(metrics, FEWSHOT_KEY),
        finetune_accuracy=sum(finetune.values()) / len(finetune) if finetune else None,
        finetune_datasets=tuple(sorted(finetune)),
        vtab_mean=_latest(metrics, VTAB_MEAN_KEY),
        vtab_num_tasks=int(vtab_count) if vtab_count is not None else None,
        vtab_num_tasks_expected=int(vtab_expected) if vtab_expected is not None else None,
        start_time_ms=info.start_time or 0,
        loss_curve=loss_curve,
        fewshot_curve=fewshot_curve,
        notes=tuple(notes),
    )


def _is_comparison(run) -> bool:
    return run.data.tags.get(COMPARISON_KIND_TAG) == COMPARISON_KIND


def collect(client, tracking_uri: str, experiment: str | None = None, run_ids: tuple[str, ...] = ()) -> Comparison:
    """Select runs (by id, by experiment, or every experiment) and summarize them. Raises ValueError on a bad name."""
    from mlflow.exceptions import MlflowException

    names = {e.experiment_id: e.name for e in client.search_experiments()}
    notes: list[str] = []
    if run_ids:
        runs = []
        for run_id in run_ids:
            try:
                runs.append(client.get_run(run_id))
            except MlflowException as error:
                raise ValueError(f"run {run_id!r} not found in {tracking_uri}: check the id in `make ui`") from error
        title = f"{len(runs)} selected runs"
    elif experiment:
        found = client.get_experiment_by_name(experiment)
        if found is None:
            listing = ", ".join(sorted(names.values())) or "(none: the store is empty)"
            raise ValueError(
                f"experiment {experiment!r} not found in {tracking_uri}; existing experiments: {listing}. "
                "Pass one of them with --experiment (make compare EXPERIMENT=...), or omit it to compare all runs."
            )
        runs = client.search_runs([found.experiment_id], max_results=MAX_RUNS + 1, order_by=["start_time DESC"])
        title = f"experiment {experiment}"
    else:
        runs = client.search_runs(list(names), max_results=MAX_RUNS + 1, order_by=["start_time DESC"]) if names else []
        title = "all experiments"
    runs = [r for r in runs if not _is_comparison(r)]
    if len(runs) > MAX_RUNS and not run_ids:
        notes.append(f"only the newest {MAX_RUNS} runs are shown; select runs with --runs or --experiment")
        runs = runs[:MAX_RUNS]
    runs.sort(key=lambda r: r.info.start_time or 0)
    summaries = tuple(summarize_run(client, r, names.get(r.info.experiment_id, r.info.experiment_id)) for r in runs)
    if not summaries:
        notes.append("no pre-training runs to compare: launch one with `make launch` (or pick another experiment)")
    experiments = tuple(sorted({s.experiment for s in summaries}))
    return Comparison(
        title, tracking_uri, experiments or ((experiment,) if experiment else ()), summaries, tuple(notes)
    )


def log_to_mlflow(client, tracking_uri: str, comparison: Comparison, out_dir: Path, name: str) -> str:
    """Log the report folder as artifacts of a new comparison run (see module docstring); returns its id."""
    from pretrain.tracking import get_or_create_experiment

    target = comparison.experiments[0] if len(comparison.experiments) == 1 else COMPARISONS_EXPERIMENT
    experiment_id = get_or_create_experiment(client, tracking_uri, target)
    tags = {
        COMPARISON_KIND_TAG: COMPARISON_KIND,
        "vitscale.compared_runs": ",".join(r.run_id for r in comparison.runs)[:5000],
        "mlflow.note.content": f"Comparison report of {len(comparison.runs)} runs ({comparison.title}).",
    }
    run = client.create_run(experiment_id, run_name=f"compare-{name}", tags=tags)
    try:
        client.log_artifacts(run.info.run_id, str(out_dir), "report")
    except Exception:
        client.set_terminated(run.info.run_id, status="FAILED")
        raise
    client.set_terminated(run.info.run_id, status="FINISHED")
    return run.info.run_id


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-") or "comparison"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m evals.compare", description=__doc__.split("\n\n")[0])
    parser.add_argument("--experiment", help="compare the runs of this MLflow experiment (default: all experiments)")
    parser.add_argument("--runs", help="comma-separated run ids to compare (overrides --experiment)")
    parser.add_argument("--tracking-uri", help="MLflow store (default: MLFLOW_TRACKING_URI or ./mlflow.db)")
    parser.add_argument("--out", default="reports", help="parent folder of the report (default: reports)")
    parser.add_argument("--name", help="report folder name (default: the experiment name, or 'all')")
    parser.add_argument("--no-mlflow", action="store_true", help="write the report only; do not log it to MLflow")
    args = parser.parse_args(argv)
    uri = args.tracking_uri or default_tracking_uri()
    run_ids = tuple(r.strip() for r in (args.runs or "").split(",") if r.strip())
    name = _slug(args.name or ("runs-" + "-".join(r[:8] for r in run_ids[:4]) if run_ids else args.experiment or "all"))
    db = sqlite_path(uri)
    if db is not None and not db.is_file():
        print(
            f"evals.compare: error: no tracking store at {db}; run `make launch` or pass --tracking-uri",
            file=sys.stderr,
        )
        return 2
    from mlflow import MlflowClient  # after the checks above: importing MLflow takes seconds
    from mlflow.exceptions import MlflowException
    from sqlalchemy.exc import SQLAlchemyError

    from evals.compare_report import format_table, write_report

    try:
        client = MlflowClient(tracking_uri=uri)
        comparison = collect(client, uri, args.experiment, run_ids)
        output_folder(args.out, "--out")
    except (MlflowException, SQLAlchemyError) as error:  # the store itself: an unsupported URI, not a database
        reason = (str(error).strip() or "no details").splitlines()[0].split(". ")[0][:200]  # MLflow writes paragraphs
        print(
            f"evals.compare: error: cannot read the tracking store {uri} ({type(error).__name__}: {reason}); pass "
            "--tracking-uri sqlite:///<path>/mlflow.db (the project's store) or the URL of an MLflow server",
            file=sys.stderr,
        )
        return 2
    except ValueError as error:
        print(f"evals.compare: error: {error}", file=sys.stderr)
        return 2
    out_dir = Path(args.out) / name
    index = write_report(comparison, out_dir)
    print(format_table(comparison))
    print(f"report: {index.resolve()}")
    if args.no_mlflow or not comparison.runs:
        return 0
    try:
        run_id = log_to_mlflow(client, uri, comparison, out_dir, name)
    except Exception as error:  # noqa: BLE001 — the report on disk is the product; logging it is a bonus
        print(f"evals.compare: warning: report not logged to MLflow ({type(error).__name__}: {error})", file=sys.stderr)
        return 0
    print(f"logged to MLflow run {run_id} (artifacts under report/)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
