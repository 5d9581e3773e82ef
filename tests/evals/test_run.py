"""The suite runner on real built-in shards and a real checkpoint folder: table, parquet, MLflow, errors, CLI."""

import json
import math
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from evals.run import main
from evals.runner import CheckpointError, run_suite
from pretrain.model.vit import build_model
from pretrain.weights.formats import save_pretrained

PROJECT = Path(__file__).resolve().parents[2]

# One torch thread (run_suite's num_threads=None keeps it): torch's default, a thread per core, doubled the CPU time
# of every feature pass beside the suite's other workers on 2 cores and was 2-4x slower in wall time.
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def data_root(eval_data_root):
    return eval_data_root  # shared by every worker of the run: read, never written


def _save_checkpoint(folder: Path, **overrides) -> Path:
    torch.manual_seed(0)
    save_pretrained(build_model("vit_tiny_debug", num_classes=32, **overrides), folder)
    (folder / "trainer_state.json").write_text(json.dumps({"step": 120, "images_seen": 7680}))
    (folder / "COMPLETE").write_text("")
    return folder


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return _save_checkpoint(tmp_path_factory.mktemp("run") / "checkpoints" / "step_00000120")


@pytest.fixture(scope="module")
def shallow_checkpoint(tmp_path_factory):
    """The checkpoint with one block instead of four, for tests whose checks do not depend on the depth (the rows a
    suite writes, a resized model's features): the blocks were ~70% of their feature passes over thousands of
    images."""
    return _save_checkpoint(tmp_path_factory.mktemp("run") / "checkpoints" / "step_00000120", depth=1)


def write_suite(tmp_path, name, body):
    path = tmp_path / f"{name}.yaml"
    path.write_text(f"name: {name}\nevaluators:\n{body}")
    return path


FEWSHOT = "  - type: fewshot\n    datasets: [digits]\n    shots: [1, 5]\n    seeds: [0, 1]\n"


# One entry of each training-free type plus a few fine-tuning steps: the rows are the record, MLflow gets the `ok`
# rows with a finite value (not a missing task's NaN, not a held-out accuracy of each lr, which are `sweep` rows).
MIXED = FEWSHOT + (
    "  - type: finetune\n    datasets: [digits]\n    steps: 2\n    batch_size: 16\n    lr_grid: [0.01, 0.03]\n"
    "    warmup_steps: 1\n    max_train_examples: 40\n    eval_steps: [1, 2]\n"
    "  - type: vtab\n    benchmark: ci\n    tasks: [digits]\n    train_examples: 80\n    val_examples: 20\n"
)
MIXED_METRICS = {
    "fewshot/digits/1shot",
    "fewshot/digits/5shot",
    "fewshot/mean/1shot",
    "fewshot/mean/5shot",
    "finetune/digits/accuracy",
    "finetune/digits/lr",
    "finetune/digits/accuracy_at_1steps",
    "finetune/digits/accuracy_at_2steps",  # the learning curve
    "vtab/digits",
    "vtab/mean",
    "vtab/natural",
    "vtab/num_tasks",
    "vtab/natural_num_tasks",
    "vtab/specialized_num_tasks",
    "vtab/structured_num_tasks",
    "vtab/num_tasks_expected",
}


@pytest.mark.timeout(300)
def test_run_suite_writes_table_and_logs_mlflow(data_root, checkpoint, tmp_path, mlflow_uri):
    from mlflow import MlflowClient

    from tracking.runs import create_run

    uri = mlflow_uri
    run_id = create_run(uri, "evals-test", "tiny", params={"model": {"name": "vit_tiny_debug"}})
    suite = write_suite(tmp_path, "tiny_mixed", MIXED)
    table = run_suite(checkpoint, suite, data_root=data_root, mlflow_run_id=run_id, tracking_uri=uri, num_threads=1)

    rows = {r["metric"]: r for r in table.to_pylist()}
    five = rows["fewshot/digits/5shot"]
    assert 0.1 < five["value"] <= 1.0 and five["count"] == 2 and five["step"] == 120 and not math.isnan(five["std"])
    assert rows["fewshot/mean/5shot"]["value"] == pytest.approx(five["value"])
    assert rows["finetune/digits/lr"]["value"] in (0.01, 0.03) and rows["finetune/digits/holdout_accuracy"]
    # The curve's last point is the reported number: the same run, scored once.
    assert rows["finetune/digits/accuracy_at_2steps"]["value"] == rows["finetune/digits/accuracy"]["value"]
    assert rows["finetune/digits/accuracy_at_1steps"]["detail"] == "test top-1 after 1 of 2 steps (lr=" + (
        f"{rows['finetune/digits/lr']['value']:g})"
    )
    assert (rows["vtab/num_tasks"]["value"], rows["vtab/num_tasks_expected"]["value"]) == (1, 4)
    assert rows["vtab/structured"]["status"] == "missing" and rows["vtab/structured_num_tasks"]["value"] == 0
    written = pq.read_table(checkpoint / "evals" / "tiny_mixed.parquet")
    assert json.dumps(written.to_pylist()) == json.dumps(table.to_pylist())  # NaN std: compare as text

    client = MlflowClient(tracking_uri=uri)
    logged = client.get_run(run_id).data.metrics
    assert set(logged) == MIXED_METRICS
    assert all(logged[key] == pytest.approx(rows[key]["value"]) for key in MIXED_METRICS)
    history = client.get_metric_history(run_id, "fewshot/digits/5shot")
    assert [(m.step, m.value) for m in history] == [(120, pytest.approx(five["value"]))]
    artifacts = [a.path for a in client.list_artifacts(run_id, "evals/step_00000120")]
    assert artifacts == ["evals/step_00000120/tiny_mixed.parquet"]


