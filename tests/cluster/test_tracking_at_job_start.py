"""A Ray job whose MLflow server is down from its start to its end trains, ends when training does, and its courier
puts every step and eval in the run once the server answers (docs/design.md, "Tracking at a job's start").

The driver (`run_job`) runs in this process against a one-node Ray cluster, the way `python -m cluster.driver` runs
it; the server (tests/tracking/test_tracking_server.py) starts only once the job has ended. The server (MLflow's
basic-auth app) wants credentials, and the job's processes, its courier included, get them only through the job's
runtime env (`job_runtime_env`), as a submitted job does: the cluster's processes were started without them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import socket
import threading
import time
from pathlib import Path

import mlflow
import pytest

from cluster.driver import courier
from cluster.driver.courier import COURIER_FILE, NAMESPACE, deliver, hand_over
from cluster.driver.deliver import main as deliver_main
from cluster.driver.job import JobSpec, job_runtime_env, run_job
from cluster.driver.record import JobEnd, finish_job
from cluster.local_head import free_port, in_process_cluster, ray_auth_mode
from cluster.plan.planner import build_plan, resolve_config
from cluster.profiles import load_profile
from tests.tracking.test_tracking_server import ADMIN, PASSWORD, MlflowServer
from tracking import keys, runs, store
from tracking import tracker as tracker_module
from tracking.runs import CREDENTIAL_VARS, RUN_RECORD, tracking_credentials
from tracking.store import PENDING_RUN, SPOOL_DIR, pending_run_ref, spool_dir
from tracking.tracker import Tracker

SUITE = "tiny_fewshot"


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_a_ray_job_with_the_server_down_throughout_ends_with_training_and_its_courier_delivers_once(
    tmp_path, monkeypatch, capsys
):
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
    # 20 steps, a checkpoint every 10: evals at 0, 10 (while training goes on) and 20, the steps 1-20 each logged once
    sets = ["schedule.total=20", "schedule.warmup=3", "checkpoint.every_steps=10", "logging.log_every=1"]
    suite = tmp_path / f"{SUITE}.yaml"
    suite.write_text(f"name: {SUITE}\nevaluators:\n  - {{type: fewshot, datasets: [digits], shots: [1], seeds: [0]}}\n")
    sets += ["logging.progress_bar=false", f"evals.suite={suite}", "data.streams=2"]
    sets += ["data.builtin_options={num_classes: 8, images_per_class: 40, val_per_class: 2}"]
    config = resolve_config(profile, "local_demo", sets, "down-throughout")
    prepare_local_data(config, load_suite(suite))
    spec = JobSpec.from_json(JobSpec.create(profile, config, build_plan(profile, config)).to_json())
    run_dir = Path(config.checkpoint.dir)
    # The driver's creation retries every 2 s, not MLflow's minutes of HTTP retries: the test's time, same path.
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setattr(runs, "CREATE_RETRY_MAX_S", 2.0)
    try:
        with ray_auth_mode("disabled"):
            rc, run = _run_job_then_start_the_server(spec, server, tmp_path, monkeypatch)
        printed = capsys.readouterr()
        assert rc == 0, printed.err[-4000:]
        warnings = [line for line in printed.err.splitlines() if line.startswith(f"warning: MLflow at {server.uri}")]
        assert len(warnings) == 1, printed.err[-4000:]
        # The job did not wait for MLflow: its end (evals drained, summary, ledger) took seconds, not a close's 120.
        ledger = json.loads((run_dir / "goodput" / "ledger.json").read_text())
        [job_end] = [row for row in ledger["attempts"] if row["row"] == "job end"]
        assert sum(v for k, v in job_end.items() if k != "row") < 60, job_end
        assert "the job ends now, and Ray actor vitscale-courier-down-throughout-" in printed.out, printed.out[-3000:]

        client = MlflowClient(tracking_uri=server.uri)
        history = client.get_metric_history(run.info.run_id, keys.LOSS)
        assert sorted(m.step for m in history) == list(range(1, 21))  # every step once, from rank 0's spool
        assert run.data.params[keys.RUN_ID_PARAM] == run.info.run_id
        assert run.info.status == "FINISHED" and run.data.tags[keys.STATUS] == "finished"
        assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "fewshot/digits/1shot")) == [0, 10, 20]
        assert keys.RESTARTS in run.data.tags and client.get_metric_history(run.info.run_id, keys.GOODPUT_FRACTION)
        assert not list(spool_dir(run_dir / RUN_RECORD).glob("*.json"))  # every spool file sent and removed
        secret = json.dumps(run.data.params) + json.dumps(run.data.tags)
        assert PASSWORD not in secret and PASSWORD not in printed.out + printed.err
    finally:
        server.stop()


def _run_job_then_start_the_server(spec, server, tmp_path, monkeypatch):
    """`run_job` on a one-node cluster started without credentials (the job's runtime env carries them); then the
    server starts, and the run the courier made is awaited, finished, before the cluster stops."""
    import ray
    from mlflow import MlflowClient

    # A CPU beside the two ranks, as the local head has: evals run while training goes on
    cluster = in_process_cluster(
        object_store_memory=100 * 1024**2, include_dashboard=False, dashboard_agent_listen_port=free_port(), num_cpus=3
    )
    try:
        monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", ADMIN)  # the driver's own environment, and the job's
        monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", PASSWORD)  # runtime env for every process Ray starts
        runtime = job_runtime_env(
            spec.profile, spec.to_json(), str(tmp_path), credentials=tracking_credentials(os.environ)
        )
        # This cluster's address for what the job's processes look up themselves: Ray Train's PlacementGroupCleaner
        # otherwise asked the newest Ray instance on the machine (another test's, in the suite) whether the job's
        # controller lived, was told it did not, and removed the workers' placement group mid-training.
        env_vars = {**runtime["env_vars"], "RAY_ADDRESS": cluster.address}
        ray.init(address=cluster.address, runtime_env={"env_vars": env_vars})
        rc = run_job(spec, address=cluster.address, eval_timeout_s=120)
        ray.shutdown()  # the job's driver ends: a call it left in flight to the courier would die with it
        server.start()
        client = MlflowClient(tracking_uri=server.uri)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            experiment = client.get_experiment_by_name("local_demo")
            found = client.search_runs([experiment.experiment_id]) if experiment else []
            if found and found[0].info.status == "FINISHED":
                break
            time.sleep(1.0)
        assert len(found) == 1 and found[0].info.status == "FINISHED", f"the courier did not finish the run: {found}"
        ray.init(address=cluster.address)
        couriers = [a for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == NAMESPACE]
        assert not couriers, couriers  # it ended itself
        return rc, found[0]
    finally:
        ray.shutdown()
        cluster.shutdown()


def test_a_courier_leaves_the_spool_where_mlflow_refuses_or_never_answers(tmp_path, capsys):
    """No courier for a server that refuses the job's credentials (the record says so); one whose server never
    answers within its deadline says where the records stay, and returns no run."""
    closed = f"http://127.0.0.1:{free_port()}"
    refused = tmp_path / "refused"
    refused.mkdir()
    (refused / RUN_RECORD).write_text(json.dumps({"run_id": None, "tracking_uri": closed, "refused": "401"}))
    line = hand_over(refused, closed, {}, {}, "FINISHED")
    assert line == (
        f"MLflow at {closed} refuses the job's credentials: the run's records stay in {refused / SPOOL_DIR}; with the "
        f"right ones, `python -m cluster.driver.deliver {refused}` sends them"
    )
    assert json.loads((refused / COURIER_FILE).read_text())["status"] == "FINISHED"  # the work, for the command

    down = tmp_path / "down"
    run = {"experiment": "e", "config": {"model": {"name": "vit_tiny_debug"}}, "tags": {}}
    assert deliver(down, closed, run, {}, "FINISHED", deadline_s=1.0) is None
    assert f"did not answer in 1 s; the records stay in {down / SPOOL_DIR}" in capsys.readouterr().out
    assert not (down / RUN_RECORD).exists()
    down.mkdir()
    (down / RUN_RECORD).write_text(json.dumps({"run_id": "0" * 32, "tracking_uri": closed}))  # a run that exists
    assert deliver(down, closed, run, {}, "FINISHED", deadline_s=1.0) is None
    assert f"did not answer in 1 s; the records stay in {down / SPOOL_DIR}" in capsys.readouterr().out


def test_a_job_whose_server_hangs_starts_and_ends_without_waiting_on_it(tmp_path, monkeypatch, capsys):
    """A server that accepts connections and never answers: each of MLflow's calls would wait 120 s, 7 retries over
    (some 20 minutes a call). The job's start says why within its wait; its end looks once, spools the summary's
    records and leaves the run to the courier."""
    monkeypatch.setattr(store, "FAILING_SINCE", {})
    monkeypatch.setattr(tracker_module, "UNANSWERED_CLOSE_S", 2.0)
    with socket.socket() as hanging:
        hanging.bind(("127.0.0.1", 0))
        hanging.listen(8)  # the kernel completes connections; nobody ever reads or replies
        uri, run_id = f"http://127.0.0.1:{hanging.getsockname()[1]}", "0" * 32
        starting = runs.start_job_run(tmp_path / "start", uri, "e", {}, {}, {}, wait_s=6.0)
        starting.stop()
        assert starting.run_id is None and starting.ref.startswith(PENDING_RUN)
        assert f"ConnectionError: {uri[7:]} accepts connections but sends no answer within 5 s" in (
            capsys.readouterr().err
        )
        (tmp_path / RUN_RECORD).write_text(json.dumps({"run_id": run_id, "tracking_uri": uri}))
        started = time.monotonic()
        assert not finish_job(tmp_path, 5, uri, run_id, JobEnd("FINISHED", 12.0, {}))
        assert time.monotonic() - started < 5.0 + 2.0 + 5.0 + 5  # two looks (the end's, the close's), the allowance
    assert f"MLflow run {run_id} is not reachable at the job's end: {uri[7:]} accepts connections but sends no" in (
        capsys.readouterr().out
    )
    [spooled] = spool_dir(tmp_path / RUN_RECORD).glob("*.json")
    assert json.loads(spooled.read_text())["tags"] == {keys.RESTARTS: "0"}


def test_a_job_whose_server_fails_its_calls_ends_without_waiting_on_it(failing_mlflow, tmp_path, monkeypatch, capsys):
    """A server whose /health answers while every call fails (its database down): MLflow's default retries would
    hold each of the job's end's calls ~4 min. The end asks for the run once, spools the summary's records and leaves
    the run to the courier."""
    monkeypatch.setattr(store, "FAILING_SINCE", {})  # no call has failed yet in this process
    monkeypatch.setattr(tracker_module, "UNANSWERED_CLOSE_S", 2.0)
    run_id = "0" * 32
    (tmp_path / RUN_RECORD).write_text(json.dumps({"run_id": run_id, "tracking_uri": failing_mlflow}))
    started = time.monotonic()
    assert not finish_job(tmp_path, 5, failing_mlflow, run_id, JobEnd("FINISHED", 12.0, {}))
    assert time.monotonic() - started < store.PROBE_TIMEOUT_S + 2.0 + 10
    assert f"MLflow run {run_id} is not reachable at the job's end: it answers /health but fails a request" in (
        capsys.readouterr().out
    )
    [spooled] = spool_dir(tmp_path / RUN_RECORD).glob("*.json")
    assert json.loads(spooled.read_text())["tags"] == {keys.RESTARTS: "0"}


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_job_whose_server_is_down_at_its_end_leaves_the_run_to_its_courier(tmp_path, monkeypatch, capsys):
    """The run exists, and its server is down at the job's end: the end does not wait out MLflow's retries (it took
    751 s), and the courier's work, started while the server is still down, waits for it, then sends the summary, the
    late evals and the final model and marks the run; a second delivery logs no second model."""
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    from tests.tracking.test_mlflow_model import _checkpoint, _random, _run
    from tests.tracking.test_tracking_server import _store_template

    monkeypatch.setattr(tracker_module, "UNANSWERED_CLOSE_S", 2.0)  # the summary Tracker's allowance: seconds
    monkeypatch.setattr(runs, "DOWN_POLL_S", 0.5)  # the courier's looks at the server while it starts
    server = MlflowServer(tmp_path / "server", auth=False)
    # The run is made in the server's own store while the server is down, by MLflow's store code as the server's
    # (its experiment's artifacts proxied, `mlflow-artifacts:/`): the server went down after making it, and no
    # server start and stop come before the job's end.
    shutil.copytree(_store_template(), server.root)
    store_uri = f"sqlite:///{server.root / 'mlflow.db'}"
    made = SqlAlchemyStore(store_uri, "mlflow-artifacts:/")
    made.create_experiment("models")  # where `_run` makes its run
    made.engine.dispose()
    run_dir = tmp_path / "run"
    _checkpoint(run_dir, 10, _random(num_classes=4))
    run_id = _run(store_uri, "down-at-end", {10: 0.5})
    (run_dir / RUN_RECORD).write_text(json.dumps({"run_id": run_id, "tracking_uri": server.uri}))
    evals = {20: {"metrics": {"fewshot/digits/5shot": 0.25}}}  # an eval that ended while the server was down
    started = time.monotonic()
    assert not finish_job(run_dir, 5, server.uri, run_id, JobEnd("FINISHED", 12.0, evals))
    assert time.monotonic() - started < 60  # the summary's Tracker waits UNANSWERED_CLOSE_S, then spools
    assert f"MLflow run {run_id} is not reachable at the job's end: nothing accepts" in capsys.readouterr().out
    assert len(list(spool_dir(run_dir / RUN_RECORD).glob("*.json"))) == 1

    work = {"experiment": "down-at-end", "config": {}, "tags": {}}
    starting = threading.Thread(target=server.start)
    starting.start()
    try:
        assert deliver(run_dir, server.uri, work, evals, "FINISHED", deadline_s=400) == run_id
        assert deliver(run_dir, server.uri, work, evals, "FINISHED", deadline_s=60) == run_id  # again: nothing new
        client = mlflow.tracking.MlflowClient(server.uri)
        run = client.get_run(run_id)
        assert run.info.status == "FINISHED" and run.data.tags[keys.MODEL_STEP] == "10"
        assert run.data.tags[keys.RESTARTS] == "0"  # the summary's Tracker, spooled and sent
        assert [a.path for a in client.list_artifacts(run_id)] == ["summary.json"]
        assert [(m.step, m.value) for m in client.get_metric_history(run_id, "fewshot/digits/5shot")] == [(20, 0.25)]
        assert len(client.search_logged_models(experiment_ids=[run.info.experiment_id])) == 1
        assert "already in MLflow run" in capsys.readouterr().out
    finally:
        starting.join()
        server.stop()


def test_the_courier_command_sends_what_no_courier_did(tmp_path, mlflow_uri, capsys):
    """After a refusal (or a `make stop` that ended the courier), `python -m cluster.driver.deliver RUN_FOLDER` does
    the courier's work in the foreground: it creates the run, sends the spool, marks the status and clears both."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    record = run_dir / RUN_RECORD
    record.write_text(json.dumps({"run_id": None, "tracking_uri": mlflow_uri, "refused": "401"}))
    tracker = Tracker(mlflow_uri, pending_run_ref(record), rank=0)
    tracker.log_once_per_step("train/")
    for step in range(1, 6):
        tracker.log_metrics({keys.LOSS: 1.0 / step}, step=step)
    tracker.close()
    assert len(list(spool_dir(record).glob("*.json"))) == 1
    run = {"experiment": "courier-cli", "config": {"model": {"name": "vit_tiny_debug"}}, "tags": {}}
    assert "refuses the job's credentials" in hand_over(run_dir, mlflow_uri, run, {}, "FINISHED")
    record.write_text(json.dumps({"run_id": None, "tracking_uri": mlflow_uri}))  # the credentials fixed

    assert deliver_main([str(run_dir), "--wait", "60"]) == 0
    run_id = runs.recorded_run_id(record, mlflow_uri)
    client = mlflow.tracking.MlflowClient(mlflow_uri)
    assert client.get_run(run_id).info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(run_id, keys.LOSS)] == [1, 2, 3, 4, 5]
    assert not (run_dir / COURIER_FILE).exists() and not list(spool_dir(record).glob("*.json"))
    assert f"MLflow run {run_id} holds the job's records, marked FINISHED" in capsys.readouterr().out
    assert deliver_main([str(run_dir)]) == 0 and "nothing in" in capsys.readouterr().out  # again: nothing to do
    (run_dir / COURIER_FILE).write_text("{truncated")  # a damaged work file: a clear error, and it stays
    assert deliver_main([str(run_dir)]) == 2 and (run_dir / COURIER_FILE).read_text() == "{truncated"
    assert "cannot be read" in capsys.readouterr().err


