"""Resume at another world size (docs/elastic.md), on real DeepSpeed (CPU, gloo) under torchrun, every ZeRO stage.

One chain per stage: a world-size-2 run is resumed at world size 1 from its step-2 checkpoint, and that run's step-4
checkpoint is resumed at world size 2 again (accumulation 2 -> 4 -> 2, global batch 16 throughout). Against the
uninterrupted world-size-2 run, steps 3-6 consume exactly the same samples in the same global order (sample keys)
and their losses agree within fp32 reduction-order noise (relative 1e-4), with dropout, augmentation and a loader
worker on. A world size that cannot keep the global batch is refused before anything loads.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cluster.local_head import free_port
from tests.pretrain.test_train_distributed import ROOT, _env, reference_run, tiny_config, torchrun

pytestmark = [pytest.mark.slow]

SETTINGS = (
    "model.dropout=0.1",
    "data.num_workers=1",
    "checkpoint.every_steps=2",
    "checkpoint.keep_last=5",
    "schedule.total=6",
    "logging.record_sample_keys=true",
    "logging.record_batch_digests=false",
)


def global_keys(summaries: list[dict]) -> dict[int, list[str]]:
    """step -> the global batch's sample keys: the ranks' keys of the step, in rank order."""
    steps = [entry["step"] for entry in summaries[0]["sample_keys"]]
    return {step: [k for s in summaries for k in s["sample_keys"][i]["keys"]] for i, step in enumerate(steps)}


def close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-4 * max(abs(a), abs(b))


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_resume_at_another_world_size_continues_the_same_samples_and_losses(stage, tiny_fractal_shards, tmp_path):
    def config(run, *extra):
        return tiny_config(tiny_fractal_shards, tmp_path / run, f"deepspeed.zero_stage={stage}", *SETTINGS, *extra)

    whole = torchrun(config("whole"), tmp_path / "w", nproc=2)
    keys, losses = global_keys(whole), dict(whole[0]["losses"])
    assert sorted(keys) == [1, 2, 3, 4, 5, 6] and all(len(k) == 16 for k in keys.values())
    assert len(set(keys[1] + keys[2] + keys[3] + keys[4])) == 64  # epoch 0: every sample once (4 steps x 16)

    step2 = tmp_path / "whole" / "checkpoints" / "step_00000002"
    shrunk = torchrun(
        config("shrunk", f"checkpoint.resume_from={step2}", "schedule.stop_at_step=4"), tmp_path / "s", nproc=1
    )
    step4 = tmp_path / "shrunk" / "checkpoints" / "step_00000004"
    grown = torchrun(config("grown", f"checkpoint.resume_from={step4}"), tmp_path / "g", nproc=2)

    assert shrunk[0]["start_step"] == 2 and grown[0]["start_step"] == 4 and grown[0]["steps"] == 6
    resumed_keys = {**global_keys(shrunk), **global_keys(grown)}
    assert resumed_keys == {step: keys[step] for step in (3, 4, 5, 6)}
    resumed_losses = dict(shrunk[0]["losses"] + grown[0]["losses"])
    assert sorted(resumed_losses) == [3, 4, 5, 6]
    pairs = [(resumed_losses[s], losses[s]) for s in sorted(resumed_losses)]
    assert all(close(a, b) for a, b in pairs), pairs
    # a partitioned optimizer state was converted once per resized checkpoint; ZeRO-0 fp32 loads as it is
    assert (step2 / "universal").is_dir() == (stage > 0)


def test_a_world_size_that_cannot_keep_the_global_batch_is_refused_before_loading(
    tiny_fractal_shards, tmp_path, shared_folder
):
    # A world-size-2 ZeRO-2 checkpoint: the shared reference run's (tests/pretrain/test_train_distributed.py), read
    # only.
    _, summaries = reference_run(shared_folder, tiny_fractal_shards, stage=2)
    checkpoint = Path(summaries[0]["checkpoints"][-1])
    assert not (checkpoint / "universal").exists()
    config = tiny_config(tiny_fractal_shards, tmp_path / "other", f"checkpoint.resume_from={checkpoint}")
    recipe = tmp_path / "other.yaml"
    config.save(recipe)
    # Rank 0 of a 3-rank launch, with the variables torchrun gives it, alone (torchrun and 3 ranks cost 4 interpreter
    # starts): it refuses before the process group, which would wait for the 2 absent ranks until the timeout.
    ranks = dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="3", LOCAL_WORLD_SIZE="3", GROUP_RANK="0", ROLE_RANK="0")
    ranks.update(ROLE_WORLD_SIZE="3", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    cmd = [sys.executable, "-m", "pretrain.train", "--config", str(recipe)]
    result = subprocess.run(cmd, cwd=ROOT, env={**_env(), **ranks}, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "world size 3 does not divide data.streams=4" in result.stderr and "[1, 2, 4]" in result.stderr
    assert not (checkpoint / "universal").exists()
    shutil.rmtree(tmp_path / "other", ignore_errors=True)


def test_a_resume_at_another_world_size_and_micro_batch_starts(tiny_fractal_shards, tmp_path, shared_folder):
    """A world-size-2 checkpoint (micro-batch 4, accumulation 2) resumed at world size 1 with micro-batch 16
    (accumulation 1), a valid split of the same global batch: rank 0's line on the resize computed the old
    accumulation with the new micro-batch (16 x 2 does not divide 16) and stopped the run with "not divisible by world
    size 2" after the engine loaded (with more ranks, the others went on without it)."""
    run, _ = reference_run(shared_folder, tiny_fractal_shards, stage=2)
    checkpoint = shutil.copytree(Path(run) / "checkpoints" / "step_00000008", tmp_path / "step_00000008")
    sets = (f"checkpoint.resume_from={checkpoint}", "schedule.total=9", "data.micro_batch_size=16")
    resumed = torchrun(tiny_config(tiny_fractal_shards, tmp_path / "run", *sets), tmp_path / "w", nproc=1)
    assert resumed[0]["start_step"] == 8 and resumed[0]["steps"] == 9
    printed = (tmp_path / "w" / "output.log").read_text()
    assert "resuming step 8 at world size 1 (was 2): accumulation 2 -> 1, global batch 16" in printed, printed[-3000:]
    assert "converted step_00000008 (world size 2) to a universal checkpoint for world size 1" in printed
    assert "it/s]" not in printed, printed[-3000:]  # DeepSpeed's converter's progress bars, on every resize
