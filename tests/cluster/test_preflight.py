"""cluster.preflight: the verdicts and the bus-bandwidth formula on their own; then the real preflight on a local Ray
head of the test's own (token auth, every check real, gloo on CPU) passing, failing with the check and its fix
named, and refusing bad input; and the node checks on both nodes of a simulated 2-node cluster, EFA's included."""

from __future__ import annotations

import dataclasses
import logging
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from cluster import local_head
from cluster.local_head import free_port
from cluster.network import efa_missing, needs_efa
from cluster.plan.planner import build_plan, resolve_config
from cluster.preflight import __main__ as preflight
from cluster.preflight.checks import (
    NODE_CHECKS,
    Check,
    Measurements,
    Node,
    NodeFigures,
    _gpu_check,
    _loader_check,
    judge,
    measure,
)
from cluster.preflight.collective import BusBandwidth, bus_gb_per_s, worker_bundle
from cluster.preflight.node import Figure, GpuInventory, parse_nvidia_smi
from cluster.profiles import load_profile

ROOT = Path(__file__).resolve().parents[2]
CHECKS = ("nodes", "gpus", "efa", "shard read", "loader", "checkpoint space", "tracking", "clock", "collective")
STOP_GRACE_S = 2.0  # local_head.stop_head's cap on the SIGTERM-to-SIGKILL wait at the end of a test (default: 10 s)


# The simulated cluster's head without what no preflight check uses, each a process started for nothing on the two
# cores: the autoscaler's monitor, the log monitor (the driver takes no worker logs: log_to_driver=False), and the
# idle workers Ray prestarts for the first driver (the probes and ranks carry a runtime_env: they never take one).
LEAN_HEAD = dict(no_monitor=True, include_log_monitor=False, _system_config={"prestart_worker_first_driver": False})


def _profile_file(path: Path, replacements: dict[str, str]) -> Path:
    """local.yaml with each ``key: ...`` line named in ``replacements`` rewritten to ``key: value``."""
    text = (ROOT / "cluster/profiles/local.yaml").read_text()
    for key, value in replacements.items():
        text, n = re.subn(rf"^(\s*){key}: .*$", rf"\g<1>{key}: {value}", text, count=1, flags=re.MULTILINE)
        assert n == 1, key
    path.write_text(text)
    return path


def _name(line: str) -> str | None:
    """The check a printed line is about, None for any other line."""
    return next((name for name in CHECKS if line.startswith(f"{name} ")), None)


def test_bus_bandwidth_is_nccl_tests_busbw():
    assert bus_gb_per_s(10**9, 1.0, 2) == pytest.approx(1.0)  # 2(n-1)/n = 1 for two ranks
    assert bus_gb_per_s(10**9, 0.5, 8) == pytest.approx(2 * 1.75)


def test_nvidia_smi_inventory_and_the_gpu_verdicts():
    """nvidia-smi's CSV (MiB) becomes GB of 1e9 bytes; a training node passes with the profile's GPUs and fails one
    short, with too little memory or of another kind; a CPU profile needs none."""
    inv = parse_nvidia_smi("NVIDIA A100-SXM4-80GB, 81920, 535.104.05\nNVIDIA A100-SXM4-80GB, 81920, 535.104.05\n")
    assert (inv.count, inv.driver, round(inv.memory_gb[0], 1)) == (2, "535.104.05", 85.9)
    gpu = load_profile("a100x8")
    node = Node("n" * 32, "10.0.0.1", {"CPU": 96, "GPU": 8})
    eight = dataclasses.replace(inv, count=8, names=inv.names * 4, memory_gb=inv.memory_gb * 4)
    figures = NodeFigures(eight, *(Figure(1.0, ""),) * 4)

    def verdict(inventory: GpuInventory, profile=gpu) -> Check:
        return _gpu_check(node, dataclasses.replace(figures, gpus=inventory), profile, None, None)

    assert verdict(eight).passed
    assert not verdict(dataclasses.replace(eight, count=7, names=eight.names[:7])).passed
    assert not verdict(dataclasses.replace(eight, memory_gb=(40.0,) * 8)).passed
    assert not verdict(dataclasses.replace(eight, names=("NVIDIA A10G",) * 8)).passed
    line = verdict(GpuInventory(0)).line()
    assert line.startswith("gpus") and "0 GPUs vs 8 x A100-SXM4-80GB" in line and "FAIL; fix: " in line
    assert verdict(GpuInventory(0), load_profile("local")).passed  # CPU workers need none


