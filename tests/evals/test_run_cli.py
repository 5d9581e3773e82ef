"""`python -m evals.run` as a user runs it: Ctrl-C in the middle of a suite, and the path of the SQLite database given
as --tracking-uri; real shards, a real checkpoint folder, real MLflow on SQLite."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

from evals.run import main
from pretrain.model.vit import build_model
from pretrain.weights.formats import save_pretrained
from tests.support.interrupt import assert_one_line, ctrl_c

FEWSHOT = "  - type: fewshot\n    datasets: [digits]\n    shots: [1]\n    seeds: [0]\n"
# Far more steps than the test waits for: Ctrl-C lands while it trains.
LONG_FINETUNE = (
    "  - type: finetune\n    datasets: [digits]\n    steps: 5000\n    batch_size: 16\n    lr_grid: [0.01]\n"
    "    warmup_steps: 1\n    max_train_examples: 400\n"
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("run") / "checkpoints" / "step_00000120"
    save_pretrained(build_model("vit_tiny_debug", num_classes=32), folder)
    (folder / "trainer_state.json").write_text(json.dumps({"step": 120, "images_seen": 7680}))
    (folder / "COMPLETE").write_text("")
    return folder


def _metrics(uri: str, run_id: str) -> dict:
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=uri).get_run(run_id).data.metrics


@pytest.mark.timeout(120)
def test_ctrl_c_in_a_suite_is_one_line_that_says_nothing_of_it_is_kept(
    eval_data_root, checkpoint, tmp_path, mlflow_uri
):
    from tracking.runs import create_run

    run_id = create_run(mlflow_uri, "evals-ctrl-c", "tiny", params={})
    suite = tmp_path / "cut_short.yaml"
    suite.write_text(f"name: cut_short\nevaluators:\n{FEWSHOT}{LONG_FINETUNE}")
    command = [sys.executable, "-m", "evals.run", "--checkpoint", str(checkpoint), "--suite", str(suite)]
    command += ["--data-root", str(eval_data_root), "--mlflow-run-id", run_id, "--tracking-uri", mlflow_uri]
    done = ctrl_c(command, lambda out: "evals: fewshot done" in out.read_text(), tmp_path)

    line = assert_one_line(done, "python -m evals.run")
    assert "its table is written, then logged to MLflow, only at the end; the same command starts over" in line
    assert not (checkpoint / "evals" / "cut_short.parquet").exists() and _metrics(mlflow_uri, run_id) == {}


@pytest.mark.timeout(180)
def test_the_path_of_the_sqlite_store_is_its_uri_and_a_path_to_nothing_is_refused_before_any_work(
    eval_data_root, checkpoint, tmp_path, mlflow_uri, monkeypatch, capsys
):
    """MLflow reads a plain path as its old ./mlruns folder store, which it refuses: the suite used to run to the end
    and then fail to log (exit 1). The database's path is taken as its sqlite:/// URI; a path where no file is
    gives the exact URI to pass."""
    from tracking.runs import create_run

    run_id = create_run(mlflow_uri, "evals-path", "tiny", params={})
    db = Path(mlflow_uri.removeprefix("sqlite:///"))
    suite = tmp_path / "by_path.yaml"
    suite.write_text(f"name: by_path\nevaluators:\n{FEWSHOT}")
    argv = ["--checkpoint", str(checkpoint), "--suite", str(suite), "--data-root", str(eval_data_root)]
    argv += ["--out", str(tmp_path / "evals"), "--mlflow-run-id", run_id]
    monkeypatch.chdir(db.parent)
    assert main([*argv, "--tracking-uri", db.name]) == 0, capsys.readouterr().err
    assert set(_metrics(mlflow_uri, run_id)) == {"fewshot/digits/1shot", "fewshot/mean/1shot"}

    (tmp_path / "evals" / "by_path.parquet").unlink()
    capsys.readouterr()
    assert main([*argv, "--tracking-uri", "mlfow.db"]) == 2
    err = capsys.readouterr().err
    fix = f"pass --tracking-uri sqlite:///{db.parent / 'mlfow.db'} (an SQLite store) or a server's URL"
    assert (
        err.startswith("python -m evals.run: error: --tracking-uri mlfow.db is a path, not a tracking URI")
        and fix in err
    )
    assert err.count("\n") == 1 and not (tmp_path / "evals" / "by_path.parquet").exists()


@pytest.mark.timeout(60)
def test_a_missing_checkpoint_or_suite_is_named_before_the_data_root_is_asked(checkpoint, tmp_path, capsys):
    """The free checks first: a remote --data-root can spend a minute in its client's retries before it fails (gcsfs
    without a network: 50 s here), only to be followed by "checkpoint ... does not exist". A data root under a file
    fails at once, and stands in for it."""
    (tmp_path / "file").write_text("")
    root = str(tmp_path / "file" / "evals")
    missing = ["--checkpoint", str(tmp_path / "nothing"), "--suite", "local_fewshot", "--data-root", root]
    assert main(missing) == 2
    assert capsys.readouterr().err.startswith(
        f"python -m evals.run: error: checkpoint {tmp_path / 'nothing'} does not exist; "
    )
    assert main(["--checkpoint", str(checkpoint), "--suite", "nope", "--data-root", root]) == 2
    assert capsys.readouterr().err.startswith("python -m evals.run: error: unknown eval suite 'nope'; known suites in ")


def test_a_finetune_grid_that_diverges_at_every_lr_is_one_line(eval_data_root, checkpoint, tmp_path, capsys):
    """Every lr of the grid diverging ended the command in a FloatingPointError's traceback (exit 1)."""
    suite = tmp_path / "diverge.yaml"
    finetune = "    datasets: [digits]\n    steps: 6\n    batch_size: 16\n    max_train_examples: 100\n"
    finetune += "    lr_grid: [100.0]\n    warmup_steps: 0\n    grad_clip: 0\n"
    suite.write_text(f"name: diverge\nevaluators:\n  - type: finetune\n{finetune}")
    args = ["--checkpoint", str(checkpoint), "--suite", str(suite), "--data-root", str(eval_data_root)]
    assert main([*args, "--out", str(tmp_path / "out"), "--num-threads", "1"]) == 2
    assert capsys.readouterr().err == (
        "python -m evals.run: error: fine-tuning diverged at every lr of the grid [100.0]; use lower lrs\n"
    )


