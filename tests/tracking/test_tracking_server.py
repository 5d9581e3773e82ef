"""Tracking at a job's start against a real `mlflow server` on 127.0.0.1 that the tests start, stop and restart.

A server that is down, or refuses the credentials (401), when the job starts never stops the job: the driver's
`open_tracking` returns at once with one warning, the Trackers buffer, and the run's records reach MLflow once it
answers, each step once. MLflow's credentials travel in the job's runtime env and nowhere else. The server is
MLflow's basic-auth app (`mlflow[auth]`, in the dev extra).
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import json
import logging
import os
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from cluster.driver import deliver
from cluster.local_head import free_port
from tracking import keys, runs, store, tracker
from tracking.runs import CREDENTIAL_VARS, run_tags
from tracking.store import PENDING_RUN, spool_dir
from tracking.tracker import Tracker

pytestmark = pytest.mark.timeout(300)

ADMIN, PASSWORD = "admin", "vitscale-Test-pw-8842"  # the test server's admin: the "right credentials"
TOKEN = "vitscale-token-3fd9"  # sent (as a bearer token) to a server without auth, which ignores it


class MlflowServer:
    """`python -m mlflow server` on 127.0.0.1 with its own SQLite store and artifact folder under ``root``; with
    ``auth``, MLflow's basic-auth app whose one user is ``ADMIN``. Its process group is stopped by `stop`."""

    def __init__(self, root: Path, auth: bool) -> None:
        self.root, self.auth = root, auth
        self.uri = f"http://127.0.0.1:{free_port()}"
        self._process: subprocess.Popen | None = None

    def start(self, timeout_s: float = 300.0) -> None:
        """Start the server and wait until it answers. Its start is two imports of MLflow's server (the CLI, then
        the uvicorn it runs): 133 s measured in the suite's busiest first minutes on 2 cores, ~15 s on a quiet box."""
        if self._process is not None:
            return
        if not (self.root / "mlflow.db").exists():  # a new server: stores made by MLflow once per process, copied
            shutil.copytree(_store_template(), self.root, dirs_exist_ok=True)
        port = self.uri.rsplit(":", 1)[1]
        command = [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", port, "--workers", "1"]
        command += ["--backend-store-uri", f"sqlite:///{self.root / 'mlflow.db'}"]
        command += ["--artifacts-destination", str(self.root / "artifacts")]
        env = {k: v for k, v in os.environ.items() if k not in CREDENTIAL_VARS}
        env["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] = "false"  # no job runner processes on 2 cores
        if self.auth:
            command += ["--app-name", "basic-auth"]
            env |= self._auth_env()
        with open(self.root / "server.log", "a") as log:  # the server keeps its own copy of the descriptor
            self._process = subprocess.Popen(
                command, cwd=self.root, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        self._wait_until_up(timeout_s)

    def stop(self) -> None:
        if self._process is None:
            return
        process, self._process = self._process, None
        os.killpg(process.pid, signal.SIGTERM)  # the CLI and the uvicorn it started
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)
        assert _wait_for(lambda: not self._answers(), 30), "the stopped server still accepts connections"

    def _answers(self) -> bool:
        with socket.socket() as sock:
            return sock.connect_ex(("127.0.0.1", int(self.uri.rsplit(":", 1)[1]))) == 0

    def _auth_env(self) -> dict[str, str]:
        ini = self.root / "basic_auth.ini"
        ini.write_text(
            "[mlflow]\ndefault_permission = READ\n"
            f"database_uri = sqlite:///{self.root / 'basic_auth.db'}\nadmin_username = {ADMIN}\n"
            "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n"
        )
        return {
            "MLFLOW_AUTH_CONFIG_PATH": str(ini),
            "MLFLOW_AUTH_ADMIN_PASSWORD": PASSWORD,
            "MLFLOW_FLASK_SERVER_SECRET_KEY": "vitscale-tests",
        }

    def _wait_until_up(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self._process.poll() is None, (self.root / "server.log").read_text()[-3000:]
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=5) as response:
                    if response.status == 200:
                        return
            except (OSError, urllib.error.URLError):
                pass
            time.sleep(0.3)
        raise TimeoutError(f"mlflow server at {self.uri} not up in {timeout_s} s")


@functools.cache
def _store_template() -> Path:
    """The two SQLite stores a new server starts from, made once per process by MLflow's own code: the tracking
    store and the basic-auth store with its admin user. A server making them runs MLflow's schema migrations (seconds
    of CPU each start). The admin's password hash is PBKDF2 with 1,000 rounds instead of werkzeug's default scrypt,
    which costs 0.13 CPU-s on every request the server authenticates here: the same check, not the same price."""
    from mlflow.server.auth.sqlalchemy_store import SqlAlchemyStore
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore as TrackingStore
    from werkzeug.security import generate_password_hash

    folder = Path(tempfile.mkdtemp(prefix="mlflow-server-stores-"))
    atexit.register(shutil.rmtree, folder, True)
    # The Default experiment's artifacts where the server's own store puts them (`--artifacts-destination`).
    TrackingStore(f"sqlite:///{folder / 'mlflow.db'}", "mlflow-artifacts:/").engine.dispose()
    auth = SqlAlchemyStore()
    auth.init_db(f"sqlite:///{folder / 'basic_auth.db'}")
    auth.create_user(ADMIN, PASSWORD, is_admin=True)
    auth.engine.dispose()
    with sqlite3.connect(folder / "basic_auth.db") as db:
        cheap = generate_password_hash(PASSWORD, method="pbkdf2:sha256:1000")
        db.execute("UPDATE users SET password_hash = ? WHERE username = ?", (cheap, ADMIN))
    return folder


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """One server for the module (a start takes ~15 s here); each test starts or stops it as it needs."""
    mlflow_server = MlflowServer(tmp_path_factory.mktemp("mlflow_server"), auth=True)
    yield mlflow_server
    mlflow_server.stop()


@pytest.fixture
def fast_retries(monkeypatch, server):
    """The right credentials (a token, for a server without auth); MLflow's HTTP client not retrying, so that an
    attempt against a server that is down fails at once, and the job's retries, its looks at a server that is down,
    the Trackers' looks at the run record and a closing Tracker's allowance for a server that is down come quickly."""
    for name in CREDENTIAL_VARS:
        monkeypatch.delenv(name, raising=False)
    if server.auth:
        monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", ADMIN)
        monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", PASSWORD)
    else:
        monkeypatch.setenv("MLFLOW_TRACKING_TOKEN", TOKEN)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "20")
    monkeypatch.setattr(runs, "CREATE_RETRY_MAX_S", 1.0)
    monkeypatch.setattr(runs, "DOWN_POLL_S", 0.5)  # the creation sees the server answer within 0.5 s, not 5
    monkeypatch.setattr(tracker, "PENDING_POLL_S", 0.5)
    monkeypatch.setattr(tracker, "UNANSWERED_CLOSE_S", 2.0)  # not 10 s per Tracker closing during an outage


def _spec(tmp_path: Path, uri: str, name: str):
    """A job spec as `cluster.launch` makes it, its run folder under ``tmp_path``, tracking to ``uri``."""
    from cluster.driver.job import JobSpec
    from cluster.profiles import load_profile
    from pretrain.config.train_config import load_config

    config = load_config("local_demo")
    config = config.replace(
        checkpoint=dataclasses.replace(config.checkpoint, dir=str(tmp_path / name)),
        logging=dataclasses.replace(config.logging, mlflow_tracking_uri=uri),
    )
    tags = run_tags(config.recipe, config.model.name, 2, run_dir=config.checkpoint.dir)
    return JobSpec(load_profile("local"), config, {"world_size": 2, "note": "the plan"}, None, tags)


def _warnings(text: str, uri: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(f"warning: MLflow at {uri}")]


def _client(uri: str):
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=uri)


