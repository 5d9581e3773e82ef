"""A run's life in MLflow: creation (once per pre-training job), its tags, its final status.

Creation raises (the caller decides whether to go on untracked); `finish_run` never does: tracking never decides a
job's fate.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from data_pipeline.paths import PROJECT_ROOT
from tracking import keys
from tracking.tracker import (
    MAX_PARAMS_TAGS_PER_BATCH,
    Tracker,
    default_artifact_location,
    default_tracking_uri,
    flatten_config,
)

# In the run folder: the MLflow run a relaunch continues.
RUN_RECORD = "mlflow_run.json"


def git_commit(root: Path | str | None = None) -> str:
    """The project's current commit (``<sha>`` or ``<sha>-dirty``), or ``"unknown"`` outside a git checkout."""
    cwd = Path(root) if root is not None else PROJECT_ROOT
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return f"{sha}-dirty" if dirty else sha


def run_tags(
    recipe: str, model: str, world_size: int, *, profile: str | None = None, run_dir: str | None = None
) -> dict[str, str]:
    """The run's tags: what is trained, at which world size, ``running``. A profile's job also gets the profile and
    the commit, computed here on the launching machine: the job's copy of the code has no ``.git``."""
    tags = {keys.RECIPE: recipe, keys.MODEL: model, keys.WORLD_SIZE: str(world_size), keys.STATUS: "running"}
    if profile is not None:
        tags |= {keys.PROFILE: profile, keys.GIT_COMMIT: git_commit()}
    if run_dir is not None:
        tags[keys.RUN_DIR] = run_dir
    return tags


def get_or_create_experiment(client, tracking_uri: str, experiment: str) -> str:
    from mlflow.exceptions import MlflowException  # heavy: only when a run is touched

    found = client.get_experiment_by_name(experiment)
    if found is not None:
        return found.experiment_id
    try:
        location = default_artifact_location(tracking_uri, experiment)
        return client.create_experiment(experiment, artifact_location=location)
    except MlflowException:
        # Another process created it since the lookup.
        found = client.get_experiment_by_name(experiment)
        if found is None:
            raise
        return found.experiment_id


def create_run(
    tracking_uri: str | None,
    experiment: str,
    run_name: str,
    params: Mapping[str, Any] | None = None,
    tags: Mapping[str, Any] | None = None,
) -> str:
    """Create the run of one pre-training job; returns its id. Nested ``params`` are flattened (`flatten_config`)."""
    from mlflow import MlflowClient  # heavy: only when a run is created
    from mlflow.entities import Param

    if not experiment:
        raise ValueError("create_run: experiment name is empty; pass e.g. the recipe name")
    uri = tracking_uri or default_tracking_uri()
    client = MlflowClient(tracking_uri=uri)
    experiment_id = get_or_create_experiment(client, uri, experiment)
    run = client.create_run(experiment_id, run_name=run_name, tags={str(k): str(v) for k, v in (tags or {}).items()})
    run_id = run.info.run_id
    flat = flatten_config(params or {})
    items = [Param(k, v) for k, v in flat.items()]
    for start in range(0, len(items), MAX_PARAMS_TAGS_PER_BATCH):
        client.log_batch(run_id, params=items[start : start + MAX_PARAMS_TAGS_PER_BATCH])
    return run_id


def open_job_run(
    run_dir: Path,
    tracking_uri: str | None,
    experiment: str,
    config: Mapping[str, Any],
    tags: Mapping[str, Any],
    plan: Mapping[str, Any],
) -> str:
    """The run ``<run_dir>/mlflow_run.json`` records, else a new one (``config`` as params, ``tags``, ``plan.json``);
    its id, a config field, is logged once it exists."""
    record = run_dir / RUN_RECORD
    if record.exists():
        saved = json.loads(record.read_text())
        if saved.get("tracking_uri") == tracking_uri:
            print(f"continuing MLflow run {saved['run_id']} recorded in {record}")
            return saved["run_id"]
    params = flatten_config(config)
    params.pop(keys.RUN_ID_PARAM, None)
    run_id = create_run(tracking_uri, experiment=experiment, run_name=run_dir.name, params=params, tags=tags)
    run_dir.mkdir(parents=True, exist_ok=True)
    record.write_text(json.dumps({"run_id": run_id, "tracking_uri": tracking_uri}))
    (run_dir / "plan.json").write_text(json.dumps(plan, indent=2))
    tracker = Tracker(tracking_uri, run_id, rank=0)
    tracker.log_params({keys.RUN_ID_PARAM: run_id})
    tracker.log_artifact(str(run_dir / "plan.json"))
    tracker.close()
    return run_id


def finish_run(tracking_uri: str | None, run_id: str, status: str, outcome: str | None = None) -> None:
    """End the run with MLflow's ``status`` (FINISHED, FAILED); ``vitscale.status`` gets ``outcome`` (the trainer's
    finer word, e.g. "stopped") or ``status`` lower-cased."""
    from mlflow import MlflowClient  # heavy: only when a run is touched

    try:
        client = MlflowClient(tracking_uri=tracking_uri)
        client.set_tag(run_id, keys.STATUS, outcome or status.lower())
        client.set_terminated(run_id, status=status)
    except Exception as exc:  # tracking never decides the job's fate
        print(f"warning: could not mark MLflow run {run_id} {status}: {exc}", file=sys.stderr)