def test_a_courier_whose_status_mark_fails_keeps_its_work(tmp_path, mlflow_uri, capsys):
    """MLflow took the records but not the status (here its store refuses to change a run's row): the courier said
    the run was marked, dropped its work, and the run stayed RUNNING."""
    import sqlite3

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    run_id = runs.create_run(mlflow_uri, "refused", "run")
    (run_dir / RUN_RECORD).write_text(json.dumps({"run_id": run_id, "tracking_uri": mlflow_uri}))
    run = {"experiment": "refused", "config": {}, "tags": {}}
    work = {"tracking_uri": mlflow_uri, "run": run, "evals": {}, "status": "FINISHED"}
    (run_dir / COURIER_FILE).write_text(json.dumps(work))  # as `hand_over` leaves it
    store = sqlite3.connect(mlflow_uri.removeprefix("sqlite:///"), isolation_level=None)
    store.execute("CREATE TRIGGER refuse BEFORE UPDATE ON runs BEGIN SELECT RAISE(ABORT, 'refused'); END")
    try:
        assert deliver(run_dir, mlflow_uri, run, {}, "FINISHED") is None
    finally:
        store.execute("DROP TRIGGER refuse")
        store.close()
    assert (run_dir / COURIER_FILE).exists() and "is not marked FINISHED" in capsys.readouterr().out
    assert deliver_main([str(run_dir)]) == 0 and not (run_dir / COURIER_FILE).exists()
    assert mlflow.tracking.MlflowClient(mlflow_uri).get_run(run_id).info.status == "FINISHED"


