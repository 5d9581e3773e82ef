"""On a CUDA device: the GPU campaign's real path in short form (`bench.gpu.train`): ViT-H/14 with the vit_h14_i21k
recipe at its micro-batch through `pretrain.train` on one GPU (DeepSpeed ZeRO-2, bf16, NCCL, 8 loader workers) on a
224 px formula set made here, 3 steps and the checkpoint after them. Short, because the device script runs it before
the campaign within one 10-minute call: the campaign's train part runs the same path at length, with a resume from
its checkpoint and the ZeRO stages (`python -m bench.gpu`, docs/benchmarks/gpu.md)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bench.gpu.train import TrainSpec
from data_pipeline.builtin.sets import ensure

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_h14_recipe_trains_through_pretrain_train_on_one_gpu(tmp_path):
    data = (
        ensure(
            "rcdb",
            tmp_path / "data",
            resolution=224,
            num_classes=8,
            images_per_class=32,
            val_per_class=1,
            class_offset=0,
            background_ramp=0,
            samples_per_shard=32,
            processes=max(1, (os.cpu_count() or 2) - 2),
        )
        / "train"
    )
    spec = TrainSpec(
        data=str(data),
        run_root=str(tmp_path / "runs"),
        steps=3,
        checkpoint_at=3,
        warmup_steps=1,
        resume=False,
        zero=False,
    )
    (tmp_path / "spec.json").write_text(json.dumps(dataclasses.asdict(spec)))
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "DS_ACCELERATOR": "cuda", "PYTHONPATH": path}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
        env.pop(key, None)
    command = [sys.executable, "-m", "bench.gpu.train", str(tmp_path / "spec.json"), str(tmp_path / "out.json")]
    try:
        proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=560)
    finally:
        shutil.rmtree(tmp_path / "runs", ignore_errors=True)  # a ~12 GB checkpoint on the device's 64 GiB disk
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    out = json.loads((tmp_path / "out.json").read_text())
    assert not [k for k in out if k.startswith("error_")], {k: v for k, v in out.items() if k.startswith("error_")}
    assert out["train_path_model"] == "vit_h14" and out["train_path_micro_batch"] == 64 and out["train_path_steps"] == 3
    assert all(math.isfinite(loss) for _, loss in out["train_path_losses"])
    assert 0 < out["train_path_mfu"] < 1 and "datasheet" in out["train_path_peak_source"]
    assert out["train_path_checkpoint_gb"] > 5  # fp32 masters and Adam moments of 660M parameters, and the weights
    assert out["train_path_peak_memory_reserved_gb"] > 13  # model states alone: ~20 bytes per parameter
    assert out["train_path_steady_steps"] == 2 and out["train_path_checkpoint_save_s"] > 0
    assert 0 <= out["train_path_data_wait"] < 0.5  # 8 loader workers keep a 224 px formula set ahead of one GPU
    print(
        f"H/14 short run: {out['train_path_img_s']:.1f} img/s, MFU {out['train_path_mfu']:.1%}, peak "
        f"{out['train_path_peak_memory_reserved_gb']:.1f} GB, checkpoint {out['train_path_checkpoint_gb']:.1f} GB in "
        f"{out['train_path_checkpoint_save_s']:.1f} s"
    )
