"""Side-by-side comparison of pre-training runs, read back from MLflow: ``python -m tracking.compare``.

Writes ``reports/<name>/`` and logs it to a comparison run of its own (docs/design.md, "The comparison report").
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from data_pipeline.cli import fail, interrupted, output_folder
from data_pipeline.paths import PROJECT_ROOT, safe_name
from tracking import keys
from tracking.report_collect import COMPARISON_KIND, COMPARISONS_EXPERIMENT, Comparison, collect
from tracking.report_render import format_table, write_report
from tracking.runs import get_or_create_experiment
from tracking.store import (
    command_line_uri,
    default_store_help,
    failing_calls,
    missing_driver,
    sqlite_path,
    unanswered,
)

PROG = "python -m tracking.compare"


def log_to_mlflow(client, tracking_uri: str, comparison: Comparison, out_dir: Path, name: str) -> str:
    """A new comparison run, tagged with the runs read, holding the report; returns its id."""
    target = comparison.experiments[0] if len(comparison.experiments) == 1 else COMPARISONS_EXPERIMENT
    experiment_id = get_or_create_experiment(client, tracking_uri, target)
    tags = {
        keys.KIND: COMPARISON_KIND,
        keys.COMPARED_RUNS: ",".join(r.run_id for r in comparison.runs)[:5000],
        "mlflow.note.content": f"Comparison report of {len(comparison.runs)} runs ({comparison.title}).",
    }
    run = client.create_run(experiment_id, run_name=f"compare-{name}", tags=tags)
    try:
        client.log_artifacts(run.info.run_id, str(out_dir), "report")
    except BaseException as error:  # Ctrl-C too: no run left RUNNING
        client.set_terminated(run.info.run_id, status="KILLED" if isinstance(error, KeyboardInterrupt) else "FAILED")
        raise
    client.set_terminated(run.info.run_id, status="FINISHED")
    return run.info.run_id


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("--experiment", help="compare the runs of this MLflow experiment (default: all experiments)")
    parser.add_argument("--runs", help="comma-separated run ids to compare (overrides --experiment)")
    parser.add_argument("--tracking-uri", help=f"MLflow store ({default_store_help()})")
    parser.add_argument(
        "--out", default=str(PROJECT_ROOT / "reports"), help="parent folder of the report (default: <project>/reports)"
    )
    parser.add_argument("--name", help="report folder name (default: the experiment name, or 'all')")
    parser.add_argument("--no-mlflow", action="store_true", help="write the report only; do not log it to MLflow")
    args = parser.parse_args(argv)
    kept = ["no report is written; the same command starts over"]  # what Ctrl-C leaves, as the work goes on
    try:
        return _compare(args, kept)
    except KeyboardInterrupt:
        return interrupted(PROG, kept[-1])


def _report_folder(out: str, name: str) -> Path:
    """``<out>/<name>``, created; ValueError naming the fix when it cannot be written."""
    folder = output_folder(out, "--out") / name
    if os.path.lexists(folder) and not folder.is_dir():
        raise ValueError(f"the report folder {folder} is a file; pass another --name, or another --out")
    try:
        folder.mkdir(exist_ok=True)
    except OSError as error:
        raise ValueError(
            f"cannot create the report folder {folder} ({error.strerror or error}); pass another --out"
        ) from None
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ValueError(f"the report folder {folder} is read-only; pass another --out (or another --name)")
    return folder


def _compare(args: argparse.Namespace, kept: list[str]) -> int:
    """`main` after its arguments: the report, then its MLflow run; ``kept`` gets what each stage leaves."""
    try:
        uri = command_line_uri(args.tracking_uri)
    except ValueError as error:
        return fail(PROG, error)
    run_ids = tuple(dict.fromkeys(r.strip() for r in (args.runs or "").split(",") if r.strip()))  # repeats once
    name = args.name or ("runs-" + "-".join(r[:8] for r in run_ids[:4]) if run_ids else args.experiment or "all")
    name = safe_name(name) or "comparison"
    db = sqlite_path(uri)
    if db is not None and not db.is_file():
        return fail(PROG, f"no tracking store at {db}; run `make launch` or pass --tracking-uri")
    down = unanswered(uri)  # in seconds: MLflow's own retries last minutes
    if down:
        return fail(PROG, f"no MLflow server answers at {uri} ({down}); start it or fix --tracking-uri")
    from mlflow import MlflowClient  # heavy: only after the checks above
    from mlflow.exceptions import MlflowException
    from sqlalchemy.exc import SQLAlchemyError

    failing = failing_calls(uri)  # one call: MLflow retries a 5xx for minutes
    if failing:
        return fail(PROG, f"the MLflow server at {uri} answers /health but {failing}; check its database and its log")

    try:
        client = MlflowClient(tracking_uri=uri)
        comparison = collect(client, uri, args.experiment, run_ids)
        out_dir = _report_folder(args.out, name)
    except (MlflowException, SQLAlchemyError) as error:  # an unsupported URI, not a database
        reason = (str(error).strip() or "no details").splitlines()[0].split(". ")[0][:200]  # MLflow writes paragraphs
        return fail(
            PROG,
            f"cannot read the tracking store {uri} ({type(error).__name__}: {reason}); pass --tracking-uri "
            "sqlite:///<path>/mlflow.db (the project's store) or the URL of an MLflow server",
        )
    except ImportError as error:  # a database URI whose driver is not installed (postgresql:// without psycopg)
        return fail(PROG, missing_driver(uri, error))
    except ValueError as error:
        return fail(PROG, error)
    kept.append(f"the report in {out_dir} is not complete; the same command writes it again")
    index = write_report(comparison, out_dir)
    print(format_table(comparison))
    print(f"report: {index.resolve()}")
    if args.no_mlflow or not comparison.runs:
        return 0
    kept.append(
        f"the report is written ({index.resolve()}), not (fully) logged to MLflow; the same command logs it again"
    )
    try:
        run_id = log_to_mlflow(client, uri, comparison, out_dir, name)
    except Exception as error:  # noqa: BLE001 — the report on disk is the product
        print(
            f"tracking.compare: warning: report not logged to MLflow ({type(error).__name__}: {error})", file=sys.stderr
        )
        return 0
    print(f"logged to MLflow run {run_id} (artifacts under report/)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
