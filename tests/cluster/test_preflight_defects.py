"""cluster.preflight: the GPU kind as the profile names it, and the run's own tracking store and run folder."""

from __future__ import annotations

import dataclasses
import os
import time

import pytest

from cluster.local_head import free_port
from cluster.plan.checkpoint_costs import pinned_beyond_kept
from cluster.plan.evals.cadence import EvalCadence
from cluster.plan.planner import build_plan, resolve_config
from cluster.preflight.checks import NODE_CHECKS, Node, _request, read_streams
from cluster.preflight.node import (
    Figure,
    GpuInventory,
    NodeFigures,
    NodeProbe,
    _guarded,
    free_space,
    parse_nvidia_smi,
    read_rate,
    tracking_round_trip,
)
from cluster.profiles import load_profile

H100_SMI = "NVIDIA H100 80GB HBM3, 81559, 550.54.15\n" * 8
L40S_SMI = "NVIDIA L40S, 46068, 550.54.15\n" * 8


def _gpus(profile, smi: str):
    node = Node("n" * 32, "10.0.0.1", {"CPU": 96, "GPU": 8})
    figures = NodeFigures(parse_nvidia_smi(smi), *(Figure(1.0, ""),) * 4)
    return dict(NODE_CHECKS)["gpus"](node, figures, profile, None, None)


def _with_gpu(profile, gpu_type: str, memory_gb: float):
    return dataclasses.replace(
        profile, hardware=dataclasses.replace(profile.hardware, gpu_type=gpu_type, gpu_memory_gb=memory_gb)
    )


def test_gpu_kind_is_matched_as_the_planner_reads_gpu_type():
    """A gpu_type spelled as nvidia-smi and torch name the device ("NVIDIA H100 80GB HBM3", which the planner prices
    as an H100) passes on those GPUs; a profile of L4s fails on L40S nodes, another GPU (the planner's rule)."""
    h100 = load_profile("h100x8")
    assert _gpus(h100, H100_SMI).passed  # gpu_type H100-SXM5-80GB, as before
    assert _gpus(_with_gpu(h100, "NVIDIA H100 80GB HBM3", 80), H100_SMI).passed
    assert _gpus(_with_gpu(h100, "H100 SXM5", 80), H100_SMI).passed
    assert not _gpus(_with_gpu(h100, "H100-SXM5-80GB", 80), L40S_SMI).passed
    l4 = _gpus(_with_gpu(h100, "L4", 22), L40S_SMI)
    assert not l4.passed and "8 x NVIDIA L40S" in l4.line() and "8 x L4 " in l4.line()


def test_the_probes_check_the_runs_tracking_store_and_run_folder(tmp_path, mlflow_uri):
    """`--set logging.mlflow_tracking_uri=...` and `--set checkpoint.dir=...` (as `make launch` takes them) move the
    run's store and run folder off the profile's: each node writes where the run will, so a store the run cannot reach
    fails the tracking check even where the profile's store answers."""
    base = load_profile("a100x8")
    storage = dataclasses.replace(base.storage, mlflow_tracking_uri=mlflow_uri, checkpoints=str(tmp_path / "profile"))
    profile = dataclasses.replace(base, storage=storage)
    down = f"http://127.0.0.1:{free_port()}"
    run_dir = tmp_path / "elsewhere" / "my-run"
    sets = [f"logging.mlflow_tracking_uri={down}", f"checkpoint.dir={run_dir}"]
    config = resolve_config(profile, "vit_b16_i21k", sets, "preflight")
    plan = build_plan(profile, config)
    node = Node("n" * 32, "10.0.0.1", {"CPU": 96, "GPU": 8})
    request = _request(config, profile, (), 0, node)
    figures = NodeFigures(
        parse_nvidia_smi(""),
        Figure(1.0, ""),
        Figure(1.0, ""),
        _guarded(free_space, request.checkpoint_root),
        _guarded(tracking_round_trip, request.tracking_uri, request.label),
    )
    checks = {name: check(node, figures, profile, config, plan) for name, check in NODE_CHECKS}
    tracking = checks["tracking"]
    assert not tracking.passed and down in tracking.line() and mlflow_uri not in tracking.line()
    space = checks["checkpoint space"]
    assert str(run_dir.parent) in space.line() and str(tmp_path / "profile") not in space.line()
    assert not (tmp_path / "profile").exists()


