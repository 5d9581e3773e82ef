"""A finished rank frees its process groups before the interpreter exits (docs/reference.md §7, "Ending a rank").

- 2 torchrun ranks of `pretrain.train` (ZeRO-2, gloo) that end through the project's teardown (`finish_distributed`)
  and then exit normally (`sys.exit`, tests/support/teardown_repro.py) have no gloo thread (`pt_gloo_runloop`,
  `gloo_tcp_loop`) left before the interpreter's teardown, and exit 0. Before the fix, the default group outlived
  its destruction on every rank of every run, held by `torch.distributed.nn.functional`'s default arguments, and its
  three threads were still running when Python finalized; a finished rank was seen to abort there with "terminate
  called without an active exception".
- where that module was imported after the default group was made (a caller that creates the group itself, as Ray
  Train does), `finish_distributed` still frees the group and its threads.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.scaling import communicate_or_end
from cluster.local_head import free_port
from pretrain.config.train_config import load_config

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow]


def _env() -> dict[str, str]:
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def _run(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    """Run in a session of its own; on a timeout end torchrun and its ranks (`communicate_or_end`)."""
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        out, _ = communicate_or_end(proc, timeout)
    except subprocess.TimeoutExpired as expired:
        pytest.fail(f"{cmd[:6]} timed out after {timeout}s:\n{(expired.output or '')[-4000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, None)


@pytest.mark.timeout(240)
def test_finished_ranks_leave_no_gloo_thread_and_exit_normally(tiny_fractal_shards, tmp_path):
    config = load_config(
        "local_demo",
        [
            f"data.train={tiny_fractal_shards}",
            "data.builtin=null",
            "data.global_batch_size=16",
            "data.micro_batch_size=4",
            "data.shuffle_buffer=8",
            "data.streams=4",
            "schedule.total=8",
            "schedule.warmup=2",
            "schedule.stop_at_step=2",
            f"checkpoint.dir={tmp_path / 'run'}",
            "checkpoint.every_steps=100",
            "logging.progress_bar=false",
            "logging.peak_tflops=1.0",
            "deepspeed.zero_stage=2",
            "deepspeed.precision=fp32",
        ],
    )
    config.save(tmp_path / "config.yaml")
    reports = tmp_path / "reports"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node=2",
        "--master-addr=127.0.0.1",
        f"--master-port={free_port()}",
        str(ROOT / "tests" / "support" / "teardown_repro.py"),
        str(reports),
        "--config",
        str(tmp_path / "config.yaml"),
    ]
    result = _run(cmd, timeout=180)
    assert "terminate called" not in result.stdout, result.stdout[-6000:]
    for rank in range(2):
        report = json.loads((reports / f"rank{rank}.json").read_text())
        assert report["code"] == 0
        assert report["gloo_threads"] == [], (rank, report["threads"])  # every group freed, its threads joined
    assert result.returncode == 0, result.stdout[-6000:]  # both ranks exited 0 through the interpreter's teardown


# A caller that made the default group itself imports torch.distributed.nn.functional after it (here explicitly;
# in a training process torch._dynamo imports it at the first optimizer): its default arguments hold the group.
CAPTURED = """
import gc, sys
import deepspeed, torch, torch.distributed as dist
from pretrain.distributed import finish_distributed
from teardown_repro import gloo_threads  # tests/support/ is on PYTHONPATH

deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
import torch.distributed.nn.functional as functional
assert functional.all_reduce.__defaults__[-1] is dist.group.WORLD  # the group is captured
dist.all_reduce(torch.ones(4))
finish_distributed()
gc.collect()
print("gloo threads after finish_distributed:", gloo_threads(), flush=True)
sys.exit(1 if gloo_threads() else 0)
"""


@pytest.mark.timeout(180)
def test_finish_distributed_frees_a_group_that_default_arguments_captured(tmp_path):
    script = tmp_path / "captured.py"
    script.write_text(CAPTURED)
    env = {
        **_env(),
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests' / 'support'}",
    }
    proc = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    assert "gloo threads after finish_distributed: []" in proc.stdout
