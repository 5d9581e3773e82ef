"""Evals never take training down: a killed eval task is run again by Ray's task retry; an eval that fails for good
(an exception in the suite, a task killed twice, one still running when the job's end has waited `evals.timeout_s`)
is recorded in the MLflow run as failed for that checkpoint, with the reason, and never holds the job's end longer.
Where MLflow does not take those records by the job's end, they wait in the run folder's spool and arrive once.

Real Ray (a local head in this process), the real eval scheduler actor, real MLflow on SQLite. The eval task's body
is the real `run_suite_task` where its outcome is the point (a suite that fails), and a stand-in that sleeps where a
task must run long enough to be killed or outlast the timeout (a real suite on CPU is either too quick or too slow
for that). The spool's tests run the scheduler's actor class in this process, without Ray: its recording needs none.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from cluster.local_head import ray_auth_mode
from pretrain.checkpoint.run_folder import is_pinned, pin_checkpoint
from tests.tracking.test_tracking import _server_that_is_down
from tracking import keys
from tracking import store as store_module
from tracking import tracker as tracker_module
from tracking.runs import RUN_RECORD, create_run, send_spooled
from tracking.store import pending_run_ref, spool_dir
from tracking.tracker import PENDING_CLOSE_S, UNANSWERED_CLOSE_S


@pytest.fixture
def ray_local():
    import ray

    with ray_auth_mode("disabled"):
        ray.init(address="local", num_cpus=2, include_dashboard=False, object_store_memory=100 * 1024**2)
        try:
            yield ray
        finally:
            ray.shutdown()


@pytest.fixture
def mlflow_run(mlflow_uri):
    from tracking.runs import create_run

    uri = mlflow_uri
    return uri, create_run(uri, "evals", "test", {}, {})


def _checkpoints(run_dir: Path, steps) -> list[Path]:
    """COMPLETE step folders, pinned for their evals as training rank 0 leaves them."""
    folders = []
    for step in steps:
        folder = run_dir / "checkpoints" / f"step_{step:08d}"
        folder.mkdir(parents=True)
        (folder / "COMPLETE").write_text(f"{step}\n")
        pin_checkpoint(folder, "evals pending")
        folders.append(folder)
    return folders


def _sleeper(marks: str):
    """An eval task body that records its pid and sleeps: the first attempt (or every one, with ``forever``) is
    there to be killed."""

    def body(checkpoint_dir: str, suite: str, data_root: str, run_id, tracking_uri) -> dict:
        import os
        import time
        from pathlib import Path

        attempts = sorted(Path(marks).glob("attempt-*"))
        (Path(marks) / f"attempt-{len(attempts)}-{os.getpid()}").touch()
        if suite == "forever" or not attempts:
            time.sleep(600)
        return {"metrics": {"fewshot/mean/10shot": 0.5}, "seconds": 0.0}

    return body


def _attempt_pids(marks: Path, count: int, timeout_s: float = 120) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while len(found := sorted(marks.glob("attempt-*"))) < count:
        assert time.monotonic() < deadline, f"{count} eval attempts did not start within {timeout_s} s"
        time.sleep(0.2)
    return [int(p.name.rsplit("-", 1)[1]) for p in found]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_killed_eval_task_runs_again_and_one_killed_twice_is_recorded_failed(tmp_path, ray_local, mlflow_run):
    from mlflow import MlflowClient

    from cluster.driver.eval_scheduler import EvalScheduler

    uri, run_id = mlflow_run
    s10, s20 = _checkpoints(tmp_path / "run", (10, 20))
    retried, doomed = tmp_path / "retried", tmp_path / "doomed"
    retried.mkdir(), doomed.mkdir()

    once = EvalScheduler.remote("local_fewshot", str(tmp_path), run_id, uri, num_cpus=1, task=_sleeper(str(retried)))
    assert ray_local.get(once.submit.remote(str(s10), 10, {}))
    os.kill(_attempt_pids(retried, 1)[0], signal.SIGKILL)  # OOM-killed, say: Ray runs the task again
    rows = ray_local.get(once.drain.remote(120))
    assert rows[10]["metrics"] == {"fewshot/mean/10shot": 0.5} and "error" not in rows[10], rows
    assert len(_attempt_pids(retried, 2)) == 2 and not is_pinned(s10)

    twice = EvalScheduler.remote("forever", str(tmp_path), run_id, uri, num_cpus=1, task=_sleeper(str(doomed)))
    assert ray_local.get(twice.submit.remote(str(s20), 20, {}))
    os.kill(_attempt_pids(doomed, 1)[0], signal.SIGKILL)
    os.kill(_attempt_pids(doomed, 2)[1], signal.SIGKILL)  # killed again: beyond Ray's one retry
    rows = ray_local.get(twice.drain.remote(120))
    assert rows[20]["error"].startswith("eval task failed:") and not is_pinned(s20), rows

    client = MlflowClient(tracking_uri=uri)
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, keys.eval_failed("forever"))] == [(20, 1.0)]
    assert client.get_metric_history(run_id, keys.eval_failed("local_fewshot")) == []  # the retried one succeeded
    reason = (tmp_path / "run" / keys.EVAL_FAILURES_DIR / "step_00000020.txt").read_text()
    assert reason.startswith("step 20: eval task failed:")
    artifacts = [a.path for a in client.list_artifacts(run_id, keys.EVAL_FAILURES_DIR)]
    assert artifacts == [f"{keys.EVAL_FAILURES_DIR}/step_00000020.txt"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_failed_evals_are_recorded_and_the_end_waits_no_longer_than_the_timeout(tmp_path, ray_local, mlflow_run):
    """A suite that raises (the real eval task), and an eval still running at the job's end: both recorded as failed
    for their checkpoints with the reason; the drain returns after evals.timeout_s, not when the eval ends."""
    from mlflow import MlflowClient

    from cluster.driver.eval_scheduler import EvalScheduler

    uri, run_id = mlflow_run
    s10, s20 = _checkpoints(tmp_path / "run", (10, 20))
    broken = EvalScheduler.remote("no_such_suite", str(tmp_path), run_id, uri, num_cpus=1)  # real run_suite_task
    assert ray_local.get(broken.submit.remote(str(s10), 10, {"train/loss": 3.0}))
    rows = ray_local.get(broken.drain.remote(120))
    assert "no_such_suite" in rows[10]["error"] and not is_pinned(s10)

    marks = tmp_path / "marks"
    marks.mkdir()
    slow = EvalScheduler.remote(
        "forever", str(tmp_path), run_id, uri, num_cpus=1, max_pinned=1, task=_sleeper(str(marks))
    )
    assert ray_local.get(slow.submit.remote(str(s20), 20, {}))
    _attempt_pids(marks, 1)
    (s30,) = _checkpoints(tmp_path / "run", (30,))
    assert ray_local.get(slow.submit.remote(str(s30), 30, {}))  # step 20's eval holds the one pin: skipped
    assert not is_pinned(s30)
    started = time.monotonic()
    rows = ray_local.get(slow.drain.remote(1.0))  # what the driver passes: evals.timeout_s
    waited = time.monotonic() - started
    # The eval would sleep 600 s; the drain waits 1 s, then closes the scheduler's Tracker (up to 60 s).
    assert waited < 120, waited
    assert "evals.timeout_s" in rows[20]["error"] and not is_pinned(s20)
    by_hand = f"`python -m evals.run --checkpoint {s20} --suite forever --data-root {tmp_path} --mlflow-run-id {run_id}"
    assert f"while the checkpoint is kept, {by_hand} --tracking-uri {uri}` scores it" in rows[20]["error"]
    assert rows[30]["skipped"] and rows[30]["error"].startswith("eval skipped")

    client = MlflowClient(tracking_uri=uri)
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, keys.eval_failed("no_such_suite"))] == [
        (10, 1.0)
    ]
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, keys.eval_failed("forever"))] == [(20, 1.0)]
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, keys.eval_skipped("forever"))] == [(30, 1.0)]
    reasons = {p.name: p.read_text() for p in (tmp_path / "run" / keys.EVAL_FAILURES_DIR).iterdir()}
    assert "eval skipped" in reasons["step_00000030.txt"]
    assert "no_such_suite" in reasons["step_00000010.txt"] and "Traceback" in reasons["step_00000010.txt"]
    assert "evals.timeout_s" in reasons["step_00000020.txt"]
    tags = client.get_run(run_id).data.tags
    assert tags[keys.EVAL_FAILURES] == "1" and tags[keys.EVAL_SKIPPED] == "1"  # counted per scheduler: one per job


def _failed_and_skipped(run_dir: Path, run_id: str, uri: str):
    """The eval scheduler (its actor class, in this process: recording needs no Ray) of the job in ``run_dir``, with
    step 10's eval skipped (no pin left: ``max_pinned=0``) and step 20's failed for good (what `_collect` does with a
    task's error, which takes a Ray task to make)."""
    from cluster.driver.eval_scheduler import EvalScheduler

    s10, s20 = _checkpoints(run_dir, (10, 20))
    scheduler = EvalScheduler.__ray_metadata__.modified_class(
        "local_fewshot", str(run_dir), run_id, uri, max_pinned=0, run_dir=str(run_dir)
    )
    assert scheduler.submit(str(s10), 10, {})
    with scheduler._lock:
        scheduler._paths[20], scheduler._due[20] = str(s20), ("local_fewshot",)
        scheduler._fail(20, {"error": "eval task failed: WorkerCrashedError: killed twice"})
    return scheduler


@pytest.mark.timeout(120)
def test_failed_and_skipped_evals_of_a_run_not_created_by_the_end_arrive_once_when_it_exists(tmp_path, mlflow_uri):
    """MLflow down since the job's start: its run is still pending when the job's end drains the evals. The drain
    closes the scheduler's Tracker within seconds and leaves its records of a failed and a skipped eval in the run
    folder's spool (before: kept in the actor's memory, which dies with the job); once the run exists, the job's end
    or its courier (`send_spooled`) sends them, each once."""
    run_dir = tmp_path / "run"
    record = run_dir / RUN_RECORD
    scheduler = _failed_and_skipped(run_dir, pending_run_ref(record), mlflow_uri)
    started = time.monotonic()
    rows = scheduler.drain(5)
    assert time.monotonic() - started < PENDING_CLOSE_S + 5
    assert rows[10]["skipped"] and "killed twice" in rows[20]["error"]
    assert len(list(spool_dir(record).glob("*.json"))) == 1

    run_id = create_run(mlflow_uri, "evals", "test", {}, {})  # MLflow answers: the courier creates the run
    record.write_text(json.dumps({"run_id": run_id, "tracking_uri": mlflow_uri}))
    assert send_spooled(record) == (6, 0)  # 2 metrics, 2 tags, 2 reasons
    assert send_spooled(record) == (0, 0)
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=mlflow_uri)
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, keys.eval_failed("local_fewshot"))] == [
        (20, 1.0)
    ]
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, keys.eval_skipped("local_fewshot"))] == [
        (10, 1.0)
    ]
    tags = client.get_run(run_id).data.tags
    assert tags[keys.EVAL_FAILURES] == "1" and tags[keys.EVAL_SKIPPED] == "1"
    assert sorted(a.path for a in client.list_artifacts(run_id, keys.EVAL_FAILURES_DIR)) == [
        f"{keys.EVAL_FAILURES_DIR}/step_00000010.txt",
        f"{keys.EVAL_FAILURES_DIR}/step_00000020.txt",
    ]