@pytest.mark.timeout(300)
def test_an_eval_whose_tracking_server_is_down_ends_in_seconds(data_root, checkpoint, tmp_path, monkeypatch):
    """An eval task ends with a flush of its metrics. With the server down (here from the task's start, as at a job's
    end) and MLflow's default 7 retries, that flush waited out ~4 minutes of retries per call, which held the job's
    end (`EvalScheduler.drain`). It now asks the server first, and the table is still written. What MLflow did not
    take waits in the run folder's spool, the table copied there (keep_last may prune the checkpoint before the
    spool is sent); it used to be dropped."""
    from cluster.local_head import free_port
    from tracking.runs import RUN_RECORD
    from tracking.store import spool_dir

    monkeypatch.delenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", raising=False)
    monkeypatch.setattr("tracking.store.FAILING_SINCE", {})  # a fresh process: no send has failed yet
    monkeypatch.setattr("tracking.tracker.UNANSWERED_CLOSE_S", 2.0)
    uri, run_id = f"http://127.0.0.1:{free_port()}", "0" * 32
    record = checkpoint.parent.parent / RUN_RECORD
    record.write_text(json.dumps({"run_id": run_id, "tracking_uri": uri}))
    lines: list[str] = []
    started = time.monotonic()
    try:
        table = run_suite(
            checkpoint,
            write_suite(tmp_path, "tiny_fewshot", FEWSHOT),
            data_root=data_root,
            mlflow_run_id=run_id,
            tracking_uri=uri,
            num_threads=1,
            log=lines.append,
        )
        assert time.monotonic() - started < 60
        assert table.num_rows and (checkpoint / "evals" / "tiny_fewshot.parquet").exists()
        [spooled] = spool_dir(record).glob("*.json")
        # The last line says what MLflow lacks and where it waits (it used to say "logged 4 metrics to MLflow run").
        assert lines[-1].startswith(
            f"evals: warning: 5 of the 5 items (4 metrics, 1 file) at step 120 did not reach "
            f"MLflow run {run_id} yet (nothing accepts connections at 127.0.0.1:"
        ), lines
        assert lines[-1].endswith(
            f"they wait in {spooled}: `python -m cluster.driver.deliver {record.parent}` sends them"
        ) and not any("logged" in line for line in lines), lines
        payload = json.loads(spooled.read_text())
        assert payload["ref"] == run_id and {m[0] for m in payload["metrics"]} >= {"fewshot/digits/5shot"}
        [[copy, where]] = payload["artifacts"]
        assert where == "evals/step_00000120" and Path(copy).parent.parent == spooled.with_suffix(".files")
        assert Path(copy).read_bytes() == (checkpoint / "evals" / "tiny_fewshot.parquet").read_bytes()
    finally:
        record.unlink()
        shutil.rmtree(spool_dir(record), ignore_errors=True)


ONE_SHOT = "  - type: fewshot\n    datasets: [digits]\n    shots: [1]\n    seeds: [0]\n"


@pytest.mark.timeout(300)
def test_cli_exits_1_and_says_so_when_mlflow_did_not_take_the_metrics(
    data_root, checkpoint, tmp_path, capsys, monkeypatch
):
    """No server at the tracking URI: the table is written, and the command used to end with "logged 2 metrics to
    MLflow run ..." and exit 0. Its last line now says how many items did not reach the run and that they are not
    kept (the checkpoint's run folder does not record this run, so there is no spool), and it exits 1."""
    from cluster.local_head import free_port

    monkeypatch.delenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", raising=False)
    monkeypatch.setattr("tracking.store.FAILING_SINCE", {})  # a fresh process: no send has failed yet
    monkeypatch.setattr("tracking.tracker.UNANSWERED_CLOSE_S", 2.0)
    uri, run_id, table = f"http://127.0.0.1:{free_port()}", "0" * 32, tmp_path / "out" / "one_shot.parquet"
    argv = ["--checkpoint", str(checkpoint), "--suite", str(write_suite(tmp_path, "one_shot", ONE_SHOT))]
    argv += ["--data-root", str(data_root), "--out", str(table.parent), "--num-threads", "1"]
    capsys.readouterr()
    assert main([*argv, "--mlflow-run-id", run_id, "--tracking-uri", uri]) == 1
    out, err = capsys.readouterr()
    assert out.startswith(f"evals.run: warning: nothing accepts connections at {uri.removeprefix('http://')} ")
    assert "logged" not in out and pq.read_table(table).num_rows == 2
    assert err.endswith(
        f"and are not kept; the table is in {table}: run the evaluation again once MLflow answers\n"
    ) and err.splitlines()[-1].startswith(
        "python -m evals.run: error: "
        f"3 of the 3 items (2 metrics, 1 file) at step 120 did not reach MLflow run {run_id} ("
    ), err


@pytest.mark.timeout(300)
def test_a_run_the_tracking_server_lacks_is_refused_before_any_work(checkpoint, tmp_path, capsys):
    """A server that answers is asked for the run first, as an SQLite store is: an unknown or deleted run id used to
    be found out only after the evaluation, when MLflow refused its metrics."""
    from mlflow import MlflowClient

    from tests.tracking.test_tracking_server import MlflowServer
    from tracking.runs import create_run

    server = MlflowServer(tmp_path / "server", auth=False)
    server.start()
    try:
        deleted = create_run(server.uri, "evals-deleted", "run", params={})
        MlflowClient(tracking_uri=server.uri).delete_run(deleted)
        empty = tmp_path / "empty"  # the few-shot suite would generate its built-in sets here
        argv = ["--checkpoint", str(checkpoint), "--suite", "local_fewshot", "--data-root", str(empty)]
        cases = [
            ("0123abcd", f"MLflow run '0123abcd' does not exist in {server.uri}; check --mlflow-run-id"),
            (deleted, f"mlflow runs restore --run-id {deleted}`) or pass another --mlflow-run-id"),
        ]
        capsys.readouterr()
        for run_id, needle in cases:
            assert main([*argv, "--mlflow-run-id", run_id, "--tracking-uri", server.uri]) == 2, run_id
            err = capsys.readouterr().err
            assert err.startswith("python -m evals.run: error: ") and err.count("\n") == 1 and needle in err, err
        assert not empty.exists() and not (checkpoint / "evals" / "local_fewshot.parquet").exists()
    finally:
        server.stop()