def test_a_database_uri_without_its_driver_is_refused_before_any_work(checkpoint, tmp_path, capsys):
    """`--tracking-uri postgresql://...` without psycopg was taken for a server that is down: the whole suite ran,
    then the command exited 1 saying MLflow was not reached."""
    uri, out = "postgresql://user@127.0.0.1:1/mlflow", tmp_path / "out"
    argv = ["--checkpoint", str(checkpoint), "--suite", "local_fewshot", "--out", str(out)]
    assert main([*argv, "--mlflow-run-id", "abc", "--tracking-uri", uri]) == 2
    assert capsys.readouterr().err == (
        f"python -m evals.run: error: cannot read the tracking store {uri}: its database driver is not installed (No "
        "module named 'psycopg'); install the driver SQLAlchemy names for it into .venv, or pass the URL of an MLflow "
        "server\n"
    )
    assert not out.exists()


def test_a_default_output_folder_that_cannot_be_made_is_refused_before_any_work(checkpoint, tmp_path, capsys):
    """Without --out the table goes to evals/ inside the weights folder. Where that cannot be made (a link to a disk
    that is gone here; a read-only share of weights alike) the whole suite ran first and then ended in a bare
    "[Errno 17] File exists" that named no fix."""
    weights = shutil.copytree(checkpoint, tmp_path / "step_00000120", ignore=shutil.ignore_patterns("evals"))
    (weights / "evals").symlink_to(tmp_path / "unmounted" / "evals")
    suite, empty = tmp_path / "one.yaml", tmp_path / "empty"
    suite.write_text(f"name: one\nevaluators:\n{FEWSHOT}")
    assert main(["--checkpoint", str(weights), "--suite", str(suite), "--data-root", str(empty)]) == 2
    out, err = capsys.readouterr()
    assert err == (
        "python -m evals.run: error: "
        f"output folder {weights / 'evals'} (the default for these weights) cannot be created: "
        f"{weights / 'evals'} is a broken symbolic link (to {tmp_path / 'unmounted' / 'evals'}); pass --out a "
        "writable folder (it is created if absent)\n"
    )
    assert "fewshot" not in out and not empty.exists()  # nothing evaluated, no built-in set generated


