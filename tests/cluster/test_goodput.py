"""The goodput ledger (pretrain.telemetry.attempt_clock on the worker, cluster.driver.ledger at the driver) and the
step-time tails.

The ledger's end-to-end sums (a killed worker, the elastic demo) are checked in test_cluster_driver.py and
test_cluster_elastic.py, on their existing runs; here the bookkeeping itself, on records with known numbers.
"""

from __future__ import annotations

import json
import os
import socket
import time

import psutil
import pytest
import torch

from cluster.driver.ledger import (
    EvalSpan,
    GoodputMonitor,
    JobClock,
    build_ledger,
    data_wait_line,
    eval_spans,
    evals_share_training_cores,
    finish_ledger,
    format_ledger,
    interference,
    process_starts,
    read_workers,
)
from cluster.profiles import load_profile
from pretrain.telemetry.attempt_clock import AttemptClock, attempt_path, read_attempts
from pretrain.telemetry.metrics import TrainMetrics, percentile, tail_metrics
from tracking import keys
from tracking.tracker import Tracker


def _attempt(n, started, ended, step, start_step, seconds, checkpoints=(), windows=(), pid=None, updated=None):
    return {
        "attempt": n,
        "pid": pid or 100 + n,
        "started": started,
        "ended": ended,
        "updated": updated or ended,
        "step": step,
        "start_step": start_step,
        "last_step": 30,
        "seconds": seconds,
        "checkpoints": [list(c) for c in checkpoints],
        "windows": list(windows),
    }


def _two_attempts():
    """Job 0..100 s: fit at 5; attempt 1's process at 8, train_worker at 10, killed after its record of 40 (step
    14, checkpoint at 10 with 12 s productive + 2 s data wait); attempt 2's process at 50, resumes step 10, ends 90."""
    first = _attempt(
        1,
        10.0,
        None,
        14,
        0,
        {"startup": 6.0, "productive": 18.0, "data_wait": 3.0, "checkpoint": 2.0},
        checkpoints=[(10, 12.0, 2.0)],
        updated=40.0,
    )
    second = _attempt(2, 52.0, 90.0, 30, 10, {"startup": 5.0, "productive": 25.0, "data_wait": 4.0, "checkpoint": 3.0})
    return first, second, {101: 8.0, 102: 50.0}


def test_ledger_sums_to_the_wall_clock_and_counts_redone_steps_as_restart():
    first, second, starts = _two_attempts()
    ledger = build_ledger(JobClock(0.0, 5.0), 100.0, [first, second], starts)
    assert ledger.wall_s == 100.0
    assert sum(ledger.total.values()) == pytest.approx(100.0, abs=1e-9)
    for _, row in ledger.rows:
        assert min(row.values()) >= 0
    rows = dict(ledger.rows)
    assert rows["job start"]["startup"] == 5.0  # driver: Ray, MLflow run, eval scheduler
    a1, a2 = rows["attempt 1"], rows["attempt 2"]
    assert a1["resource_wait"] == 3.0 and a1["startup"] == 2.0 + 6.0  # fit → process; process → train_worker + own
    # Steps 11-14 were redone: 18 - 12 productive and 3 - 2 data wait seconds are lost, not productive.
    assert a1["productive"] == 12.0 and a1["data_wait"] == 2.0 and a1["restart"] == 7.0
    assert a1["other"] == pytest.approx(30.0 - 29.0)  # its span 10..40 less what it booked
    assert a2["restart"] == 10.0 and a2["startup"] == 2.0 + 5.0  # 40 → 50: the gap after the kill, then start-up
    assert a2["productive"] == 25.0 and a2["other"] == pytest.approx(38.0 - 37.0)
    assert rows["job end"]["other"] == 10.0  # 90 → 100: Ray Train's end, evals drained, the final model
    assert ledger.fraction == pytest.approx(0.37)
    assert ledger.data_wait_measured == pytest.approx(7.0 / 50.0)
    assert any("steps 11-14 were trained again" in n for n in ledger.notes)
    metrics = ledger.metrics()
    assert metrics[keys.GOODPUT_WALL_S] == 100.0 and metrics[keys.GOODPUT_FRACTION] == pytest.approx(0.37)
    assert {keys.goodput_bucket(b) for b in keys.GOODPUT_BUCKETS} <= set(metrics)