@pytest.mark.timeout(120)
def test_failed_and_skipped_evals_wait_in_the_spool_when_the_server_is_down_at_the_end(tmp_path, monkeypatch):
    """The run exists and its record names it, but its server is down at the job's end: the drain waits at most
    `UNANSWERED_CLOSE_S` for it, then leaves the records in the run folder's spool, which the job's courier (or
    `python -m cluster.driver.deliver`) sends (before: dropped with the actor)."""
    monkeypatch.setattr(store_module, "FAILING_SINCE", {})  # this test's URI only
    monkeypatch.setattr(tracker_module, "CLOSE_RETRIES", 0)  # one last send: seconds
    uri, run_id = _server_that_is_down(monkeypatch), "0123456789abcdef"
    run_dir = tmp_path / "run"
    record = run_dir / RUN_RECORD
    record.parent.mkdir()
    record.write_text(json.dumps({"run_id": run_id, "tracking_uri": uri}))
    scheduler = _failed_and_skipped(run_dir, run_id, uri)
    started = time.monotonic()
    scheduler.drain(5)
    assert time.monotonic() - started < UNANSWERED_CLOSE_S + 5
    [spooled] = spool_dir(record).glob("*.json")
    payload = json.loads(spooled.read_text())
    assert (payload["tracking_uri"], payload["ref"]) == (uri, run_id)
    assert sorted((key, value, step) for key, value, _, step in payload["metrics"]) == [
        (keys.eval_failed("local_fewshot"), 1.0, 20),
        (keys.eval_skipped("local_fewshot"), 1.0, 10),
    ]
    assert payload["tags"] == {keys.EVAL_SKIPPED: "1", keys.EVAL_FAILURES: "1"}
    assert sorted(Path(local).name for local, _ in payload["artifacts"]) == ["step_00000010.txt", "step_00000020.txt"]
    assert all(Path(local).is_relative_to(spool_dir(record)) for local, _ in payload["artifacts"])  # the spool's copies