def test_a_run_deleted_in_mlflow_is_named_at_once_and_its_records_kept(tmp_path, mlflow_uri, capsys):
    """The run a run folder records was deleted in MLflow. The courier's work and the courier command stop at once,
    naming the run and how to restore it, and keep the work and the spool (before: a run deleted for good held a
    courier for its 24 h, and a deleted one got the records to drop them); once it is restored, everything is sent.
    A relaunch of the run folder logs to a new run and says so."""
    client = mlflow.tracking.MlflowClient(mlflow_uri)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    record = run_dir / RUN_RECORD
    record.write_text(json.dumps({"run_id": None, "tracking_uri": mlflow_uri, "refused": "401"}))
    tracker = Tracker(mlflow_uri, pending_run_ref(record), rank=0)  # a spool file, as a job's rank leaves it
    for step in range(1, 4):
        tracker.log_metrics({keys.LOSS: 1.0 / step}, step=step)
    tracker.close()
    run_id = runs.create_run(mlflow_uri, "deleted", "run")
    record.write_text(json.dumps({"run_id": run_id, "tracking_uri": mlflow_uri}))
    client.delete_run(run_id)

    started = time.monotonic()
    assert deliver_main([str(run_dir), "--wait", "60"]) == 2  # the spool alone
    assert f"mlflow runs restore --run-id {run_id}` brings it back); its 1 spool file(s) stay" in (
        capsys.readouterr().err
    )
    work = {
        "tracking_uri": mlflow_uri,
        "run": {"experiment": "deleted", "config": {}, "tags": {}},
        "status": "FINISHED",
    }
    (run_dir / COURIER_FILE).write_text(json.dumps({**work, "evals": {"20": {"metrics": {"fewshot/mean/5shot": 0.5}}}}))
    assert deliver_main([str(run_dir), "--wait", "60"]) == 1  # the courier's work
    assert f"courier: MLflow run {run_id} is deleted" in capsys.readouterr().out
    assert time.monotonic() - started < 30 and (run_dir / COURIER_FILE).exists()
    assert len(list(spool_dir(record).glob("*.json"))) == 1

    client.restore_run(run_id)
    assert deliver_main([str(run_dir), "--wait", "60"]) == 0
    assert [m.step for m in client.get_metric_history(run_id, keys.LOSS)] == [1, 2, 3]
    assert [m.step for m in client.get_metric_history(run_id, "fewshot/mean/5shot")] == [20]
    assert client.get_run(run_id).info.status == "FINISHED"

    gone = "0" * 32  # deleted for good (`mlflow gc`)
    record.write_text(json.dumps({"run_id": gone, "tracking_uri": mlflow_uri}))
    (run_dir / COURIER_FILE).write_text(json.dumps({**work, "evals": {}}))
    started = time.monotonic()
    assert deliver(run_dir, mlflow_uri, work["run"], {}, "FINISHED", deadline_s=600) is None
    assert time.monotonic() - started < 30
    assert f"has no run {gone}: it was deleted for good" in capsys.readouterr().out
    relaunch = runs.start_job_run(run_dir, mlflow_uri, "deleted", {}, {}, {}, wait_s=60)
    relaunch.stop()
    assert relaunch.run_id not in (None, gone) and runs.recorded_run_id(record, mlflow_uri) == relaunch.run_id
    assert (
        f"warning: MLflow at {mlflow_uri} has no run {gone}: it was deleted for good (`mlflow gc`); this job logs"
        in (capsys.readouterr().out)
    )


