"""Run an eval suite on one checkpoint: ``python -m evals.run --checkpoint DIR|FILE.npz --suite NAME``.

This is what the eval scheduler calls after every checkpoint, so it is cheap to import (torch and the
evaluators load on use), keeps nothing between calls (a fresh feature cache per call; nothing can go stale
across checkpoints), and can be held to a few threads (``num_threads``) to run beside training.

Inputs: a checkpoint folder (``<run>/checkpoints/step_XXXXXXXX/``, refused without its ``COMPLETE`` marker;
step from ``trainer_state.json``) or an official JAX ``.npz`` (step 0). Outputs: ``evals/<suite>.parquet`` in
the checkpoint folder (for a ``.npz``: ``<stem>_evals/`` beside it, or ``--out``), the metrics logged to the
MLflow run ``--mlflow-run-id`` at ``step`` = the checkpoint's step, and a printed table.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

from evals.suites import RESULT_COLUMNS, EvalContext, EvalOutput, get_evaluator, load_suite


class CheckpointError(ValueError):
    """A checkpoint that cannot be evaluated (missing, unfinished, unknown format)."""


def checkpoint_step(checkpoint_dir: Path) -> int:
    state = checkpoint_dir / "trainer_state.json"
    if not state.is_file():
        raise CheckpointError(f"{checkpoint_dir} has no trainer_state.json, so its step is unknown")
    return int(json.loads(state.read_text())["step"])


def open_checkpoint(checkpoint: str | Path):
    """``(load_model(image_size=None), step, default_out_dir)`` for a checkpoint folder or an official .npz."""
    path = Path(checkpoint)
    if path.is_dir():
        if not (path / "COMPLETE").is_file():
            raise CheckpointError(
                f"checkpoint folder {path} has no COMPLETE marker: it is still being written or its save failed; "
                "evaluate a finished checkpoint (one whose folder holds COMPLETE)"
            )
        step = checkpoint_step(path)

        def load_model(image_size: int | None = None):
            from pretrain.weights import load_checkpoint_model

            return load_checkpoint_model(path, image_size=image_size)

        return load_model, step, path / "evals"
    if path.suffix == ".npz" and path.is_file():

        def load_model(image_size: int | None = None):
            from pretrain.weights import load_npz

            return load_npz(path, image_size=image_size)

        return load_model, 0, path.parent / f"{path.stem}_evals"
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist")
    raise CheckpointError(f"{path} is neither a checkpoint folder (with COMPLETE) nor an official .npz file")


def run_suite(
    checkpoint,
    suite,
    data_root="data",
    mlflow_run_id=None,
    tracking_uri=None,
    *,
    out=None,
    num_threads: int | None = None,
    device: str | None = None,
    log=print,
):
    """Evaluate one checkpoint on one suite; returns the result table (``pyarrow.Table``, columns RESULT_COLUMNS
    plus ``checkpoint``) after writing it to ``<out>/<suite>.parquet`` and logging metrics to MLflow."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch

    config = load_suite(suite)  # fail on a bad suite before loading any weights
    load_model, step, default_out = open_checkpoint(checkpoint)
    out_dir = Path(out) if out is not None else default_out
    previous_threads = torch.get_num_threads()
    if num_threads:
        torch.set_num_threads(int(num_threads))
    try:
        model = load_model().eval()
        ctx = EvalContext(
            model=model,
            load_model=load_model,
            data_root=Path(data_root),
            step=step,
            out_dir=out_dir,
            num_threads=num_threads,
            device=device or "cpu",
            log=log,
        )
        results, start = EvalOutput(), time.perf_counter()
        for spec in config.evaluators:
            t0 = time.perf_counter()
            produced = get_evaluator(spec.type)(ctx, dict(spec.options))
            for row in produced.rows:
                results.rows.append(row if spec.name == spec.type else replace(row, evaluator=spec.name))
            clash = sorted(set(produced.metrics) & set(results.metrics))
            if clash:  # both stay in the table; MLflow keeps one value per key and step, the later one
                log(
                    f"evals: warning: {spec.name!r} repeats metric keys {clash[:4]} of an earlier entry of suite "
                    f"{config.name}; MLflow gets the later values (merge the entries to avoid this)"
                )
            results.metrics.update(produced.metrics)
            results.artifacts.extend(produced.artifacts)
            log(f"evals: {spec.name} done in {time.perf_counter() - t0:.1f}s")
    finally:
        torch.set_num_threads(previous_threads)

    records = [{**asdict(r), "suite": config.name, "step": step} for r in results.rows]
    columns = {c: [rec[c] for rec in records] for c in RESULT_COLUMNS}
    columns["checkpoint"] = [str(Path(checkpoint))] * len(records)
    table = pa.table(columns, schema=_schema(pa))
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / f"{config.name}.parquet"
    tmp = target.with_suffix(f".parquet.tmp{os.getpid()}")
    pq.write_table(table, tmp)
    os.replace(tmp, target)  # readers never see a half-written table
    log(format_table(table))
    log(f"evals: suite {config.name} at step {step} in {time.perf_counter() - start:.1f}s → {target}")
    if mlflow_run_id:
        _log_to_mlflow(results, step, target, mlflow_run_id, tracking_uri, log)
    return table


