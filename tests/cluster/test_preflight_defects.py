"""cluster.preflight: the GPU kind as the profile names it, and the run's own tracking store and run folder."""

from __future__ import annotations

import dataclasses
import os

from cluster.local_head import free_port
from cluster.plan.planner import build_plan, resolve_config
from cluster.preflight.checks import NODE_CHECKS, Node, _request
from cluster.preflight.node import (
    Figure,
    NodeFigures,
    NodeProbe,
    _guarded,
    free_space,
    parse_nvidia_smi,
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
