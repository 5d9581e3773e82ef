"""The Makefile's environment: DeepSpeed runs on the CPU only where the machine has no NVIDIA GPU.

`nvidia-smi` is what the Makefile asks; each case puts a stand-in for it first on PATH (one that lists a GPU, one
that fails as it does on a machine without a driver), so the test means the same on this CPU machine and the GPU box.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SHOW = ["make", "-s", "--eval", 'show-ds: ; @echo "DS=$${DS_ACCELERATOR-unset}"', "show-ds"]


def _nvidia_smi(folder: Path, script: str) -> dict[str, str]:
    folder.mkdir()
    (folder / "nvidia-smi").write_text(f"#!/bin/sh\n{script}\n")
    (folder / "nvidia-smi").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("DS_ACCELERATOR", "MAKEFLAGS", "MAKELEVEL")}
    return {**env, "PATH": f"{folder}:{env['PATH']}"}


@pytest.mark.parametrize(
    ("script", "expected"),
    [
        ('echo "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-1234)"', "DS=unset"),  # DeepSpeed detects CUDA itself
        ('echo "NVIDIA-SMI has failed because it could not communicate with the NVIDIA driver." >&2; exit 9', "DS=cpu"),
    ],
    ids=["nvidia-smi-lists-one", "nvidia-smi-fails"],
)
def test_deepspeed_runs_on_the_cpu_only_without_a_gpu(tmp_path, script, expected):
    env = _nvidia_smi(tmp_path / "bin", script)
    assert subprocess.run(SHOW, cwd=ROOT, env=env, capture_output=True, text=True).stdout.strip() == expected
    chosen = subprocess.run(SHOW, cwd=ROOT, env={**env, "DS_ACCELERATOR": "cuda"}, capture_output=True, text=True)
    assert chosen.stdout.strip() == "DS=cuda"  # the user's choice wins


def test_clean_keeps_the_committed_gpu_results(tmp_path):
    """bench-results/gpu*.json are committed campaigns (a GPU run, not rerunnable here): `make clean` removes only
    what the CPU benchmarks and the smoke campaign wrote."""
    (tmp_path / "Makefile").write_text((ROOT / "Makefile").read_text())
    results = tmp_path / "bench-results"
    results.mkdir()
    for name in ("gpu.json", "gpu-2026-12-04-rerun.json", "data.json", "precision.json", "gpu-smoke.json"):
        (results / name).write_text("{}\n")
    (results / "device").mkdir()  # what bench/gpu/device.sh leaves when run here
    done = subprocess.run(["make", "-s", "clean"], cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in results.iterdir()) == ["gpu-2026-12-04-rerun.json", "gpu.json"]


def test_clean_stops_the_local_head_before_it_removes_its_folder(tmp_path):
    """`make clean` after `make launch` (whose head keeps running) removed .ray-local under the head: its GCS and
    raylet then outlived SIGTERM and `make stop` found no head to stop. The interpreter is a stand-in that records
    what it was asked and whether the head's folder was still there."""
    (tmp_path / "Makefile").write_text((ROOT / "Makefile").read_text())
    (tmp_path / ".ray-local").mkdir()
    (tmp_path / ".ray-local" / "head.json").write_text("{}\n")
    python = tmp_path / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text('#!/bin/sh\necho "$* $(test -e .ray-local/head.json && echo while-there)" >> asked.txt\n')
    python.chmod(0o755)
    done = subprocess.run(["make", "-s", "clean"], cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "asked.txt").read_text() == "-m cluster.jobs stop --cluster local while-there\n"
    assert not (tmp_path / ".ray-local").exists()


def test_the_bench_help_names_what_it_runs():
    """`make bench` runs four of the six benchmark targets; its help line says which, not "all"."""
    line = next(line for line in (ROOT / "Makefile").read_text().splitlines() if line.startswith("bench:"))
    targets, help_text = line.split("##")
    runs = [name.removeprefix("bench-") for name in targets.split(":")[1].split()]
    assert all(name in help_text for name in runs) and "all" not in help_text, line


def test_make_bench_runs_its_benchmarks_one_at_a_time_under_j(tmp_path):
    """Each benchmark times this machine: under `make -j` (or MAKEFLAGS) the four would time each other's load."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    log = tmp_path / "log"
    # a stand-in python that logs when each benchmark starts and ends
    (venv / "bin" / "python").write_text(f'#!/bin/sh\necho "start $2" >> {log}; sleep 0.3; echo "end $2" >> {log}\n')
    (venv / "bin" / "python").chmod(0o755)
    (venv / ".vitscale-installed").touch()  # `setup` is done
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL")}
    done = subprocess.run(["make", "-s", "-j4", "bench", f"VENV={venv}"], cwd=ROOT, env=env, capture_output=True)
    assert done.returncode == 0, done.stderr
    names = ("data", "train", "scaling", "scale")
    assert log.read_text().split("\n")[:-1] == [f"{what} bench.{name}" for name in names for what in ("start", "end")]


@pytest.mark.parametrize(
    ("setting", "runs"),
    [
        ("DRY_RUN=1", "--dry-run"),
        ("DRY_RUN=0", ""),  # was a dry run: any value counted
        ("DRY_RUN=ture", "error"),  # was a dry run; a value read as "off" would submit the job
        ("SMOKE=0", ""),
        ("SMOKE=yes", "--smoke"),
    ],
)
def test_a_flag_is_on_for_1_off_for_0_and_refused_otherwise(tmp_path, setting, runs):
    target = "launch" if setting.startswith("DRY_RUN") else "bench-gpu"
    done = subprocess.run(
        ["make", "-n", target, setting, "VENV=/nonexistent"], cwd=ROOT, capture_output=True, text=True
    )
    if runs == "error":
        assert done.returncode != 0 and "DRY_RUN=ture: give DRY_RUN=1 or DRY_RUN=0" in done.stderr, done.stderr
        return
    line = next(line for line in done.stdout.splitlines() if " -m cluster.launch " in line or " -m bench.gpu" in line)
    assert (runs in line) if runs else ("--dry-run" not in line and "--smoke" not in line), line