@pytest.mark.timeout(180)
def test_a_courier_on_a_cluster_kuberay_deletes_says_so_and_names_the_command(tmp_path, monkeypatch):
    """On the rendered RayJob's cluster (KubeRay deletes it an hour after the job, the courier with it), the job's end
    does not promise 24 h: it says until when the courier lives and which command sends the records after that."""
    import ray

    from cluster.render import CLUSTER_TTL_S

    monkeypatch.setenv(courier.CLUSTER_TTL_ENV, str(CLUSTER_TTL_S))  # as the rendered pods set it
    closed = f"http://127.0.0.1:{free_port()}"
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    run = {"experiment": "e", "config": {}, "tags": {}}
    with ray_auth_mode("disabled"):
        cluster = in_process_cluster(include_dashboard=False, dashboard_agent_listen_port=free_port(), num_cpus=1)
        try:
            ray.init(address=cluster.address)
            line = hand_over(run_dir, closed, run, {}, "FINISHED")
        finally:
            ray.shutdown()
            cluster.shutdown()
    assert "the job ends now, and Ray actor vitscale-courier-run-" in line and "24 h" not in line, line
    assert line.endswith(
        f"until KubeRay deletes the RayCluster, 60 min after the job's end; if MLflow answers later, "
        f"`python -m cluster.driver.deliver {run_dir}` sends them)"
    )
    assert (run_dir / COURIER_FILE).exists()  # what that command sends