def _schema(pa):
    return pa.schema([
        ("suite", pa.string()), ("evaluator", pa.string()), ("dataset", pa.string()), ("metric", pa.string()),
        ("value", pa.float64()), ("std", pa.float64()), ("count", pa.int64()), ("status", pa.string()),
        ("detail", pa.string()), ("step", pa.int64()), ("checkpoint", pa.string()),
    ])  # fmt: skip


def _log_to_mlflow(results: EvalOutput, step: int, table_path: Path, run_id: str, tracking_uri, log) -> None:
    from pretrain.tracking import Tracker, default_tracking_uri

    metrics = {k: float(v) for k, v in results.metrics.items() if v is not None and math.isfinite(float(v))}
    # rank=0: one eval task per checkpoint logs, even when launched from a process that has RANK set.
    tracker = Tracker(tracking_uri or default_tracking_uri(), run_id, rank=0)
    try:
        tracker.log_metrics(metrics, step=step)
        tracker.log_artifact(table_path, f"evals/step_{step:08d}")
        for artifact in results.artifacts:
            tracker.log_artifact(artifact, f"evals/step_{step:08d}")
        if not tracker.flush():
            log(f"evals: warning: MLflow run {run_id} did not take all metrics yet (tracking server down?)")
    finally:
        tracker.close()
    log(f"evals: logged {len(metrics)} metrics to MLflow run {run_id} at step {step}")


def format_table(table) -> str:
    """A fixed-width text rendering: evaluator, dataset, metric, value ± std, count, status, detail."""
    lines = [f"{'evaluator':<10} {'dataset':<14} {'metric':<34} {'value':>16} {'n':>5} {'status':<8} detail"]
    for row in table.to_pylist():
        value = "nan" if math.isnan(row["value"]) else f"{row['value']:.4f}"
        if not math.isnan(row["std"]):
            value += f" ± {row['std']:.4f}"
        lines.append(
            f"{row['evaluator']:<10} {row['dataset']:<14} {row['metric']:<34} {value:>16} "
            f"{row['count']:>5} {row['status']:<8} {row['detail']}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m evals.run", description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", required=True, help="checkpoint folder (with COMPLETE) or official .npz")
    parser.add_argument("--suite", required=True, help="configs/evals/<suite>.yaml name, or a path to a suite YAML")
    parser.add_argument("--data-root", default="data", help="folder holding <dataset>/<split>/ shard folders")
    parser.add_argument("--mlflow-run-id", default=None, help="log metrics to this MLflow run (step = ckpt step)")
    parser.add_argument("--tracking-uri", default=None, help="MLflow tracking URI (default: sqlite project db)")
    parser.add_argument("--out", default=None, help="folder for <suite>.parquet (default: <checkpoint>/evals)")
    parser.add_argument("--num-threads", type=int, default=None, help="torch threads (keep low beside training)")
    parser.add_argument("--device", default=None, help="cpu (default) or cuda")
    args = parser.parse_args(argv)
    try:
        run_suite(
            args.checkpoint,
            args.suite,
            args.data_root,
            args.mlflow_run_id,
            args.tracking_uri,
            out=args.out,
            num_threads=args.num_threads,
            device=args.device,
        )
    except ValueError as error:  # user errors: one clear line, no traceback
        print(f"evals.run: error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
