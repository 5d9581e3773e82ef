"""Run an eval suite on any weights (`run_suite`), after every checkpoint (the cluster's eval tasks) or by
``python -m evals.run``: the suite is checked before any weights load, nothing is kept between calls, ``num_threads``
holds it beside training.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
import time
from dataclasses import asdict, replace
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch
import yaml
from safetensors import SafetensorError

from data_pipeline.paths import command_line_path, is_remote, replace_atomically
from evals.evaluator import RESULT_COLUMNS, EvalContext, mlflow_metrics
from evals.features import data_location
from evals.finetune import FinetuneOptions, check_crop_padding
from evals.suites import EVALUATORS, load_suite
from evals.vtab import VtabOptions
from pretrain.checkpoint import run_folder
from pretrain.model.vit import VisionTransformer
from pretrain.weights import source as weights_source
from pretrain.weights.formats import load_model as load
from pretrain.weights.formats import resize_model
from tracking.runs import RUN_RECORD
from tracking.store import (
    DELIVER_COMMAND,
    PENDING_RUN,
    default_tracking_uri,
    lifecycle_stage,
    missing_driver,
    recorded_run_id,
    spool_dir,
    sqlite_path,
    unanswered,
)
from tracking.tracker import Tracker

ACCEPTED = (
    "pass a training checkpoint folder (with COMPLETE), a run folder, a folder written by save_pretrained / "
    "`python -m pretrain.weights convert` (model.safetensors + model.json) or an official .npz"
)
_NUMERIC = {"value": pa.float64(), "std": pa.float64(), "count": pa.int64(), "step": pa.int64()}
# RESULT_COLUMNS and the weights evaluated.
SCHEMA = pa.schema([(c, _NUMERIC.get(c, pa.string())) for c in (*RESULT_COLUMNS, "checkpoint")])


class CheckpointError(ValueError):
    """Weights that cannot be evaluated (missing, unfinished, unknown format, a contradicting step)."""


class NotDelivered(RuntimeError):
    """The table is written (``table``), but MLflow did not take all of it; the message says what is where."""

    def __init__(self, message: str, table: pa.Table) -> None:
        super().__init__(message)
        self.table = table


def check_local_inputs(checkpoint: str | Path, suite: str | Path | None = None) -> None:
    """The checks that cost nothing, before a remote data root's or checkpoint's network: a local checkpoint that is
    not there, a suite that does not load (ValueError)."""
    if not is_remote(checkpoint) and not command_line_path(checkpoint).exists():
        raise CheckpointError(f"checkpoint {checkpoint} does not exist; {ACCEPTED}")
    if suite is not None:
        load_suite(suite)


def open_checkpoint(checkpoint: str | Path, step: int | None = None, *, require_step: bool = False):
    """``(load_model(image_size=None), step, default_out_dir, path)`` without loading. A checkpoint must be
    ``COMPLETE`` with verified checksums and has its own step; ``step`` is for weights without one (default 0, refused
    with ``require_step``: a run's step 0 is its baseline before the first update)."""
    if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
        raise CheckpointError(f"step={step!r}: the MLflow step must be an integer >= 0")
    if not is_remote(checkpoint) and not command_line_path(checkpoint).exists():
        raise CheckpointError(f"checkpoint {checkpoint} does not exist; {ACCEPTED}")
    try:
        path = weights_source.resolve(checkpoint)  # a run folder: its newest COMPLETE checkpoint, verified
    except (FileNotFoundError, weights_source.DamagedCheckpointError) as error:
        raise CheckpointError(str(error)) from None
    except (OSError, ImportError) as error:  # object storage: credentials, network, its fsspec extra
        raise CheckpointError(f"checkpoint {checkpoint} could not be fetched: {error}") from None
    if run_folder.looks_like_checkpoint(path):  # else exported weights: no step of their own
        try:
            own = run_folder.open_checkpoint(path).step
        except ValueError as error:  # no COMPLETE marker, or a trainer state without a step
            raise CheckpointError(str(error)) from None
        if own is None and step is None:
            raise CheckpointError(
                f"{path} has no {run_folder.TRAINER_STATE}, so its step is unknown; pass --step N for the MLflow step"
            )
        if own is not None and step is not None and step != own:
            raise CheckpointError(
                f"--step {step} contradicts checkpoint {path}, which is step {own} ({run_folder.TRAINER_STATE}); "
                "drop --step (a training checkpoint logs at its own step)"
            )
        step = own if own is not None else step
    elif step is None and require_step:
        raise CheckpointError(
            f"{path} records no training step (exported weights); pass --step N, the step of the checkpoint they "
            "were exported from, to log them into an MLflow run (--step 0 is the run's before-training baseline)"
        )
    default_out = path / "evals" if path.is_dir() else path.parent / f"{path.stem}_evals"
    return functools.partial(load, path), 0 if step is None else step, default_out, path


def init_seed(checkpoint: str | Path) -> int:
    """The seed of a checkpoint's step-0 model: its saved recipe's ``seed``, else 0."""
    try:
        path = weights_source.resolve(checkpoint)
    except (OSError, ValueError):  # the suite's own load says it
        path = Path(checkpoint)
    recipe = path / run_folder.CONFIG_YAML if path.is_dir() else None
    if recipe is None or not recipe.is_file():
        return 0
    try:
        seed = (yaml.safe_load(recipe.read_text()) or {}).get("seed", 0)
    except (yaml.YAMLError, AttributeError) as error:
        raise CheckpointError(f"{recipe} is not a readable recipe ({error}); pass --init-seed N") from None
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise CheckpointError(f"{recipe} records seed={seed!r}, not an integer; pass --init-seed N")
    return seed


def random_init(config, seed: int):
    """``load_model(image_size=None)`` of a ``config`` model seeded as the trainer's step 0 (global state untouched)."""

    def load_model(image_size: int | None = None):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = VisionTransformer(config)
        if image_size is not None and image_size != config.image_size:
            resize_model(model, image_size)
        return model

    return load_model


def check_resolution(setting: str, value: int, patch_size: int) -> None:
    """ValueError naming the nearest valid sizes when ``value`` is not a multiple of ``patch_size``."""
    if value % patch_size == 0:
        return
    below, above = value // patch_size * patch_size, (value // patch_size + 1) * patch_size
    sizes = f"{below} or {above}" if below else str(above)
    raise ValueError(f"{setting}: {value} is not a multiple of the patch size {patch_size}: use {sizes}")


def check_resolutions(config, patch_size: int) -> None:
    """`check_resolution` for every suite option that resizes the model (``patch_size``: its stride)."""
    for i, spec in enumerate(config.evaluators):
        for option in EVALUATORS[spec.type].resolutions:
            value = getattr(spec.options, option)
            if value is not None:
                check_resolution(f"eval suite {config.name}: evaluators[{i}].{option} ({spec.name})", value, patch_size)


def check_crop_paddings(config, image_size: int) -> None:
    """`check_crop_padding` of the fine-tuning entries at the model's own ``image_size`` (theirs unset)."""
    for i, spec in enumerate(config.evaluators):
        options, setting = spec.options, "crop_padding"
        if isinstance(options, VtabOptions) and options.protocol == "finetune":
            options, setting = options.finetune, "finetune.crop_padding"
        if isinstance(options, FinetuneOptions) and spec.options.image_size is None:
            where = f"eval suite {config.name}: evaluators[{i}].{setting} ({spec.name})"
            check_crop_padding(options.crop_padding, image_size, where)


def check_out_dir(out_dir: Path, default: bool) -> None:
    """ValueError naming the fix when the folder of the table cannot be made or written (``default``: not given, the
    weights' own ``evals/`` or ``<stem>_evals/``); nothing is created."""
    existing = next(p for p in (out_dir, *out_dir.parents) if os.path.lexists(p))
    if existing.is_symlink() and not existing.exists():
        problem = f"cannot be created: {existing} is a broken symbolic link (to {os.readlink(existing)})"
    elif not existing.is_dir():
        problem = "is a file" if existing == out_dir else f"cannot be created: {existing} is a file"
    elif not os.access(existing, os.W_OK | os.X_OK):
        problem = f"cannot be written: {existing} is read-only (or not yours)"
    else:
        return
    given = " (the default for these weights)" if default else ""
    raise ValueError(
        f"output folder {out_dir}{given} {problem}; pass --out a writable folder (it is created if absent)"
    )


def _load(load_model, checkpoint):
    """An unreadable or non-ViT file is the user's error."""
    try:
        return load_model()
    except (ValueError, OSError, SafetensorError) as error:
        raise CheckpointError(f"cannot evaluate {checkpoint}: {error}") from None


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
    step: int | None = None,
    random_init_seed: int | None = None,
    log=print,
    require_delivery: bool = False,
):
    """Write ``<out>/<suite>.parquet``, log its metrics, return the table. ``random_init_seed``: evaluate `random_init`
    instead, at step 0, into ``<suite>_random_init.parquet``, never logged. What MLflow did not take is a warning, or
    with ``require_delivery`` `NotDelivered` (raised after the table is written)."""
    config = load_suite(suite)
    _check_options(random_init_seed, mlflow_run_id, num_threads, device)
    load_model, step, default_out, path = open_checkpoint(checkpoint, step, require_step=bool(mlflow_run_id))
    out_dir = Path(out) if out is not None else default_out
    check_out_dir(out_dir, default=out is None)  # before any work: the table is written only at the end
    previous_threads = torch.get_num_threads()
    if num_threads:
        torch.set_num_threads(int(num_threads))
    try:
        model = _load(load_model, checkpoint)
        check_resolutions(config, model.config.stride)  # before any evaluator works
        check_crop_paddings(config, model.config.image_size)
        if random_init_seed is not None:  # the checkpoint's architecture, fresh weights
            load_model, step = random_init(model.config, random_init_seed), 0
            model = load_model()
        model = model.eval().to(device or "cpu")  # evaluators put their inputs there
        ctx = EvalContext(
            model=model,
            load_model=load_model,
            data_root=data_location(data_root),
            step=step,
            out_dir=out_dir if random_init_seed is None else out_dir / "random_init",  # figures apart
            num_threads=num_threads,
            device=device or "cpu",
            log=log,
        )
        start = time.perf_counter()
        rows, artifacts = _run_entries(config, ctx, log)
    finally:
        torch.set_num_threads(previous_threads)

    records = [{**asdict(r), "suite": config.name, "step": step} for r in rows]
    columns = {c: [rec[c] for rec in records] for c in RESULT_COLUMNS}
    source = weights_source.origin(path)  # an object store's URL, not the local copy's cache path
    if random_init_seed is not None:
        source = f"random init (seed {random_init_seed}) shaped as {source}"
    columns["checkpoint"] = [source] * len(records)
    table = pa.table(columns, schema=SCHEMA)
    uri = tracking_uri or default_tracking_uri()
    held = _held_at(uri, mlflow_run_id, mlflow_metrics(rows), step) if mlflow_run_id else set()
    name = f"{config.name}{'' if random_init_seed is None else '_random_init'}"
    target = _write_table(table, out_dir, name, keep_earlier=bool(held))
    log(format_table(table))
    log(f"evals: suite {config.name} at step {step} in {time.perf_counter() - start:.1f}s → {target}")
    if mlflow_run_id:
        shortfall = _log_to_mlflow(mlflow_metrics(rows), artifacts, step, target, mlflow_run_id, uri, log, path, held)
        if shortfall and require_delivery:
            raise NotDelivered(shortfall, table)
        if shortfall:
            log(f"evals: warning: {shortfall}")
    return table