def test_efa_is_checked_on_each_training_node_of_a_multi_node_efa_profile(tmp_path):
    """On a100x64 (EFA between 8 nodes) a training node fails without a uverbs device, with the reason a worker would
    refuse to start for and the fix, and passes where the probe found EFA; a node no worker fits on, and profiles whose
    ranks reach no other node over EFA (local: sockets; EFA on one node), need none."""
    efa = load_profile("a100x64")
    assert needs_efa(efa)
    training = Node("n" * 32, "10.0.0.1", {**worker_bundle(efa), "CPU": 96})
    evals_only = Node("e" * 32, "10.0.0.9", {"CPU": 8})
    check = dict(NODE_CHECKS)["efa"]  # what judge() runs on each node

    def verdict(problem: str | None, profile=efa, node=training) -> Check:
        figures = NodeFigures(GpuInventory(0), *(Figure(1.0, ""),) * 4, efa_missing=problem)
        return check(node, figures, profile, None, None)

    devices = tmp_path / "infiniband"
    devices.mkdir()
    missing = verdict(efa_missing(devices))
    assert not missing.passed
    assert missing.line() == (
        f"efa               10.0.0.1/nnnnnn   no EFA device in this container ({devices}/uverbs* missing) vs "
        "/dev/infiniband/uverbs* and libnccl-net.so loading (network.kind efa on 8 nodes): FAIL; fix: run the image "
        "./Dockerfile builds (libfabric, aws-ofi-nccl) with the nodes' EFA devices, as cluster.render's files do, or "
        "set network.kind: sockets to train over TCP knowingly (docs/network.md)"
    )
    assert verdict(None).passed and "/dev/infiniband/uverbs* present, libnccl-net.so loads vs" in verdict(None).line()
    elsewhere = verdict("no EFA device", node=evals_only).line()
    assert elsewhere.endswith("not checked vs none (no training worker fits here): PASS")
    assert verdict(None, load_profile("local")).line().endswith("not checked vs none (network.kind sockets): PASS")
    one_node = dataclasses.replace(efa, hardware=dataclasses.replace(efa.hardware, nodes=1))
    assert verdict(None, one_node).passed and "one node" in verdict(None, one_node).line()


def test_a_slower_loader_fails_only_where_the_run_would_wait_for_data():
    """On a100x8 (the plan: 700 images/s per core declared, no data wait), half the rate still feeds the GPUs; a
    tenth makes half of each step a wait for data: FAIL, with the fix."""
    profile = load_profile("a100x8")
    config = resolve_config(profile, "vit_b16_i21k", [], "preflight")
    plan = build_plan(profile, config)
    node = Node("n" * 32, "10.0.0.1", {"CPU": 96, "GPU": 8})

    def verdict(rate: float) -> Check:
        figures = NodeFigures(GpuInventory(0), *(Figure(1.0, ""),) * 4)
        figures = dataclasses.replace(figures, loader_img_s_per_core=Figure(rate, "one core"))
        return _loader_check(node, figures, profile, config, plan)

    assert verdict(700).passed and verdict(350).passed
    slow = verdict(70)
    assert not slow.passed and "data wait 53%" in slow.line() and "fix: more loader cores" in slow.line()


