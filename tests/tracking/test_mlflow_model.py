"""The run's model in MLflow (`tracking.models`), against a real SQLite store: logged on request
(`python -m pretrain.weights export ... --mlflow-run ID`) and at the end of a job (`cluster.driver.record.finish_job`),
loaded back with `mlflow.pyfunc.load_model` to our logits, tagged with its step and eval means, shown by
`make compare`; a model that cannot be logged costs the job one warning line, never its status."""

from __future__ import annotations

import csv
import json
import os
import re
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from cluster.driver.record import JobEnd, finish_job
from cluster.local_head import free_port
from pretrain.checkpoint import checksums
from pretrain.checkpoint.run_folder import COMPLETE, TrainerState
from pretrain.model.vit import VisionTransformer, model_config
from pretrain.weights.__main__ import main
from pretrain.weights.formats import save_pretrained
from tracking import keys
from tracking.compare import main as compare_main
from tracking.report_collect import collect
from tracking.report_render import CSV_NAME, format_table
from tracking.runs import create_run, run_tags

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("one_torch_thread")]
pytest.importorskip("transformers")
mlflow = pytest.importorskip("mlflow")


@pytest.fixture(scope="module")
def uri(tmp_path_factory) -> str:
    """One SQLite store for the module: creating its tables costs seconds on a busy machine."""
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"


def _random(**overrides) -> VisionTransformer:
    torch.manual_seed(0)
    model = VisionTransformer(model_config("vit_tiny_debug", **overrides))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(std=0.05 if p.ndim > 1 else 0.2)
    return model.eval()


def _checkpoint(run: Path, step: int, model: VisionTransformer) -> Path:
    """A COMPLETE checkpoint as far as export and evals read one (weights, trainer state, checksums)."""
    folder = run / "checkpoints" / f"step_{step:08d}"
    save_pretrained(model, folder)
    TrainerState(
        step=step, images_seen=8 * step, world_size=2, deepspeed_tag=folder.name, stream_state={}, rng_states=()
    ).write(folder)
    names = ("model.safetensors", "model.json", "trainer_state.json")
    checksums.write(folder, {name: checksums.entry(folder / name) for name in names})
    (folder / COMPLETE).write_text("")
    return folder


def _run(uri: str, name: str, evals: dict[int, float]) -> str:
    """A run with a training metric and few-shot / VTAB means at some steps, as the trainer and evals log them."""
    tags = run_tags("demo", "vit_tiny_debug", 2)
    run_id = create_run(uri, "models", name, {"model": {"name": "vit_tiny_debug"}}, tags)
    client = mlflow.MlflowClient(uri)
    for step, value in evals.items():
        client.log_metric(run_id, keys.FEWSHOT_MEAN_10SHOT, value, step=step)
        client.log_metric(run_id, keys.VTAB_MEAN, value / 2, step=step)
        client.log_metric(run_id, "fewshot/digits/10shot", value + 0.1, step=step)  # not a mean: not a tag
        client.log_metric(run_id, "vtab1k_probe/mean", value / 4, step=step)  # a named suite entry's mean
        client.log_metric(run_id, "inspect/mean_attention_distance/layer_1", 2.0, step=step)  # not a mean
        client.log_metric(run_id, keys.LOSS, 3.0 - value, step=step)
    return run_id


def _pixels(model: VisionTransformer) -> np.ndarray:
    side = model.config.image_size
    return np.random.default_rng(0).uniform(-1, 1, (3, 3, side, side)).astype(np.float32)


def _logits(model: VisionTransformer, pixels: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(pixels)).numpy()


@pytest.fixture
def load(monkeypatch):
    """`mlflow.pyfunc.load_model(uri)` against a store given as users give it (the variable), restored after."""

    def loaded(uri: str, model_uri: str):
        monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
        return mlflow.pyfunc.load_model(model_uri)

    return loaded