UNLOGGED = ".unlogged.parquet"  # a table whose suite the MLflow run already holds at its step: kept locally only


def _write_table(table, out_dir: Path, name: str, keep_earlier: bool) -> Path:
    """``<out_dir>/<name>.parquet``; with ``keep_earlier`` (the run keeps the earlier evaluation's table) an existing
    one stays and the new table is ``<name>.unlogged.parquet`` beside it."""
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / f"{name}.parquet"
    if keep_earlier and target.exists():
        target = out_dir / f"{name}{UNLOGGED}"
    replace_atomically(target, lambda tmp: pq.write_table(table, tmp))
    return target


def _check_options(random_init_seed: int | None, mlflow_run_id: str | None, num_threads, device) -> None:
    """`run_suite`'s settings that need no checkpoint; ValueError naming the fix."""
    if random_init_seed is not None and (isinstance(random_init_seed, bool) or not isinstance(random_init_seed, int)):
        raise ValueError(f"random_init_seed={random_init_seed!r} must be an integer")
    if random_init_seed is not None and mlflow_run_id:
        raise ValueError(
            "random-init results are not logged to MLflow (a run's random-init baseline is its step 0); "
            "drop the MLflow run id for the random-init evaluation"
        )
    if num_threads is not None and not (isinstance(num_threads, int) and num_threads >= 1):
        raise ValueError(f"num_threads={num_threads!r} must be an integer >= 1")
    if device not in (None, "cpu") and not re.fullmatch(r"cuda(:\d+)?", str(device)):
        raise ValueError(f"device={device!r} is not a device name; use cpu or cuda (cuda:N for one GPU of several)")
    if device not in (None, "cpu") and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} is not available here; use cpu (or cuda on a machine with a GPU)")
    if device not in (None, "cpu") and int(str(device).partition(":")[2] or 0) >= (count := torch.cuda.device_count()):
        gpus = f"{count} GPU{'s' * (count > 1)} (cuda:0{f'..cuda:{count - 1}' if count > 1 else ''})"
        raise ValueError(f"device={device!r} is not available here: this machine has {gpus}; use one of them, or cpu")


