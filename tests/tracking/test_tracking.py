"""The tracking package against a real MLflow SQLite store: run creation, rank-0 logging, and real outages."""

import json
import logging
import os
import shutil
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from data_pipeline.paths import PROJECT_ROOT
from tracking import keys, runs
from tracking import store as store_module
from tracking import tracker as tracker_module
from tracking.runs import RUN_RECORD, create_run, finish_run, open_job_run, run_tags, send_spooled
from tracking.store import (
    MAX_PARAM_VALUE_LENGTH,
    default_tracking_uri,
    flatten_config,
    pending_run_ref,
    spool_dir,
    unanswered,
)
from tracking.tracker import PENDING_CLOSE_S, Tracker

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> tuple[str, Path]:
    """One SQLite store for the module: creating its tables costs seconds on a busy machine."""
    root = tmp_path_factory.mktemp("mlflow")
    return f"sqlite:///{root / 'mlflow.db'}", root


def _client(uri):
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=uri)


def _wait_for(predicate, timeout=60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return False


def _server_that_is_down(monkeypatch) -> str:
    """A tracking URI at a closed localhost port (a server that is down); MLflow's HTTP client set not to retry."""
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed again when the block ends: nothing listens there
    return f"http://127.0.0.1:{port}"


def test_default_tracking_uri_env_and_embedded(monkeypatch, tmp_path):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert default_tracking_uri() == f"sqlite:///{PROJECT_ROOT / 'mlflow.db'}"
    assert default_tracking_uri(tmp_path) == f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5000")
    assert default_tracking_uri(tmp_path) == "http://127.0.0.1:5000"


def test_flatten_config_nested_lists_and_limits():
    flat = flatten_config(
        {"model": {"name": "vit_b16", "patch_size": 16, "stages": (3, 4)}, "optim": {"lr": 1e-3}, "empty": {}}
    )
    assert flat == {
        "model.name": "vit_b16",
        "model.patch_size": "16",
        "model.stages": "[3, 4]",
        "optim.lr": "0.001",
        "empty": "{}",
    }
    long = flatten_config({"note": "x" * 10_000})["note"]
    assert len(long) == MAX_PARAM_VALUE_LENGTH and long.endswith("[truncated, 10000 chars]")
    with pytest.raises(ValueError, match="250-character"):
        flatten_config({"k" * 251: 1})


def test_import_does_not_import_mlflow():
    code = "import sys, tracking.runs; assert 'mlflow' not in sys.modules, 'mlflow imported eagerly'"
    subprocess.run([sys.executable, "-c", code], cwd=PROJECT_ROOT, check=True, timeout=60)


def test_an_enabled_tracker_imports_mlflow_when_made_and_a_disabled_one_never(tmp_path):
    """The logging rank imports MLflow when its tracker is made, on its own thread: left to the sender's first turn,
    the import (seconds on a loaded machine) ate the 5 s a checkpoint soon after the start waits for its steps to be
    sent, and a shuffled suite run once lost steps 1-3 (test_train_units.py, the worker lost after a checkpoint)."""
    code = (
        "import sys\nfrom tracking.tracker import Tracker\n"
        f"Tracker('sqlite:///{tmp_path}/m.db', 'run', rank=1).close()\n"
        "assert 'mlflow' not in sys.modules, 'a disabled tracker imported mlflow'\n"
        f"t = Tracker('sqlite:///{tmp_path}/m.db', 'run', rank=0)\n"
        "assert t.enabled and 'mlflow' in sys.modules and t._thread is None\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=PROJECT_ROOT, check=True, timeout=120)


@pytest.mark.waits
def test_connect_in_background_sets_up_the_store_before_anything_is_logged(store, monkeypatch, caplog):
    """The eval scheduler connects when it starts, so that the job's end, which flushes its failures, does not wait
    for MLflow's first touch of the store (measured: a 39 s flush in a fresh actor on the loaded 2-core machine). A
    store that is down is only reported by the first send, once."""
    uri, _ = store
    run_id = create_run(uri, "connect", "run", {}, {})
    code = (
        "import sys, time\nfrom tracking.tracker import Tracker\n"
        f"t = Tracker({uri!r}, {run_id!r}, rank=0)\n"
        "assert 'mlflow.store.tracking.sqlalchemy_store' not in sys.modules\n"
        "t.connect_in_background()\n"
        "deadline = time.monotonic() + 60\n"
        "while 'mlflow.store.tracking.sqlalchemy_store' not in sys.modules or t._client is None:\n"
        "    assert time.monotonic() < deadline, 'the store was not set up in the background'\n"
        "    time.sleep(0.1)\n"
        "assert t.pending == 0 and t._thread is None  # nothing sent, no sender started\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=PROJECT_ROOT, check=True, timeout=120)

    # close()'s last send and one retry 1 s later fail as well (its default three retries waited 1 + 2 + 4 s more):
    # still several failed sends after the first, and one warning.
    monkeypatch.setattr(tracker_module, "CLOSE_RETRIES", 1)
    down = Tracker(_server_that_is_down(monkeypatch), "0123456789abcdef", rank=0)
    with caplog.at_level(logging.WARNING, logger="tracking.tracker"):
        down.connect_in_background()
        down.log_metrics({"train/loss": 1.0}, step=1)
        assert not down.flush()
        down.close(timeout=30)
    assert caplog.text.count("failed (") == 1, caplog.text


def test_create_run_and_rank0_tracker_round_trip(store, tmp_path):
    uri, root = store
    config = {"model": {"name": "vit_tiny_debug"}, "optim": {"lr": 0.001, "weight_decay": 0.1}}
    tags = {"vitscale.recipe": "local_demo", "vitscale.world_size": 2}
    run_id = create_run(uri, "roundtrip", "demo", config, tags)
    artifact = tmp_path / "plan.json"
    artifact.write_text('{"world_size": 2}')
    with Tracker(uri, run_id, rank=0) as tracker:
        for step in range(1, 4):
            tracker.log_metrics({"train/loss": 3.0 - step, "train/images_seen": 64 * step}, step=step)
        tracker.set_tags({"vitscale.status": "FINISHED"})
        tracker.log_artifact(artifact, "plan")
        assert tracker.flush()
    run = _client(uri).get_run(run_id)
    assert run.data.params == {"model.name": "vit_tiny_debug", "optim.lr": "0.001", "optim.weight_decay": "0.1"}
    assert run.data.tags["vitscale.recipe"] == "local_demo" and run.data.tags["vitscale.world_size"] == "2"
    assert run.data.tags["vitscale.status"] == "FINISHED"
    history = _client(uri).get_metric_history(run_id, "train/loss")
    assert [(m.step, m.value) for m in history] == [(1, 2.0), (2, 1.0), (3, 0.0)]
    assert [a.path for a in _client(uri).list_artifacts(run_id, "plan")] == ["plan/plan.json"]
    # Artifacts of the embedded store live next to the database, not under the current directory.
    assert (root / "mlartifacts" / "roundtrip" / run_id / "artifacts" / "plan" / "plan.json").is_file()


def test_the_sender_writes_a_second_of_steps_at_once(store, monkeypatch):
    """Logged every step, the metrics reach the store without a flush, in writes at most ``send_every_s`` apart: the
    sender's Python holds the GIL while it writes, and a write per step had taken it from the training thread."""
    uri, _ = store
    run_id = create_run(uri, "coalesced", "demo", {}, {})
    tracker = Tracker(uri, run_id, rank=0, send_every_s=1.0)
    writes: list[float] = []
    send_all = tracker._send_all

    def counted() -> None:
        writes.append(time.monotonic())
        send_all()

    monkeypatch.setattr(tracker, "_send_all", counted)
    try:
        start = time.monotonic()
        for step in range(1, 31):  # 30 steps of 50 ms
            tracker.log_metrics({"train/loss": float(step)}, step=step)
            time.sleep(0.05)
        logging_s = time.monotonic() - start
        assert _wait_for(lambda: len(_client(uri).get_metric_history(run_id, "train/loss")) == 30, timeout=30)
    finally:
        tracker.close()
    # The first write at once, then at most one a second while steps come (1.5 s of them, longer on a loaded machine),
    # and one for what came last: 2 or 3 writes, not 30.
    assert 2 <= len(writes) <= 2 + int(logging_s), (writes, logging_s)
    assert all(b - a >= 0.95 for a, b in zip(writes, writes[1:])), writes


def test_sync_sends_at_once_and_never_waits_on_a_store_that_is_down(store, monkeypatch):
    """Before a checkpoint (pretrain.checkpointer.Checkpointer) the buffer is delivered now, not at the sender's next
    turn: a worker lost after the checkpoint must not take the metrics of its steps along. A store that is down
    makes it return at once, with everything still buffered."""
    uri, _ = store
    run_id = create_run(uri, "synced", "demo", {}, {})
    tracker = Tracker(uri, run_id, rank=0, send_every_s=60.0)
    try:
        tracker.log_metrics({"train/loss": 1.0}, step=1)  # the first write goes at once; the next waits 60 s
        assert _wait_for(lambda: len(_client(uri).get_metric_history(run_id, "train/loss")) == 1, timeout=30)
        tracker.log_metrics({"train/loss": 0.5}, step=2)
        started = time.monotonic()
        assert tracker.sync(timeout=30) and tracker.pending == 0
        assert time.monotonic() - started < 30
        assert [m.step for m in _client(uri).get_metric_history(run_id, "train/loss")] == [1, 2]
    finally:
        tracker.close()

    down = Tracker(_server_that_is_down(monkeypatch), "0123456789abcdef", rank=0)
    try:
        down.log_metrics({"train/loss": 1.0}, step=1)
        assert _wait_for(lambda: down._failures > 0, timeout=30)  # the sender has met the store down: backing off
        started = time.monotonic()
        assert not down.sync(timeout=30) and down.pending == 1
        assert time.monotonic() - started < 1.0
    finally:
        down.close(timeout=10)


def test_job_run_is_created_once_continued_on_relaunch_and_finished(store, tmp_path, capsys):
    """The driver's run: config as params (its own id logged once it exists), the run's tags, the plan as
    artifact; a relaunch of the same run folder continues it; the end sets MLflow's status and the tag."""
    uri, _ = store
    run_dir = tmp_path / "runs" / "demo-1"
    config = {"model": {"name": "vit_tiny_debug"}, "logging": {"mlflow_run_id": None, "log_every": 1}}
    tags = run_tags("local_demo", "vit_tiny_debug", 2, profile="local", run_dir=str(run_dir))
    assert tags[keys.STATUS] == "running" and tags[keys.WORLD_SIZE] == "2" and tags[keys.GIT_COMMIT]
    run_id = open_job_run(run_dir, uri, "jobs", config, tags, {"world_size": 2})
    assert open_job_run(run_dir, uri, "jobs", config, tags, {"world_size": 2}) == run_id
    assert f"continuing MLflow run {run_id}" in capsys.readouterr().out
    finish_run(uri, run_id, "FAILED")
    _client(uri).set_tag(run_id, keys.FAILURE, "checkpoint step_00000080 was not saved")  # as the failed job's end
    finish_run(uri, run_id, "FINISHED")  # the relaunch finished the run: the earlier job's failure is no longer why
    run = _client(uri).get_run(run_id)
    assert keys.FAILURE not in run.data.tags
    assert run.info.run_name == "demo-1" and run.info.status == "FINISHED"
    assert run.data.params == {"model.name": "vit_tiny_debug", "logging.log_every": "1", keys.RUN_ID_PARAM: run_id}
    assert run.data.tags[keys.STATUS] == "finished" and run.data.tags[keys.RUN_DIR] == str(run_dir)
    assert run.data.tags[keys.PROFILE] == "local" and run.data.tags[keys.RECIPE] == "local_demo"
    assert [a.path for a in _client(uri).list_artifacts(run_id)] == ["plan.json"]
    assert len(_client(uri).search_runs([run.info.experiment_id])) == 1


def test_steps_redone_after_a_restart_are_logged_once(store, caplog):
    """A worker group restarted from checkpoint step 10 redoes steps 11-14 that the lost group already logged:
    the run keeps one value per step (the first), other keys are unaffected, and the skip is said once."""
    import torch

    from pretrain.telemetry.metrics import TrainMetrics

    uri, _ = store
    run_id = create_run(uri, "restart", "r", {}, {})

    def attempt(start_step: int, last_step: int, loss: float) -> Tracker:
        tracker = Tracker(uri, run_id, rank=0)
        metrics = TrainMetrics(
            rank=0,
            world_size=2,
            total_steps=20,
            flops_per_image=10**9,
            peak_tflops=1.0,
            device=torch.device("cpu"),
            log_every=2,
            tracker=tracker,
            progress_bar=False,
            start_step=start_step,
        )
        for step in range(start_step + 1, last_step + 1):
            metrics.step(step, loss, 1e-3, 0.5, images=64, data_s=0.0)
        return tracker

    first = attempt(0, 14, loss=3.0)  # lost a worker after logging step 14; its checkpoint is step 10
    assert first.flush()
    first.close()
    with caplog.at_level(logging.INFO, logger="tracking.tracker"):
        second = attempt(10, 20, loss=2.0)
        second.log_metrics({"fewshot/mean/10shot": 0.5}, step=12)  # not a training key: logged as usual
        assert second.flush()
        second.close()
    history = _client(uri).get_metric_history(run_id, "train/loss")
    assert sorted((m.step, m.value) for m in history) == [(s, 3.0) for s in (2, 4, 6, 8, 10, 12, 14)] + [
        (s, 2.0) for s in (16, 18, 20)
    ]
    assert sorted(m.step for m in _client(uri).get_metric_history(run_id, "train/images_seen")) == list(range(2, 21, 2))
    assert [m.step for m in _client(uri).get_metric_history(run_id, "fewshot/mean/10shot")] == [12]
    assert caplog.text.count("the redone steps are not logged again") == 1
    assert "up to step 14" in caplog.text


def test_a_spool_folder_removed_while_a_tracker_spools_is_made_again(store, tmp_path, monkeypatch):
    """`send_spooled` removes a spool folder it emptied; a Tracker spooling at that moment (the folder made, then
    gone before the file is written) makes it again and keeps its records rather than dropping them."""
    uri, _ = store
    record = tmp_path / "run" / RUN_RECORD
    record.parent.mkdir()
    write, removed = tracker_module.write_text_atomically, []

    def remove_folder_first(path, text):
        if not removed:
            removed.append(path.parent)
            path.parent.rmdir()  # what send_spooled does to an emptied folder
        write(path, text)

    monkeypatch.setattr(tracker_module, "write_text_atomically", remove_folder_first)
    pending = Tracker(uri, pending_run_ref(record), rank=0)
    pending.log_metrics({keys.LOSS: 3.0}, step=1)
    pending.close()
    assert removed and pending.pending == 0
    assert len(list(spool_dir(record).glob("*.json"))) == 1


def test_a_pending_runs_records_wait_in_the_spool_and_arrive_once_when_it_exists(store, tmp_path, caplog):
    """A Tracker whose run does not exist yet closes within seconds, its records left in the spool beside the run
    record (the job ends when training does). Once the run exists, `send_spooled` sends each file with its own times
    and removes it: the steps a later attempt already logged are not sent again, the earlier ones are."""
    uri, _ = store
    record = tmp_path / "run" / RUN_RECORD
    record.parent.mkdir()
    ref = pending_run_ref(record)
    first = Tracker(uri, ref, rank=0)  # attempt 1: steps 1-7, its last checkpoint at step 4
    first.log_once_per_step("train/")
    first.log_params({"model.name": "vit", keys.RUN_ID_PARAM: ref})
    for step in range(1, 8):
        first.log_metrics({keys.LOSS: 3.0}, step=step)
    first.log_metrics({"fewshot/mean/5shot": 0.5}, step=4)
    table = tmp_path / "run" / "checkpoints" / "step_00000004" / "evals" / "fewshot.parquet"
    table.parent.mkdir(parents=True)
    table.write_bytes(b"the eval table")
    first.log_artifact(table, "evals/step_00000004")
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="tracking.tracker"):
        first.close()
    assert time.monotonic() - started < PENDING_CLOSE_S + 2 and first.pending == 0
    [spooled] = spool_dir(record).glob("*.json")
    assert f"has not answered; the run's 11 items from this process wait in {spooled}" in caplog.text
    shutil.rmtree(table.parent.parent)  # keep_last pruned the checkpoint: the spool holds its own copy

    run_id = create_run(uri, "spool", "s", {}, {})
    record.write_text(json.dumps({"run_id": run_id, "tracking_uri": uri}))
    second = Tracker(uri, run_id, rank=0)  # attempt 2, from step 4, with MLflow up: steps 5-10 live
    second.log_once_per_step("train/")
    for step in range(5, 11):
        second.log_metrics({keys.LOSS: 2.0}, step=step)
    assert second.flush()
    second.close()
    copy = spooled.read_bytes()
    assert send_spooled(record) == (11, 0) and not spooled.exists()
    spooled.parent.mkdir()
    spooled.write_bytes(copy)  # a send that MLflow took but whose process died before removing the file
    assert send_spooled(record)[1] == 0  # sent whole again: the same rows (times kept), one value per step still
    assert not spool_dir(record).exists()  # no empty folder, nor the copy, left in the run folder
    client = _client(uri)
    history = sorted(client.get_metric_history(run_id, keys.LOSS), key=lambda m: m.step)
    assert [(m.step, m.value) for m in history] == [(s, 3.0) for s in range(1, 5)] + [(s, 2.0) for s in range(5, 11)]
    assert history[3].timestamp <= history[4].timestamp  # the spooled values keep the time they were logged
    assert [m.step for m in client.get_metric_history(run_id, "fewshot/mean/5shot")] == [4]
    assert [a.path for a in client.list_artifacts(run_id, "evals/step_00000004")] == [
        "evals/step_00000004/fewshot.parquet"
    ]
    assert client.get_run(run_id).data.params == {"model.name": "vit", keys.RUN_ID_PARAM: run_id}
    assert send_spooled(record) == (0, 0)


def test_a_spool_file_that_cannot_be_read_is_left_and_the_later_ones_sent(store, tmp_path, capsys):
    """A cut-short spool file (a copy of the run folder that stopped) ended `python -m cluster.driver.deliver` and the
    job's end in a JSONDecodeError traceback, after the files before it were sent and with those after it never."""
    uri, _ = store
    record = tmp_path / "run" / RUN_RECORD
    record.parent.mkdir()
    run_id = create_run(uri, "spool", "damaged", {}, {})
    record.write_text(json.dumps({"run_id": run_id, "tracking_uri": uri}))
    folder = spool_dir(record)
    folder.mkdir()
    for n, step in ((1, 1), (3, 3)):
        payload = {"tracking_uri": uri, "ref": run_id, "once_prefixes": [], "params": {}, "tags": {}, "artifacts": []}
        payload["metrics"] = [[keys.LOSS, 1.0, step * 1000, step]]
        (folder / f"{n:020d}-1-a.json").write_text(json.dumps(payload))
    damaged = folder / f"{2:020d}-1-a.json"
    damaged.write_text('{"tracking_uri": ')
    assert send_spooled(record) == (2, 1)
    assert [m.step for m in _client(uri).get_metric_history(run_id, keys.LOSS)] == [1, 3]
    assert sorted(folder.iterdir()) == [damaged]  # kept: it may be mended; its neighbours sent and removed
    assert f"warning: spool file {damaged} cannot be read (JSONDecodeError" in capsys.readouterr().err


def test_a_spool_is_sent_from_wherever_its_run_folder_is_now(store, tmp_path, monkeypatch):
    """A spool file names its pending run's record and its artifacts' copies by absolute path: a run folder moved, or
    mounted elsewhere on the node that runs `deliver`, left the file unsent ("not sent", no reason why) and a spooled
    artifact "no longer exists". Both are read where the record `send_spooled` is given is now."""
    monkeypatch.setattr(tracker_module, "PENDING_CLOSE_S", 1.0)
    uri, _ = store
    old = tmp_path / "old" / "run"
    old.mkdir(parents=True)
    table = old / "table.txt"
    table.write_text("the eval table")
    ref = pending_run_ref(old / RUN_RECORD)
    pending = Tracker(uri, ref, rank=0)
    pending.log_params({keys.RUN_ID_PARAM: ref})
    pending.log_metrics({keys.LOSS: 1.0}, step=1)
    pending.log_artifact(table, "evals")
    pending.close()
    new = tmp_path / "new" / "run"
    new.parent.mkdir()
    old.rename(new)
    run_id = create_run(uri, "moved", "r", {}, {})
    (new / RUN_RECORD).write_text(json.dumps({"run_id": run_id, "tracking_uri": uri}))
    assert send_spooled(new / RUN_RECORD, timeout_s=30) == (3, 0)
    client = _client(uri)
    assert [m.step for m in client.get_metric_history(run_id, keys.LOSS)] == [1]
    assert client.get_run(run_id).data.params == {keys.RUN_ID_PARAM: run_id}
    assert [a.path for a in client.list_artifacts(run_id, "evals")] == ["evals/table.txt"]


def test_sending_the_spool_to_a_server_that_is_down_stops_at_its_first_file(monkeypatch, tmp_path, caplog):
    """Each spool file is a Tracker's close: against a server that is down, the first one that fails ends the work (at
    a job's end, the driver's Trackers may have spooled several), and every file stays for a later send."""
    monkeypatch.setattr(store_module, "FAILING_SINCE", {})
    monkeypatch.setattr(tracker_module, "CLOSE_RETRIES", 0)  # one last send per close: seconds, not 7 s each
    uri = _server_that_is_down(monkeypatch)
    record = tmp_path / RUN_RECORD
    record.write_text(json.dumps({"run_id": "0123456789abcdef", "tracking_uri": uri}))
    with caplog.at_level(logging.WARNING, logger="tracking.tracker"):
        for step in (1, 2):  # two processes of the job, each closing while the server is down
            tracker = Tracker(uri, "0123456789abcdef", rank=0, record=record)
            tracker.log_metrics({keys.LOSS: 1.0}, step=step)
            tracker.close(timeout=30)
        assert len(list(spool_dir(record).glob("*.json"))) == 2
        caplog.clear()
        assert send_spooled(record, timeout_s=30) == (0, 2)
    assert caplog.text.count("closing with 1 items not sent") == 1  # the second file was not tried
    assert len(list(spool_dir(record).glob("*.json"))) == 2


def test_spool_files_of_a_pending_run_are_not_counted_sent_to_a_server_that_is_down(monkeypatch, tmp_path):
    """Files spooled while the run was pending, sent once the record names it but its server is down, stay as they
    are and count as left: their Tracker once spooled them again under a new name, counted them sent (`deliver`
    said "2 records sent, 0 spool file(s) left", exit 0) and paid one close per file."""
    monkeypatch.setattr(store_module, "FAILING_SINCE", {})
    monkeypatch.setattr(tracker_module, "CLOSE_RETRIES", 0)
    uri = _server_that_is_down(monkeypatch)
    record = tmp_path / RUN_RECORD
    for step in (1, 2):  # two processes of the job close before the run exists
        tracker = Tracker(uri, pending_run_ref(record), rank=0)
        tracker.log_metrics({keys.LOSS: 1.0}, step=step)
        tracker.close(timeout=30)
    spooled = sorted(spool_dir(record).glob("*.json"))
    record.write_text(json.dumps({"run_id": "0123456789abcdef", "tracking_uri": uri}))  # created; then down again
    assert send_spooled(record, timeout_s=30) == (0, 2)
    assert sorted(spool_dir(record).glob("*.json")) == spooled


def test_tracker_is_a_noop_off_rank0_or_without_run(store, monkeypatch):
    uri, _ = store
    run_id = create_run(uri, "ranks", "r", {}, {})
    monkeypatch.setenv("RANK", "1")
    tracker = Tracker(uri, run_id)
    assert not tracker.enabled
    tracker.log_metrics({"train/loss": 1.0}, step=1)
    tracker.close()
    assert _client(uri).get_metric_history(run_id, "train/loss") == []
    assert not Tracker(uri, None, rank=0).enabled and not Tracker(uri, run_id, enabled=False, rank=0).enabled


def test_rejected_param_is_dropped_and_the_rest_still_arrives(store, caplog):
    uri, _ = store
    run_id = create_run(uri, "conflict", "r", {"optim": {"lr": 0.1}}, {})
    tracker = Tracker(uri, run_id, rank=0)
    with caplog.at_level(logging.WARNING, logger="tracking.tracker"):
        tracker.log_params({"optim": {"lr": 0.2}})  # MLflow params are immutable: a permanent rejection
        tracker.log_metrics({"train/loss": 1.5}, step=7)
        assert tracker.flush()
    tracker.close()
    assert "INVALID_PARAMETER_VALUE" in caplog.text and "dropped" in caplog.text
    assert [(m.step, m.value) for m in _client(uri).get_metric_history(run_id, "train/loss")] == [(7, 1.5)]


def test_a_changed_param_is_dropped_alone_and_its_batchs_new_params_arrive(store, caplog):
    """MLflow refuses a whole params batch for one changed value (a relaunch with another ``schedule.total``): the
    batch's other params, new to the run, were dropped with it. The batch is sent again one param at a time."""
    uri, _ = store
    run_id = create_run(uri, "changed-param", "r", {"schedule": {"total": 100}}, {})
    tracker = Tracker(uri, run_id, rank=0)
    with caplog.at_level(logging.WARNING, logger="tracking.tracker"):
        tracker.log_params({"schedule": {"total": 600}, "optim": {"lr": 0.2, "warmup": 10}})
        assert tracker.flush()
    tracker.close()
    params = _client(uri).get_run(run_id).data.params
    assert (params["schedule.total"], params["optim.lr"], params["optim.warmup"]) == ("100", "0.2", "10"), params
    assert caplog.text.count("INVALID_PARAMETER_VALUE") == 1 and "schedule.total" in caplog.text, caplog.text


def test_a_run_deleted_while_it_trains_is_one_warning_not_one_a_second(store, caplog):
    """Deleted in the UI while training ran, the run refused each send, and each refusal was a forced warning: one
    line a second (the sender's pace) in the job's log for the rest of training. The same refusal warns once."""
    uri, _ = store
    run_id = create_run(uri, "deleted-while-training", "r", {}, {})
    tracker = Tracker(uri, run_id, rank=0)
    tracker.log_metrics({keys.LOSS: 1.0}, step=1)
    assert tracker.flush()
    _client(uri).delete_run(run_id)
    with caplog.at_level(logging.WARNING, logger="tracking.tracker"):
        for step in range(2, 7):
            tracker.log_metrics({keys.LOSS: 1.0 / step}, step=step)
            assert tracker.flush()  # rejected for good: dropped, not retried
    tracker.close()
    assert caplog.text.count("must be in the 'active' state") == 1, caplog.text


def test_a_name_mlflow_refuses_is_skipped_and_the_rest_of_its_batch_arrives(store, caplog):
    """MLflow refuses a whole batch (up to 1000 metrics, 100 params or tags) for one name it does not take: a dataset
    named "a+b" dropped train/loss at every step sent with it. Such a name is skipped, with one warning naming it."""
    uri, _ = store
    run_id = create_run(uri, "bad-names", "r", {}, {})
    tracker = Tracker(uri, run_id, rank=0, send_every_s=60.0)
    bad = ["fewshot/a+b/accuracy", "x" * 251, "fewshot//accuracy", "../loss"]
    with caplog.at_level(logging.WARNING, logger="tracking.tracker"):
        for step in (1, 2, 3):
            tracker.log_metrics({keys.LOSS: 1.0 / step, **dict.fromkeys(bad, 0.5)}, step=step)
        tracker.log_params({"model.name": "vit", "eval.a+b": "x"})
        tracker.set_tags({keys.STATUS: "running", "vitscale.a+b": "x"})
        assert tracker.flush()
    tracker.close()
    assert [m.step for m in _client(uri).get_metric_history(run_id, keys.LOSS)] == [1, 2, 3]
    run = _client(uri).get_run(run_id)
    assert run.data.params == {"model.name": "vit"} and run.data.tags[keys.STATUS] == "running"
    assert "vitscale.a+b" not in run.data.tags
    for name in [*bad, "eval.a+b", "vitscale.a+b"]:
        assert caplog.text.count(f"named {name!r}") == 1, caplog.text
    assert "rejected" not in caplog.text, caplog.text


def test_a_param_key_longer_than_mlflow_takes_is_skipped_not_raised_into_training(store, caplog):
    """Tracker.log_params raised flatten_config's ValueError for a key over MLflow's 250 characters, into the loop
    that called it; such a key is skipped with one warning, as a name MLflow refuses is, and the rest arrives."""
    uri, _ = store
    run_id = create_run(uri, "long-param", "r", {}, {})
    tracker = Tracker(uri, run_id, rank=0)
    long = "k" * 251
    with caplog.at_level(logging.WARNING, logger="tracking.tracker"):
        tracker.log_params({"model": {"name": "vit"}, long: 1})
        tracker.log_params({long: 2})
        assert tracker.flush()
    tracker.close()
    assert _client(uri).get_run(run_id).data.params == {"model.name": "vit"}
    assert caplog.text.count(f"named {long!r}") == 1, caplog.text


def test_an_infinite_metric_reaches_mlflow_as_nan_not_as_the_largest_float(store, caplog):
    """MLflow's SQL stores keep +-inf as +-1.8e308, a finite number to every reader: `make compare` showed a final
    loss of 1.798e+308, and an infinite goodput bucket stopped it with matplotlib's traceback. It is logged as NaN,
    which readers skip, with one warning per key."""
    uri, _ = store
    run_id = create_run(uri, "infinite", "r", {}, {})
    tracker = Tracker(uri, run_id, rank=0)
    with caplog.at_level(logging.WARNING, logger="tracking.tracker"):
        for step in (1, 2, 3):
            tracker.log_metrics({keys.LOSS: 2.0 if step == 1 else float("inf"), keys.GRAD_NORM: -float("inf")}, step)
        assert tracker.flush()
    tracker.close()
    client = _client(uri)
    losses = [m.value for m in client.get_metric_history(run_id, keys.LOSS)]
    assert losses[0] == 2.0 and len(losses) == 3 and all(v != v for v in losses[1:]), losses
    assert all(m.value != m.value for m in client.get_metric_history(run_id, keys.GRAD_NORM))
    assert caplog.text.count(repr(keys.LOSS)) == 1 and caplog.text.count(repr(keys.GRAD_NORM)) == 1, caplog.text


def test_an_upload_ending_after_close_spooled_it_is_no_failure(store, tmp_path, monkeypatch, caplog):
    """close() spools what is still buffered when its wait ends, an artifact whose upload is in flight included. The
    upload ending afterwards raised ValueError in the sender: a "tracking failed" warning, and the store marked as
    failing, so that this process's later Trackers waited only the short allowance for it."""
    from mlflow import MlflowClient

    uri, _ = store
    monkeypatch.setattr(store_module, "FAILING_SINCE", {})
    run_id = create_run(uri, "slow-upload", "r", {}, {})
    record = tmp_path / RUN_RECORD
    record.write_text(json.dumps({"run_id": run_id, "tracking_uri": uri}))
    table = tmp_path / "table.txt"
    table.write_text("the eval table")
    upload, started, done = MlflowClient.log_artifact, threading.Event(), threading.Event()

    def slow_upload(self, *args, **kwargs):
        started.set()
        done.wait(30)
        return upload(self, *args, **kwargs)

    monkeypatch.setattr(MlflowClient, "log_artifact", slow_upload)
    tracker = Tracker(uri, run_id, rank=0, record=record)
    with caplog.at_level(logging.WARNING, logger="tracking.tracker"):
        tracker.log_artifact(table)
        assert started.wait(30)
        tracker.close(timeout=1)
        done.set()
        tracker._thread.join(30)
    assert len(list(spool_dir(record).glob("*.json"))) == 1 and "wait in" in caplog.text, caplog.text
    assert "failed" not in caplog.text and uri not in store_module.FAILING_SINCE, caplog.text
    assert [a.path for a in _client(uri).list_artifacts(run_id)] == ["table.txt"]
    assert send_spooled(record) == (1, 0)  # the same file again, to the same path
    assert [a.path for a in _client(uri).list_artifacts(run_id)] == ["table.txt"]


def test_a_last_send_that_fails_at_close_is_tried_again(store, monkeypatch, caplog):
    """A job whose run was created as training ended: rank 0's first send raced the driver's params into SQLite
    (`BAD_REQUEST: UNIQUE constraint failed: params.key`), and close() gave its 777 items up after that one try.
    Here the real store refuses the first two batches so: close() tries again and everything arrives once."""
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException
    from mlflow.protos.databricks_pb2 import BAD_REQUEST

    uri, _ = store
    run_id = create_run(uri, "close-retry", "r", {}, {})
    log_batch, refused = MlflowClient.log_batch, []

    def refuse_twice(self, *args, **kwargs):
        if len(refused) < 2:
            refused.append(kwargs)
            raise MlflowException("UNIQUE constraint failed: params.key, params.run_uuid", error_code=BAD_REQUEST)
        return log_batch(self, *args, **kwargs)

    monkeypatch.setattr(MlflowClient, "log_batch", refuse_twice)
    tracker = Tracker(uri, run_id, rank=0, send_every_s=60.0)
    with caplog.at_level(logging.WARNING, logger="tracking.tracker"):
        tracker.log_params({"recipe": "local_demo"})
        tracker.log_metrics({"train/loss": 1.0}, step=1)
        tracker.close(timeout=30)
    assert len(refused) == 2 and "UNIQUE constraint" in caplog.text, caplog.text
    assert "not sent" not in caplog.text, caplog.text
    run = _client(uri).get_run(run_id)
    assert run.data.params["recipe"] == "local_demo"
    assert [(m.step, m.value) for m in _client(uri).get_metric_history(run_id, "train/loss")] == [(1, 1.0)]


@pytest.mark.waits
def test_locked_sqlite_outage_warns_buffers_and_recovers(store, caplog):
    """A writer holding an exclusive lock on the SQLite file is a real outage (MLflow waits 20 s, then fails)."""
    uri, root = store
    run_id = create_run(uri, "outage", "r", {}, {})
    tracker = Tracker(uri, run_id, rank=0)
    tracker.log_metrics({"train/loss": 9.0}, step=0)
    assert tracker.flush()
    lock = sqlite3.connect(root / "mlflow.db", isolation_level=None)
    lock.execute("BEGIN EXCLUSIVE")
    try:
        with caplog.at_level(logging.WARNING, logger="tracking.tracker"):
            started = time.monotonic()
            for step in range(1, 21):
                tracker.log_metrics({"train/loss": 1.0 / step}, step=step)
            assert time.monotonic() - started < 1.0, "logging must not wait for the locked store"
            assert _wait_for(lambda: "database is locked" in caplog.text), caplog.text
    finally:
        lock.execute("ROLLBACK")
        lock.close()
    assert "the work goes on meanwhile" in caplog.text and tracker.pending == 20
    assert uri in store_module.FAILING_SINCE  # what a closing Tracker of this process goes by
    assert tracker.flush()
    assert uri not in store_module.FAILING_SINCE
    tracker.close()
    history = _client(uri).get_metric_history(run_id, "train/loss")
    assert [m.step for m in history] == list(range(21))
    assert history[-1].value == pytest.approx(1.0 / 20)


@pytest.mark.waits
def test_trackers_closing_after_a_failed_send_do_not_wait_out_mlflows_request(monkeypatch, caplog):
    """A job's end closes several Trackers (rank 0's, the driver's ledger and summary). Once a send to their URI has
    failed in the process, each waits at most `UNANSWERED_CLOSE_S` for its last send, which a server that stopped
    answering holds for MLflow's whole request timeout (before: up to the close's 120 s, each), and says so."""
    monkeypatch.setattr(store_module, "FAILING_SINCE", {})  # this test's URI only
    monkeypatch.setattr(tracker_module, "UNANSWERED_CLOSE_S", 2.0)  # the allowance, shorter than the request's 60 s
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # one request per send
    with socket.socket() as hanging:
        hanging.bind(("127.0.0.1", 0))
        hanging.listen(8)  # the kernel completes connections; nobody ever reads or replies
        uri = f"http://127.0.0.1:{hanging.getsockname()[1]}"
        monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
        during = Tracker(uri, "0123456789abcdef", rank=0)  # rank 0's, while the job trains
        during.log_metrics({"train/loss": 1.0}, step=1)
        assert not during.flush(timeout=30)  # a send failed after its request's 2 s
        monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "60")  # from now, a last send would wait a minute
        at_end = Tracker(uri, "0123456789abcdef", rank=0)  # made at the end, as the job's summary's is
        at_end.log_metrics({"train/loss": 2.0}, step=2)
        with caplog.at_level(logging.WARNING, logger="tracking.tracker"):
            for closing in (during, at_end):
                started = time.monotonic()
                closing.close(timeout=120)
                assert time.monotonic() - started < tracker_module.UNANSWERED_CLOSE_S + 2
        # Their senders end their looks (5 s at most) at the server that still hangs: the socket closed under a look
        # would let one send through MLflow's default retries, for minutes, after the test.
        for closed in (during, at_end):
            closed._thread.join(30)
            assert not closed._thread.is_alive()
    assert caplog.text.count("closing with 1 items not sent") == 2 and "MLflow has failed for" in caplog.text


@pytest.mark.parametrize("outage", ["server down", "database down"])
def test_a_tracker_closing_as_its_server_fails_waits_only_the_unanswered_allowance(
    outage, monkeypatch, caplog, request
):
    """The server went down, or its database did (`/health` answers, every call 500), after the last successful
    send: the close's send is MLflow retrying for minutes, and no send has failed yet in this process. Once
    `UNANSWERED_CLOSE_S` have passed, close() looks at the server (and asks for the run once), stops waiting and
    names why (before: the whole timeout, up to 120 s per Tracker at a job's end); the look counts as a failed call
    for this process's other Trackers."""
    monkeypatch.setattr(store_module, "FAILING_SINCE", {})
    monkeypatch.setattr(tracker_module, "UNANSWERED_CLOSE_S", 2.0)
    if outage == "server down":
        uri = _server_that_is_down(monkeypatch)
        monkeypatch.delenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES")  # MLflow's default: 7 retries, 2 s x 2^n apart
        why = f"nothing accepts connections at 127.0.0.1:{uri.rsplit(':', 1)[1]}"
    else:
        uri = request.getfixturevalue("failing_mlflow")
        why = "it answers /health but fails a request for run 0123456789abcdef"
    tracker = Tracker(uri, "0123456789abcdef", rank=0)
    tracker.log_metrics({"train/loss": 1.0}, step=1)
    time.sleep(0.5)  # the sender is in its first send
    with caplog.at_level(logging.WARNING, logger="tracking.tracker"):
        started = time.monotonic()
        tracker.close(timeout=60)
        assert time.monotonic() - started < 2.0 + 3  # the allowance, then one look
    assert why in caplog.text and "closing with 1 items not sent" in caplog.text
    assert uri in store_module.FAILING_SINCE


def test_unreachable_server_never_raises_or_hangs(monkeypatch, caplog):
    """A tracking URI at a closed localhost port (a server that is down): warnings, no exception, bounded close."""
    tracker = Tracker(_server_that_is_down(monkeypatch), "0123456789abcdef", rank=0, max_buffered=5)
    with caplog.at_level(logging.WARNING, logger="tracking.tracker"):
        for step in range(10):
            tracker.log_metrics({"train/loss": float(step)}, step=step)
        assert not tracker.flush()
        assert tracker.pending == 5  # bounded buffer: the newest values are kept
        started = time.monotonic()
        tracker.close(timeout=30)
        assert time.monotonic() - started < 30
    assert "failed" in caplog.text and "the work goes on meanwhile" in caplog.text
    assert "not sent" in caplog.text
    assert "5 metric values were dropped" in caplog.text


def test_a_tracker_closing_with_a_full_buffer_counts_the_values_it_dropped(tmp_path, caplog):
    """A run that never exists while the job trains: the buffer keeps the newest ``max_buffered`` values for the
    spool. The values dropped to keep it bounded were only counted by a send that succeeded, so the close, whose
    line says the run's items wait in the spool, said nothing of the others."""
    record = tmp_path / RUN_RECORD
    tracker = Tracker("sqlite:///unused.db", pending_run_ref(record), rank=0, max_buffered=2)
    with caplog.at_level(logging.WARNING, logger="tracking.tracker"):
        for step in range(1, 6):
            tracker.log_metrics({keys.LOSS: 1.0}, step=step)
        tracker.close()
    [spooled] = spool_dir(record).glob("*.json")
    assert [m[3] for m in json.loads(spooled.read_text())["metrics"]] == [4, 5]
    assert "3 metric values were dropped" in caplog.text


def test_hanging_server_does_not_block_logging_or_close(monkeypatch, caplog):
    """A server that accepts connections but never answers: logging stays instant, and close() waits the
    `UNANSWERED_CLOSE_S` allowance and one look at the server, not its timeout (MLflow's send waits 60 s here, 120 s
    by default, and retries 7 times)."""
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "60")
    monkeypatch.setattr(tracker_module, "UNANSWERED_CLOSE_S", 2.0)
    with socket.socket() as hanging:
        hanging.bind(("127.0.0.1", 0))
        hanging.listen(8)  # the kernel completes connections; nobody ever reads or replies
        tracker = Tracker(f"http://127.0.0.1:{hanging.getsockname()[1]}", "0123456789abcdef", rank=0)
        started = time.monotonic()
        for step in range(100):
            tracker.log_metrics({"train/loss": 1.0, "train/lr": 0.1}, step=step)
        assert time.monotonic() - started < 1.0
        with caplog.at_level(logging.WARNING, logger="tracking.tracker"):
            started = time.monotonic()
            tracker.close(timeout=60)
            assert time.monotonic() - started < 2.0 + 5.0 + 3  # the allowance, then a look of at most 5 s
        assert "200 items not sent" in caplog.text and "accepts connections but sends no answer" in caplog.text


