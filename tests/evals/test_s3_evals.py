"""Eval data on a real S3-compatible server (moto's, on 127.0.0.1): ``--data-root s3://...`` through
``python -m evals.run`` scores as the local copy does, few-shot and fine-tuning alike.

The endpoint comes from the environment, as for any S3 client (the ``s3_endpoint`` fixture, tests/conftest.py).
"""

import json
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from evals.runner import run_suite
from pretrain.model.vit import build_model
from pretrain.weights.formats import save_pretrained

PROJECT = Path(__file__).resolve().parents[2]
BUCKET = "vitscale-evals"

# Few-shot features, a VTAB-style fine-tune (train800/val200 shrunk to 80/20) and a fine-tune with a learning curve,
# whose test split is streamed from the bucket at each point.
SUITE = """name: s3_evals
evaluators:
  - type: fewshot
    datasets: [digits]
    shots: [1, 5]
    seeds: [0, 1]
  - type: vtab
    benchmark: ci
    tasks: [digits]
    protocol: finetune
    train_examples: 80
    val_examples: 20
    finetune: {steps: 2, batch_size: 16, lr_grid: [0.01, 0.03], warmup_steps: 1}
"""
CURVE = """  - type: finetune
    datasets: [digits]
    steps: 2
    batch_size: 16
    lr_grid: [0.01]
    warmup_steps: 1
    max_train_examples: 40
    eval_steps: [1, 2]
"""
SUITE += CURVE


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_suite_on_an_s3_data_root_scores_as_its_local_copy(s3_endpoint, eval_data_root, tmp_path):
    import s3fs

    s3 = s3fs.S3FileSystem(endpoint_url=s3_endpoint, key="testing", secret="testing", skip_instance_cache=True)
    s3.mkdir(BUCKET)
    s3.put(str(eval_data_root / "digits"), f"{BUCKET}/data/digits", recursive=True)
    assert s3.exists(f"{BUCKET}/data/digits/test/manifest.parquet")
    torch.manual_seed(0)
    weights = tmp_path / "weights"
    # One block: the check is that both copies score alike, at any depth; four made every feature pass ~3x dearer.
    save_pretrained(build_model("vit_tiny_debug", num_classes=32, depth=1), weights)
    suite = tmp_path / "s3_evals.yaml"
    suite.write_text(SUITE)

    data_root = f"s3://{BUCKET}/data"
    cli = [sys.executable, "-m", "evals.run", "--checkpoint", str(weights), "--suite", str(suite)]
    cli += ["--data-root", data_root, "--out", str(tmp_path / "s3"), "--num-threads", "1"]
    start = time.perf_counter()
    done = subprocess.run(cli, cwd=PROJECT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-4000:]
    remote = pq.read_table(tmp_path / "s3" / "s3_evals.parquet").to_pylist()
    middle = time.perf_counter()
    local = run_suite(weights, suite, data_root=eval_data_root, out=tmp_path / "local", num_threads=1).to_pylist()
    print(
        f"\nevals.run on s3:// {middle - start:.1f} s (a new process), run_suite on the local copy "
        f"{time.perf_counter() - middle:.1f} s"
    )

    scored = {r["metric"] for r in remote if r["status"] == "ok"}
    assert {"fewshot/digits/5shot", "vtab/digits", "finetune/digits/accuracy_at_1steps"} <= scored
    assert json.dumps(remote) == json.dumps(local)  # every row, every value (NaN std too: compared as text)


@pytest.mark.timeout(180)
def test_a_checkpoint_in_a_bucket_is_fetched_once_without_its_optimizer_state(
    s3_endpoint, tmp_path, capsys, monkeypatch
):
    """A run folder on s3:// means its newest COMPLETE checkpoint, as locally, for evals, load and export alike;
    only the checkpoint's own files are copied (not `deepspeed/`), once per listing; a URL with nothing there, or a
    damaged copy, is one line and exit 2."""
    import s3fs

    from evals import run as evals_run
    from evals.runner import open_checkpoint
    from pretrain.model.vit import model_config
    from pretrain.weights.__main__ import main as weights_main
    from pretrain.weights.formats import load_model
    from pretrain.weights.source import FETCHED, origin
    from tests.pretrain.test_export import _checkpoint, _random

    run = tmp_path / "run"
    for step in (1, 2, 3):
        folder = _checkpoint(run, step, _random(model_config("vit_tiny_debug", num_classes=4, depth=step)), step < 3)
        (folder / "deepspeed").mkdir()
        (folder / "deepspeed" / "optim_states.pt").write_bytes(b"\0" * 4096)  # stands for the optimizer state
    s3 = s3fs.S3FileSystem(endpoint_url=s3_endpoint, key="testing", secret="testing", skip_instance_cache=True)
    s3.mkdir(BUCKET)
    s3.put(str(run), f"{BUCKET}/runs/r", recursive=True)
    url = f"s3://{BUCKET}/runs/r"

    load, step, out, path = open_checkpoint(url)
    assert (step, path.name, out) == (2, "step_00000002", path / "evals")  # step 3 has no COMPLETE
    assert sorted(p.name for p in path.iterdir()) == sorted(
        [FETCHED, "COMPLETE", "checksums.json", "model.json", "model.safetensors", "trainer_state.json"]
    )
    assert origin(path) == f"{url}/checkpoints/step_00000002"  # what result rows name, not the cache path
    fetching, fetched = capsys.readouterr().out.splitlines()  # a copy of gigabytes says what it copies, and its rate
    assert fetching.startswith(f"fetching {url}/checkpoints/step_00000002: 5 file(s), ") and str(path) in fetching
    assert fetched.startswith(f"fetched {url}/checkpoints/step_00000002 in ") and fetched.endswith(" MB/s)")
    fetched_at = (path / FETCHED).stat().st_mtime_ns
    assert load().config.depth == 2 and load_model(f"{url}/checkpoints").config.depth == 2
    assert (path / FETCHED).stat().st_mtime_ns == fetched_at  # the same listing: the copy is reused
    assert "fetch" not in capsys.readouterr().out
    assert weights_main(["export", url, str(tmp_path / "hf")]) == 0
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["num_hidden_layers"] == 2

    # A new save in the bucket is a new listing: the run folder now means step 3
    s3.put_file(
        str(run / "checkpoints" / "step_00000002" / "COMPLETE"), f"{BUCKET}/runs/r/checkpoints/step_00000003/COMPLETE"
    )
    assert open_checkpoint(url)[1] == 3
    capsys.readouterr()
    suite = tmp_path / "s.yaml"
    suite.write_text("name: s\nevaluators:\n  - type: fewshot\n    datasets: [digits]\n    shots: [1]\n")
    for bad in (f"s3://{BUCKET}/runs/nothing-here", f"s3://{BUCKET}/runs"):
        assert evals_run.main(["--checkpoint", bad, "--suite", str(suite)]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and bad in err, err
    # Without credentials: one line naming the URL and the storage's refusal, not botocore's traceback
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no wait on an instance-metadata endpoint
    assert evals_run.main(["--checkpoint", f"{url}-elsewhere", "--suite", str(suite)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "NoCredentialsError" in err and f"{url}-elsewhere" in err, err