def test_a_worker_process_kept_across_a_resize_books_the_gap_as_restart_not_startup():
    """An elastic regrowth: Ray Train restarts the training function in the process that ran the last attempt (same
    pid, started long before), so the gap from that attempt's end to train_worker is the restart's."""
    first, second, starts = _two_attempts()
    kept = dict(second, pid=101)  # attempt 2 runs in attempt 1's process, started at 8 s
    rows = dict(build_ledger(JobClock(0.0, 5.0), 100.0, [first, kept], starts).rows)
    assert rows["attempt 2"]["restart"] == 52.0 - 40.0  # the whole gap 40 → 52 (attempt 1 books its own lost work)
    assert rows["attempt 2"]["startup"] == 5.0  # only what train_worker itself booked
    assert rows["attempt 1"]["startup"] == 2.0 + 6.0  # the first attempt's process start still counts as start-up


def test_the_attempts_process_start_is_its_rank_0s_not_another_nodes_process_of_the_same_pid(tmp_path):
    """Identical containers number their processes alike: attempt 1's rank 1 on node b had pid 102, the pid attempt
    2's rank 0 gets on node c. The attempt (rank 0's record) started its process at 50 s, not at rank 1's 7.5 s."""
    first, second, _ = _two_attempts()
    folder = tmp_path / "workers"
    folder.mkdir()
    for rank, pid, host, started in ((0, 101, "a", 8.0), (1, 102, "b", 7.5), (0, 102, "c", 50.0), (1, 103, "d", 50.0)):
        record = {"rank": rank, "pid": pid, "hostname": host, "process_started": started}
        (folder / f"rank{rank}-pid{pid}.json").write_text(json.dumps(record))
    assert process_starts(read_workers(tmp_path)) == {101: 8.0, 102: 50.0}
    rows = dict(build_ledger(JobClock(0.0, 5.0), 100.0, [first, second], process_starts(read_workers(tmp_path))).rows)
    assert rows["attempt 2"]["restart"] == 10.0 and rows["attempt 2"]["startup"] == 2.0 + 5.0  # not a kept process


def test_two_attempts_whose_rank_0_had_the_same_pid_on_different_nodes_keep_their_own_process_starts(tmp_path):
    """Identical containers number their processes alike: attempt 2's rank 0, on node c after node a was lost, got
    pid 101 as attempt 1's rank 0 had. The placement records keep both (named by node), but a lookup by pid finds one
    of them for both attempts; each attempt's record names its own process start and host."""
    first, second, _ = _two_attempts()
    second["pid"] = 101
    first.update(host="a", process_started=8.0)
    second.update(host="c", process_started=50.0)
    folder = tmp_path / "workers"
    folder.mkdir()
    for node, started in (("cccc", 50.0), ("aaaa", 8.0)):  # named as cluster.driver.record names them
        record = {"rank": 0, "pid": 101, "node_id": node * 8, "hostname": node[0], "process_started": started}
        (folder / f"rank0-pid101-{node * 3}.json").write_text(json.dumps(record))
    starts = process_starts(read_workers(tmp_path))
    rows = dict(build_ledger(JobClock(0.0, 5.0), 100.0, [first, second], starts).rows)
    assert rows["attempt 1"]["resource_wait"] == 3.0 and rows["attempt 1"]["startup"] == 2.0 + 6.0
    assert rows["attempt 2"]["restart"] == 10.0 and rows["attempt 2"]["startup"] == 2.0 + 5.0  # not a kept process
    clock = AttemptClock()  # the worker's side: its record carries them
    clock.open(attempt_path(tmp_path, 1), pid=os.getpid())
    clock.write()
    [record] = read_attempts(tmp_path)
    assert record["process_started"] == psutil.Process().create_time() and record["host"] == socket.gethostname()