def test_bad_input_exits_2_with_one_message(capsys, tmp_path):
    """An unknown profile, and a remote profile whose Ray cluster does not answer: exit 2, one error, no traceback."""
    assert preflight.main(["--cluster", "no_such_profile"]) == 2
    err = capsys.readouterr().err
    assert (
        err.startswith("python -m cluster.preflight: error: unknown cluster profile 'no_such_profile'")
        and "Traceback" not in err
    )
    remote = tmp_path / "remote.yaml"
    address = f"http://127.0.0.1:{free_port()}"
    remote.write_text((ROOT / "cluster/profiles/a100x8.yaml").read_text().replace("http://127.0.0.1:8265", address))
    assert preflight.main(["--cluster", str(remote), "--recipe", "vit_b16_i21k"]) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "cannot reach the Ray Jobs API" in err and address in err


@pytest.fixture
def local_head_profile(monkeypatch, tmp_path, local_demo_data, mlflow_uri):
    """A `local` profile of the test's own: its Ray temp dir (short: Ray's socket paths), a test token, the
    local_demo shards generated for the run, checkpoints and MLflow under tmp_path; the head is stopped after."""
    token = tmp_path / "token"
    token.write_text("vitscale-preflight-test-token")
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(token))
    for var in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_ADDRESS", "RAY_API_SERVER_ADDRESS"):
        monkeypatch.delenv(var, raising=False)
    # Ray prestarts idle workers for each driver that joins (two here) and delays its ray.init by them (measured: about
    # 1 s each); the probes and ranks carry a runtime_env and never take one: none, on the head `ray start` begins.
    monkeypatch.setenv("RAY_prestart_worker_first_driver", "0")
    temp_dir = tempfile.mkdtemp(prefix="vsp", dir="/tmp")
    replacements = {
        "temp_dir": f'"{temp_dir}"',
        "dashboard_port": str(free_port()),
        "shards": f'"{local_demo_data}"',
        "checkpoints": f'"{tmp_path / "runs"}"',
        "mlflow_tracking_uri": f'"{mlflow_uri}"',
    }
    path = _profile_file(tmp_path / "local_test.yaml", replacements)
    try:
        yield path, replacements
    finally:
        # stop_head KILLs at once what outlives SIGTERM (the GCS, the raylet, the monitor): about 1 s; the grace only
        # caps the wait for anything else that ignores SIGTERM.
        local_head.stop_head(load_profile(path), grace_s=STOP_GRACE_S)
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_local_preflight_passes_then_names_the_failing_checks(local_head_profile, tmp_path, capsys):
    """`python -m cluster.preflight` (what `make preflight` runs) on a real local head started for it: a line per
    check, each PASS, the plan at the measured figures, exit 0. Then, on the same head, checkpoints needing more space
    than the disk has and a tracking server that is down: exit 1, each failing check named with its fix."""
    path, replacements = local_head_profile
    cmd = [sys.executable, "-m", "cluster.preflight", "--cluster", str(path), "--recipe", "local_demo"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    checks = [line for line in lines if _name(line)]
    assert [_name(line) for line in checks] == list(CHECKS)  # one node: one line per check
    assert all(line.endswith(": PASS") for line in checks), "\n".join(checks)
    assert "busbw" in checks[-1] and "gloo all-reduce" in checks[-1] and "2 ranks on 1 node(s)" in checks[-1]
    assert "measured by the preflight on" in done.stdout  # the data wait at the measured loader rate
    assert "measured by the preflight: gloo all-reduce busbw" in done.stdout  # the communication at the measured busbw
    assert "efa " in checks[2] and "not checked vs none (network.kind sockets): PASS" in checks[2]
    assert lines[-1] == "preflight: 9 of 9 checks passed; every check passed"
    assert "Traceback" not in done.stderr

    down = f"http://127.0.0.1:{free_port()}"
    # One worker: this run is about the node checks that fail; the collective of 2 ranks was measured above on this
    # head, and with one rank it is not measured (a PASS: nothing is reduced), two rank processes fewer to start.
    failing = _profile_file(
        tmp_path / "down.yaml", {**replacements, "mlflow_tracking_uri": f'"{down}"', "num_workers": "1"}
    )
    argv = ["--cluster", str(failing), "--recipe", "local_demo", "--set", "checkpoint.keep_last=100000000"]
    assert preflight.main(argv) == 1
    out = capsys.readouterr().out
    failed = {_name(line): line for line in out.splitlines() if ": FAIL; fix: " in line}
    assert set(failed) == {"checkpoint space", "tracking"}, out
    assert "lower checkpoint.keep_last" in failed["checkpoint space"]
    assert down in failed["tracking"] and "start the tracking server" in failed["tracking"]
    assert "one rank: nothing is reduced vs no collective: PASS" in out
    assert out.splitlines()[-1] == "preflight: 7 of 9 checks passed; FAILED: checkpoint space, tracking"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_node_checks_run_on_both_nodes_of_a_two_node_cluster(monkeypatch, tmp_path, local_demo_data, mlflow_uri):
    """A simulated 2-node cluster (`local_head.in_process_cluster`, one CPU per node): every node check runs once on
    each node (the probes are pinned), the clocks agree, and the two ranks all-reduce across both nodes. The profile
    says EFA between the nodes: each node's probe finds what a training worker there would (on this machine no
    uverbs device: FAIL, with the fix), and every other check passes."""
    import ray

    from cluster.elastic_demo import NODE_ARGS

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    path = _profile_file(
        tmp_path / "two_nodes.yaml",
        {
            "nodes": "2",
            "num_workers": "2\n  placement_strategy: STRICT_SPREAD",
            "shards": f'"{local_demo_data}"',
            "checkpoints": f'"{tmp_path / "runs"}"',
            "mlflow_tracking_uri": f'"{mlflow_uri}"',
        },
    )
    profile = load_profile(path)
    # load_profile refuses EFA for gloo (CPU) ranks, which ignore it: set here, as on a GPU profile of 2 nodes
    profile = dataclasses.replace(profile, network=dataclasses.replace(profile.network, kind="efa"))
    assert needs_efa(profile)
    config = resolve_config(profile, "local_demo", [], "preflight")
    plan = build_plan(profile, config)
    temp_dir = tempfile.mkdtemp(prefix="vsp2", dir="/tmp")
    with local_head.ray_auth_mode("disabled"):
        cluster = local_head.in_process_cluster(**NODE_ARGS, **LEAN_HEAD, num_cpus=1, temp_dir=temp_dir)
        try:
            cluster.add_node(**NODE_ARGS, num_cpus=1, temp_dir=temp_dir)
            cluster.wait_for_nodes()
            ray.init(address=cluster.address, logging_level=logging.WARNING, log_to_driver=False)
            measured = measure(profile, config, plan)
        finally:
            ray.shutdown()
            cluster.shutdown()
            shutil.rmtree(temp_dir, ignore_errors=True)
    checks = judge(measured, profile, config, plan)
    labels = [node.label for node in measured.nodes]
    assert len(set(labels)) == 2
    for name in CHECKS[1:-1]:
        assert [c.node for c in checks if c.name == name] == labels, name
    efa, others = [c for c in checks if c.name == "efa"], [c for c in checks if c.name != "efa"]
    problem = efa_missing()  # both "nodes" are this machine
    assert all(c.passed == (problem is None) for c in efa), "\n".join(c.line() for c in efa)
    assert problem is None or all(c.measured == problem and "set network.kind: sockets" in c.fix for c in efa)
    assert all(c.passed for c in others), "\n".join(c.line() for c in others)
    assert measured.collective.nodes == 2 and measured.collective.gb_per_s > 0
    _assert_measurements_typed(measured)


def _assert_measurements_typed(measured: Measurements) -> None:
    for figures in measured.figures.values():
        assert figures is not None and figures.read_mb_per_s.value > 0 and figures.loader_img_s_per_core.value > 0
    assert isinstance(measured.collective, BusBandwidth)