def test_a_vtab_suite_with_no_task_under_its_data_root_is_refused(checkpoint, tmp_path, capsys):
    """A mistyped --data-root made a VTAB suite report 19 missing tasks, log `vtab/num_tasks` 0 and exit 0: an
    evaluation that evaluated nothing."""
    args = ["--checkpoint", str(checkpoint), "--suite", "vtab1k_probe", "--data-root", str(tmp_path / "vtba")]
    assert main([*args, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(
        f"python -m evals.run: error: none of the 19 vtab1k tasks of the suite has data under {tmp_path / 'vtba'} ("
    )
    assert err.count("\n") == 1 and not (tmp_path / "out" / "vtab1k_probe.parquet").exists()


def test_an_evaluation_of_a_step_the_run_holds_is_not_logged_twice(eval_data_root, checkpoint, tmp_path, mlflow_uri):
    """Evaluating a checkpoint again into its run (or a VTAB fine-tune after the scheduled linear probe, both
    `vtab/...`) logged a second value at the step: `vtab/mean` then mixed two protocols without a word. What the run
    holds at the step is left as it is, with one warning; the rest is logged."""
    from mlflow import MlflowClient

    from tracking.runs import create_run

    run_id = create_run(mlflow_uri, "evals-again", "tiny", params={})
    client = MlflowClient(tracking_uri=mlflow_uri)
    client.log_metric(run_id, "fewshot/digits/1shot", 0.5, step=120)  # an earlier evaluation of this step
    suite = tmp_path / "again.yaml"
    suite.write_text(f"name: again\nevaluators:\n{FEWSHOT}")
    args = ["--checkpoint", str(checkpoint), "--suite", str(suite), "--data-root", str(eval_data_root)]
    args += ["--mlflow-run-id", run_id, "--tracking-uri", mlflow_uri, "--out", str(tmp_path / "out")]
    for _ in range(2):
        assert main(args) == 0
    histories = {key: client.get_metric_history(run_id, key) for key in client.get_run(run_id).data.metrics}
    assert len(histories) > 1 and all([m.step for m in h] == [120] for h in histories.values()), histories
    assert histories["fewshot/digits/1shot"][0].value == 0.5


def _suite(tmp_path: Path, file: str, text: str) -> Path:
    (tmp_path / file).write_text(text)
    return tmp_path / file


def test_a_suite_of_the_same_name_run_again_leaves_the_runs_table_and_the_earlier_local_one(
    eval_data_root, checkpoint, tmp_path, mlflow_uri
):
    """A second suite of the same name at an evaluated step: MLflow kept the first values (held keys are not logged
    again) but its table artifact, and the local table, were replaced by the second table, which the run's metrics
    do not hold."""
    import pyarrow.parquet as pq
    from mlflow import MlflowClient

    from tracking.runs import create_run

    run_id = create_run(mlflow_uri, "evals-rerun", "tiny", params={})
    first = _suite(tmp_path, "first.yaml", f"name: again\nevaluators:\n{FEWSHOT}")
    second = _suite(tmp_path, "second.yaml", f"name: again\nevaluators:\n{FEWSHOT.replace('[1]', '[1, 2]', 1)}")
    out = tmp_path / "out"
    common = ["--checkpoint", str(checkpoint), "--data-root", str(eval_data_root), "--mlflow-run-id", run_id]
    common += ["--tracking-uri", mlflow_uri, "--out", str(out)]
    assert main([*common, "--suite", str(first)]) == 0
    earlier = pq.read_table(out / "again.parquet").select(["metric", "value"]).to_pylist()
    assert main([*common, "--suite", str(second)]) == 0
    client = MlflowClient(tracking_uri=mlflow_uri)
    artifact = client.download_artifacts(run_id, "evals/step_00000120/again.parquet", str(tmp_path))
    assert pq.read_table(artifact).select(["metric", "value"]).to_pylist() == earlier  # what its metrics hold
    assert pq.read_table(out / "again.parquet").select(["metric", "value"]).to_pylist() == earlier
    newer = {r["metric"] for r in pq.read_table(out / "again.unlogged.parquet").to_pylist()}
    assert {"fewshot/digits/2shot", "fewshot/digits/1shot"} <= newer
    assert "fewshot/digits/2shot" in client.get_run(run_id).data.metrics


def test_exported_weights_without_a_step_are_not_logged_over_the_runs_step_0(
    eval_data_root, checkpoint, tmp_path, mlflow_uri, capsys
):
    """An exported folder carries no step: logged into a training run without --step, it landed at step 0 and
    replaced the run's before-training baseline without a word."""
    from tracking.runs import create_run

    exported = tmp_path / "exported"
    torch.manual_seed(0)
    save_pretrained(build_model("vit_tiny_debug", num_classes=32), exported)
    run_id = create_run(mlflow_uri, "evals-exported", "tiny", params={})
    suite = _suite(tmp_path, "one.yaml", f"name: one\nevaluators:\n{FEWSHOT}")
    args = ["--weights", str(exported), "--suite", str(suite), "--data-root", str(eval_data_root)]
    args += ["--mlflow-run-id", run_id, "--tracking-uri", mlflow_uri, "--out", str(tmp_path / "out")]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"python -m evals.run: error: {exported} records no training step") and err.count("\n") == 1
    assert "pass --step N" in err and not _metrics(mlflow_uri, run_id)
    assert main([*args, "--step", "0"]) == 0  # given explicitly: the baseline it is
    assert _metrics(mlflow_uri, run_id)


def test_vtab1k_does_not_score_a_built_in_stand_in_as_the_vtab_task(eval_data_root, checkpoint, tmp_path, capsys):
    """The built-in dsprites_loc (64 px, data_pipeline.builtin) under --data-root was scored as VTAB-1k's
    dsprites_loc: `vtab/mean` over 1/19 tasks of a synthetic stand-in."""
    args = ["--checkpoint", str(checkpoint), "--suite", "vtab1k_probe", "--data-root", str(eval_data_root)]
    assert main([*args, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "dsprites_loc/train is the built-in stand-in" in err
    assert "--vtab dsprites_loc" in err and not (tmp_path / "out" / "vtab1k_probe.parquet").exists()


def test_a_named_vtab_entrys_coverage_names_its_own_mean(eval_data_root, checkpoint, tmp_path):
    """`ci_probe/num_tasks` said "tasks covered by vtab/mean": a key the named entry does not log."""
    import pyarrow.parquet as pq

    text = "name: named\nevaluators:\n  - type: vtab\n    name: ci_probe\n    benchmark: ci\n    tasks: [digits]\n"
    suite = _suite(tmp_path, "named.yaml", text)
    args = ["--checkpoint", str(checkpoint), "--suite", str(suite), "--data-root", str(eval_data_root)]
    assert main([*args, "--out", str(tmp_path / "out")]) == 0
    rows = {r["metric"]: r["detail"] for r in pq.read_table(tmp_path / "out" / "named.parquet").to_pylist()}
    assert rows["ci_probe/num_tasks"] == "tasks covered by ci_probe/mean (of 4)"
    assert rows["ci_probe/natural_num_tasks"] == "tasks covered by ci_probe/natural (of 1)"
