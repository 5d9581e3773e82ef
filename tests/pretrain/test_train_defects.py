"""Defects of the training loop and its checkpoints that only a resumed, resized or long run meets, each pinned by
the run (or the piece) that showed it."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest

from pretrain import checkpointer as ckpt
from pretrain.checkpoint import checksums, run_folder
from pretrain.config.train_config import load_config


def _tiny(shards: Path, run_dir: Path, *overrides: str):
    return load_config(
        "local_demo",
        [
            f"data.train={shards}",
            "data.builtin=null",
            "data.global_batch_size=8",
            "data.micro_batch_size=8",
            "data.streams=4",
            "schedule.total=4",
            "schedule.warmup=1",
            f"checkpoint.dir={run_dir}",
            "logging.progress_bar=false",
            "deepspeed.precision=fp32",
            *overrides,
        ],
    )


def _flip_middle_byte(path: Path) -> None:
    with open(path, "r+b") as f:
        f.seek(path.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x10]))


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_save_after_skipping_a_damaged_newer_checkpoint_is_not_pruned_at_once(
    tiny_fractal_shards, train_cli, tmp_path
):
    # A run resumed from step 2 past a damaged step-4 checkpoint: with keep_last=1, each save it made was the one
    # "older than the newest" (the damaged step 4) and was deleted as it was published, so the stopped run left
    # nothing to resume from but the damaged checkpoint, and the same command then refused to start.
    run_dir = tmp_path / "run"
    train_cli(_tiny(tiny_fractal_shards, run_dir, "checkpoint.every_steps=1", "checkpoint.keep_last=4"), run_dir)
    shutil.rmtree(run_folder.checkpoint_dir(run_dir, 3))
    newest = run_folder.checkpoint_dir(run_dir, 4)
    _flip_middle_byte(newest / run_folder.WEIGHTS_FILE)
    resumed = _tiny(
        tiny_fractal_shards, run_dir, "checkpoint.every_steps=1", "checkpoint.keep_last=1", "schedule.stop_at_step=3"
    )
    summary = train_cli(resumed, tmp_path / "resumed")
    assert (summary["start"], summary["start_step"], summary["steps"]) == ("run", 2, 3)
    saved = run_folder.checkpoint_dir(run_dir, 3)
    assert summary["checkpoints"] == [str(saved)]
    assert run_folder.is_complete(saved)
    assert checksums.verify(saved).status == "verified"
    assert ckpt.newest_verified(run_dir) == saved  # what the same command resumes from
    assert not run_folder.checkpoint_dir(run_dir, 2).exists()  # keep_last=1 still prunes the older ones
    assert newest.is_dir()  # left for the run to save again when it reaches step 4


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_mfu_and_exaflops_follow_the_resolution_of_each_step(tiny_fractal_shards, train_cli, tmp_path):
    # 16 px for steps 0-1, 32 px from step 2: the FLOPs per image grow ~4x at the switch. The logged tflops (and
    # mfu) divided by the FLOPs of the start's resolution for the whole run, and exaflops counted every image seen at
    # one resolution.
    from pretrain.model.flops import train_flops
    from pretrain.weights.formats import recorded_config
    from tracking import keys

    def tiny(*more: str):
        return _tiny(
            tiny_fractal_shards,
            tmp_path / "run",
            "data.resolution_schedule=[[0, 16], [2, 32]]",
            "checkpoint.every_steps=1",
            "checkpoint.keep_last=10",
            "logging.log_every=1",
            "logging.peak_tflops=1.0",
            *more,
        )

    train_cli(tiny("schedule.stop_at_step=3"), tmp_path / "run")  # switches at step 2
    train_cli(tiny(), tmp_path / "resumed")  # resumes at 32 px from step 3
    model = recorded_config(run_folder.checkpoint_dir(tmp_path / "run", 4))  # the trained model, at 32 px
    per_image = {size: train_flops(model, size) for size in (16, 32)}
    assert per_image[32] > 3 * per_image[16]
    for step, done in ((3, 2 * per_image[16] + per_image[32]), (4, 2 * per_image[16] + 2 * per_image[32])):
        metrics = run_folder.TrainerState.read(run_folder.checkpoint_dir(tmp_path / "run", step)).metrics
        flops = metrics[keys.TFLOPS] * 1e12 / metrics[keys.IMAGES_PER_S]  # one window = this step, one rank
        assert flops == pytest.approx(per_image[32], rel=1e-6), step
        assert metrics[keys.MFU] == pytest.approx(metrics[keys.TFLOPS], rel=1e-9)  # peak 1.0
        assert metrics[keys.EXAFLOPS] == pytest.approx(8 * done / 1e18, rel=1e-9), step


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_grad_norm_is_logged_at_zero0(tiny_fractal_shards, train_cli, tmp_path):
    # DeepSpeed keeps the gradient norm only from a ZeRO or bf16 optimizer: at ZeRO-0 (fp32) train/grad_norm was
    # never logged, with or without clipping.
    from tracking import keys

    def norms(stage: int, clip: float) -> list[float]:
        run_dir = tmp_path / f"zero{stage}_clip{clip}"
        tiny = _tiny(
            tiny_fractal_shards,
            run_dir,
            f"deepspeed.zero_stage={stage}",
            f"optim.grad_clip={clip}",
            "schedule.stop_at_step=2",
            "checkpoint.every_steps=1",
            "checkpoint.keep_last=4",
            "logging.log_every=1",
        )
        train_cli(tiny, run_dir)
        return [
            run_folder.TrainerState.read(run_folder.checkpoint_dir(run_dir, step)).metrics.get(keys.GRAD_NORM)
            for step in (1, 2)
        ]

    clipped, unclipped, zero1 = norms(0, 1.0), norms(0, 0.0), norms(1, 1.0)
    assert None not in zero1
    # the same weights and batch at step 1: DeepSpeed's norm at ZeRO-1, before any clip
    assert clipped[0] == pytest.approx(zero1[0], rel=1e-5) and unclipped[0] == pytest.approx(zero1[0], rel=1e-5)
    assert clipped[1] == pytest.approx(zero1[1], rel=1e-4) and 0 < unclipped[1] < math.inf