def _steps(uri: str, run_id: str, key: str = keys.LOSS) -> list[int]:
    return sorted(m.step for m in _client(uri).get_metric_history(run_id, key))


def _wait_for(predicate, timeout_s: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.2)
    return False


def _worker_tracker(config, **kwargs) -> Tracker:
    """Rank 0's Tracker as `pretrain.loop` makes it: the run named by the config the driver handed the workers."""
    worker = Tracker(config.logging.mlflow_tracking_uri, config.logging.mlflow_run_id, rank=0, **kwargs)
    worker.log_params({**config.to_dict(), "model.patch_size": 16})
    worker.set_tags({keys.STATUS: "running"})
    return worker


@pytest.mark.timeout(120)
def test_credentials_reach_the_runtime_env_and_nowhere_else(monkeypatch):
    """Every credential of the launching shell is in the job's env_vars; none is in the rest of the runtime env, the
    job spec ($VITSCALE_PLAN), the printed plan, or a runtime env rendered to a file (cluster.render)."""
    from cluster import launch
    from cluster.driver.job import PLAN_ENV, JobSpec, job_runtime_env
    from cluster.plan.planner import build_plan, resolve_config
    from cluster.plan.text import format_plan
    from cluster.profiles import load_profile

    secrets = {name: f"secret-{i}-Zq81x" for i, name in enumerate(CREDENTIAL_VARS)}
    for name, value in secrets.items():
        monkeypatch.setenv(name, value)
    profile = load_profile("local")
    config = resolve_config(profile, "local_demo", [], "r")
    plan = build_plan(profile, config)
    spec = JobSpec.create(profile, config, plan)
    runtime = launch.runtime_env(profile, spec)
    env_vars = runtime["env_vars"]
    assert {name: env_vars[name] for name in CREDENTIAL_VARS} == secrets
    rest = json.dumps({**runtime, "env_vars": {k: v for k, v in env_vars.items() if k not in CREDENTIAL_VARS}})
    rendered = json.dumps(job_runtime_env(profile, spec.to_json(), "/code"))
    for text in (rest, env_vars[PLAN_ENV], spec.to_json(), format_plan(plan), rendered):
        assert not any(value in text for value in secrets.values())