def test_a_checkpoint_logged_on_request_loads_back_with_our_logits(uri, tmp_path, capsys, load, monkeypatch):
    model = _random(num_classes=5)
    checkpoint = _checkpoint(tmp_path / "run", 40, model)
    run_id = _run(uri, "on-request", {0: 0.1, 40: 0.5})
    out = tmp_path / "hf"
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    before = mlflow.get_tracking_uri()
    assert main(["export", str(checkpoint), str(out), "--mlflow-run", run_id, "--tracking-uri", uri]) == 0
    # MLflow's process-wide URI (and the variable it sets) are as they were: later code keeps its default store.
    assert "MLFLOW_TRACKING_URI" not in os.environ and mlflow.get_tracking_uri() == before
    printed = capsys.readouterr().out
    model_uri = mlflow.MlflowClient(uri).get_run(run_id).data.tags[keys.MODEL_URI]
    assert f"logged to MLflow run {run_id} as {model_uri}" in printed and model_uri.startswith("models:/")
    loaded = load(uri, model_uri)
    pixels = _pixels(model)
    expected = _logits(model, pixels)
    got = loaded.predict(pixels)
    assert got.shape == (3, 5) and np.abs(got - expected).max() <= 1e-4 * np.abs(expected).max()
    # Signature, input example and tags: what the registry and serving read.
    signature = loaded.metadata.signature
    assert tuple(signature.inputs.to_dict()[0]["tensor-spec"]["shape"]) == (-1, 3, 32, 32)
    assert tuple(signature.outputs.to_dict()[0]["tensor-spec"]["shape"]) == (-1, 5)
    logged = mlflow.get_logged_model(model_uri.removeprefix("models:/"))
    # Filed with its run (experiment, artifacts next to the store), never under ./mlruns of the current folder.
    run = mlflow.MlflowClient(uri).get_run(run_id)
    assert logged.experiment_id == run.info.experiment_id and str(logged.status) == "READY"
    store = Path(uri.removeprefix("sqlite:///")).parent
    assert logged.artifact_location.startswith((store / "mlartifacts").as_uri()), logged.artifact_location
    assert logged.tags[keys.MODEL_TAG_STEP] == "40" and logged.tags[keys.MODEL_TAG_SOURCE] == str(checkpoint)
    assert float(logged.tags[keys.MODEL_TAG_EVAL_PREFIX + keys.FEWSHOT_MEAN_10SHOT]) == 0.5  # step 40's, not 0's
    assert float(logged.tags[keys.MODEL_TAG_EVAL_PREFIX + keys.VTAB_MEAN]) == 0.25
    assert float(logged.tags[keys.MODEL_TAG_EVAL_PREFIX + "vtab1k_probe/mean"]) == 0.125
    prefix = keys.MODEL_TAG_EVAL_PREFIX
    evals = {k.removeprefix(prefix) for k in logged.tags if k.startswith(prefix)}
    assert evals == {keys.FEWSHOT_MEAN_10SHOT, keys.VTAB_MEAN, "vtab1k_probe/mean"}  # not fewshot/digits, not inspect
    local = Path(mlflow.artifacts.download_artifacts(model_uri, tracking_uri=uri))
    assert json.loads((local / "input_example.json").read_text())  # an example is stored
    hf_folder = local / "artifacts" / "hf"  # a plain from_pretrained folder, for who wants transformers directly
    assert {"config.json", "model.safetensors", "preprocessor_config.json"} <= {p.name for p in hf_folder.iterdir()}


def test_a_headless_model_predicts_its_features(uri, tmp_path, capsys, load):
    model = _random(num_classes=0)
    checkpoint = _checkpoint(tmp_path / "run", 3, model)
    run_id = _run(uri, "headless", {3: 0.3})
    assert (
        main(["export", str(tmp_path / "run"), str(tmp_path / "hf"), "--mlflow-run", run_id, "--tracking-uri", uri])
        == 0
    )
    capsys.readouterr()
    model_uri = mlflow.MlflowClient(uri).get_run(run_id).data.tags[keys.MODEL_URI]
    assert mlflow.MlflowClient(uri).get_run(run_id).data.tags[keys.MODEL_STEP] == "3" and checkpoint.is_dir()
    pixels = _pixels(model)
    got, expected = load(uri, model_uri).predict(pixels), _logits(model, pixels)
    assert got.shape == (3, 64) and np.abs(got - expected).max() <= 1e-4 * np.abs(expected).max()


def test_an_older_checkpoint_does_not_displace_the_runs_final_model(uri, tmp_path, capsys):
    run_id = _run(uri, "two-models", {10: 0.2, 20: 0.4})
    for step in (20, 10):
        folder = _checkpoint(tmp_path / "run", step, _random(num_classes=3))
        assert (
            main(["export", str(folder), str(tmp_path / f"hf{step}"), "--mlflow-run", run_id, "--tracking-uri", uri])
            == 0
        )
    capsys.readouterr()
    tags = mlflow.MlflowClient(uri).get_run(run_id).data.tags
    assert tags[keys.MODEL_STEP] == "20"