def test_a_courier_leaves_the_status_to_a_later_job_of_the_run_folder(tmp_path, mlflow_uri, capsys):
    """MLflow down at a job's end, the run folder relaunched before it returns: the old job's work (its courier, or
    the command) sends its records, but marks no FAILED on the run the later job trains, logs none of that job's
    checkpoints as the final model, and leaves the later job's own work file alone."""
    from pretrain.telemetry.heartbeat import Heartbeat, heartbeat_path
    from tests.tracking.test_mlflow_model import _checkpoint, _random

    client = mlflow.tracking.MlflowClient(mlflow_uri)
    run_dir = tmp_path / "run"
    run_id = runs.create_run(mlflow_uri, "relaunched", "run")
    _checkpoint(run_dir, 10, _random(num_classes=4))  # the later job's newest checkpoint
    (run_dir / RUN_RECORD).write_text(json.dumps({"run_id": run_id, "tracking_uri": mlflow_uri}))
    run = {"experiment": "relaunched", "config": {}, "tags": {}}
    evals = {"20": {"metrics": {"fewshot/mean/5shot": 0.5}}}  # the old job's, never logged
    handed_over = time.time() - 60
    work = {"tracking_uri": mlflow_uri, "run": run, "evals": evals, "status": "FAILED", "handed_over": handed_over}
    (run_dir / COURIER_FILE).write_text(json.dumps(work))  # as `hand_over` leaves it
    Heartbeat(heartbeat_path(run_dir, 0), {"rank": 0, "world_size": 1}).step(3, 0.1, {})  # the later job trains

    assert deliver_main([str(run_dir), "--wait", "60"]) == 0
    found = client.get_run(run_id)
    assert found.info.status == "RUNNING" and keys.MODEL_URI not in found.data.tags
    assert [m.step for m in client.get_metric_history(run_id, "fewshot/mean/5shot")] == [20]
    assert "a later job of the run folder trains" in capsys.readouterr().out
    assert not (run_dir / COURIER_FILE).exists()

    # the later job's end handed its own work over meanwhile: an earlier courier finishing late keeps it
    later = {**work, "status": "FINISHED", "handed_over": time.time()}
    (run_dir / COURIER_FILE).write_text(json.dumps(later))
    assert deliver(run_dir, mlflow_uri, run, evals, "FAILED", 60, since=handed_over) == run_id
    assert json.loads((run_dir / COURIER_FILE).read_text()) == later
    assert client.get_run(run_id).info.status == "RUNNING"
    assert deliver_main([str(run_dir), "--wait", "60"]) == 0  # the later job's work: its status, its model
    found = client.get_run(run_id)
    assert found.info.status == "FINISHED" and found.data.tags[keys.MODEL_STEP] == "10"