@pytest.mark.timeout(120)
def test_a_server_that_never_answers_holds_the_start_for_the_short_wait_only(monkeypatch, tmp_path, capsys):
    """A server that accepts connections and never replies (slow, overloaded): the start gives it `START_WAIT_S`,
    says so once, and the job's Trackers log without waiting."""
    from cluster.driver.job import open_tracking

    monkeypatch.setattr(runs, "START_WAIT_S", 2.0)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    # One 5 s attempt at a time, none of MLflow's own retries: the attempt in flight ends before this test does (an
    # attempt left retrying drew urllib3's backoff jitter from `random` while later tests checked its state).
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    with socket.socket() as hanging:
        hanging.bind(("127.0.0.1", 0))
        hanging.listen(8)  # the kernel completes connections; nobody reads or replies
        uri = f"http://127.0.0.1:{hanging.getsockname()[1]}"
        started = time.monotonic()
        job_run, config = open_tracking(_spec(tmp_path, uri, "slow"))
        assert time.monotonic() - started < 8 and job_run.ref.startswith(PENDING_RUN)
        worker = _worker_tracker(config)
        started = time.monotonic()
        for step in range(1, 101):
            worker.log_metrics({keys.LOSS: 1.0}, step=step)
        assert not worker.sync(timeout=10) and time.monotonic() - started < 5
        job_run.stop(wait_s=15)
        worker.close(timeout=5)
    assert not job_run._thread.is_alive(), "the run's creation outlived the test"
    [warning] = _warnings(capsys.readouterr().err, uri)
    assert "did not answer within 2 s" in warning and "buffered" in warning


OUTAGE_S = 40.0  # the server down after the job's start, before its own start (see the test)


@pytest.mark.waits
@pytest.mark.slow
def test_a_run_asked_for_during_a_long_outage_exists_seconds_after_the_server_answers(
    server, monkeypatch, tmp_path, capsys
):
    """MLflow's own HTTP retries back off to minutes (2, 4, 8 ... 64 s): a creation left inside them was made 40 s
    after the server came back (docs/benchmarks/2026-12-03-tracking-outage.md), and a job that had finished training
    waited for it. The creation asks MLflow only once something accepts connections at the server's address, looking
    every `DOWN_POLL_S`; here with MLflow's default retries, after `OUTAGE_S` plus the server's start of outage.

    Without the look, MLflow's retries of the creation come 0, 0, 4, 12, 28, 60, 124 s after its first try (2 s x
    2^n backoff, from the 2nd retry on), and the start waits its `START_WAIT_S` (10 s) on that try: the server answers
    10 + `OUTAGE_S` + its start (~15 s quiet, 27 s loaded) after the first try. With 40 s, that is between the tries
    at 60 and 124 s, more than the assertion's margin before the latter, for any start of 10 to 59 s (measured without
    the look, start 26.5 s: the run came 53 s late); 70 s was so only for starts under ~29 s (at 26.5 s: ~19 s late),
    and idled 30 s longer."""
    from cluster.driver.job import open_tracking

    for name in CREDENTIAL_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", ADMIN)
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", PASSWORD)
    monkeypatch.delenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", raising=False)
    server.stop()
    job_run, _ = open_tracking(_spec(tmp_path, server.uri, "late"))
    try:
        time.sleep(OUTAGE_S)
        server.start()
        answered = time.monotonic()
        run_id = job_run.wait(timeout_s=120)
        lag = time.monotonic() - answered
    finally:
        job_run.stop(wait_s=15)
    assert run_id is not None, "the run was not created within 120 s of the server answering"
    assert lag < runs.DOWN_POLL_S + 10, f"the run was created {lag:.0f} s after the server answered"
    [warning] = _warnings(capsys.readouterr().err, server.uri)
    assert "nothing accepts connections at 127.0.0.1:" in warning and "Connection refused" in warning, warning


