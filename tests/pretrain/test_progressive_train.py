"""Progressive resolution through the real trainer (`python -m pretrain.train`, DeepSpeed ZeRO-2 on CPU): the
position embeddings change size at the scheduled step, checkpoints record the resolution they were saved at, the
loss stays finite, and a run killed right at the switch (after its step-4 checkpoint, the last at 16 px; its folder
as it stood then) and launched again equals the uninterrupted one."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from safetensors import safe_open

from pretrain.config.train_config import load_config
from tests.pretrain.test_train_distributed import copy_run_until

pytestmark = [pytest.mark.slow]


def _config(shards: Path, run_dir: Path, *overrides: str):
    return load_config(
        "local_demo",
        [
            f"data.train={shards}",
            "data.builtin=null",
            "data.global_batch_size=8",
            "data.micro_batch_size=8",
            "data.shuffle_buffer=8",
            "data.streams=4",
            "data.resolution_schedule=[[0, 16], [4, 32]]",
            "schedule.total=8",
            "schedule.warmup=2",
            f"checkpoint.dir={run_dir}",
            "checkpoint.every_steps=2",
            "checkpoint.keep_last=10",
            "logging.progress_bar=false",
            "logging.log_every=1",
            "logging.peak_tflops=1.0",
            "deepspeed.precision=fp32",  # exact resume: one precision in every run (not auto's probe)
            *overrides,
        ],
    )


def _checkpoint(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step:08d}"


@pytest.mark.timeout(900)
def test_progressive_resolution_switches_and_resumes_exactly(tiny_fractal_shards, train_cli, tmp_path):
    full = train_cli(_config(tiny_fractal_shards, tmp_path / "full"), tmp_path / "full")
    losses = dict((int(s), v) for s, v in full["losses"])
    assert sorted(losses) == list(range(1, 9)) and all(math.isfinite(v) for v in losses.values())
    for step, size in ((2, 16), (4, 16), (6, 32), (8, 32)):  # steps 0-3 train at 16 px, 4-7 at 32 px
        ckpt = _checkpoint(tmp_path / "full", step)
        assert json.loads((ckpt / "model.json").read_text())["image_size"] == size
        assert load_config(ckpt / "config.yaml").data.image_size == size
        with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
            grid = (size // 4) ** 2
            assert tuple(f.get_slice("pos_embed").get_shape()) == (1, 1 + grid, 64)

    # Killed where the parameters are still 16 px but the next step trains at 32 px, then launched again.
    split = copy_run_until(tmp_path / "full", tmp_path / "split", 4)
    resumed = train_cli(_config(tiny_fractal_shards, split), split)
    assert resumed["start"] == "run" and resumed["start_step"] == 4
    assert [int(step) for step, _ in resumed["losses"]] == [5, 6, 7, 8]
    for step, loss in resumed["losses"]:
        assert loss == pytest.approx(losses[int(step)], abs=1e-6), f"step {step}: {loss} vs {losses[int(step)]}"