def _run_entries(config, ctx: EvalContext, log) -> tuple[list, list]:
    """Rows (named after their entry) and ``(artifact, folder under evals/step_N/)`` of every entry."""
    rows, artifacts, logged = [], [], set()
    for spec in config.evaluators:
        t0 = time.perf_counter()
        produced = EVALUATORS[spec.type].evaluate(replace(ctx, entry=spec.name), spec.options)
        entry_rows = [row if spec.name == spec.type else _named(row, spec) for row in produced.rows]
        keys = set(mlflow_metrics(entry_rows))
        clash = sorted(keys & logged)
        if clash:  # both stay in the table; MLflow keeps the later
            log(
                f"evals: warning: {spec.name!r} repeats metric keys {clash[:4]} of an earlier entry of suite "
                f"{config.name}; MLflow gets the later values (merge the entries to avoid this)"
            )
        logged |= keys
        rows += entry_rows
        artifacts += [(a, "" if spec.name == spec.type else spec.name) for a in produced.artifacts]  # files apart
        log(f"evals: {spec.name} done in {time.perf_counter() - t0:.1f}s")
    return rows, artifacts


def _named(row, spec):
    """A named entry's row: its evaluator and the first part of its metric key are the entry's name (`fewshot_big/mean/
    10shot`), so that two entries of one type (of one suite, or of suites merged at a checkpoint) keep apart."""
    prefix = f"{spec.type}/"
    metric = spec.name + row.metric[len(spec.type) :] if row.metric.startswith(prefix) else row.metric
    return replace(row, evaluator=spec.name, metric=metric)