@pytest.mark.slow
def test_a_job_started_while_the_server_is_down_trains_and_every_step_arrives_once(
    server, fast_retries, tmp_path, capsys, caplog
):
    """The driver's start does not wait for a server that is down: one warning, a pending run the workers log to.
    Once the server answers, the run is created and all the buffered steps arrive once; a later outage (stop,
    restart) loses none either; a relaunch continues the run without asking MLflow."""
    from cluster.driver.job import open_tracking

    server.stop()
    spec = _spec(tmp_path, server.uri, "down-at-start")
    started = time.monotonic()
    job_run, config = open_tracking(spec)
    assert time.monotonic() - started < 10, "the job's start waited for MLflow"
    assert config.logging.mlflow_run_id == job_run.ref and job_run.ref.startswith(PENDING_RUN)
    worker = _worker_tracker(config)
    for step in range(1, 21):
        worker.log_metrics({keys.LOSS: 1.0 / step}, step=step)
    started = time.monotonic()
    assert not worker.sync(timeout=30) and time.monotonic() - started < 5  # a checkpoint never waits for MLflow

    server.start()  # seconds: the creation retries meanwhile, every `DOWN_POLL_S`, silently
    run_id = job_run.wait(120)
    assert run_id is not None
    for step in range(21, 31):
        worker.log_metrics({keys.LOSS: 1.0 / step}, step=step)
    assert _wait_for(lambda: worker.pending == 0 and _steps(server.uri, run_id) == list(range(1, 31)))

    server.stop()  # an outage mid-run, then the same server back
    for step in range(31, 41):
        worker.log_metrics({keys.LOSS: 1.0 / step}, step=step)
    # A process of the job that ends during the outage (a restarted rank 0's, the driver's end): its records wait in
    # the spool of the run folder, and `python -m cluster.driver.deliver` sends them once the server is back.
    # One Tracker holds the run's id (a rank started after the run existed), one the pending reference of the start.
    record = Path(config.checkpoint.dir) / runs.RUN_RECORD
    ending = Tracker(server.uri, run_id, rank=0, record=record)
    ending.log_once_per_step("train/")
    ending.log_metrics({keys.LOSS: 1.0 / 40, "train/lr": 0.1}, step=40)  # step 40 again: it must not arrive twice
    ending.log_metrics({keys.LOSS: 1.0 / 41}, step=41)
    pending = Tracker(server.uri, config.logging.mlflow_run_id, rank=0)
    pending.log_params({keys.RUN_ID_PARAM: config.logging.mlflow_run_id, "late.param": "x"})
    with caplog.at_level(logging.WARNING, logger="tracking.tracker"):
        closing = [threading.Thread(target=t.close, kwargs={"timeout": 60}) for t in (ending, pending)]
        for thread in closing:
            thread.start()
        for thread in closing:
            thread.join()
    assert len(list(spool_dir(record).glob("*.json"))) == 2 and "not sent" not in caplog.text
    assert f"python -m cluster.driver.deliver {record.parent}" in caplog.text
    server.start()
    assert worker.flush(timeout=60) or _wait_for(lambda: worker.pending == 0)
    worker.close()
    assert _steps(server.uri, run_id) == list(range(1, 41))  # each step once
    assert deliver.main([str(record.parent), "--wait", "60"]) == 0 and not spool_dir(record).exists()
    assert _steps(server.uri, run_id) == list(range(1, 42)) and _steps(server.uri, run_id, "train/lr") == [40]
    params = _client(server.uri).get_run(run_id).data.params
    assert params["late.param"] == "x" and params[keys.RUN_ID_PARAM] == run_id  # the reference, spooled as the id

    run = _client(server.uri).get_run(run_id)
    assert run.data.params[keys.RUN_ID_PARAM] == run_id  # the pending reference was sent as the run's id
    assert run.data.params["model.patch_size"] == "16" and run.data.params["model.name"] == config.model.name
    assert run.data.tags[keys.RUN_DIR] == config.checkpoint.dir and run.info.run_name == "down-at-start"
    assert [a.path for a in _client(server.uri).list_artifacts(run_id)] == ["plan.json"]
    plan = Path(_client(server.uri).download_artifacts(run_id, "plan.json", str(tmp_path))).read_text()
    printed = capsys.readouterr()
    [warning] = _warnings(printed.err, server.uri)
    assert "buffered" in warning and "reach MLflow once it answers" in warning
    assert f"MLflow run {run_id} created after" in printed.out
    secret = PASSWORD if server.auth else TOKEN
    for text in (json.dumps(run.data.params), json.dumps(run.data.tags), plan, printed.out, printed.err):
        assert secret not in text

    again, config = open_tracking(spec)  # a relaunch of the run folder: the same run, MLflow not asked
    assert again.ref == again.run_id == run_id == config.logging.mlflow_run_id
    job_run.stop()


