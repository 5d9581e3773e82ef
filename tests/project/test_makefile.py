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