def test_bad_requests_are_one_line_errors(uri, tmp_path, capsys):
    save_pretrained(_random(num_classes=3), tmp_path / "weights")
    run_id = _run(uri, "bad", {})
    cases = {
        (str(tmp_path / "weights"), run_id): r"weights is no training checkpoint: only a checkpoint",
        (str(_checkpoint(tmp_path / "run", 1, _random(num_classes=3))), "0" * 32): r"MLflow run '0{32}' is not in",
    }
    for (source, run), expected in cases.items():
        assert main(["export", source, str(tmp_path / "hf"), "--mlflow-run", run, "--tracking-uri", uri]) == 2
        err = capsys.readouterr().err
        lines = [line for line in err.splitlines() if "error:" in line]
        assert len(lines) == 1 and re.search(expected, lines[0]) and "Traceback" not in err, err
    # A server that does not answer was "no such run" after MLflow's retries (minutes): now said at once.
    down = f"http://127.0.0.1:{free_port()}"
    started = time.monotonic()
    argv = ["export", str(tmp_path / "run"), str(tmp_path / "hf"), "--mlflow-run", run_id, "--tracking-uri", down]
    assert main(argv) == 2 and time.monotonic() - started < 30
    err = capsys.readouterr().err
    assert f"error: no MLflow server answers at {down} (" in err and "is not in" not in err


def _finish(uri: str, run_dir: Path, run_id: str, status: str = "FINISHED") -> None:
    finish_job(run_dir, keep_last=5, uri=uri, run=run_id, end=JobEnd(status, 12.0, {}))


def test_the_end_of_a_job_logs_its_newest_checkpoint_and_compare_links_it(uri, tmp_path, capsys, load):
    model = _random(num_classes=4)
    _checkpoint(tmp_path / "run", 5, _random(num_classes=4, depth=1))
    _checkpoint(tmp_path / "run", 10, model)
    run_id = _run(uri, "job", {5: 0.3, 10: 0.6})
    _finish(uri, tmp_path / "run", run_id)
    out = capsys.readouterr().out
    run = mlflow.MlflowClient(uri).get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.tags[keys.MODEL_STEP] == "10"
    model_uri = run.data.tags[keys.MODEL_URI]
    assert f"final model: {model_uri} (step_00000010" in out
    pixels = _pixels(model)
    got, expected = load(uri, model_uri).predict(pixels), _logits(model, pixels)
    assert np.abs(got - expected).max() <= 1e-4 * np.abs(expected).max()
    # make compare: a line in the table, a column in runs.csv, the URI on the page.
    client = mlflow.MlflowClient(uri)
    comparison = collect(client, uri, run_ids=(run_id,))
    assert comparison.runs[0].model_uri == model_uri and comparison.runs[0].model_step == 10
    assert f"model [job]: {model_uri} (step 10; load with mlflow.pyfunc.load_model)" in format_table(comparison)
    assert (
        compare_main(
            ["--runs", run_id, "--tracking-uri", uri, "--out", str(tmp_path / "reports"), "--name", "m", "--no-mlflow"]
        )
        == 0
    )
    capsys.readouterr()
    rows = list(csv.DictReader((tmp_path / "reports" / "m" / CSV_NAME).open()))
    assert rows[0]["model_uri"] == model_uri and rows[0]["model_step"] == "10"
    assert model_uri in (tmp_path / "reports" / "m" / "index.html").read_text()


def test_a_model_hfs_vit_cannot_hold_is_said_once_as_the_plan_did_and_its_weights_are_not_read(uri, tmp_path, capsys):
    """`local_mpp` (a gap pool) and the i21k recipes (pre-logits): the plan says the final model is not logged, so
    the job's end says so once as an outcome, not a warning with an exception's name after loading the weights."""
    checkpoint = _checkpoint(tmp_path / "run", 7, _random(num_classes=4, pool="gap"))  # HF's ViT has no average pooling
    (checkpoint / "model.safetensors").write_bytes(b"not read")  # an H/14's 2.5 GB, loaded for nothing before
    run_id = _run(uri, "gap-job", {7: 0.4})
    _finish(uri, tmp_path / "run", run_id)
    out, err = capsys.readouterr()
    said = [line for line in out.splitlines() if "final model: not logged to MLflow (step_00000007)" in line]
    assert len(said) == 1 and "pool='gap'" in said[0] and "--format npz" in said[0], out
    assert "final model" not in err and "Traceback" not in err, err
    run = mlflow.MlflowClient(uri).get_run(run_id)
    assert run.info.status == "FINISHED" and keys.MODEL_URI not in run.data.tags
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["status"] == "FINISHED"


def test_a_failed_job_logs_no_model(uri, tmp_path, capsys):
    _checkpoint(tmp_path / "run", 2, _random(num_classes=4))
    run_id = _run(uri, "failed-job", {})
    _finish(uri, tmp_path / "run", run_id, status="FAILED")
    capsys.readouterr()
    run = mlflow.MlflowClient(uri).get_run(run_id)
    assert run.info.status == "FAILED" and keys.MODEL_URI not in run.data.tags