def test_a_resume_from_a_step_it_did_not_save_is_interpolated_and_overlong_records_are_scaled():
    first, second, starts = _two_attempts()
    second["start_step"] = 12  # no checkpoint of attempt 1 at 12: kept = 12/14 of its step seconds
    ledger = build_ledger(JobClock(0.0, 5.0), 100.0, [first, second], starts)
    assert dict(ledger.rows)["attempt 1"]["productive"] == pytest.approx(18.0 * 12 / 14)
    # Killed in the step after its checkpoint (its record still at step 10): that unfinished step is lost too.
    first["step"], second["start_step"] = 10, 10
    ledger = build_ledger(JobClock(0.0, 5.0), 100.0, [first, second], starts)
    assert dict(ledger.rows)["attempt 1"]["productive"] == 12.0 and dict(ledger.rows)["attempt 1"]["restart"] == 7.0
    # A record that books more than its span on the driver's clock (clock skew) is scaled; other never negative.
    late = _attempt(1, 10.0, 20.0, 30, 0, {"startup": 5.0, "productive": 15.0, "data_wait": 0.0, "checkpoint": 0.0})
    ledger = build_ledger(JobClock(0.0, 5.0), 30.0, [late])
    row = dict(ledger.rows)["attempt 1"]
    assert row["productive"] == pytest.approx(7.5) and row["startup"] == pytest.approx(2.5) and row["other"] == 0
    assert sum(ledger.total.values()) == pytest.approx(30.0) and "scaled by 0.500" in ledger.notes[0]
    # A ledger closed before the job got its workers: all start-up, and still the wall-clock.
    early = build_ledger(JobClock(0.0, None), 4.0, [])
    assert early.total["startup"] == 4.0 and sum(early.total.values()) == 4.0


def test_eval_interference_is_the_extra_step_time_of_windows_an_eval_overlapped():
    windows = [
        {"t0": 10.0 * i, "t1": 10.0 * (i + 1), "steps": 10, "productive_s": 10.0, "step": 10 * (i + 1)}
        for i in range(4)
    ]
    windows[2]["productive_s"] = 16.0  # an eval ran 20..25: half the window, steps 1.6x as long
    attempt = _attempt(
        1, 0.0, 50.0, 40, 0, {"startup": 0.0, "productive": 46.0, "data_wait": 0.0, "checkpoint": 0.0}, windows=windows
    )
    evals = [EvalSpan(20.0, 25.0)]
    assert interference(attempt, evals) == pytest.approx(6.0 * 0.5)
    assert interference(attempt, [EvalSpan(100.0, 110.0)]) == 0.0  # no overlap
    ledger = build_ledger(JobClock(0.0, 0.0), 50.0, [attempt], evals=evals, evals_shared=True)
    row = dict(ledger.rows)["attempt 1"]
    assert row["eval_interference"] == pytest.approx(3.0) and row["productive"] == pytest.approx(43.0)
    assert build_ledger(JobClock(0.0, 0.0), 50.0, [attempt], evals=evals).total["eval_interference"] == 0.0
    assert eval_spans({10: {"started": 20.0, "seconds": 5.0}, 20: {"error": "x"}}) == evals


def test_evals_share_training_cores_only_where_the_profile_oversubscribes_a_node():
    assert evals_share_training_cores(load_profile("local"))  # 2 workers + an eval slot on 2 cores
    assert evals_share_training_cores(load_profile("local_elastic"))
    assert not evals_share_training_cores(load_profile("a100x64"))  # evals on a GPU node group of their own
    assert not evals_share_training_cores(load_profile("a100x8"))  # 96 cores: room for the eval's 12


def test_attempt_clock_books_every_second_and_writes_its_record(tmp_path):
    clock = AttemptClock()
    path = attempt_path(tmp_path, 1)
    time.sleep(0.05)
    clock.open(path, world_size=2, start_step=0, last_step=3, pid=123)
    clock.lap("startup")
    clock.saved_before_loop(0.0)
    saved = 0.0
    for step in (1, 2, 3):
        clock.lap("productive")
        time.sleep(0.02)
        step_s = clock.step_done(step, data_s=0.01)
        assert step_s >= 0.02
        if step == 2:  # a save of 0.03 s
            time.sleep(0.03)
            saved += 0.03
        clock.after_step(saved, logged=step % 2 == 1)
    clock.close("finished")
    [record] = read_attempts(tmp_path)
    assert record["step"] == 3 and record["world_size"] == 2 and record["outcome"] == "finished"
    seconds = record["seconds"]
    assert sum(seconds.values()) == pytest.approx(record["ended"] - record["started"], abs=0.01)
    assert seconds["startup"] >= 0.05 and seconds["data_wait"] == pytest.approx(0.03)
    assert seconds["checkpoint"] == pytest.approx(0.03) and seconds["productive"] >= 0.03
    assert [c[0] for c in record["checkpoints"]] == [2]
    assert [w["step"] for w in record["windows"]] == [1, 3] and sum(w["steps"] for w in record["windows"]) == 3
    AttemptClock().write()  # a clock opened without a path (ranks other than 0) writes nothing
    assert len(list(path.parent.iterdir())) == 2  # the record and its windows