def _log_to_mlflow(metrics: dict, artifacts: list, step: int, table_path: Path, run_id: str, uri, log, path, held):
    """What MLflow does not take waits in the spool of the checkpoint's run folder, where its record names the run (a
    pending run's: the job's spool). ``held``: the keys the run holds at ``step`` (`_held_at`), not logged, nor a
    table `_write_table` kept apart and its figures. Returns "" when MLflow took everything, or the job's spool holds
    a pending run's items, else what was not sent and where it is."""
    record = Path(path).parent.parent / RUN_RECORD
    named = recorded_run_id(record, uri) == run_id
    pending = run_id.startswith(PENDING_RUN)
    spool = spool_dir(run_id[len(PENDING_RUN) :] if pending else record)
    before = set(spool.glob("*.json"))
    uploads = [(table_path, ""), *artifacts]
    if held:
        few = ", ".join(sorted(held)[:3]) + (f" and {len(held) - 3} more" if len(held) > 3 else "")
        unlogged = table_path.name.endswith(UNLOGGED)  # the same suite again: the run keeps its table and figures
        kept = f"nor this table or its figures (the run keeps the earlier ones; this table is only in {table_path})"
        log(
            f"evals: warning: MLflow run {run_id} already holds {few} at step {step} (an earlier evaluation of this "
            "step, or another suite's entry of the same type): not logged again, "
            f"{kept if unlogged else 'the table holds them'}; a suite entry's `name:` logs it under its own keys"
        )
        metrics = {k: v for k, v in metrics.items() if k not in held}
        uploads = [] if unlogged else uploads
    tracker = Tracker(uri, run_id, rank=0, record=record if named else None)
    try:
        tracker.log_metrics(metrics, step=step)
        for artifact, folder in uploads:
            tracker.log_artifact(artifact, f"evals/step_{step:08d}/{folder}".rstrip("/"))
        tracker.flush()
    finally:
        tracker.close()  # a run not created yet, or one its record names: what is left waits in the spool
    mine = f"-{os.getpid()}-{id(tracker):x}.json"  # the Tracker's spool file name: not the job's other processes'
    spooled = sorted(f for f in set(spool.glob("*.json")) - before if f.name.endswith(mine)) if pending or named else []
    waiting = sum(len(p["metrics"]) + len(p["artifacts"]) for p in (json.loads(f.read_text()) for f in spooled))
    if not waiting and not tracker.pending:
        log(f"evals: logged {len(metrics)} metrics to MLflow run {tracker.run_id} at step {step}")
        return ""
    if pending and not tracker.pending:  # the job's driver creates the run, then sends its spool
        log(f"evals: {waiting} items ({len(metrics)} metrics at step {step}) wait in {spooled[0]} until the run exists")
        return ""
    files = len(uploads)
    total = f"{len(metrics) + files} items ({len(metrics)} metrics, {files} file{'s' * (files != 1)})"
    why = unanswered(uri) or "MLflow failed the calls (the warnings above say how)"
    if tracker.pending:
        return (
            f"{tracker.pending} of the {total} at step {step} did not reach MLflow run {run_id} ({why}) and are not "
            f"kept; the table is in {table_path}: run the evaluation again once MLflow answers"
        )
    return (
        f"{waiting} of the {total} at step {step} did not reach MLflow run {run_id} yet ({why}); they wait in "
        f"{spooled[0]}: `{DELIVER_COMMAND} {record.parent}` sends them"
    )