def test_a_relaunch_whose_server_fails_its_calls_continues_its_run_at_once(failing_mlflow, tmp_path, capsys):
    """A server whose /health answers while every call fails (its database down), MLflow's default retries set: the
    relaunch asks about its recorded run once and continues it within seconds (before: 7 retries, ~4 min before
    training). The real server's answers to that question: tests/tracking/test_tracking_server.py."""
    run_id = "a" * 32
    (tmp_path / RUN_RECORD).write_text(json.dumps({"run_id": run_id, "tracking_uri": failing_mlflow}))
    started = time.monotonic()
    relaunch = runs.start_job_run(tmp_path, failing_mlflow, "relaunch", {}, {}, {})
    assert time.monotonic() - started < store_module.PROBE_TIMEOUT_S and relaunch.run_id == run_id
    assert f"continuing MLflow run {run_id}" in capsys.readouterr().out


def test_a_server_answers_with_any_status_below_500_and_not_when_it_hangs_or_is_down(monkeypatch):
    """`unanswered`, the look a closing Tracker, a job's start and end and a courier take before they wait on MLflow.
    A 5xx from /health is a proxy whose server is down, or a failing server: MLflow retries each call for minutes."""
    import http.server
    import threading

    class Status(http.server.BaseHTTPRequestHandler):
        status = 404

        def do_GET(self):
            self.send_error(self.status)

        def log_message(self, *args):
            pass

    answering = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Status)
    threading.Thread(target=answering.serve_forever, daemon=True).start()
    port = answering.server_address[1]
    try:
        assert unanswered(f"http://127.0.0.1:{port}/prefix", timeout_s=5) == ""
        Status.status = 502
        assert unanswered(f"http://127.0.0.1:{port}", timeout_s=5) == (
            f"127.0.0.1:{port} answers /health with HTTP 502 Bad Gateway"
        )
    finally:
        answering.shutdown()
        answering.server_close()
    with socket.socket() as hanging:
        hanging.bind(("127.0.0.1", 0))
        hanging.listen(8)
        port = hanging.getsockname()[1]
        assert unanswered(f"http://127.0.0.1:{port}", timeout_s=0.5) == (
            f"127.0.0.1:{port} accepts connections but sends no answer within 0.5 s"
        )
    down = _server_that_is_down(monkeypatch)
    assert unanswered(down).startswith(f"nothing accepts connections at 127.0.0.1:{down.rsplit(':', 1)[1]} (")
    assert unanswered("sqlite:///tmp/mlflow.db") == unanswered(None) == ""  # no server to ask