def test_a_data_root_or_out_that_cannot_be_one_is_refused_before_any_work(checkpoint, tmp_path, capsys, monkeypatch):
    """A --data-root that is a file (or under one), --out under a file, an S3 root without credentials: one line
    naming the option, before the few-shot suite generates its built-in sets under the empty root. --out under a file
    was found only after every feature was computed, as a bare "[Errno 20] Not a directory"; an S3 root without
    credentials was a 77-line botocore traceback."""
    import s3fs

    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))  # the user's files stay unread
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no instance role asked for either
    s3fs.S3FileSystem.clear_instance_cache()  # a client of an earlier test's credentials
    a_file, empty = tmp_path / "a_file", tmp_path / "empty"
    a_file.write_text("")
    argv = ["--checkpoint", str(checkpoint), "--suite", "local_fewshot"]
    cases = [
        (
            ["--data-root", str(empty), "--out", str(a_file / "sub")],
            f"--out {a_file / 'sub'}: cannot create the folder",
        ),
        (["--data-root", str(a_file)], f"--data-root {a_file}: {a_file} is a file, not a folder"),
        (["--data-root", str(empty), "--device", "gpu"], "device='gpu' is not a device name; use cpu or cuda"),
        (["--data-root", str(a_file / "sub")], f"--data-root {a_file / 'sub'}: {a_file} is a file, not a folder"),
        (
            ["--data-root", "s3://vitscale-no-bucket/vtab"],
            "--data-root s3://vitscale-no-bucket/vtab cannot be read (NoCredentialsError: Unable to locate credentials)"
            "; set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY",
        ),
    ]
    capsys.readouterr()
    for args, needle in cases:
        assert main([*argv, *args]) == 2, args
        err = capsys.readouterr().err
        assert err.startswith(f"python -m evals.run: error: {needle}") and err.count("\n") == 1, err
    assert not empty.exists() and not (checkpoint / "evals" / "local_fewshot.parquet").exists()
    s3fs.S3FileSystem.clear_instance_cache()


