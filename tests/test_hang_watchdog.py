"""A hung rank is found in minutes, not at the collective timeout.

Fast tests of the watchdog's decisions (allowances per phase, the group rule, the culprit, stragglers, the data
counters), of the heartbeat a rank writes, and of the watchdog acting on real processes: two Python processes coupled
like ranks in a collective (the second reads what the first writes each step), the first stopped with SIGSTOP. One
end-to-end test runs the real Ray driver with a 2-worker CPU profile and a rank that SIGSTOPs itself after a
checkpoint: the job goes on from that checkpoint within 2 minutes of the stop, in one MLflow run.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from cluster.profiles import HangSpec, load_profile
from cluster.watchdog import (
    EVENTS_FILE,
    Watchdog,
    active_reports,
    allowance,
    assess,
    data_totals,
    pick_culprit,
    process_state,
    step_bound,
    stragglers,
)
from pretrain.heartbeat import Heartbeat, heartbeat_path, read_heartbeats
from tracking.tracker import Tracker

ROOT = Path(__file__).resolve().parents[1]
SPEC = HangSpec(floor_s=30, factor=10, startup_s=600, checkpoint_s=300)


def report(rank: int, t: float, phase: str = "step", step: int = 10, **kw) -> dict:
    return {"rank": rank, "world_size": 2, "pid": 1000 + rank, "host": "h", "started": 0.0, "time": t,
            "phase": phase, "step": step, "step_s": 0.5, "data_s": 0.01, **kw}  # fmt: skip


def test_allowance_per_phase_and_step_time():
    assert step_bound(SPEC, 0.5) == 30 and step_bound(SPEC, 5.0) == 50 and step_bound(SPEC, None) == 30
    assert allowance(SPEC, "start", 0.5) == 600  # engine build, resume, step-0 save, first batch
    assert allowance(SPEC, "checkpoint", 0.5) == 300 and allowance(SPEC, "switch", 0.5) == 300
    assert allowance(SPEC, "checkpoint", 40.0) == 400  # never shorter than the training bound
    assert allowance(SPEC, "step", 0.5) == 30


def test_the_group_is_hung_only_when_no_rank_reports_within_the_longest_allowance():
    now = 10_000.0
    hung = assess([report(0, now - 35), report(1, now - 40)], now, SPEC)
    assert hung.hung and hung.idle_s == pytest.approx(35) and hung.bound_s == 30 and "floor 30" in hung.why
    assert not assess([report(0, now - 35), report(1, now - 1)], now, SPEC).hung  # someone is progressing
    # Rank 0 in a long save holds rank 1 in its next collective: that is no hang until the save's allowance.
    saving = [report(0, now - 200, "checkpoint"), report(1, now - 190)]
    assert not assess(saving, now, SPEC).hung and assess(saving, now + 150, SPEC).hung
    assert not assess([report(0, now - 500, "start"), report(1, now - 500, "start")], now, SPEC).hung
    assert not assess([report(0, now - 999, "done"), report(1, now - 999, "done")], now, SPEC).hung
    slow_steps = [report(0, now - 35, step_s=4.0), report(1, now - 35, step_s=4.0)]
    assert not assess(slow_steps, now, SPEC).hung  # 10 x 4 s steps: a 40 s bound
    assert assess(slow_steps, now + 6, SPEC).hung


def test_reports_of_retired_processes_and_ranks_beyond_the_world_are_ignored():
    old = [report(0, 1.0, pid=7), report(1, 1.0, pid=8), dict(report(2, 1.0, pid=9), world_size=4)]
    new = dict(report(0, 5.0, pid=17), started=4.0)
    assert active_reports(old, {("h", 7), ("h", 8), ("h", 9)}) == []
    assert [b["pid"] for b in active_reports([new, old[1], old[2]], {("h", 7)})] == [17, 8]  # rank 2: world 2 now


def test_the_culprit_is_the_stopped_process_else_the_one_behind():
    ranks = [report(0, 100.0, step=12), report(1, 101.0, step=12), report(2, 90.0, step=11)]
    assert pick_culprit(ranks, {0: "S", 1: "T", 2: "S"})["rank"] == 1  # stopped, although not the oldest report
    assert pick_culprit(ranks, {0: "S", 1: "D", 2: "S"})["rank"] == 1  # stuck in the kernel (a hung filesystem)
    assert pick_culprit(ranks, {0: "S", 1: "S", 2: "S"})["rank"] == 2  # behind the others


def test_stragglers_are_ranks_waiting_for_data_longer_than_the_median():
    ranks = [report(0, 1, data_s=0.02), report(1, 1, data_s=0.30), report(2, 1, data_s=0.03)]
    slow = stragglers(ranks, fraction=0.2)  # median step 0.5 s: more than 0.1 s above the median wait
    assert list(slow) == [1] and "waits 0.300 s per step" in slow[1]
    assert stragglers(ranks[:1], 0.2) == {} and stragglers([report(0, 1), report(1, 1)], 0.2) == {}


def test_data_counters_are_summed_over_ranks():
    ranks = [report(0, 1, data={"read_retries": 2, "dropped_samples": 5}), report(1, 1, data={"read_retries": 1})]
    totals = data_totals(ranks)
    assert totals["read_retries"] == 3 and totals["read_failures"] == 0 and "dropped_samples" not in totals


def test_heartbeat_reports_progress_phases_and_step_time(tmp_path, monkeypatch):
    path = heartbeat_path(tmp_path, 1)
    beat = Heartbeat(path, {"rank": 1, "world_size": 2}, min_interval_s=60).for_run(last_step=30, every_steps=10)
    first = json.loads(path.read_text())
    assert first["phase"] == "start" and first["rank"] == 1 and first["step"] == 0
    beat.saved()  # the step-0 save before the first step: still the start
    assert json.loads(path.read_text())["phase"] == "start"
    clock = [100.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    for step in range(1, 10):
        clock[0] += 1.0  # one second a step
        beat.step(step, 0.25, Counter(read_retries=step))
    record = json.loads(path.read_text())
    assert record["phase"] == "step" and record["step"] == 1  # one write a minute while the phase stays
    clock[0] += 1.0
    beat.step(10, 0.25, Counter(read_retries=10))  # a save follows step 10: said at once, before it starts
    record = json.loads(path.read_text())
    assert (record["phase"], record["step"], record["data"]) == ("checkpoint", 10, {"read_retries": 10})
    assert record["step_s"] == 1.0 and record["data_s"] == 0.25
    clock[0] += 100.0  # a long save: not a step
    beat.saved()
    clock[0] += 1.0
    beat.step(11, 0.25, Counter())
    assert beat.record["step_s"] == 1.0  # the 100 s save between steps 10 and 11 is not a step
    beat.busy("switch")
    assert json.loads(path.read_text())["phase"] == "switch"
    beat.end()
    assert [b["phase"] for b in read_heartbeats(tmp_path)] == ["done"]
    Heartbeat(None).for_run(10, 5).step(1, 0.0, Counter())  # no watchdog: nothing written, nothing fails


def test_heartbeat_goes_on_when_the_disk_is_full(tmp_path, monkeypatch, capsys):
    """A full disk refuses the new file of an atomic replace: the record is rewritten in place (no new block), so a
    training group is not taken for hung; a rank that cannot write at all trains on."""
    import errno

    path = heartbeat_path(tmp_path, 0)
    beat = Heartbeat(path, {"rank": 0}, min_interval_s=0.0).for_run(100, 50)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "replace", full)
    beat.step(1, 0.0, Counter())
    assert json.loads(path.read_text())["step"] == 1 and list(path.parent.iterdir()) == [path]  # no temp file left
    path.unlink()
    path.mkdir()  # not even in place now (a chmod would not stop root)
    beat.step(2, 0.0, Counter())
    beat.step(3, 0.0, Counter())
    assert capsys.readouterr().err.count("warning: cannot write the heartbeat") == 1  # said once; training goes on


RANK_SCRIPT = """
import os, sys, time
from pathlib import Path
from cluster.watchdog import install_stack_dump
from pretrain.heartbeat import Heartbeat, heartbeat_path
run_dir, rank, fd = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
stacks = install_stack_dump(run_dir, rank)
beat = Heartbeat(heartbeat_path(run_dir, rank), {"rank": rank, "world_size": 2, "host": sys.argv[4]},
                 min_interval_s=0.0).for_run(10**9, 10**9)