_CREATOR = """
import json, sys, time
from pathlib import Path
from mlflow import MlflowClient
from tracking import runs
run_dir, uri, go, role = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3]), sys.argv[4]
MlflowClient(tracking_uri=uri).search_experiments()  # MLflow imported and its store opened before the start line
print("ready", flush=True)
while not go.exists():
    time.sleep(0.001)
config, tags = {"model": {"name": "vit_tiny_debug"}}, {"vitscale.recipe": "r"}
if role == "courier":  # job 1's courier: job 1 never had its run
    run_id = runs.await_job_run(run_dir, uri, "race", config, tags, 60.0)
else:  # job 2, launched again on the run folder meanwhile
    run_id = runs.start_job_run(run_dir, uri, "race", config, tags, {"world_size": 1}, wait_s=60.0).run_id
print(json.dumps(run_id), flush=True)
"""


def test_a_courier_and_a_relaunch_creating_the_run_at_once_make_one_run(mlflow_uri, tmp_path):
    """Job 1's run was never created (MLflow down): its courier and a relaunched job 2 each retried the creation
    until MLflow answered, then each read the run record (none yet), created a run and recorded it. Two runs for one
    run folder: the record named the later, the other was an orphan holding the records sent to it. Real processes
    released at once against one real store: one run, named by the record and returned to both."""
    run_dir = tmp_path / "runs" / "race"
    run_dir.mkdir(parents=True)
    (run_dir / "plan.json").write_text("{}")
    go = tmp_path / "go"
    env = {**os.environ, "PYTHONPATH": str(PROJECT_ROOT)}
    creators = [
        subprocess.Popen(
            [sys.executable, "-c", _CREATOR, str(run_dir), mlflow_uri, str(go), role],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for role in ("courier", "relaunch")
    ]
    try:
        for creator in creators:
            assert creator.stdout.readline().strip() == "ready"
        go.touch()
        outputs = [creator.communicate(timeout=90) for creator in creators]
    finally:
        for creator in creators:
            creator.kill()
    returned = [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs]
    client = _client(mlflow_uri)
    made = client.search_runs([client.get_experiment_by_name("race").experiment_id])
    recorded = json.loads((run_dir / RUN_RECORD).read_text())["run_id"]
    assert [r.info.run_id for r in made] == [recorded] and returned == [recorded, recorded], outputs


def test_a_creator_killed_holding_the_creation_lock_holds_no_one_up(mlflow_uri, tmp_path):
    """While another process creates the run folder's run, a job's start waits for its record rather than making a
    second run; a creator killed in its attempt (a node lost, `make stop`) leaves no claim that blocks the run."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    hold = "import fcntl, sys, time; f = open(sys.argv[1], 'a'); fcntl.flock(f, fcntl.LOCK_EX); print('held')"
    holder = subprocess.Popen(
        [sys.executable, "-u", "-c", hold + "; time.sleep(300)", str(run_dir / runs.CREATION_LOCK)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        run = runs.start_job_run(run_dir, mlflow_uri, "locked", {}, {}, {}, wait_s=2.0)
        assert run.run_id is None and not (run_dir / RUN_RECORD).exists()
    finally:
        holder.kill()
        holder.wait()
    assert run.wait(60) == json.loads((run_dir / RUN_RECORD).read_text())["run_id"]
    run.stop()