@pytest.mark.slow
def test_a_server_refusing_the_credentials_never_fails_the_job_and_the_right_ones_deliver(
    server, fast_retries, tmp_path, monkeypatch, capsys, caplog
):
    """401 at the job's start: no exception, one warning naming the fix, a bounded buffer, a close that says at once
    what was not sent. With the right credentials from the environment the records arrive, and the password is in
    none of them, nor in what the job printed or logged. A relaunch's one question about its recorded run (no
    retries, `store.missing_run`) carries them too: the run is there, deleted, or gone."""
    from cluster.driver.job import open_tracking

    server.start()
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "wrong-password-Kx7")
    with caplog.at_level(logging.INFO):
        refused, config = open_tracking(_spec(tmp_path, server.uri, "refused"))
        worker = _worker_tracker(config, max_buffered=10)
        params_and_tag = worker.pending
        for step in range(1, 26):
            worker.log_metrics({keys.LOSS: 1.0}, step=step)
        assert not worker.flush() and worker.pending == params_and_tag + 10  # bounded: the newest 10 values
        time.sleep(3)  # refused again and again meanwhile, silently
        started = time.monotonic()
        worker.close(timeout=120)
        assert time.monotonic() - started < 10  # a run MLflow refuses is not waited for (the record says so)
        refused.stop(wait_s=30)
    assert refused.run_id is None and refused.ref.startswith(PENDING_RUN)
    [warning] = _warnings(capsys.readouterr().err, server.uri)
    assert "401" in warning and "MLFLOW_TRACKING_PASSWORD" in warning and "buffered" in warning
    assert "MLflow refuses the job's credentials; the run's" in caplog.text  # its records wait in the spool
    assert len(list(spool_dir(refused.record).glob("*.json"))) == 1

    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", PASSWORD)
    with caplog.at_level(logging.INFO):
        accepted, config = open_tracking(_spec(tmp_path, server.uri, "accepted"))
        assert accepted.ref == accepted.run_id  # created within the start's wait
        worker = _worker_tracker(config)
        for step in range(1, 6):
            worker.log_metrics({keys.LOSS: 1.0}, step=step)
        assert worker.flush(timeout=60)
        worker.close()
    run_id = accepted.run_id
    assert _steps(server.uri, run_id) == [1, 2, 3, 4, 5]
    run = _client(server.uri).get_run(run_id)
    plan = Path(_client(server.uri).download_artifacts(run_id, "plan.json", str(tmp_path))).read_text()
    printed = capsys.readouterr()
    assert not _warnings(printed.err, server.uri)
    for text in (json.dumps(run.data.params), json.dumps(run.data.tags), plan, printed.out, printed.err, caplog.text):
        assert PASSWORD not in text and "wrong-password-Kx7" not in text
    assert store.missing_run(server.uri, run_id) == ""
    _client(server.uri).delete_run(run_id)
    assert f"MLflow run {run_id} is deleted" in store.missing_run(server.uri, run_id)
    assert "it was deleted for good" in store.missing_run(server.uri, "0" * 32)


