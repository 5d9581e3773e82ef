"""Progressive resolution through the real trainer (`python -m pretrain.train`, DeepSpeed ZeRO-2 on CPU): the
position embeddings change size at the scheduled step, checkpoints record the resolution they were saved at, the
loss stays finite, and a run stopped right at the switch and resumed equals the uninterrupted one."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors import safe_open

from pretrain.config import load_config

ROOT = Path(__file__).resolve().parent.parent
pytestmark = [pytest.mark.slow]


@pytest.fixture
def shards(tiny_fractal_shards) -> Path:
    return tiny_fractal_shards


def _train(shards: Path, run_dir: Path, *overrides: str) -> dict:
    config = load_config(
        "local_demo",
        [
            f"data.train={shards}", "data.builtin=null", "data.global_batch_size=8", "data.micro_batch_size=8",
            "data.shuffle_buffer=8", "data.resolution_schedule=[[0, 16], [4, 32]]", "schedule.total=8",
            "schedule.warmup=2", f"checkpoint.dir={run_dir}", "checkpoint.every_steps=2", "checkpoint.keep_last=10",
            "logging.progress_bar=false", "logging.log_every=1", "logging.peak_tflops=1.0", *overrides,
        ],
    )  # fmt: skip
    run_dir.mkdir(parents=True, exist_ok=True)
    config.save(run_dir / "recipe.yaml")
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
        env.pop(key, None)
    cmd = [sys.executable, "-m", "pretrain.train", "--config", str(run_dir / "recipe.yaml"),
           "--summary", str(run_dir / "summary.json")]  # fmt: skip
    # Own session: a timeout kills the whole process tree, never leaking it.
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=400)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"training timed out:\n{out[-4000:]}")
    assert proc.returncode == 0, out[-6000:]
    return json.loads((run_dir / "summary.json").read_text())


def _checkpoint(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step:08d}"


@pytest.mark.timeout(900)
def test_progressive_resolution_switches_and_resumes_exactly(shards, tmp_path):
    full = _train(shards, tmp_path / "full")
    losses = dict((int(s), v) for s, v in full["losses"])
    assert sorted(losses) == list(range(1, 9)) and all(math.isfinite(v) for v in losses.values())
    for step, size in ((2, 16), (4, 16), (6, 32), (8, 32)):  # steps 0-3 train at 16 px, 4-7 at 32 px
        ckpt = _checkpoint(tmp_path / "full", step)
        assert json.loads((ckpt / "model.json").read_text())["image_size"] == size
        assert load_config(ckpt / "config.yaml").data.image_size == size
        with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
            grid = (size // 4) ** 2
            assert tuple(f.get_slice("pos_embed").get_shape()) == (1, 1 + grid, 64)

    # Stop where the parameters are still 16 px but the next step trains at 32 px, then resume.
    _train(shards, tmp_path / "split", "schedule.stop_at_step=4")
    resumed = _train(shards, tmp_path / "split")
    assert resumed["start"] == "run" and resumed["start_step"] == 4
    for step, loss in resumed["losses"]:
        assert loss == pytest.approx(losses[int(step)], abs=1e-6), f"step {step}: {loss} vs {losses[int(step)]}"