def test_a_refusing_store_as_data_root_is_one_line(checkpoint, refusing_store):
    """A store that refuses the credentials, as the entry point itself prints it: one line naming --data-root and
    the fix, none of the store clients' retry logs (gcsfs logs each retry with a traceback)."""
    for url, fix in [("s3://bucket/vtab", "set AWS_ACCESS_KEY_ID"), ("gs://bucket/vtab", "gcloud auth")]:
        done = subprocess.run(
            [sys.executable, "-m", "evals.run", "--checkpoint", str(checkpoint), "--suite", "local_fewshot"]
            + ["--data-root", url],
            cwd=PROJECT,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
        assert (
            done.stderr.startswith(f"python -m evals.run: error: --data-root {url} cannot be read (")
            and fix in done.stderr
        )


def test_a_missing_split_names_the_command_that_writes_it(tmp_path):
    """Every VTAB task used to get `python -m data_pipeline.builtin <task>`, which refuses a name it does not build."""
    from evals.features import resolve_split

    def message(root, dataset, generate=False):
        with pytest.raises(ValueError) as caught:
            resolve_split(root, dataset, "test", generate_builtin=generate)
        return str(caught.value)

    local, remote = tmp_path / "root", "memory://vitscale-missing/root"
    tfds = "`python -m data_pipeline.write --source tfds:TFDS_DIR --vtab caltech101 --split test --out "
    assert tfds + f"{local}/caltech101/test` from the task's TFDS folder, docs/vtab.md" in message(local, "caltech101")
    assert "data_pipeline.builtin" not in message(local, "caltech101")
    # dsprites_loc is a VTAB-1k task and a built-in stand-in: the TFDS folder for vtab1k, the built-in where allowed.
    assert "--vtab dsprites_loc --split test" in message(local, "dsprites_loc")
    built = message(remote, "dsprites_loc", generate=True)
    assert "`python -m data_pipeline.builtin dsprites_loc --out DIR`) and copy dsprites_loc/ to " + remote in built
    unknown = message(local, "cifar1000", generate=True)
    assert "'cifar1000' is an unknown dataset (not built in: fractal, rcdb, digits," in unknown
    assert "data_pipeline.builtin" not in unknown and "--vtab" not in unknown and not local.exists()


def test_fewshot_l2_sweep_picks_one_l2_per_shot(data_root, shallow_checkpoint, tmp_path):
    from evals.fewshot import L2_SWEEP

    body = "  - type: fewshot\n    datasets: [digits, dsprites_loc]\n    shots: [2, 5]\n    seeds: [0, 1]\n"
    suite = write_suite(tmp_path, "sweep", body + "    l2_sweep: true\n")
    rows = {r["metric"]: r for r in run_suite(shallow_checkpoint, suite, data_root=data_root, out=tmp_path).to_pylist()}
    for shots in (2, 5):
        chosen = rows[f"fewshot/l2/{shots}shot"]["value"]
        assert chosen in L2_SWEEP and "mean rank over 2 dataset(s)" in rows[f"fewshot/l2/{shots}shot"]["detail"]
        assert rows[f"fewshot/digits/{shots}shot"]["detail"] == f"l2={chosen:g}"
    fixed = write_suite(tmp_path, "fixed", body)
    fixed_rows = {
        r["metric"]: r for r in run_suite(shallow_checkpoint, fixed, data_root=data_root, out=tmp_path).to_pylist()
    }
    # Without the sweep: the paper's fixed l2, and no l2 metric.
    assert "fewshot/l2/5shot" not in fixed_rows and fixed_rows["fewshot/digits/5shot"]["detail"] == "l2=1024"


@pytest.mark.timeout(300)
def test_fewshot_and_the_linear_probe_at_another_resolution_use_the_resized_model(
    data_root, shallow_checkpoint, tmp_path
):
    # image_size resizes the model for frozen features too (position embeddings interpolated, docs/contracts.md), as
    # the plan prices them; it was fed 48 px images into the 32 px model, which refused them mid-suite.
    from evals.features import extract_features
    from evals.fewshot import fewshot_table
    from pretrain.weights.formats import load_model

    body = (
        "  - type: fewshot\n    datasets: [digits]\n    shots: [2]\n    seeds: [0]\n    image_size: 48\n"
        "  - type: vtab\n    benchmark: ci\n    tasks: [digits]\n    image_size: 48\n"
        "    train_examples: 80\n    val_examples: 20\n"
    )
    suite = write_suite(tmp_path, "resized", body)
    rows = {r["metric"]: r for r in run_suite(shallow_checkpoint, suite, data_root=data_root, out=tmp_path).to_pylist()}
    assert rows["vtab/digits"]["status"] == "ok" and 0.0 <= rows["vtab/digits"]["value"] <= 1.0
    resized = load_model(shallow_checkpoint, image_size=48)
    train = extract_features(resized, data_root / "digits" / "train")
    test = extract_features(resized, data_root / "digits" / "test")
    table = fewshot_table({"digits": (*train[:2], *test[:2], 10)}, [2], [0], [1024.0])
    assert rows["fewshot/digits/2shot"]["value"] == table["digits"][2][1024.0][0]


@pytest.mark.timeout(300)
def test_vtab_over_present_and_missing_tasks(data_root, shallow_checkpoint, tmp_path):
    # A VTAB root holding two of the 19 tasks: svhn, a copy of the built-in digits (10 classes) without its `builtin`
    # marker, as a written VTAB task is, and the built-in dsprites_loc itself: a stand-in, reported missing (it
    # was scored as VTAB's dsprites_loc). Everything else must be reported missing.
    import shutil

    vtab_root = tmp_path / "vtab"
    shutil.copytree(data_root / "digits", vtab_root / "svhn")
    for split in ("train", "test"):
        meta = json.loads((vtab_root / "svhn" / split / "dataset.json").read_text())
        meta.pop("builtin")
        (vtab_root / "svhn" / split / "dataset.json").write_text(json.dumps(meta))
    (vtab_root / "dsprites_loc").symlink_to(data_root / "dsprites_loc")
    suite = write_suite(
        tmp_path, "vtab_partial", f"  - type: vtab\n    benchmark: vtab1k\n    data_root: {vtab_root}\n"
    )
    table = run_suite(shallow_checkpoint, suite, data_root=data_root, out=tmp_path / "out")
    rows = {r["metric"]: r for r in table.to_pylist()}
    assert rows["vtab/svhn"]["status"] == "ok" and 0.0 < rows["vtab/svhn"]["value"] <= 1.0
    assert rows["vtab/caltech101"]["status"] == "missing" and math.isnan(rows["vtab/caltech101"]["value"])
    assert "no shard folder" in rows["vtab/caltech101"]["detail"]
    stand_in = rows["vtab/dsprites_loc"]
    assert stand_in["status"] == "missing" and "is the built-in stand-in" in stand_in["detail"]
    mean = rows["vtab/mean"]
    assert mean["count"] == 1 and mean["detail"].startswith("VTAB mean over 1/19 tasks")
    assert mean["value"] == pytest.approx(rows["vtab/svhn"]["value"])
    assert rows["vtab/specialized"]["status"] == "missing" and rows["vtab/specialized"]["count"] == 0
    assert (tmp_path / "out" / "vtab_partial.parquet").is_file()


def test_checkpoint_without_complete_is_refused(checkpoint, tmp_path):
    unfinished = tmp_path / "step_00000200"
    save_pretrained(build_model("vit_tiny_debug"), unfinished)
    (unfinished / "trainer_state.json").write_text(json.dumps({"step": 200}))
    with pytest.raises(CheckpointError, match="has no COMPLETE marker"):
        run_suite(unfinished, "local_fewshot")
    with pytest.raises(CheckpointError, match="does not exist"):
        run_suite(tmp_path / "nowhere", "local_fewshot")
    assert not (unfinished / "evals").exists()


@pytest.mark.timeout(300)
def test_bad_dataset_and_shots_raise(data_root, shallow_checkpoint, tmp_path):
    # Labels exceeding the declared classes: a copy of digits whose dataset.json claims 5 classes.
    import shutil

    broken = tmp_path / "root" / "digits"
    shutil.copytree(data_root / "digits", broken)
    for split in ("train", "test"):
        meta = json.loads((broken / split / "dataset.json").read_text())
        (broken / split / "dataset.json").write_text(json.dumps({**meta, "num_classes": 5}))
    suite = write_suite(tmp_path, "s", FEWSHOT)
    with pytest.raises(ValueError, match=r"\d+ sample\(s\) have labels outside the declared classes 0..4"):
        run_suite(shallow_checkpoint, suite, data_root=tmp_path / "root", out=tmp_path / "o")

    many = write_suite(tmp_path, "many", "  - type: fewshot\n    datasets: [digits]\n    shots: [500]\n")
    with pytest.raises(ValueError, match="500-shot needs 500 training examples per class"):
        run_suite(shallow_checkpoint, many, data_root=data_root, out=tmp_path / "o")


def test_a_gpu_index_the_machine_lacks_is_refused_before_any_work(checkpoint, tmp_path, capsys, monkeypatch):
    # --device cuda:N past the last visible GPU passed the check and failed later in model.to() with torch's
    # "invalid device ordinal" traceback. Here: a one-GPU machine as torch reports it.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    lines, out = [], tmp_path / "out"
    expected = "device='cuda:1' is not available here: this machine has 1 GPU (cuda:0); use one of them, or cpu"
    with pytest.raises(ValueError, match=f"^{re.escape(expected)}$"):
        run_suite(checkpoint, "local_fewshot", data_root=tmp_path / "data", out=out, device="cuda:1", log=lines.append)
    assert lines == [] and not out.exists()
    args = ["--checkpoint", str(checkpoint), "--suite", "local_fewshot", "--data-root", str(tmp_path / "data")]
    assert main([*args, "--device", "cuda:1"]) == 2
    assert capsys.readouterr().err == f"python -m evals.run: error: {expected}\n"


def test_cli_reports_errors_in_one_line(checkpoint, data_root, tmp_path, capsys, mlflow_uri):
    from tracking.runs import create_run

    unfinished = tmp_path / "step_00000300"
    unfinished.mkdir()
    half = tmp_path / "half"  # the trainer's state is there, COMPLETE is not: still being written
    save_pretrained(build_model("vit_tiny_debug"), half)
    (half / "trainer_state.json").write_text(json.dumps({"step": 300}))
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    (no_weights / "notes.txt").write_text("not weights")
    truncated = tmp_path / "truncated"
    save_pretrained(build_model("vit_tiny_debug"), truncated)
    data = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[: len(data) // 2])
    pickled = tmp_path / "pickled.npz"
    pickled.write_bytes(b"\x80\x04K\x01.")  # pickle.dumps(1): never loaded
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    bad_seed = tmp_path / "bad_seed"  # a checkpoint whose recipe records a seed that is not an integer
    save_pretrained(build_model("vit_tiny_debug"), bad_seed)
    (bad_seed / "trainer_state.json").write_text(json.dumps({"step": 5}))
    (bad_seed / "config.yaml").write_text("recipe: x\nseed: abc\n")
    (bad_seed / "COMPLETE").write_text("")
    uri = mlflow_uri
    create_run(uri, "evals-errors", "run", params={})
    capsys.readouterr()  # MLflow's own log lines from creating the store
    ckpt, suite = ["--checkpoint", str(checkpoint)], ["--suite", "local_fewshot", "--data-root", str(data_root)]
    cases = [
        (["--checkpoint", str(tmp_path / "nowhere"), *suite], "nowhere does not exist"),
        (["--checkpoint", str(unfinished), *suite], "has no COMPLETE marker"),
        (["--checkpoint", str(half), *suite], "has no COMPLETE marker"),
        (["--checkpoint", str(no_weights), *suite], "cannot evaluate"),
        (["--checkpoint", str(truncated), *suite], "model.safetensors"),
        (["--checkpoint", str(pickled), *suite], "pickle"),
        ([*ckpt, "--suite", "no_such_suite"], "unknown eval suite 'no_such_suite'"),
        ([*ckpt, *suite, "--step", "x"], "--step 'x' is not an integer >= 0"),
        ([*ckpt, *suite, "--step", "-3"], "--step '-3' is not an integer >= 0"),
        ([*ckpt, *suite, "--step", "7"], "--step 7 contradicts checkpoint"),  # it is step 120
        ([*ckpt, *suite, "--num-threads", "0"], "--num-threads '0'"),
        ([*ckpt, *suite, "--init-seed", "3"], "add --random-init or drop it"),
        ([*ckpt, *suite, "--random-init", "--init-seed", "x"], "--init-seed 'x' is not an integer >= 0"),
        (["--checkpoint", str(bad_seed), *suite, "--random-init"], "records seed='abc', not an integer"),
        ([*ckpt, *suite, "--out", str(a_file)], "is a file"),
        ([*ckpt, *suite, "--device", "cuda:7" if torch.cuda.is_available() else "cuda"], "not available here"),
        ([*ckpt, *suite, "--mlflow-run-id", "0123abcd", "--tracking-uri", uri], "run '0123abcd' does not exist"),
        ([*ckpt, *suite, "--mlflow-run-id", "0123abcd", "--tracking-uri", f"sqlite:///{tmp_path}/no.db"], "no.db"),
    ]
    for argv, needle in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("python -m evals.run: error: ") and err.count("\n") == 1 and needle in err, (argv, err)
    assert not (checkpoint / "evals" / "local_fewshot.parquet").exists()  # nothing was evaluated
    # The entry point itself: exit 2, the message, no traceback.
    done = subprocess.run(
        [sys.executable, "-m", "evals.run", "--checkpoint", str(no_weights), "--suite", "local_fewshot"],
        cwd=PROJECT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr and "cannot evaluate" in done.stderr


@pytest.mark.timeout(300)
def test_any_loadable_weights_with_and_without_step(data_root, checkpoint, tmp_path, mlflow_uri):
    """An exported folder (`python -m pretrain.weights convert`, save_pretrained), an official .npz and a checkpoint
    folder;
    --step names the MLflow step of weights that carry none (default 0), a checkpoint keeps its own."""
    import numpy as np
    from mlflow import MlflowClient

    from pretrain.weights.__main__ import main as weights_main
    from tests.support.weights_npz_reference import official_arrays
    from tracking.runs import create_run

    npz = tmp_path / "ViT-tiny.npz"
    np.savez(npz, **official_arrays(width=32, depth=2, heads=4, mlp=64, patch=4, grid=8, num_classes=5))
    converted = tmp_path / "converted"
    weights_main(["convert", str(npz), str(converted)])  # model.safetensors + model.json, no step, no COMPLETE
    uri = mlflow_uri
    run_id = create_run(uri, "evals-any-weights", "run", params={})
    suite = write_suite(tmp_path, "any", "  - type: fewshot\n    datasets: [digits]\n    shots: [1]\n    seeds: [0]\n")
    common = ["--suite", str(suite), "--data-root", str(data_root), "--num-threads", "1"]
    mlflow, out = ["--mlflow-run-id", run_id, "--tracking-uri", uri], tmp_path / "out"
    runs = [  # (argv, the step logged, where the table goes)
        (["--weights", str(converted), "--step", "7", *mlflow], 7, converted / "evals"),
        (["--checkpoint", str(converted)], 0, converted / "evals"),
        (["--checkpoint", str(npz), "--step", "3", *mlflow], 3, tmp_path / "ViT-tiny_evals"),
        (["--checkpoint", str(checkpoint), "--step", "120", "--out", str(out), *mlflow], 120, out),  # its own step
    ]
    for argv, step, folder in runs:
        assert main([*argv, *common]) == 0, argv
        rows = pq.read_table(folder / "any.parquet").to_pylist()
        assert {r["step"] for r in rows} == {step} and rows[0]["metric"] == "fewshot/digits/1shot", argv
    history = MlflowClient(tracking_uri=uri).get_metric_history(run_id, "fewshot/digits/1shot")
    assert sorted(m.step for m in history) == [3, 7, 120]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_cli_module_entry_point(data_root, checkpoint, tmp_path):
    suite = write_suite(tmp_path, "cli_fewshot", "  - type: fewshot\n    datasets: [digits]\n    shots: [1]\n")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "evals.run",
            "--checkpoint",
            str(checkpoint),
            "--suite",
            str(suite),
            "--data-root",
            str(data_root),
            "--out",
            str(tmp_path / "cli"),
            "--num-threads",
            "1",
        ],
        cwd=PROJECT,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert done.returncode == 0, done.stderr
    assert "fewshot/digits/1shot" in done.stdout and (tmp_path / "cli" / "cli_fewshot.parquet").is_file()


@pytest.mark.timeout(300)
def test_vtab_finetune_protocol_at_a_new_resolution(data_root, checkpoint, tmp_path):
    # The paper's VTAB adaptation path, shrunk: fine-tune at 48 px (position embeddings interpolated from the
    # checkpoint's 8x8 grid to 12x12), lr chosen on val, refit on train+val, test top-1. Few steps: this checks
    # the wiring and the coverage report, not the score.
    suite = write_suite(
        tmp_path,
        "vtab_ft",
        "  - type: vtab\n    benchmark: ci\n    tasks: [digits]\n    protocol: finetune\n    image_size: 48\n"
        "    train_examples: 80\n    val_examples: 20\n"
        "    finetune: {steps: 4, batch_size: 16, lr_grid: [0.01, 0.03], warmup_steps: 1}\n",
    )
    table = run_suite(checkpoint, suite, data_root=data_root, out=tmp_path / "out", num_threads=1)
    rows = {r["metric"]: r for r in table.to_pylist()}
    assert rows["vtab/digits"]["status"] == "ok" and 0.0 <= rows["vtab/digits"]["value"] <= 1.0
    assert "finetune lr=" in rows["vtab/digits"]["detail"] and "at 48px" in rows["vtab/digits"]["detail"]
    assert (
        rows["vtab/dsprites_loc"]["status"] == "missing" and "not in this suite" in rows["vtab/dsprites_loc"]["detail"]
    )
    assert rows["vtab/mean"]["detail"] == "VTAB mean over 1/4 tasks (missing: dsprites_loc, dsprites_ori, shapes_count)"


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("suite", ["local_fewshot", "ci_vtab"])
def test_shipped_suites_run_end_to_end(data_root, shallow_checkpoint, tmp_path, suite):
    # The suites the local demo schedules after every checkpoint; missing built-ins are generated on first use.
    table = run_suite(shallow_checkpoint, suite, data_root=data_root, out=tmp_path, num_threads=1)
    rows = {r["metric"]: r for r in table.to_pylist()}
    if suite == "local_fewshot":
        for dataset in ("digits", "dsprites_loc", "dsprites_ori"):
            for shots in (1, 5, 10, 25):
                assert rows[f"fewshot/{dataset}/{shots}shot"]["count"] == 3  # seeds 0-2
        assert rows["fewshot/mean/10shot"]["count"] == 3
    else:
        assert all(
            rows[f"vtab/{t}"]["status"] == "ok" for t in ("digits", "dsprites_loc", "dsprites_ori", "shapes_count")
        )
        assert rows["vtab/mean"]["detail"] == "VTAB mean over 4/4 tasks"
        specialized = rows["vtab/specialized"]  # the offline benchmark has no Specialized stand-in: says so
        assert specialized["status"] == "missing" and specialized["detail"] == "Specialized mean over 0/0 tasks"
        assert (rows["vtab/num_tasks"]["value"], rows["vtab/specialized_num_tasks"]["value"]) == (4, 0)
    scores = [r for r in rows.values() if r["status"] == "ok" and not r["metric"].endswith(("num_tasks", "expected"))]
    assert all(0.0 <= r["value"] <= 1.0 for r in scores)


@pytest.mark.timeout(300)
def test_official_npz_checkpoint(data_root, tmp_path):
    # An official-layout JAX .npz (the test helper of pretrain.weights.formats writes one): step 0, results beside it.
    import numpy as np

    from tests.support.weights_npz_reference import official_arrays

    npz = tmp_path / "ViT-tiny.npz"
    np.savez(npz, **official_arrays(width=32, depth=2, heads=4, mlp=64, patch=4, grid=8, num_classes=5))
    suite = write_suite(tmp_path, "npz_fewshot", "  - type: fewshot\n    datasets: [digits]\n    shots: [1]\n")
    table = run_suite(npz, suite, data_root=data_root, num_threads=1)
    row = table.to_pylist()[0]
    assert row["metric"] == "fewshot/digits/1shot" and row["step"] == 0 and 0.0 <= row["value"] <= 1.0
    assert (tmp_path / "ViT-tiny_evals" / "npz_fewshot.parquet").is_file()


INSPECT = (
    "  - type: inspect\n    dataset: digits\n    num_images: 8\n    num_rollout_images: 2\n    num_components: 4\n"
)


@pytest.mark.gpu
@pytest.mark.timeout(600)
def test_every_evaluator_type_runs_on_cuda_and_agrees_with_the_cpu(data_root, checkpoint, tmp_path):
    """Few-shot, fine-tuning, VTAB and inspect on CUDA give the CPU's rows. The values differ by float error only:
    up to 1e-3 relative for the inspect scalars, a few predictions for the accuracies (a few-shot score 0.02 at
    most, fine-tuning's 0.1, whose updates compound the differences). On an H200 every accuracy was equal and the
    inspect scalars within 5e-8."""
    suite = write_suite(tmp_path, "mixed", MIXED + INSPECT)
    cpu = {r["metric"]: r for r in run_suite(checkpoint, suite, data_root=data_root, out=tmp_path / "cpu").to_pylist()}
    table = run_suite(checkpoint, suite, data_root=data_root, out=tmp_path / "cuda", device="cuda")
    gpu = {r["metric"]: r for r in table.to_pylist()}
    assert gpu.keys() == cpu.keys() and any(m.startswith("inspect/") for m in gpu)
    diffs = {}
    for metric, row in cpu.items():
        assert (gpu[metric]["status"], gpu[metric]["count"]) == (row["status"], row["count"]), metric
        if row["status"] == "ok" and not metric.endswith(("num_tasks", "expected", "/lr")):
            diffs[metric] = abs(gpu[metric]["value"] - row["value"])
    print("largest CPU-CUDA differences:", sorted(diffs.items(), key=lambda kv: -kv[1])[:6])
    for metric, diff in diffs.items():
        if metric.startswith("inspect/"):
            assert diff <= 1e-3 * max(1.0, abs(cpu[metric]["value"])), (metric, diff)
        else:
            assert diff <= (0.02 if metric.startswith("fewshot/") else 0.1), (metric, diff)


def test_learning_curve_is_measured_along_the_one_run():
    """The curve scores the final run after the steps asked, without changing it: the same weights either way."""
    import numpy as np

    from evals.finetune import FinetuneOptions, accuracy, train_classifier

    gen = torch.Generator().manual_seed(0)
    images, labels = torch.rand(24, 3, 32, 32, generator=gen) * 2 - 1, np.arange(24) % 3
    opts = FinetuneOptions(steps=4, batch_size=8, warmup_steps=1)

    def run(**curve):
        torch.manual_seed(1)
        model = build_model("vit_tiny_debug", dropout=0.1)  # dropout on: measuring must not shift its masks either
        return train_classifier(model, images, labels, num_classes=3, lr=0.03, steps=4, opts=opts, **curve)

    torch.manual_seed(2)
    plain, none = run()
    torch.manual_seed(2)
    measured, curve = run(measure_at={1, 3}, measure=lambda m: accuracy(m, images, labels))
    assert none == {} and sorted(curve) == [1, 3] and all(0.0 <= acc <= 1.0 for acc in curve.values())
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), measured.state_dict().values()))
    assert measured.training  # handed back in train mode, as training left it