@pytest.mark.slow
def test_the_runs_first_records_wait_in_the_spool_when_the_server_fails_right_after_creating_it(
    server, fast_retries, tmp_path, monkeypatch, caplog
):
    """The driver creates the run, records it, then sends the config, the run-id param and plan.json with a Tracker
    of its own: a server failing in that moment had them dropped with a warning ("not sent"). They wait in the run
    folder's spool, as its other Trackers' records do, and reach the run once the server answers."""
    create, run_dir = runs.create_run, tmp_path / "down-after-creation"

    def create_then_stop(*args, **kwargs) -> str:
        run_id = create(*args, **kwargs)
        server.stop()
        return run_id

    monkeypatch.setattr(store, "FAILING_SINCE", {})
    monkeypatch.setattr(tracker, "CLOSE_RETRIES", 0)  # one last send: seconds
    monkeypatch.setattr(runs, "create_run", create_then_stop)
    server.start()
    with caplog.at_level(logging.WARNING, logger="tracking.tracker"):
        run_id = runs.open_job_run(run_dir, server.uri, "created-then-down", {"model": {"name": "vit"}}, {}, {})
    record = run_dir / runs.RUN_RECORD
    assert "not sent" not in caplog.text and len(list(spool_dir(record).glob("*.json"))) == 1, caplog.text
    server.start()
    assert runs.send_spooled(record, timeout_s=60) == (3, 0)
    assert _client(server.uri).get_run(run_id).data.params == {"model.name": "vit", keys.RUN_ID_PARAM: run_id}
    assert [a.path for a in _client(server.uri).list_artifacts(run_id)] == ["plan.json"]


@pytest.mark.timeout(120)
def test_a_deleted_experiment_is_one_warning_naming_the_fix_and_a_restore_creates_the_run(
    mlflow_uri, monkeypatch, tmp_path, capsys
):
    """Deleting a recipe's experiment in the MLflow UI keeps its name, and MLflow refuses new runs in it: every later
    launch's creation failed with MLflow's "must be in the 'active' state", retried for good and never said the fix.
    The warning says it; once restored, the retry creates the run."""
    monkeypatch.setattr(runs, "CREATE_RETRY_MAX_S", 0.5)
    client = _client(mlflow_uri)
    runs.create_run(mlflow_uri, "deleted-recipe", "first", {}, {})
    experiment_id = client.get_experiment_by_name("deleted-recipe").experiment_id
    client.delete_experiment(experiment_id)
    job_run = runs.start_job_run(tmp_path / "relaunch", mlflow_uri, "deleted-recipe", {"seed": 1}, {}, {}, wait_s=30)
    try:
        [warning] = _warnings(capsys.readouterr().err, mlflow_uri)
        assert f"`mlflow experiments restore --experiment-id {experiment_id}`" in warning, warning
        assert f"`mlflow gc --experiment-ids {experiment_id}`" in warning and job_run.run_id is None
        client.restore_experiment(experiment_id)
        run_id = job_run.wait(timeout_s=30)
    finally:
        job_run.stop(wait_s=15)
    assert run_id is not None and client.get_run(run_id).info.experiment_id == experiment_id


@pytest.mark.timeout(120)
def test_a_config_key_longer_than_mlflows_limit_is_skipped_not_retried_for_good(mlflow_uri, tmp_path, caplog):
    """A task's options are the task's to check: a registered task taking a mapping with long names made a config key
    over MLflow's 250 characters, and the job's run creation raised on it, retried until the job ended. The run is
    created and that one param skipped with a warning, as the Trackers' params are."""
    long_key = "k" * 260
    config = {"seed": 1, "task": {"name": "custom", "options": {long_key: 1}}}
    with caplog.at_level(logging.WARNING, logger="tracking.tracker"):
        run_id = runs.open_job_run(tmp_path / "long", mlflow_uri, "long-keys", config, {}, {})
    params = _client(mlflow_uri).get_run(run_id).data.params
    assert params == {"seed": "1", "task.name": "custom", keys.RUN_ID_PARAM: run_id}
    assert f"MLflow refuses params named 'task.options.{long_key}'" in caplog.text