def collective(step):  # rank 0 sends, rank 1 waits for it: like ranks in an all-reduce
    if rank == 0:
        os.write(fd, b".")
    else:
        os.read(fd, 1)

for step in range(1, 10**9):
    collective(step)
    beat.step(step, 0.001, {})
    time.sleep(0.02)
"""


def _wait_for(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {timeout_s} s")
        time.sleep(0.1)


def test_watchdog_dumps_stacks_and_kills_the_stopped_rank(tmp_path):
    """Real processes: rank 0 stopped with SIGSTOP holds rank 1 in its "collective"; the watchdog finds the group
    hung, dumps both stacks (rank 0's from where it stopped), kills rank 0 only, and notes the resume."""
    host = socket.gethostname()
    read_fd, write_fd = os.pipe()
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RANK_SCRIPT, str(tmp_path), str(rank), str(fd), host],
            pass_fds=(fd,),
            env=env,
            cwd=ROOT,
        )
        for rank, fd in ((0, write_fd), (1, read_fd))
    ]
    spec = HangSpec(floor_s=1.0, factor=1.0, poll_s=0.2)
    try:
        _wait_for(lambda: all(b.get("step", 0) > 5 for b in read_heartbeats(tmp_path)) and
                  len(read_heartbeats(tmp_path)) == 2, 60, "progress from both ranks")  # fmt: skip
        watchdog = Watchdog(tmp_path, spec, Tracker(None, None, enabled=False))
        watchdog._seen.retired.clear()  # these two started before it: here they are the job's own ranks
        assert not watchdog.poll(time.time()).hung
        procs[0].send_signal(signal.SIGSTOP)
        _wait_for(lambda: process_state(procs[0].pid) == "T", 10, "stopped state")
        stopped_at = time.time()
        _wait_for(lambda: watchdog.poll(time.time()).hung, 30, "hang verdict")
        assert procs[0].wait(timeout=30) == -signal.SIGKILL
        assert procs[1].poll() is None  # the rank that only waited is left to Ray's restart of the group
        hung = [e for e in watchdog.events if e["event"] == "hung"]
        assert len(hung) == 1 and hung[0]["rank"] == 0 and hung[0]["state"] == "T", watchdog.events
        assert "stopped" in hung[0]["text"] and hung[0]["time"] - stopped_at < 10
        stack = (tmp_path / "stacks" / "rank0.txt").read_text()
        assert "watchdog: no progress" in stack and "process state T" in stack
        assert re.search(r'File ".*", line \d+ in (collective|<module>)', stack), stack  # where it was
        assert "line" in (tmp_path / "stacks" / "rank1.txt").read_text()  # the waiting rank's stack too
        assert json.loads((tmp_path / EVENTS_FILE).read_text().splitlines()[0])["event"] == "hung"
        assert not watchdog.poll(time.time()).hung  # the retired processes no longer count
        # A new attempt of the group reports a step: training resumed, said once.
        Heartbeat(heartbeat_path(tmp_path, 0), {"rank": 0, "world_size": 2, "host": host}).step(11, 0.0, {})
        watchdog.poll(time.time())
        assert [e["event"] for e in watchdog.events] == ["hung", "resumed"]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_watchdog_logs_data_counters_and_stragglers_to_mlflow(tmp_path, mlflow_uri):
    from mlflow import MlflowClient

    from tracking.runs import create_run

    uri = mlflow_uri
    run_id = create_run(uri, "watchdog", "test", {}, {})
    for rank in range(3):
        Heartbeat(heartbeat_path(tmp_path / "run", rank), {"rank": rank, "world_size": 3, "host": "h"})
    watchdog = Watchdog(tmp_path / "run", HangSpec(straggler_polls=2), Tracker(uri, run_id, rank=0))
    watchdog._seen.retired.clear()
    for step in (5, 6, 7):
        for rank, (wait, retries) in enumerate(((0.01, 2), (0.40, 1), (0.02, 0))):
            record = report(rank, time.time(), step=step, data_s=wait, world_size=3, pid=1,
                            data={"read_retries": retries * step, "truncated_shards": 0})  # fmt: skip
            heartbeat_path(tmp_path / "run", rank).write_text(json.dumps(record))
        watchdog.poll(time.time())
    watchdog.tracker.close()
    client = MlflowClient(tracking_uri=uri)
    history = client.get_metric_history(run_id, "data/read_retries")
    assert [(m.step, m.value) for m in history] == [(5, 15), (6, 18), (7, 21)]
    run = client.get_run(run_id)
    assert run.data.tags["vitscale.stragglers"].startswith("rank 1: waits 0.400 s per step")
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "cluster/stragglers")] == [(6, 1)]