def test_random_init_has_the_checkpoints_shape_and_the_trainers_seed_rule(checkpoint, tmp_path):
    from evals.runner import init_seed, random_init
    from pretrain.randomness import seed_everything
    from pretrain.weights.formats import load_model

    trained = load_model(checkpoint)  # the fixture was built at seed 0: the step-0 model of a seed-0 recipe
    make = random_init(trained.config, 0)
    before = torch.get_rng_state()
    first, second = make(), make()
    assert torch.equal(torch.get_rng_state(), before)  # the caller's random state is left alone
    expected = trained.state_dict()
    assert {k: v.shape for k, v in first.state_dict().items()} == {k: v.shape for k, v in expected.items()}
    assert all(torch.equal(first.state_dict()[k], second.state_dict()[k]) for k in expected)  # deterministic
    assert all(torch.equal(first.state_dict()[k], v) for k, v in expected.items())  # = the trainer's seed-0 init
    seed_everything(7)  # what pretrain.engine does before building the step-0 model of a seed-7 recipe
    seven = build_model("vit_tiny_debug", num_classes=32).state_dict()
    other = random_init(trained.config, 7)().state_dict()
    assert all(torch.equal(other[k], v) for k, v in seven.items())
    assert not torch.equal(other["blocks.0.attn.qkv.weight"], expected["blocks.0.attn.qkv.weight"])
    assert make(image_size=48).pos_embed.shape == (1, 1 + 12 * 12, trained.config.width)  # interpolated, as loads

    assert init_seed(checkpoint) == 0  # no recipe saved beside the weights: every recipe's default
    (tmp_path / "config.yaml").write_text("recipe: local_demo\nseed: 7\n")
    assert init_seed(tmp_path) == 7 and init_seed(tmp_path / "missing.npz") == 0


