"""A Ray job started while its MLflow server is down trains at once, and every step reaches the run once the server
answers (docs/design.md, "Tracking at a job's start").

The driver (`run_job`) runs in this process against a one-node Ray cluster, the way `python -m cluster.driver` runs
it; the server (tests/tracking/test_tracking_server.py) starts only once training has begun. The server
(MLflow's basic-auth app) wants credentials, and the training workers get them only through the job's runtime
env (`job_runtime_env`), as a submitted job does: the cluster's processes were started without them.
"""

from __future__ import annotations

import dataclasses
import os
import re
import threading
import time
from pathlib import Path

import pytest

from cluster.driver.job import JobSpec, job_runtime_env, run_job
from cluster.local_head import free_port, in_process_cluster, ray_auth_mode
from cluster.plan.planner import build_plan, resolve_config
from cluster.profiles import load_profile
from pretrain.checkpoint.run_folder import PINNED
from tests.tracking.test_tracking_server import ADMIN, PASSWORD, MlflowServer
from tracking import keys, runs
from tracking.runs import CREDENTIAL_VARS, tracking_credentials

SUITE = "tiny_fewshot"


def _step0_eval_ended(run_dir: Path) -> bool:
    """Training is under way (rank 0 placed itself in the run folder) and the step-0 eval task has ended: its table
    is written and the checkpoint's pin, which the task releases last, is gone."""
    step0 = run_dir / "checkpoints" / "step_00000000"
    return (
        bool(list((run_dir / "workers").glob("rank0-*.json")))
        and (step0 / "evals" / f"{SUITE}.parquet").exists()
        and not (step0 / PINNED).exists()
    )


def _start_when_training_began(server: MlflowServer, run_dir: Path, errors: list) -> threading.Thread:
    """Start ``server`` once the step-0 eval has ended while the run could not exist (`_step0_eval_ended`)."""

    def start() -> None:
        try:
            deadline = time.monotonic() + 300
            while not _step0_eval_ended(run_dir) and time.monotonic() < deadline:
                time.sleep(0.2)
            server.start()
        except Exception as error:  # noqa: BLE001 — the test fails on it, in its own thread
            errors.append(error)

    thread = threading.Thread(target=start, daemon=True)
    thread.start()
    return thread


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_a_ray_job_started_with_the_server_down_trains_and_logs_every_step_and_eval_once(tmp_path, monkeypatch, capsys):
    from mlflow import MlflowClient

    from cluster.local_data import prepare_local_data
    from evals.suites import load_suite

    for name in CREDENTIAL_VARS:
        monkeypatch.delenv(name, raising=False)  # the cluster's processes start without them
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    server = MlflowServer(tmp_path / "server", auth=True)
    server.root.mkdir()
    base = load_profile("local")
    profile = dataclasses.replace(
        base,
        storage=dataclasses.replace(
            base.storage,
            shards=str(tmp_path / "data"),
            checkpoints=str(tmp_path / "runs"),
            mlflow_tracking_uri=server.uri,
        ),
        max_failures=0,
    )
    sets = ["schedule.total=40", "schedule.warmup=3", "checkpoint.every_steps=20", "logging.log_every=1"]
    suite = tmp_path / f"{SUITE}.yaml"
    suite.write_text(f"name: {SUITE}\nevaluators:\n  - {{type: fewshot, datasets: [digits], shots: [1], seeds: [0]}}\n")
    sets += ["logging.progress_bar=false", f"evals.suite={suite}", "data.streams=2"]
    sets += ["data.builtin_options={num_classes: 8, images_per_class: 40, val_per_class: 2}"]
    config = resolve_config(profile, "local_demo", sets, "down-at-start")
    prepare_local_data(config, load_suite(suite))
    spec = JobSpec.from_json(JobSpec.create(profile, config, build_plan(profile, config)).to_json())
    # The driver's creation retries every 2 s, not MLflow's minutes of HTTP retries: the test's time, same path.
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setattr(runs, "CREATE_RETRY_MAX_S", 2.0)
    errors: list = []
    try:
        with ray_auth_mode("disabled"):
            rc, job_s = _run_job_while_the_server_starts(spec, server, errors, tmp_path, monkeypatch)
        printed = capsys.readouterr()
        assert not errors, errors
        assert rc == 0, printed.err[-4000:]
        warnings = [line for line in printed.err.splitlines() if line.startswith(f"warning: MLflow at {server.uri}")]
        assert len(warnings) == 1, printed.err[-4000:]
        client = MlflowClient(tracking_uri=server.uri)
        [run] = client.search_runs([client.get_experiment_by_name("local_demo").experiment_id])
        # The workers got the pending reference, not an id: every step below reached the run through its record.
        assert "MLflow run being created in the background" in printed.out and "created after" in printed.out
        history = client.get_metric_history(run.info.run_id, keys.LOSS)
        assert sorted(m.step for m in history) == list(range(1, 41))
        assert run.data.params[keys.RUN_ID_PARAM] == run.info.run_id
        assert run.info.status == "FINISHED" and run.data.tags[keys.STATUS] == "finished"
        # The step-0 eval ended before the run existed (the server started only then): the driver sent its metrics
        assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "fewshot/digits/1shot")) == [0, 20, 40]
        # (step 0's at least; a later one too when it also ended before the run existed)
        sent = re.search(r"evals of step\(s\) \[0(, \d+)*\]: metrics sent by the driver", printed.out)
        assert sent, printed.out[-3000:]
        early = [m.step for m in history if m.timestamp < run.info.start_time]
        print(f"job {job_s:.0f} s; steps logged before the run existed: {early}")
    finally:
        server.stop()


def _run_job_while_the_server_starts(spec, server, errors, tmp_path, monkeypatch) -> tuple[int, float]:
    """`run_job` on a one-node cluster started without credentials; the job's runtime env carries them."""
    import ray

    # A CPU beside the two ranks, as the local head has: the step-0 eval runs while training goes on, so the server
    # (started once that eval has ended) is up before the job ends
    cluster = in_process_cluster(
        object_store_memory=100 * 1024**2, include_dashboard=False, dashboard_agent_listen_port=free_port(), num_cpus=3
    )
    try:
        if server.auth:  # the driver's own environment, and the job's runtime env for every process Ray starts
            monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", ADMIN)
            monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", PASSWORD)
        credentials = tracking_credentials(os.environ)
        runtime = job_runtime_env(spec.profile, spec.to_json(), str(tmp_path), credentials=credentials)
        ray.init(address=cluster.address, runtime_env={"env_vars": runtime["env_vars"]})
        starter = _start_when_training_began(server, Path(spec.config.checkpoint.dir), errors)
        started = time.monotonic()
        rc = run_job(spec, address=cluster.address, eval_timeout_s=120)
        starter.join(timeout=120)
        return rc, time.monotonic() - started
    finally:
        ray.shutdown()
        cluster.shutdown()
