"""Run an eval suite on any weights: ``python -m evals.run --checkpoint PATH --suite NAME [--step N]``.

The work, and what is checked and logged, is `evals.runner.run_suite`'s. Exit status: 0 when the table is written
(and MLflow took its metrics); 1 when the table is written but MLflow did not take all of it (the last line says how
many, and where they wait); 2 for bad input, one line, before any work.
"""

from __future__ import annotations

import argparse
import sys

from data_pipeline.cli import fail, interrupted, output_folder
from evals.features import check_data_root
from evals.runner import NotDelivered, check_local_inputs, check_mlflow_run, format_gap, init_seed, run_suite
from tracking.store import command_line_uri, default_store_help


def _count(text: str | None, flag: str, low: int, what: str) -> int | None:
    """An integer flag: a bad value is one line, without argparse's usage block."""
    if text is None:
        return None
    try:
        value = int(text)
    except ValueError:
        value = low - 1
    if value < low:
        raise ValueError(f"{flag} {text!r} is not an integer >= {low} ({what})")
    return value


def _kept(table_written: bool) -> str:
    """What Ctrl-C leaves: a suite's table is written, then logged to MLflow, once all its entries are done."""
    if not table_written:
        return (
            "the suite did not finish: its table is written, then logged to MLflow, only at the end; the same "
            "command starts over"
        )
    return "the checkpoint's table is written (above), the random-init baseline's is not; the same command runs both"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m evals.run", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--checkpoint",
        "--weights",
        dest="checkpoint",
        required=True,
        metavar="PATH",
        help="training checkpoint folder (with COMPLETE), save_pretrained / `python -m pretrain.weights convert` "
        "folder (model.safetensors + model.json), or official .npz",
    )
    parser.add_argument("--suite", required=True, help="configs/evals/<suite>.yaml name, or a path to a suite YAML")
    parser.add_argument(
        "--data-root",
        default="data",
        help="folder or fsspec URL (s3://...) holding <dataset>/<split>/ shard folders; built-in sets missing from a "
        "folder are generated there",
    )
    parser.add_argument("--mlflow-run-id", help="log metrics to this MLflow run (at the step below)")
    parser.add_argument("--tracking-uri", help=f"MLflow store ({default_store_help()})")
    parser.add_argument(
        "--step",
        metavar="N",
        help="MLflow step for weights that carry none (.npz, exported folder): required with --mlflow-run-id (step 0 "
        "is a run's before-training baseline); a training checkpoint logs at its trainer_state.json step and refuses "
        "a different one",
    )
    parser.add_argument(
        "--out",
        help="folder for <suite>.parquet (default: evals/ inside a checkpoint or exported folder, <stem>_evals/ "
        "beside an .npz)",
    )
    parser.add_argument("--num-threads", help="torch threads (keep low beside training)")
    parser.add_argument("--device", help="cpu (default) or cuda")
    parser.add_argument(
        "--random-init",
        action="store_true",
        help="also evaluate a random initialisation of the same architecture (the trainer's seed rule) and print "
        "both and the gap; its table is <suite>_random_init.parquet (figures: random_init/), not logged to MLflow",
    )
    parser.add_argument(
        "--init-seed",
        metavar="N",
        help="with --random-init: the initialisation seed (default: the checkpoint recipe's seed, else 0)",
    )
    args = parser.parse_args(argv)
    table = None
    try:
        step = _count(args.step, "--step", 0, "the MLflow step to log the metrics at")
        num_threads = _count(args.num_threads, "--num-threads", 1, "torch threads")
        seed = _count(args.init_seed, "--init-seed", 0, "the random initialisation's seed")
        if seed is not None and not args.random_init:
            raise ValueError("--init-seed is the seed of --random-init's model; add --random-init or drop it")
        if args.random_init and seed is None:  # read before any work: a bad recipe fails first
            seed = init_seed(args.checkpoint)
        check_local_inputs(args.checkpoint, args.suite)  # before a remote --data-root's network (retries: a minute)
        check_data_root(args.data_root)
        uri = command_line_uri(args.tracking_uri) if args.mlflow_run_id else None  # a database path → its URI
        down = args.mlflow_run_id and check_mlflow_run(args.mlflow_run_id, uri)
        out = None if args.out is None else output_folder(args.out, "--out")  # before any work is spent
        if down:
            print(f"evals.run: warning: {down}; evaluating anyway: the metrics are sent at the end if it answers then")
        common = dict(out=out, num_threads=num_threads, device=args.device, step=step, require_delivery=True)
        mlflow, shortfall = (args.mlflow_run_id, uri), ""
        try:
            table = run_suite(args.checkpoint, args.suite, args.data_root, *mlflow, **common)
        except NotDelivered as error:  # written: the baseline still runs, the last line says what MLflow lacks
            table, shortfall = error.table, str(error)
        if args.random_init:
            print(f"evals: the same suite on a random init of the same architecture (seed {seed})")
            baseline = run_suite(args.checkpoint, args.suite, args.data_root, random_init_seed=seed, **common)
            print(format_gap(table, baseline))
    except (ValueError, OSError, FloatingPointError) as error:  # user errors (an lr grid that diverges): one line
        return fail(parser.prog, error)
    except KeyboardInterrupt:
        return interrupted(parser.prog, _kept(table is not None))
    if shortfall:
        return fail(parser.prog, shortfall, status=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