def test_evals_timeout_is_a_checked_setting():
    from pretrain.config.train_config import load_config

    assert load_config("local_demo").evals.timeout_s == 3600
    with pytest.raises(ValueError, match=r"evals\.timeout_s=0.0 must be > 0"):
        load_config("local_demo", ["evals.timeout_s=0"]).validate(2, check_paths=False)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_last_checkpoints_eval_is_not_skipped_when_the_pins_are_taken(tmp_path, ray_local, mlflow_run):
    """Evals behind checkpoints skip new ones beyond max_pinned, but never the last step's, which every suite
    evaluates (the cadence's rule): no checkpoint comes after it, so its pin is the last (before: skipped, and the
    final model had no eval)."""
    from cluster.driver.eval_scheduler import EvalScheduler
    from cluster.plan.evals.cadence import EvalCadence

    uri, run_id = mlflow_run
    marks = tmp_path / "marks"
    marks.mkdir()
    cadence = EvalCadence((("forever", 1),), checkpoint_every=10, last_step=40)
    scheduler = EvalScheduler.remote(
        cadence, str(tmp_path), run_id, uri, num_cpus=1, max_pinned=1, task=_sleeper(str(marks))
    )
    s10, s20, s40 = _checkpoints(tmp_path / "run", (10, 20, 40))
    assert ray_local.get(scheduler.submit.remote(str(s10), 10, {}))
    assert ray_local.get(scheduler.submit.remote(str(s20), 20, {}))  # step 10's eval holds the one pin: skipped
    assert ray_local.get(scheduler.submit.remote(str(s40), 40, {}))
    assert not is_pinned(s20) and is_pinned(s40)
    assert ray_local.get(scheduler.pending.remote()) == [10, 40]
    rows = ray_local.get(scheduler.drain.remote(1.0))
    assert rows[20]["skipped"] and not rows[40].get("skipped") and "evals.timeout_s" in rows[40]["error"]