@pytest.mark.timeout(300)
def test_cli_random_init_prints_both_and_the_gap(checkpoint, data_root, tmp_path, capsys):
    # A seed-0 recipe's checkpoint whose weights are not its step-0 init (drawn at seed 1 here, trained in a run):
    # its random init is the fixture's model (seed 0), so the baseline's rows must equal the fixture's own.
    torch.manual_seed(1)
    trained = tmp_path / "run" / "checkpoints" / "step_00000040"
    save_pretrained(build_model("vit_tiny_debug", num_classes=32), trained)
    (trained / "trainer_state.json").write_text(json.dumps({"step": 40}))
    (trained / "config.yaml").write_text("recipe: local_demo\nseed: 0\n")
    (trained / "COMPLETE").write_text("")
    suite = write_suite(tmp_path, "gap", "  - type: fewshot\n    datasets: [digits]\n    shots: [2]\n    seeds: [0]\n")
    common = ["--suite", str(suite), "--data-root", str(data_root), "--num-threads", "1"]
    assert main(["--checkpoint", str(trained), "--out", str(tmp_path / "out"), "--random-init", *common]) == 0
    printed = capsys.readouterr().out
    ours = pq.read_table(tmp_path / "out" / "gap.parquet").to_pylist()
    base = pq.read_table(tmp_path / "out" / "gap_random_init.parquet").to_pylist()
    assert {r["step"] for r in ours} == {40} and {r["step"] for r in base} == {0}
    assert base[0]["checkpoint"] == f"random init (seed 0) shaped as {trained}"
    reference = run_suite(checkpoint, suite, data_root=data_root, out=tmp_path / "ref", num_threads=1).to_pylist()
    assert [r["value"] for r in base] == [r["value"] for r in reference]  # the same seed rule as the trainer's
    a, b = ours[0]["value"], base[0]["value"]
    assert "random init of the same architecture (seed 0)" in printed
    assert f"{'fewshot/digits/2shot':<40} {a:>10.4f} {b:>11.4f} {a - b:>+9.4f}" in printed.splitlines()


