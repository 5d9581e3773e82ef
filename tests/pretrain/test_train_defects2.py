"""Defects of the training loop's telemetry and of how `python -m pretrain.train` ends, each pinned by the piece (or
the run) that showed it."""

from __future__ import annotations

import time

import pytest
import torch

from pretrain.telemetry.attempt_clock import AttemptClock
from pretrain.telemetry.metrics import TrainMetrics
from tracking import keys


def test_throughput_counts_the_steps_not_the_start_the_switches_or_the_saves(monkeypatch):
    # train/images_per_s, train/tflops, train/mfu and train/data_wait divided by the wall time since the window began:
    # the first window held the start-up and the baseline save, the window after each save held the save. At ViT-H a
    # 12 GB save every N steps made the logged MFU dip after each save, read as a slowdown against the plan. Here the
    # loop's sequence runs on a fake clock: every step trains 2 s, 0.5 s of it waiting for data.
    now = [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: now[0])
    clock = AttemptClock()
    metrics = TrainMetrics(
        rank=0,
        world_size=2,
        total_steps=6,
        flops_per_image=10**12,
        peak_tflops=64.0,
        device=torch.device("cpu"),
        log_every=2,
        progress_bar=False,
    )
    now[0] += 30.0  # the rest of the start-up: the engine, the data
    clock.open(None, start_step=0)
    clock.lap("startup")
    now[0] += 50.0  # the baseline save
    saved_s = 50.0
    clock.saved_before_loop(saved_s)
    metrics.start(clock.overhead_s)
    windows = []
    for step in range(1, 7):
        clock.lap("productive")
        now[0] += 20.0 if step == 5 else 0.0  # a resolution switch: start-up work
        clock.lap("startup")
        now[0] += 2.0
        step_s = clock.step_done(step, 0.5)
        logged = metrics.step(step, 1.0, 1e-3, None, images=64, data_s=0.5, step_s=step_s, overhead_s=clock.overhead_s)
        if logged:
            windows.append(logged)
        if step % 2 == 0:  # checkpoint.every_steps=2: a 100 s save
            now[0] += 100.0
            saved_s += 100.0
        clock.after_step(saved_s, logged=bool(logged))
    assert len(windows) == 3
    for logged in windows:  # 128 images in 4 s of training, whatever came before
        assert logged[keys.IMAGES_PER_S] == pytest.approx(32.0)
        assert logged[keys.TFLOPS] == pytest.approx(16.0)  # per device
        assert logged[keys.MFU] == pytest.approx(0.25)
        assert logged[keys.DATA_WAIT] == pytest.approx(0.25)
        assert logged[keys.step_time_percentile(99)] == pytest.approx(2.0)


def test_digest_lines_name_the_attempt_without_sample_keys(tmp_path, monkeypatch):
    # `open_recorder` asked rank 0 for the attempt number only with logging.record_sample_keys: with digests alone
    # (the documented way to compare runs) every line of <run>/batch_digests/rank<r>.jsonl said attempt 0, so a
    # restarted job's redone steps could not be told from the lines they replace.
    import json
    import socket

    import torch.distributed as dist

    from pretrain.checkpoint.run_folder import BATCH_DIGESTS_DIR
    from pretrain.config.train_config import CheckpointConfig, LoggingConfig, TrainConfig
    from pretrain.distributed import Placement
    from pretrain.loop import open_recorder

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        config = TrainConfig(
            checkpoint=CheckpointConfig(dir=str(tmp_path)), logging=LoggingConfig(record_batch_digests=True)
        )
        recorder = open_recorder(config, Placement(0, 1, 0, torch.device("cpu")), starts=3)
        recorder.batch(torch.zeros(2, 3, 4, 4), torch.tensor([0, 1]), [])
        recorder.end_step(1, loss=1.0, epoch=0)
        recorder.close()
    finally:
        dist.destroy_process_group()
    (line,) = (tmp_path / BATCH_DIGESTS_DIR / "rank0.jsonl").read_text().splitlines()
    assert json.loads(line)["attempt"] == 3
