"""Masked patch prediction through the real trainer (`python -m pretrain.train --config local_mpp`, DeepSpeed
ZeRO-2 on CPU): the registered `mpp` task trains, its loss falls from ln(512), the checkpointed ViT has no
classification head, and a run killed after its step-4 checkpoint and launched again (its folder as it stood then)
draws the same corruptions (identical losses)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from pretrain.config.train_config import load_config
from tests.pretrain.test_train_distributed import copy_run_until

pytestmark = [pytest.mark.slow]


def _config(shards: Path, run_dir: Path, *overrides: str):
    return load_config(
        "local_mpp",
        [
            f"data.train={shards}",
            "data.builtin=null",
            "data.global_batch_size=16",
            "data.micro_batch_size=16",
            "data.streams=4",  # the tiny set has 4 shards
            "data.shuffle_buffer=8",
            "schedule.total=8",
            "schedule.warmup=2",
            "optim.lr=3e-3",
            f"checkpoint.dir={run_dir}",
            "checkpoint.every_steps=4",
            "logging.progress_bar=false",
            "logging.log_every=1",
            "logging.peak_tflops=1.0",
            "deepspeed.precision=fp32",  # exact resume: one precision in every run (not auto's probe)
            *overrides,
        ],
    )


@pytest.mark.timeout(900)
def test_mpp_recipe_trains_checkpoints_and_resumes_exactly(tiny_fractal_shards, train_cli, tmp_path):
    full = train_cli(_config(tiny_fractal_shards, tmp_path / "full"), tmp_path / "full")
    losses = {int(s): v for s, v in full["losses"]}
    assert sorted(losses) == list(range(1, 9)) and all(math.isfinite(v) for v in losses.values())
    assert losses[1] == pytest.approx(math.log(512), abs=0.05)  # zero-initialised 512-way head
    assert losses[8] < losses[1] - 1.0, losses
    model_json = json.loads((tmp_path / "full" / "checkpoints" / "step_00000008" / "model.json").read_text())
    assert model_json["num_classes"] == 0 and model_json["pool"] == "gap"

    split = copy_run_until(tmp_path / "full", tmp_path / "split", 4)
    resumed = train_cli(_config(tiny_fractal_shards, split), split)
    assert resumed["start"] == "run" and resumed["start_step"] == 4
    assert [int(step) for step, _ in resumed["losses"]] == [5, 6, 7, 8]
    for step, loss in resumed["losses"]:
        assert loss == pytest.approx(losses[int(step)], abs=1e-6), f"step {step}: {loss} vs {losses[int(step)]}"