@pytest.mark.timeout(300)
def test_a_remote_data_root_is_read_as_a_url(data_root, shallow_checkpoint, tmp_path, monkeypatch):
    # memory:// is a real fsspec filesystem and no local path: the shards copied there must score as the local ones.
    # From tmp_path, a URL mangled into a path ("memory:/...") would be a folder here.
    import fsspec

    monkeypatch.chdir(tmp_path)
    memory, url = fsspec.filesystem("memory"), f"memory://evals-{tmp_path.name}"
    memory.put(str(data_root / "digits"), f"{url}/digits", recursive=True)
    vtab = "  - type: vtab\n    benchmark: ci\n    tasks: [digits]\n    train_examples: 80\n    val_examples: 20\n"
    suite = write_suite(tmp_path, "remote", FEWSHOT + vtab)
    absent = write_suite(tmp_path, "absent", vtab.replace("[digits]", "[dsprites_loc]"))
    absent_fewshot = write_suite(tmp_path, "absent_fewshot", FEWSHOT.replace("[digits]", "[dsprites_loc]"))
    try:
        local = run_suite(shallow_checkpoint, suite, data_root=data_root, out=tmp_path / "local", num_threads=1)
        remote = run_suite(shallow_checkpoint, suite, data_root=url + "/", out=tmp_path / "remote", num_threads=1)
        # A built-in set is never generated under a remote root: VTAB without any of its tasks refuses, as few-shot.
        absent_root = f"{url} (no shard folder at {url}/dsprites_loc/"
        vtab_absent = f"none of the 1 ci tasks of the suite has data under {absent_root}"
        with pytest.raises(ValueError, match=re.escape(vtab_absent)):
            run_suite(shallow_checkpoint, absent, data_root=url, out=tmp_path / "remote")
        with pytest.raises(ValueError, match=re.escape(f"no shard folder at {url}/dsprites_loc/train; ") + ".* local"):
            run_suite(shallow_checkpoint, absent_fewshot, data_root=url, out=tmp_path / "remote")
    finally:
        memory.rm(url, recursive=True)
    local_rows, remote_rows = ({r["metric"]: r for r in t.to_pylist()} for t in (local, remote))
    for metric in ("fewshot/digits/1shot", "fewshot/digits/5shot", "fewshot/mean/5shot", "vtab/digits"):
        assert remote_rows[metric]["status"] == "ok" and remote_rows[metric]["value"] == local_rows[metric]["value"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "absent.yaml",
        "absent_fewshot.yaml",
        "local",
        "remote",
        "remote.yaml",
    ]