def test_a_gpu_nvidia_smi_cannot_read_fails_the_gpus_check_alone(monkeypatch, tmp_path, local_demo_data, mlflow_uri):
    """nvidia-smi prints `[Unknown Error]` for a field it cannot read from a failing GPU (and exits 0): the node's
    gpus check fails naming it, and its other figures are still measured, not one "no answer" for every check."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    rows = "NVIDIA A100-SXM4-80GB, 81920, 535.104.05\\nNVIDIA A100-SXM4-80GB, [Unknown Error], 535.104.05\\n"
    smi.write_text(f"#!/bin/sh\nprintf '{rows}'\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    base = load_profile("local")
    storage = dataclasses.replace(
        base.storage, shards=str(local_demo_data), checkpoints=str(tmp_path / "runs"), mlflow_tracking_uri=mlflow_uri
    )
    profile = dataclasses.replace(base, storage=storage)
    config = resolve_config(profile, "local_demo", [], "preflight")
    node = Node("n" * 32, "10.0.0.1", {"CPU": 2})
    figures = NodeProbe().measure(_request(config, profile, (), 0, node))
    assert "[Unknown Error]" in figures.gpus.error
    assert figures.free_gb.value > 0 and figures.tracking_s.value is not None
    gpu = load_profile("a100x8")
    check = dict(NODE_CHECKS)["gpus"](Node("n" * 32, "10.0.0.1", {"CPU": 96, "GPU": 8}), figures, gpu, None, None)
    assert not check.passed and "GPU query failed (nvidia-smi: " in check.line()


@pytest.fixture
def per_stream_store(tmp_path):
    """A real HTTP object store on 127.0.0.1 serving 8 shards of 2 MB, each request (a stream) at most 1.5 MB/s, as
    an object store serves one GET a fraction of what a node reads over many: yields their URLs."""
    import http.server
    import threading

    rate, body = 1.5e6, os.urandom(2 * 10**6)

    class Throttled(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_HEAD(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Accept-Ranges", "bytes")
            self.end_headers()

        def do_GET(self) -> None:
            first, last = 0, len(body) - 1
            if spec := self.headers.get("Range"):
                start, _, end = spec.removeprefix("bytes=").partition("-")
                first, last = int(start), min(int(end or last), last)
            part = body[first : last + 1]
            self.send_response(206 if spec else 200)
            self.send_header("Content-Length", str(len(part)))
            self.send_header("Content-Range", f"bytes {first}-{last}/{len(body)}")
            self.end_headers()
            for i in range(0, len(part), 2**16):
                self.wfile.write(part[i : i + 2**16])
                time.sleep(2**16 / rate)

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Throttled)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield tuple(f"http://127.0.0.1:{server.server_address[1]}/shard-{i:06d}.tar" for i in range(8))
    finally:
        server.shutdown()


def test_the_read_check_reads_as_many_streams_at_once_as_the_nodes_loader_workers(per_stream_store):
    """An a100x8 node runs 8 ranks x 8 loader workers, each reading its own shard: a store that serves each stream
    1.5 MB/s but many at once feeds a node needing 5 MB/s, and the check measures it so (one sequential stream would
    read 1.5 MB/s and fail a good cluster). A node that holds no training worker reads no shard: no need there."""
    profile = load_profile("a100x8")
    config = resolve_config(profile, "vit_b16_i21k", [], "preflight")
    plan = build_plan(profile, config)
    plan = dataclasses.replace(plan, data=dataclasses.replace(plan.data, read_mb_per_s=5.0))
    assert read_streams(plan) == 8 * 8
    trainer = Node("n" * 32, "10.0.0.1", {"CPU": 96, "GPU": 8})
    request = _request(config, profile, per_stream_store, 0, trainer, read_streams(plan))
    figure = read_rate(request.shard_urls, request.read_budget_bytes, request.read_streams)
    check = dict(NODE_CHECKS)["shard read"](
        trainer, NodeFigures(GpuInventory(8), figure, *(Figure(1.0, ""),) * 3), profile, config, plan
    )
    assert check.passed and "8 parallel stream(s), 8 shard(s), 16 MB" in check.line(), check.line()
    assert figure.value > 5.0
    evals = Node("e" * 32, "10.0.0.2", {"CPU": 8, "GPU": 1})
    assert _request(config, profile, per_stream_store, 1, evals, read_streams(plan)).read_streams == 1
    slow = NodeFigures(GpuInventory(1), Figure(1.5, "1 parallel stream(s)"), *(Figure(1.0, ""),) * 3)
    check = dict(NODE_CHECKS)["shard read"](evals, slow, profile, config, plan)
    assert check.passed and "none (no training worker reads here)" in check.line()


@pytest.mark.timeout(120)
def test_the_space_check_counts_the_checkpoints_the_plan_expects_pinned_for_evals():
    """H/14 on a100x64 saves checkpoints of ~13 GB; while the evals queue on the eval GPU behind its VTAB probe, pins
    keep 5 more than checkpoint.keep_last + 1 on disk (the plan's `pinned_beyond_kept`; up to 8). The check asked for
    keep_last + 1 alone, so a filesystem with room for 4 passed and the run stopped at a save that filled it."""
    profile = load_profile("a100x64")
    config = resolve_config(profile, "vit_h14_i21k", [], "preflight")
    plan = build_plan(profile, config)
    keep, size = config.checkpoint.keep_last, plan.startup.checkpoint_gb
    cadence = EvalCadence(config.evals.schedule(), config.checkpoint.every_steps, plan.compute.total_steps)
    pinned = pinned_beyond_kept(plan.evals, cadence, plan.compute.step_time_s, keep)
    assert pinned == 5 and plan.checkpoints_pinned == pinned
    node = Node("n" * 32, "10.0.0.1", {"CPU": 96, "GPU": 8})

    def space(free_gb: float):
        figures = NodeFigures(GpuInventory(8), *(Figure(1.0, ""),) * 2, Figure(free_gb, "/fsx"), Figure(1.0, ""))
        return dict(NODE_CHECKS)["checkpoint space"](node, figures, profile, config, plan)

    short = space((keep + 1) * size + 1)
    assert not short.passed and f"+ {pinned} pinned for pending evals" in short.line()
    assert f"{(keep + 1 + pinned) * size:,.3g} GB" in short.line()
    assert space((keep + 1 + pinned) * size + 1).passed


def test_an_eval_node_big_enough_for_a_worker_is_no_training_node():
    """A g5.4xlarge eval node (16 vCPUs, 1 GPU) holds an a100x64 worker's bundle (10 CPUs, 1 GPU), but the ranks'
    label selector keeps them off it: the `nodes` check and the driver's shortfall counted it as a training node."""
    from cluster.driver.job import resource_shortfall
    from cluster.preflight.checks import _nodes_check, holds_a_worker
    from cluster.profiles import EVAL_NODE_RESOURCE, EVAL_NODE_UNITS

    profile = load_profile("a100x64")
    training = [Node(f"{i}" * 32, f"10.0.0.{i}", {"CPU": 96, "GPU": 8}) for i in range(1, 8)]  # one short of 8
    eval_node = Node("e" * 32, "10.0.1.1", {"CPU": 16, "GPU": 1, "memory": 40e9, EVAL_NODE_RESOURCE: EVAL_NODE_UNITS})
    assert holds_a_worker(training[0], profile) and not holds_a_worker(eval_node, profile)
    check = _nodes_check((*training, eval_node), profile)
    assert not check.passed and check.measured.startswith("7 node(s) that can hold a worker"), check.line()
    alive = [{"Alive": True, "Resources": n.resources} for n in (*training, eval_node)]
    one_short = dataclasses.replace(profile, workers=dataclasses.replace(profile.workers, num_workers=57))
    assert resource_shortfall(one_short, alive, evals=True) == [
        "the cluster's 8 live nodes hold 56 of the 57 training workers (CPU 10, GPU 1 each): Ray Train waits for "
        "nodes with these resources to join, saying that its worker group's start timed out every minute meanwhile"
    ]