def _held_at(uri: str, run_id: str, metrics: dict, step: int) -> set[str]:
    """The keys of ``metrics`` the run already holds at ``step`` (two values at one step would mix two evaluations);
    empty when the run cannot be asked (pending, or its server failing: the send says so)."""
    if run_id.startswith(PENDING_RUN) or unanswered(uri):
        return set()
    from mlflow import MlflowClient  # heavy

    try:
        client = MlflowClient(tracking_uri=uri)
        latest = {m.key: m.step for m in client.get_run(run_id).data.to_proto().metrics}  # each key's newest step
        later = [key for key in metrics if latest.get(key, -1) >= step]  # only these may hold a value at step
        return {key for key in later if any(m.step == step for m in client.get_metric_history(run_id, key))}
    except Exception:  # noqa: BLE001 — the send that follows retries and says what failed
        return set()


def format_table(table) -> str:
    rows = table.to_pylist()
    w = max([34, *(len(row["metric"]) for row in rows)])  # the metric column fits the longest key
    lines = [f"{'evaluator':<10} {'dataset':<14} {'metric':<{w}} {'value':>16} {'n':>5} {'status':<8} detail"]
    for row in rows:
        value = "nan" if math.isnan(row["value"]) else f"{row['value']:.4f}"
        if not math.isnan(row["std"]):
            value += f" ± {row['std']:.4f}"
        lines.append(
            f"{row['evaluator']:<10} {row['dataset']:<14} {row['metric']:<{w}} {value:>16} "
            f"{row['count']:>5} {row['status']:<8} {row['detail']}"
        )
    return "\n".join(lines)


def format_gap(table, baseline) -> str:
    """Every metric both tables log, side by side, with the gap."""
    ours, theirs = mlflow_metrics(table.to_pylist()), mlflow_metrics(baseline.to_pylist())
    lines = [f"{'metric':<40} {'checkpoint':>10} {'random init':>11} {'gap':>9}"]
    for metric in (m for m in ours if m in theirs):
        a, b = ours[metric], theirs[metric]
        lines.append(f"{metric:<40} {a:>10.4f} {b:>11.4f} {a - b:>+9.4f}")
    return "\n".join(lines)


def check_mlflow_run(run_id: str, tracking_uri: str | None) -> str:
    """Refuse a run that the store, where it answers, lacks or holds deleted; returns why a server does not answer
    ("" when it does). A server is asked once, briefly: MLflow's own retries last minutes."""
    uri = tracking_uri or default_tracking_uri()
    db = sqlite_path(uri)
    if db is not None and not db.is_file():
        raise ValueError(f"no MLflow store at {db} (tracking URI {uri}); check --tracking-uri")
    down = unanswered(uri)
    if down:
        return down
    from mlflow.exceptions import MlflowException  # heavy

    try:
        stage = lifecycle_stage(uri, run_id)
    except Exception as error:  # noqa: BLE001 — a missing run is the user's; a failing server is not an answer
        if isinstance(error, MlflowException) and error.error_code == "RESOURCE_DOES_NOT_EXIST":
            raise ValueError(f"MLflow run {run_id!r} does not exist in {uri}; check --mlflow-run-id") from None
        if isinstance(error, ImportError):  # a database URI whose driver is not installed: no later try succeeds
            raise ValueError(missing_driver(uri, error)) from None
        reason = f"{type(error).__name__}: {(str(error).strip() or 'no details').splitlines()[0][:200]}"
        if db is not None:
            raise ValueError(f"cannot read the MLflow store {uri} ({reason}); check --tracking-uri") from None
        return f"MLflow at {uri} fails a request for run {run_id} ({reason})"
    if stage == "deleted":
        raise ValueError(
            f"MLflow run {run_id!r} is deleted in {uri}; restore it (`MLFLOW_TRACKING_URI={uri} mlflow runs restore "
            f"--run-id {run_id}`) or pass another --mlflow-run-id"
        )
    return ""