def test_resolution_must_be_a_multiple_of_the_patch_size():
    from evals.runner import check_resolution

    check_resolution("image_size", 224, 16)
    check_resolution("image_size", 378, 14)
    with pytest.raises(ValueError, match=r"^image_size: 384 is not a multiple of the patch size 14: use 378 or 392$"):
        check_resolution("image_size", 384, 14)
    with pytest.raises(ValueError, match=r"10 is not a multiple of the patch size 14: use 14$"):
        check_resolution("image_size", 10, 14)  # no valid size below


@pytest.mark.parametrize(
    "entry, setting",
    [
        ("  - type: finetune\n    name: ft\n    datasets: [digits]\n    crop_padding: 32\n", "crop_padding"),
        (
            "  - type: vtab\n    name: ft\n    benchmark: ci\n    protocol: finetune\n"
            "    finetune: {crop_padding: 32}\n",
            "finetune.crop_padding",
        ),
    ],
    ids=["finetune", "vtab"],
)
def test_a_crop_padding_as_large_as_the_models_images_is_refused_before_any_work(
    checkpoint, tmp_path, capsys, entry, setting
):
    # At the checkpoint's own size (32 px here) the limit is known once the weights load: reflect padding fails at
    # the first fine-tuning step, a traceback after the few-shot entry and the image reads.
    expected = (
        f"eval suite pad: evaluators[1].{setting} (ft): 32 must be smaller than the image size 32 (reflect padding "
        "mirrors at most 31 pixels); use at most 31"
    )
    _refused_before_any_work(checkpoint, write_suite(tmp_path, "pad", FEWSHOT + entry), tmp_path, capsys, expected)


@pytest.mark.parametrize(
    "entry",
    [
        "  - type: finetune\n    name: ft\n    datasets: [digits]\n    image_size: 30\n",
        "  - type: vtab\n    name: ft\n    benchmark: ci\n    protocol: finetune\n    image_size: 30\n",
        "  - type: fewshot\n    name: ft\n    datasets: [digits]\n    image_size: 30\n",
    ],
    ids=["finetune", "vtab", "fewshot"],
)
def test_a_resolution_off_the_patch_grid_is_refused_before_any_work(checkpoint, tmp_path, capsys, entry):
    # vit_tiny_debug has 4-pixel patches. The few-shot entry first would generate digits under the empty root.
    expected = (
        "eval suite off_grid: evaluators[1].image_size (ft): 30 is not a multiple of the patch size 4: use 28 or 32"
    )
    suite = write_suite(tmp_path, "off_grid", FEWSHOT + entry)
    _refused_before_any_work(checkpoint, suite, tmp_path, capsys, expected)


def _refused_before_any_work(checkpoint, suite, tmp_path, capsys, expected: str) -> None:
    """``run_suite`` raises ``expected`` and ``evals.run`` prints it, exit 2, before any data or output exists."""
    empty, out, lines = tmp_path / "empty", tmp_path / "out", []
    with pytest.raises(ValueError, match=f"^{re.escape(expected)}$"):
        run_suite(checkpoint, suite, data_root=empty, out=out, log=lines.append)
    assert lines == [] and not empty.exists() and not out.exists()
    capsys.readouterr()
    assert main(["--checkpoint", str(checkpoint), "--suite", str(suite), "--data-root", str(empty)]) == 2
    assert capsys.readouterr().err == f"python -m evals.run: error: {expected}\n"
    assert not empty.exists()


def test_a_split_a_built_in_set_does_not_have_names_the_ones_it_has(tmp_path):
    """rcdb and fractal have train and val. A suite asking rcdb's test split was told to generate rcdb, which
    writes no test split; the generator ran first, for nothing."""
    from evals.features import resolve_split

    for generate in (True, False):
        with pytest.raises(ValueError) as refused:
            resolve_split(tmp_path, "rcdb", "test", generate_builtin=generate)
        assert str(refused.value) == (
            f"no shard folder at {tmp_path / 'rcdb' / 'test'}: built-in dataset 'rcdb' has no split 'test', only "
            "train and val; name one in the suite entry (train_split / test_split, e.g. test_split: val)"
        )
    assert not (tmp_path / "rcdb").exists()  # nothing generated
