"""A hung rank is found in minutes, not at the collective timeout.

Fast tests of the watchdog's decisions (allowances per phase, a save's from the saves measured, the plan's start and
first-save allowances, the group rule, the culprit, stragglers, the data counters, which worker errors are final), of
the heartbeat a rank writes, and of the watchdog acting on real processes: two Python processes coupled like ranks in
a collective (the second reads what the first writes each step), the first stopped with SIGSTOP. One end-to-end test
runs the real Ray driver with a 2-worker CPU profile and a rank that SIGSTOPs itself after a checkpoint: the job goes
on from that checkpoint within 2 minutes of the stop, in one MLflow run; then a save into a full disk ends it at once,
not restarted.
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

from cluster.driver.job import refuse_without_efa
from cluster.driver.watchdog import (
    EVENTS_FILE,
    Watchdog,
    active_reports,
    allowance,
    assess,
    data_totals,
    final_failure,
    pick_culprit,
    process_state,
    save_bound,
    step_bound,
    stragglers,
)
from cluster.network import EfaMissingError
from cluster.profiles import HangSpec, load_profile
from pretrain.checkpoint.writes import CheckpointSaveError
from pretrain.telemetry.heartbeat import Heartbeat, heartbeat_path, read_heartbeats
from tracking.tracker import Tracker

ROOT = Path(__file__).resolve().parents[2]
SPEC = HangSpec(floor_s=30, factor=10, startup_s=600, checkpoint_s=300)


def report(rank: int, t: float, phase: str = "step", step: int = 10, **kw) -> dict:
    return {
        "rank": rank,
        "world_size": 2,
        "pid": 1000 + rank,
        "host": "h",
        "started": 0.0,
        "time": t,
        "phase": phase,
        "step": step,
        "step_s": 0.5,
        "data_s": 0.01,
        **kw,
    }


def test_allowance_per_phase_and_step_time():
    assert step_bound(SPEC, 0.5) == 30 and step_bound(SPEC, 5.0) == 50 and step_bound(SPEC, None) == 30
    assert allowance(SPEC, "start", 0.5) == 600  # engine build, resume, step-0 save, first batch
    assert allowance(SPEC, "checkpoint", 0.5) == 300 and allowance(SPEC, "switch", 0.5) == 300
    assert allowance(SPEC, "checkpoint", 40.0) == 400  # never shorter than the training bound
    assert allowance(SPEC, "step", 0.5) == 30


def test_a_save_is_allowed_factor_times_the_longest_save_measured_at_least_the_save_floor():
    assert SPEC.save_floor_s == 60 and SPEC.checkpoint_s == 300
    assert save_bound(SPEC, None) == 300  # nothing measured yet: the first save's allowance (the plan's, in a job)
    assert save_bound(SPEC, 2.0) == 60 and save_bound(SPEC, 20.0) == 200  # max(60, 10 x the longest save)
    assert allowance(SPEC, "checkpoint", 0.5, save_s=2.0) == 60 and allowance(SPEC, "checkpoint", 0.5, 45.0) == 450
    assert allowance(SPEC, "checkpoint", 8.0, save_s=2.0) == 80  # never shorter than the training bound
    assert allowance(SPEC, "switch", 0.5, save_s=2.0) == 300  # a switch rebuilds the engine: not a save
    assert allowance(SPEC, "start", 0.5, save_s=2.0) == 600
    now = 10_000.0
    saving = [report(0, now - 70, "checkpoint", save_s=3.0), report(1, now - 65, "checkpoint", save_s=5.0)]
    verdict = assess(saving, now, SPEC)  # rank 1's 5 s save is the longest: 50 s, the floor 60 s applies
    assert verdict.hung and verdict.bound_s == 60 and "max(save floor 60 s, 10 x longest save 5.00 s)" in verdict.why
    first = [report(0, now - 70, "checkpoint"), report(1, now - 65, "checkpoint")]
    verdict = assess(first, now, SPEC)
    assert not verdict.hung and verdict.bound_s == 300 and "before a save is measured" in verdict.why


def test_a_failed_save_is_the_final_worker_error_others_are_retried():
    full = CheckpointSaveError("checkpoint step_00000030 was not saved: no space left on device writing x")
    assert final_failure({0: RuntimeError("gloo: connection reset"), 1: full}) == (1, full)
    assert final_failure({0: RuntimeError("a worker died"), 1: OSError("EIO")}) is None
    assert final_failure({}) is None


def test_a_worker_without_efa_stops_with_a_final_error(tmp_path):
    """A multi-node EFA profile's worker where NCCL would silently train over TCP: the reason, the node and the fix,
    in an error no restart is spent on (the same image and devices would fail again)."""
    (tmp_path / "infiniband").mkdir()
    with pytest.raises(EfaMissingError) as refused:
        refuse_without_efa(tmp_path / "infiniband")
    why = str(refused.value)
    assert why.startswith(f"the profile's network is EFA, but on {socket.gethostname()}: no EFA device in this ")
    assert why.endswith("or set network.kind: sockets to train over TCP knowingly (docs/network.md)"), why
    assert final_failure({0: RuntimeError("a worker died"), 1: refused.value}) == (1, refused.value)


@pytest.mark.timeout(120)
def test_the_plan_gives_the_start_and_first_save_allowances_term_by_term(tmp_path):
    """a100x64 with ViT-H/14: the estimate (2 x 232 s) is below the profile's 600 s, which applies; on storage 5x
    slower the checkpoint's write decides both allowances; local keeps its floors. The job's watchdog gets them."""
    from cluster.driver.job import JobSpec, job_hang
    from cluster.plan.planner import build_plan, resolve_config
    from cluster.plan.text import format_plan

    big = load_profile("a100x64")
    config = resolve_config(big, "vit_h14_i21k", [], "h14")
    plan = build_plan(big, config)
    a, params = plan.startup, plan.model.num_params
    write_s = params * 20 / 100e6  # 20 bytes a parameter at hang.write_mb_per_s = 100
    manifest_s = plan.data.num_shards * 128 / 100e6 + plan.data.num_shards * 0.10 / 4700  # cluster.plan.startup
    expected = {
        "process start": 60.0,
        "manifest": manifest_s,
        "model and engine": 60 * params / 1e9,
        "checkpoint": write_s,
    }
    assert dict(a.terms) == pytest.approx(expected)
    assert a.estimate_s == pytest.approx(60 + manifest_s + 60 * params / 1e9 + write_s) and a.estimate_s < 300
    assert (a.startup_s, a.first_save_s) == (600, 300)  # the profile's floors
    assert (
        "  hang watchdog start 600 s = max(hang.startup_s 600, 2 x (process start 60 + manifest 0.0932 + model and "
        "engine 39.6 + checkpoint 132 = 232 s)); first save 300 s = max(hang.checkpoint_s 300, 2 x 132 s); a "
        "checkpoint of 13.2 GB at 100 MB/s (hang.write_mb_per_s); a manifest of 4134 shards, 0.53 MB at 100 MB/s "
        "(storage.read_mb_per_s)"
    ) in format_plan(plan).splitlines()
    slow = dataclasses.replace(big, hang=dataclasses.replace(big.hang, write_mb_per_s=20.0))
    plan = build_plan(slow, config)
    assert plan.startup.startup_s == pytest.approx(2 * (60 + manifest_s + 60 * params / 1e9 + 5 * write_s))
    assert plan.startup.first_save_s == pytest.approx(2 * 5 * write_s)
    assert f"hang watchdog start {plan.startup.startup_s:.0f} s = max(hang.startup_s 600, 2 x (" in format_plan(plan)
    hang = job_hang(JobSpec.from_json(JobSpec(slow, config, plan.to_dict()).to_json()))  # what the driver runs with
    assert (hang.startup_s, hang.checkpoint_s) == (plan.startup.startup_s, plan.startup.first_save_s)
    assert (hang.save_floor_s, hang.factor) == (60, 10)

    local = load_profile("local")
    storage = dataclasses.replace(local.storage, shards=str(tmp_path / "data"), checkpoints=str(tmp_path / "runs"))
    local = dataclasses.replace(local, storage=storage)
    plan = build_plan(local, resolve_config(local, "local_demo", [], "demo"))
    assert [name for name, _ in plan.startup.terms] == ["process start", "manifest", "model and engine", "checkpoint"]
    assert (plan.startup.startup_s, plan.startup.first_save_s) == (600, 300)
    line = next(x for x in format_plan(plan).splitlines() if x.startswith("  hang watchdog"))
    start = "  hang watchdog start 600 s = max(hang.startup_s 600, 2 x (process start 60 + manifest "
    assert line.startswith(start) and "first save 300 s = max(hang.checkpoint_s 300, 2 x " in line, line


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
    assert "save_s" not in record  # no save measured yet
    clock[0] += 100.0  # a long save: not a step
    beat.saved()
    assert json.loads(path.read_text())["save_s"] == 100.0  # the save, from its report to the one after it
    clock[0] += 1.0
    beat.step(11, 0.25, Counter())
    assert beat.record["step_s"] == 1.0  # the 100 s save between steps 10 and 11 is not a step
    for step in range(12, 21):
        clock[0] += 1.0
        beat.step(step, 0.25, Counter())
    clock[0] += 40.0  # a shorter save: the longest of the attempt stays
    beat.saved()
    assert beat.record["save_s"] == 100.0
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
from cluster.driver.watchdog import install_stack_dump
from pretrain.telemetry.heartbeat import Heartbeat, heartbeat_path
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
        _wait_for(
            lambda: (
                all(b.get("step", 0) > 5 for b in read_heartbeats(tmp_path)) and len(read_heartbeats(tmp_path)) == 2
            ),
            60,
            "progress from both ranks",
        )
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
            record = report(
                rank,
                time.time(),
                step=step,
                data_s=wait,
                world_size=3,
                pid=1,
                data={"read_retries": retries * step, "truncated_shards": 0},
            )
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
def test_driver_restarts_a_stopped_rank_and_ends_at_a_full_disk_without_a_restart(
    tmp_path, monkeypatch, capsys, local_demo_data, ray_auth_off, mlflow_uri
):
    """The local profile's settings (2 CPU workers, ZeRO-2, the default hang allowances) with max_failures=2: rank 1
    stops itself with SIGSTOP right after checkpoint step 10. The watchdog kills it, Ray Train restarts the group,
    which resumes from step 10. Then the disk "fills" (every save after step 20 fails on rank 1 with ENOSPC, in every
    attempt): the step-30 save fails, and the job fails at once with the save's message, in the log and the MLflow
    run, although max_failures allows a second restart (which would only save into the same full disk)."""
    import ray
    from mlflow import MlflowClient

    from cluster.driver.job import FaultInjection, JobSpec, run_job
    from cluster.local_head import own_ray
    from cluster.plan.planner import build_plan, resolve_config
    from pretrain.checkpoint.run_folder import complete_checkpoints, world_size_history
    from tracking.keys import FAILURE

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    uri = mlflow_uri
    base = load_profile("local")
    profile = dataclasses.replace(
        base,
        storage=dataclasses.replace(
            base.storage, shards=str(local_demo_data), checkpoints=str(tmp_path / "runs"), mlflow_tracking_uri=uri
        ),
        max_failures=2,
    )
    sets = [
        "schedule.total=30",
        "schedule.warmup=3",
        "checkpoint.every_steps=10",
        "logging.progress_bar=false",
        "logging.log_every=1",
        "evals.suite=null",
    ]
    config = resolve_config(profile, "local_demo", sets, "hang")
    plan = build_plan(profile, config)
    fault = FaultInjection(rank=1, after_step=10, delay_s=0.0, kind="stop", full_disk_after=20)
    spec = JobSpec.from_json(
        JobSpec(profile, config, plan.to_dict(), fault, {"vitscale.recipe": "local_demo"}).to_json()
    )
    own = {"worker_process_setup_hook": own_ray}  # Ray Train's cleaner asks this Ray, not another test's
    ray.init(address="local", num_cpus=3, include_dashboard=False, object_store_memory=100 * 1024**2, runtime_env=own)
    try:
        rc = run_job(spec)
    finally:
        ray.shutdown()

    run_dir = Path(config.checkpoint.dir)
    assert rc == 1
    summary = json.loads((run_dir / "summary.json").read_text())
    # Two starts of the group: at step 0, and from checkpoint 10 after the hang; none after the failed save.
    assert summary["status"] == "FAILED" and summary["restarts"] == 1
    assert [start["step"] for start in world_size_history(run_dir)] == [0, 10]
    assert [p.name for p in complete_checkpoints(run_dir)][-2:] == ["step_00000010", "step_00000020"]
    assert not list((run_dir / "checkpoints").glob("*.tmp"))  # the failed save's partial files are gone
    marker = (run_dir / ".fault_injected").read_text()
    assert "stopped (SIGSTOP)" in marker, marker
    stopped_at = float(re.search(r" at (\d+\.\d+)", marker).group(1))
    events = [json.loads(line) for line in (run_dir / EVENTS_FILE).read_text().splitlines()]
    assert [e["event"] for e in events] == ["hung", "resumed"], events
    hung, resumed = events
    assert hung["rank"] == 1 and hung["state"] == "T" and "stopped" in hung["text"]
    lost = resumed["time"] - stopped_at
    print(
        f"SIGSTOP at step 10 -> hang declared after {hung['time'] - stopped_at:.0f} s, training resumed (step "
        f"{resumed['step']}) after {lost:.0f} s"
    )
    assert resumed["step"] > 10 and lost < 120
    assert "watchdog: no progress" in (run_dir / "stacks" / "rank1.txt").read_text()
    # The driver says why in one line: the save's own message, which names the disk as full.
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("training failed: ")]
    assert len(said) == 1, said
    why = said[0].removeprefix("training failed: ")
    assert why.startswith("checkpoint step_00000030 was not saved: no space left on device writing "), why
    assert "(rank 1: OSError: [Errno 28] No space left on device)" in why and "(newest: step_00000020)" in why, why
    assert why.endswith("(checkpoint.on_save_error: stop) (not restarted: a restart would fail the same way)"), why

    client = MlflowClient(tracking_uri=uri)
    runs = client.search_runs([client.get_experiment_by_name("local_demo").experiment_id])
    assert len(runs) == 1
    run = runs[0]
    assert run.info.status == "FAILED" and run.data.tags["vitscale.restarts"] == "1"
    assert run.data.tags[FAILURE] == why
    assert run.data.tags["vitscale.hangs"] == "1" and "rank 1" in run.data.tags["vitscale.last_hang"]
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "train/loss")) == list(range(1, 31))