@pytest.fixture
def ray_auth_off():
    from cluster.local_head import ray_auth_mode

    with ray_auth_mode("disabled"):
        yield


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_driver_restarts_a_stopped_rank_from_the_newest_checkpoint(tmp_path, monkeypatch, local_demo_data,
                                                                   ray_auth_off, mlflow_uri):  # fmt: skip
    """The local profile's settings (2 CPU workers, ZeRO-2, the default hang allowances): rank 1 stops itself with
    SIGSTOP right after checkpoint step 10. The watchdog kills it, Ray Train restarts the group, which resumes from
    step 10 and finishes: one MLflow run, every step's loss once, the hang in the run's tags."""
    import ray
    from mlflow import MlflowClient

    from cluster.driver import FaultInjection, JobSpec, run_job
    from cluster.plan import build_plan, resolve_config

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    uri = mlflow_uri
    base = load_profile("local")
    profile = dataclasses.replace(
        base,
        storage=dataclasses.replace(
            base.storage, shards=str(local_demo_data), checkpoints=str(tmp_path / "runs"), mlflow_tracking_uri=uri
        ),  # fmt: skip
    )
    sets = ["schedule.total=30", "schedule.warmup=3", "checkpoint.every_steps=10", "logging.progress_bar=false",
            "logging.log_every=1", "evals.suite=null"]  # fmt: skip
    config = resolve_config(profile, "local_demo", sets, "hang")
    plan = build_plan(profile, config)
    fault = FaultInjection(rank=1, after_step=10, delay_s=0.0, kind="stop")
    spec = JobSpec.from_json(
        JobSpec(profile, config, plan.to_dict(), fault, {"vitscale.recipe": "local_demo"}).to_json()
    )
    ray.init(address="local", num_cpus=3, include_dashboard=False, object_store_memory=100 * 1024**2)
    try:
        rc = run_job(spec)
    finally:
        ray.shutdown()

    run_dir = Path(config.checkpoint.dir)
    assert rc == 0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "FINISHED" and summary["restarts"] == 1
    assert summary["train_result"]["steps"] == 30 and summary["train_result"]["start_step"] == 10
    marker = (run_dir / ".fault_injected").read_text()
    assert "stopped (SIGSTOP)" in marker, marker
    stopped_at = float(re.search(r" at (\d+\.\d+)", marker).group(1))
    events = [json.loads(line) for line in (run_dir / EVENTS_FILE).read_text().splitlines()]
    assert [e["event"] for e in events] == ["hung", "resumed"], events
    hung, resumed = events
    assert hung["rank"] == 1 and hung["state"] == "T" and "stopped" in hung["text"]
    lost = resumed["time"] - stopped_at
    print(f"SIGSTOP at step 10 -> hang declared after {hung['time'] - stopped_at:.0f} s, training resumed (step "
          f"{resumed['step']}) after {lost:.0f} s")  # fmt: skip
    assert resumed["step"] > 10 and lost < 120
    assert "watchdog: no progress" in (run_dir / "stacks" / "rank1.txt").read_text()

    client = MlflowClient(tracking_uri=uri)
    runs = client.search_runs([client.get_experiment_by_name("local_demo").experiment_id])
    assert len(runs) == 1
    run = runs[0]
    assert run.info.status == "FINISHED" and run.data.tags["vitscale.restarts"] == "1"
    assert run.data.tags["vitscale.hangs"] == "1" and "rank 1" in run.data.tags["vitscale.last_hang"]
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "train/loss")) == list(range(1, 31))
