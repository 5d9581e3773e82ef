"""Eval data and a run folder on a real GCS-compatible server (gcp-storage-emulator's JSON API, on 127.0.0.1):
``python -m evals.run --checkpoint gs://... --data-root gs://...`` scores as the local copies do, and a ``gs://`` run
folder exports its newest COMPLETE checkpoint. The endpoint comes from the environment, as for any GCS client (the
``gcs_endpoint`` fixture, tests/conftest.py); the S3 twin of these tests is tests/evals/test_s3_evals.py."""

import json
import subprocess
import sys
from pathlib import Path

import fsspec
import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file

from evals.runner import run_suite
from pretrain.model.vit import model_config
from pretrain.weights.__main__ import main as weights_main
from tests.evals.test_s3_evals import CURVE
from tests.pretrain.test_export import _checkpoint, _random

PROJECT = Path(__file__).resolve().parents[2]
BUCKET = "vitscale-gcs"

# Few-shot features, and a fine-tune whose test split is streamed from the bucket at each point of its curve.
SUITE = (
    """name: gcs_evals
evaluators:
  - type: fewshot
    datasets: [digits]
    shots: [1, 5]
    seeds: [0]
"""
    + CURVE
)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_run_folder_and_a_suite_in_a_gcs_bucket_score_as_their_local_copies(gcs_endpoint, eval_data_root, tmp_path):
    run = tmp_path / "run"
    _checkpoint(run, 2, _random(model_config("vit_tiny_debug", num_classes=10, depth=2)))
    _checkpoint(run, 3, _random(model_config("vit_tiny_debug", num_classes=10, depth=1)), complete=False)
    gcs = fsspec.filesystem("gs")
    gcs.mkdir(BUCKET)
    gcs.put(str(eval_data_root / "digits"), f"{BUCKET}/data/digits", recursive=True)
    gcs.put(str(run), f"{BUCKET}/runs/r", recursive=True)
    assert gcs.exists(f"{BUCKET}/data/digits/test/manifest.parquet")
    suite = tmp_path / "gcs_evals.yaml"
    suite.write_text(SUITE)

    cli = [sys.executable, "-m", "evals.run", "--checkpoint", f"gs://{BUCKET}/runs/r", "--suite", str(suite)]
    cli += ["--data-root", f"gs://{BUCKET}/data", "--out", str(tmp_path / "gcs"), "--num-threads", "1"]
    done = subprocess.run(cli, cwd=PROJECT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-4000:]
    remote = pq.read_table(tmp_path / "gcs" / "gcs_evals.parquet").to_pylist()
    local = run_suite(run, suite, data_root=eval_data_root, out=tmp_path / "local", num_threads=1).to_pylist()
    scored = {r["metric"] for r in remote if r["status"] == "ok"}
    assert {"fewshot/digits/5shot", "finetune/digits/accuracy_at_2steps"} <= scored
    assert {r.pop("checkpoint") for r in remote} == {f"gs://{BUCKET}/runs/r/checkpoints/step_00000002"}
    assert {r.pop("checkpoint") for r in local} == {str(run / "checkpoints" / "step_00000002")}
    assert json.dumps(remote) == json.dumps(local)  # every other value of every row (NaN std too: compared as text)

    # The same rule for a weights source as locally: the newest COMPLETE checkpoint (step 2; step 3 is unfinished).
    assert weights_main(["export", f"gs://{BUCKET}/runs/r", str(tmp_path / "hf")]) == 0
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["num_hidden_layers"] == 2
    # An official-layout .npz in the bucket converts as its local copy does.
    assert weights_main(["export", str(run), str(tmp_path / "model.npz"), "--format", "npz"]) == 0
    gcs.put_file(str(tmp_path / "model.npz"), f"{BUCKET}/weights/model.npz")
    for name, npz in (("local", str(tmp_path / "model.npz")), ("bucket", f"gs://{BUCKET}/weights/model.npz")):
        assert weights_main(["convert", npz, str(tmp_path / f"{name}_weights")]) == 0  # "local" holds a suite table
    local, bucket = (load_file(tmp_path / f"{name}_weights" / "model.safetensors") for name in ("local", "bucket"))
    assert local.keys() == bucket.keys() and all(torch.equal(local[k], bucket[k]) for k in local)