# A driver process that submits the real eval task and waits; stopped, Ray stops its task as `make stop` does a job's.
_DRIVER = """
import sys, time, ray
from cluster.driver.eval_task import run_suite_task
ray.init(address=sys.argv[1])
ray.remote(num_cpus=1)(run_suite_task).remote(*sys.argv[2:5], None, None)
time.sleep(600)
"""


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_an_eval_stopped_with_its_job_keeps_its_pin_for_the_next_job(tmp_path, ray_local, eval_data_root):
    """Ray stops a stopped job's tasks with SIGTERM, a SystemExit in the task: its checkpoint stays pinned, so the run's
    next job runs the eval (`EvalScheduler.catch_up`). Before, the task unpinned it on the way out and the eval, the
    step-0 baseline among them, was lost for good."""
    import subprocess
    import sys

    import psutil

    from pretrain.model.vit import build_model
    from pretrain.weights.formats import save_pretrained

    (folder,) = _checkpoints(tmp_path / "run", (0,))
    save_pretrained(build_model("vit_tiny_debug", num_classes=32), folder)
    (folder / "trainer_state.json").write_text(json.dumps({"step": 0, "images_seen": 0}))
    suite = tmp_path / "long.yaml"  # far longer than the test waits: the stop lands while it trains
    suite.write_text(
        "name: long\nevaluators:\n  - type: finetune\n    datasets: [digits]\n    steps: 5000\n    batch_size: 16\n"
        "    lr_grid: [0.01]\n    warmup_steps: 1\n    max_train_examples: 400\n"
    )
    address = ray_local.get_runtime_context().gcs_address
    driver = subprocess.Popen([sys.executable, "-c", _DRIVER, address, str(folder), str(suite), str(eval_data_root)])
    deadline = time.monotonic() + 120
    while not (
        tasks := [
            p for p in psutil.process_iter(["cmdline"]) if "ray::run_suite_task" in " ".join(p.info["cmdline"] or ())
        ]
    ):
        assert driver.poll() is None and time.monotonic() < deadline, "the eval task did not start"
        time.sleep(0.2)
    time.sleep(2)  # into the suite
    driver.terminate()  # as `ray job stop` stops a job's driver
    driver.wait()
    psutil.wait_procs(tasks, timeout=60)
    assert not any(task.is_running() for task in tasks), "Ray did not stop the stopped driver's task"
    assert is_pinned(folder) and not (folder / "evals").exists()