def test_step_time_tails_show_a_loader_that_stalls_one_step_in_fifty():
    steps = [0.1] * 49 + [2.0]
    waits = [0.0] * 49 + [1.9]
    tails = tail_metrics(steps, waits)
    assert tails[keys.step_time_percentile(50)] == pytest.approx(0.1)
    assert tails[keys.step_time_percentile(99)] > 1.0 and tails[keys.data_wait_percentile(99)] > 0.9
    assert tails[keys.data_wait_percentile(90)] == 0.0
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0 and percentile([1.0, 2.0], 50) == 1.5
    assert tail_metrics([], []) == {}
    metrics = TrainMetrics(
        rank=0,
        world_size=1,
        total_steps=4,
        flops_per_image=1,
        peak_tflops=1.0,
        device=torch.device("cpu"),
        log_every=2,
        progress_bar=False,
    )
    assert metrics.step(1, 2.0, 0.1, None, 8, 0.0, step_s=0.5) == {}
    logged = metrics.step(2, 2.0, 0.1, None, 8, 0.25, step_s=1.5)
    assert logged[keys.step_time_percentile(50)] == pytest.approx(1.0)
    assert logged[keys.data_wait_percentile(99)] == pytest.approx(0.2475)
    assert metrics.step(3, 2.0, 0.1, None, 8, 0.0) == {}  # without step_s: the time since the previous call
    assert 0 <= metrics.step(4, 2.0, 0.1, None, 8, 0.0)[keys.step_time_percentile(99)] < 5


def test_final_ledger_is_written_printed_with_the_predicted_data_wait_and_monitored(tmp_path):
    first, second, starts = _two_attempts()
    ledger = build_ledger(JobClock(0.0, 5.0), 100.0, [first, second], starts)
    table = format_ledger(ledger)
    assert table.splitlines()[0].startswith("goodput 37.0%: 37.0 s productive of 100.0 s")
    assert "attempt 1" in table.splitlines()[1] and "100.0 s wall" in table
    assert data_wait_line({"data": {}}, ledger) is None  # a plan without the prediction
    plan = {"data": {"predicted_data_wait": 0.05}}
    assert data_wait_line(plan, ledger) == "data wait: predicted 5.0%, measured 14.0% of step time"
    text = finish_ledger(tmp_path, ledger, plan, Tracker(None, None, enabled=False), step=30)
    saved = json.loads((tmp_path / "goodput" / "ledger.json").read_text())
    assert saved["wall_s"] == 100.0 and [a["row"] for a in saved["attempts"]][1:3] == ["attempt 1", "attempt 2"]
    assert text.endswith("measured 14.0% of step time") and (tmp_path / "goodput" / "ledger.txt").read_text()
    # The monitor logs the ledger so far at the newest step, and never at the last one (the final ledger's).
    run = tmp_path / "run"
    clock = AttemptClock()
    clock.open(attempt_path(run, 1), start_step=0, last_step=30)
    clock.step = 12
    clock.write()
    monitor = GoodputMonitor(run, JobClock(clock.started - 1, clock.started), Tracker(None, None, enabled=False))
    assert monitor.poll() and not monitor.poll()  # once per new step
    clock.step = 30
    clock.write()
    assert not monitor.poll()


def test_a_job_that_ends_early_logs_one_goodput_value_per_step(tmp_path, mlflow_uri):
    """A job ending before its schedule's last step logged the monitor's interim ledger and then the totals at the
    same step: two values at one step. The monitor's newest values wait for a newer step, so the totals stand alone."""
    from mlflow import MlflowClient

    from tracking.runs import create_run

    run_id = create_run(mlflow_uri, "goodput", "ends-early")
    run = tmp_path / "run"
    clock = AttemptClock()
    clock.open(attempt_path(run, 1), start_step=0, last_step=30)
    job = JobClock(clock.started - 1, clock.started)
    monitor = GoodputMonitor(run, job, Tracker(mlflow_uri, run_id, rank=0))
    for step in (12, 20):  # the job stops at 20 of 30
        clock.step = step
        clock.write()
        assert monitor.poll()
    monitor.stop()
    ledger = build_ledger(job, time.time(), read_attempts(run), process_starts(read_workers(run)))
    with Tracker(mlflow_uri, run_id, rank=0) as tracker:
        finish_ledger(run, ledger, {"data": {}}, tracker, step=20)
    history = MlflowClient(mlflow_uri).get_metric_history(run_id, keys.GOODPUT_WALL_S)
    assert [m.step for m in history] == [12, 20] and history[-1].value == ledger.wall_s
