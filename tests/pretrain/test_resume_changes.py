"""A resume whose recipe changed what the checkpoint's engine state can be loaded into, on real DeepSpeed (CPU)
checkpoints: refused in one ``python -m pretrain.train: error:`` line, exit 2, before any rank builds an engine, naming
the checkpoint's setting to set back.

- ZeRO stage: 1 and 2 write the same partitioned optimizer state and load each other (the same losses); a change to
  or from 0 or 3 crashed in DeepSpeed (an AssertionError traceback, ``'NoneType' object has no attribute 'copy'``, or
  a missing ``zero_pp_rank`` file called damaged);
- precision: an explicit fp32 <-> bf16 change looked for the other precision's files and called the healthy
  checkpoint damaged (``move this one away``); ``auto`` keeps the checkpoint's;
- model: another ``model.pool`` under the same ``model.name`` advised ``model.name=<the same name>``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pretrain.checkpoint import run_folder
from pretrain.checkpointer import find_start, nothing_to_train
from pretrain.config.train_config import load_config
from pretrain.train import main as train_main
from tests.pretrain.test_command_ends import _tiny

pytestmark = [pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
PROG = "python -m pretrain.train: error: "


def _sets(shards: Path, run_dir: Path, *overrides: str) -> list[str]:
    return _tiny(shards, run_dir, "schedule.total=4", "checkpoint.every_steps=2", *overrides)


def _trained(root: Path, shards: Path, precision: str) -> Path:
    """A real 2-step ZeRO-2 run in ``precision``, one process: its step-2 checkpoint."""
    run = root / f"run_{precision}"
    sets = _sets(shards, run, "schedule.total=2", "deepspeed.zero_stage=2", f"deepspeed.precision={precision}")
    cmd = [sys.executable, "-m", "pretrain.train", "--config", "local_demo", *(a for s in sets for a in ("--set", s))]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
        env.pop(key, None)
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return run_folder.checkpoint_dir(run, 2)


@pytest.fixture(scope="module")
def fp32_checkpoint(tmp_path_factory, tiny_fractal_shards) -> Path:
    return _trained(tmp_path_factory.mktemp("fp32"), tiny_fractal_shards, "fp32")


@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory, tiny_fractal_shards) -> Path:
    return _trained(tmp_path_factory.mktemp("bf16"), tiny_fractal_shards, "bf16")


def _copy(checkpoint: Path, to: Path) -> Path:
    """A copy of ``checkpoint``'s run folder: the newest checkpoint of ``to``."""
    shutil.copytree(checkpoint.parents[1], to)
    return run_folder.checkpoint_dir(to, 2)


def _refused(sets: list[str], capsys) -> str:
    """The one error line `python -m pretrain.train` (in this process) ends with, exit 2, nothing printed."""
    code = train_main(["--config", "local_demo", *(a for s in sets for a in ("--set", s))])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and len(err.splitlines()) == 1, err[-3000:]
    assert err.startswith(PROG), err
    return err.rstrip().removeprefix(PROG)


@pytest.mark.timeout(400)
def test_a_zero_stage_change_deepspeed_cannot_load_is_refused_before_anything_starts(
    fp32_checkpoint, tiny_fractal_shards, tmp_path, capsys
):
    run = tmp_path / "run"
    folder = _copy(fp32_checkpoint, run)
    before = sorted(p.name for p in run.iterdir())
    for stage in (0, 3):
        sets = _sets(tiny_fractal_shards, run, "deepspeed.precision=fp32", f"deepspeed.zero_stage={stage}")
        line = (
            f"the run folder's newest checkpoint {folder} was saved at deepspeed.zero_stage=2, whose engine state "
            f"ZeRO-{stage} cannot load; set deepspeed.zero_stage=2 to resume it, or set another checkpoint.dir to "
            "train a new run"
        )
        with pytest.raises(ValueError) as refused:
            nothing_to_train(load_config("local_demo", sets))
        assert str(refused.value) == line
        with pytest.raises(ValueError, match="was saved at deepspeed.zero_stage=2"):
            find_start(load_config("local_demo", sets))  # a Ray worker's start
        assert _refused(sets, capsys) == line
    assert sorted(p.name for p in run.iterdir()) == before  # no attempt, no world-size record
    # ZeRO-1 reads ZeRO-2's files (the same losses on resume): not refused
    config = load_config("local_demo", _sets(tiny_fractal_shards, run, "deepspeed.precision=fp32"))
    one = load_config(
        "local_demo", _sets(tiny_fractal_shards, run, "deepspeed.precision=fp32", "deepspeed.zero_stage=1")
    )
    for same_files in (config, one):
        assert nothing_to_train(same_files) is None and find_start(same_files).kind == "run"
    other = tmp_path / "other"
    sets = _sets(tiny_fractal_shards, other, "deepspeed.zero_stage=3", f"checkpoint.resume_from={fp32_checkpoint}")
    assert _refused(sets, capsys).endswith("set deepspeed.zero_stage=2 to resume it, or drop checkpoint.resume_from")
    assert not other.exists()


@pytest.mark.timeout(400)
def test_an_explicit_precision_change_is_refused_without_calling_the_checkpoint_damaged(
    fp32_checkpoint, bf16_checkpoint, tiny_fractal_shards, tmp_path, capsys
):
    for checkpoint, kept, asked in ((fp32_checkpoint, "fp32", "bf16"), (bf16_checkpoint, "bf16", "fp32")):
        run = tmp_path / kept
        folder = _copy(checkpoint, run)
        before = sorted(p.name for p in run.iterdir())
        sets = _sets(tiny_fractal_shards, run, f"deepspeed.precision={asked}")
        line = (
            f"the run folder's newest checkpoint {folder} was trained in {kept}, and a {asked} engine cannot load its "
            f"state; set deepspeed.precision={kept} (or auto) to resume it, or set another checkpoint.dir to train a "
            "new run"
        )
        with pytest.raises(ValueError) as refused:
            nothing_to_train(load_config("local_demo", sets))
        assert str(refused.value) == line
        with pytest.raises(ValueError, match=f"was trained in {kept}"):
            find_start(load_config("local_demo", sets))
        assert _refused(sets, capsys) == line
        assert sorted(p.name for p in run.iterdir()) == before  # no attempt, no world-size record
        for same in (kept, "auto", "probe"):  # auto and probe keep the checkpoint's precision
            config = load_config("local_demo", _sets(tiny_fractal_shards, run, f"deepspeed.precision={same}"))
            assert nothing_to_train(config) is None and find_start(config).kind == "run"


@pytest.mark.timeout(400)
def test_a_checkpoint_of_another_pool_names_the_pool_to_set_back(
    fp32_checkpoint, tiny_fractal_shards, tmp_path, capsys
):
    run = tmp_path / "run"
    folder = _copy(fp32_checkpoint, run)
    sets = _sets(tiny_fractal_shards, run, "deepspeed.precision=fp32", "model.pool=gap")
    assert _refused(sets, capsys) == (
        f"the run folder's newest checkpoint {folder} holds another model than model.name=vit_tiny_debug builds "
        "(pool token, not gap): a resume cannot load it; set the model back to the checkpoint's (model.pool=token), "
        "or set another checkpoint.dir to train a new run"
    )
    both = _sets(tiny_fractal_shards, run, "deepspeed.precision=fp32", "model.name=vit_s16", "model.pool=gap")
    assert _refused(both, capsys).endswith(
        "set the model back to the checkpoint's (model.name=vit_tiny_debug, model.pool=token), or set another "
        "checkpoint.dir to train a new run"
    )
