"""How a standalone `python -m pretrain.train` ends, as real processes on real DeepSpeed, checkpoints and MLflow:

- the hybrid model with masked patch prediction at an image size that leaves one patch is one error line naming the
  numbers and the fix (exit 2), not the corruption's own error after the workers started;
- after a damaged newest checkpoint is passed over, the closing line names the checkpoint the same command resumes
  from, not the damaged one;
- Ctrl-C records a user's stop: attempt ``stopped``, the MLflow run KILLED with ``vitscale.status`` stopped.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pretrain.checkpoint import run_folder
from pretrain.config.train_config import load_config
from pretrain.telemetry.attempt_clock import attempt_path
from tests.pretrain.test_command_ends import _tiny
from tests.support.interrupt import ctrl_c
from tracking import keys

PROG = "python -m pretrain.train"


def _command(sets: list[str]) -> list[str]:
    return [sys.executable, "-m", PROG.split()[-1], "--config", "local_demo", *(a for s in sets for a in ("--set", s))]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_mpp_on_a_model_that_leaves_one_patch_per_image_is_one_error_line_naming_the_fix(
    tiny_fractal_shards, train_env, tmp_path
):
    sets = _tiny(tiny_fractal_shards, tmp_path / "run", "schedule.total=3", "model.name=r26_vit_s32")  # 32 px images
    done = subprocess.run(_command(sets), env=train_env(), capture_output=True, text=True, timeout=100)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert done.stderr.splitlines()[-1] == (
        f"{PROG}: error: model r26_vit_s32 at data.image_size 32 leaves 1 patch per image (one per 32x32 px); masked "
        "patch prediction needs >= 2: raise data.image_size to 64 or set task.name=classification"
    )
    assert not run_folder.checkpoints_dir(tmp_path / "run").exists()


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_after_a_damaged_newest_checkpoint_the_end_names_the_one_the_run_resumes_from(
    tiny_fractal_shards, train_cli, tmp_path
):
    run = tmp_path / "run"
    sets = _tiny(tiny_fractal_shards, run, "schedule.total=4", "checkpoint.every_steps=2")
    train_cli(load_config("local_demo", sets), run, timeout=300)
    step3, step4 = run_folder.checkpoint_dir(run, 3), run_folder.checkpoint_dir(run, 4)
    damaged = step4 / "deepspeed" / step4.name / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    with open(damaged, "r+b") as f:
        f.truncate(1000)
    summary = train_cli(load_config("local_demo", [*sets, "schedule.stop_at_step=3"]), run, timeout=300)
    out = (run / "output.log").read_text()
    assert f"skipping damaged checkpoint {step4}" in out and summary["start_step"] == 2, out[-3000:]
    end = out.splitlines()[-1]
    assert end.startswith("done: ") and end.endswith(f"; newest checkpoint {step3}"), end  # not the damaged step 4


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_ctrl_c_records_a_users_stop_as_stopped_and_the_mlflow_run_killed(
    tiny_fractal_shards, train_env, tmp_path, mlflow_uri
):
    from mlflow import MlflowClient

    run = tmp_path / "run"
    tracking = [f"logging.mlflow_tracking_uri={mlflow_uri}", "logging.mlflow_experiment=stop"]
    sets = _tiny(tiny_fractal_shards, run, "schedule.total=10000", "checkpoint.every_steps=2", "logging.log_every=1")
    done = ctrl_c(
        _command([*sets, *tracking]), lambda out: "\nstep 3/" in f"\n{out.read_text()}", tmp_path, env=train_env()
    )
    assert json.loads(attempt_path(run, 1).read_text())["outcome"] == "stopped"
    client = MlflowClient(tracking_uri=mlflow_uri)
    (mlflow_run,) = client.search_runs([client.get_experiment_by_name("stop").experiment_id])
    assert (mlflow_run.info.status, mlflow_run.data.tags[keys.STATUS]) == ("KILLED", "stopped")
    newest = run_folder.latest_checkpoint(run)  # step 2's, or a later one saved before the signal came
    assert done.returncode == 130 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert [line for line in done.stderr.splitlines() if "interrupted" in line] == [
        f"{PROG}: interrupted; kept {newest}, the newest complete checkpoint: the same command resumes from it"
    ]
    # The same command again continues that MLflow run (one run per run folder, as a relaunched job's), each step once
    step = run_folder.parse_step(newest.name)
    again = subprocess.run(
        _command([*sets, *tracking, f"schedule.stop_at_step={step + 2}"]),
        env=train_env(),
        capture_output=True,
        text=True,
        timeout=200,
    )
    assert again.returncode == 0 and f"continuing MLflow run {mlflow_run.info.run_id}" in again.stdout, again.stderr
    (continued,) = client.search_runs([client.get_experiment_by_name("stop").experiment_id])
    assert (continued.info.run_id, continued.info.status) == (mlflow_run.info.run_id, "FINISHED")
    steps = [m.step for m in client.get_metric_history(continued.info.run_id, keys.LOSS)]
    assert sorted(steps) == sorted(set(steps)) and max(steps) == step + 2, steps
