"""evals.inspection on a real (tiny) VisionTransformer: every figure is written, non-blank, with finite metrics."""

import math
from pathlib import Path

import matplotlib.image
import numpy as np
import pytest
import torch

from evals import inspection as insp
from pretrain.model.vit import build_model


def _assert_nonblank_png(path):
    img = matplotlib.image.imread(path)
    assert img.ndim == 3 and min(img.shape[:2]) > 100, f"{path} is too small: {img.shape}"
    assert img[..., :3].std() > 0.05, f"{path} looks blank"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("pool", ["token", "gap"])
def test_run_inspection_writes_every_figure(tmp_path, pool):
    torch.manual_seed(0)
    model = build_model("vit_tiny_debug", num_classes=10, pool=pool)
    model.train()
    images = torch.rand(6, 3, 32, 32) * 2 - 1
    config = insp.InspectConfig(num_images=6, num_rollout_images=2, batch_size=4)
    metrics, figures = insp.run_inspection(model, images, tmp_path, config, label="tiny")
    assert model.training, "run_inspection must restore the training mode"
    names = sorted(p.name for p in figures)
    assert names == sorted(
        [
            "attention_distance.png",
            "position_embedding_similarity.png",
            "embedding_filters.png",
            "attention_rollout.png",
        ]
    )
    for path in figures:
        assert path.parent == tmp_path
        _assert_nonblank_png(path)
    depth = model.config.depth
    assert {f"inspect/mean_attention_distance/layer_{i}" for i in range(1, depth + 1)} <= set(metrics)
    assert all(math.isfinite(v) for v in metrics.values())
    # A 32px image with 4px patches: no head can average farther than the image diagonal.
    assert 0 < metrics["inspect/mean_attention_distance/max_head"] < 32 * math.sqrt(2)
    distances = np.load(tmp_path / "attention_distance.npy")
    assert distances.shape == (depth, model.config.num_heads)


@pytest.mark.timeout(300)
def test_inspect_suite_writes_pngs_into_the_checkpoint_and_logs_them_to_mlflow(tmp_path, mlflow_uri):
    """configs/evals/inspect.yaml through evals.run on real digits shards, a checkpoint folder and a SQLite MLflow."""
    import json

    from mlflow import MlflowClient

    from data_pipeline.builtin.sets import ensure
    from evals.runner import run_suite
    from pretrain.weights.formats import save_pretrained
    from tracking.runs import create_run

    data_root = tmp_path / "data"
    ensure("digits", data_root, num_test=40, samples_per_shard=20)
    torch.manual_seed(0)
    checkpoint = tmp_path / "run" / "checkpoints" / "step_00000050"
    save_pretrained(build_model("vit_tiny_debug", num_classes=10), checkpoint)
    (checkpoint / "trainer_state.json").write_text(json.dumps({"step": 50, "images_seen": 3200}))
    (checkpoint / "COMPLETE").write_text("")
    uri = mlflow_uri
    run_id = create_run(uri, "inspect-test", "tiny", params={"model": {"name": "vit_tiny_debug"}})

    table = run_suite(checkpoint, "inspect", data_root=data_root, mlflow_run_id=run_id, tracking_uri=uri)

    metrics = {r["metric"]: r["value"] for r in table.to_pylist()}
    assert "inspect/mean_attention_distance/layer_4" in metrics
    pngs = sorted(p.name for p in (checkpoint / "evals" / "inspect").glob("*.png"))
    expected = ["attention_distance", "attention_rollout", "embedding_filters", "position_embedding_similarity"]
    assert pngs == [f"{n}.png" for n in expected]
    for name in pngs:
        _assert_nonblank_png(checkpoint / "evals" / "inspect" / name)
    client = MlflowClient(tracking_uri=uri)
    logged = {Path(a.path).name for a in client.list_artifacts(run_id, "evals/step_00000050")}
    assert {*pngs, "attention_distance.npy"} <= logged  # the header of configs/evals/inspect.yaml says so
    history = client.get_metric_history(run_id, "inspect/mean_attention_distance/layer_1")
    assert [m.step for m in history] == [50]


@pytest.mark.timeout(300)
def test_the_random_init_baselines_figures_do_not_replace_the_checkpoints(tmp_path):
    """`evals.run --random-init` keeps the baseline's table apart (<suite>_random_init.parquet); its figures were
    written over the checkpoint's in <out>/inspect/, so the folder showed the random init's attention."""
    import json

    from data_pipeline.builtin.sets import ensure
    from evals.runner import run_suite
    from pretrain.weights.formats import save_pretrained

    data_root, out = tmp_path / "data", tmp_path / "out"
    ensure("digits", data_root, num_test=40, samples_per_shard=20)
    torch.manual_seed(0)
    checkpoint = tmp_path / "run" / "checkpoints" / "step_00000050"
    save_pretrained(build_model("vit_tiny_debug", num_classes=10), checkpoint)
    (checkpoint / "trainer_state.json").write_text(json.dumps({"step": 50, "images_seen": 3200}))
    (checkpoint / "COMPLETE").write_text("")
    quiet = dict(data_root=data_root, out=out, log=lambda _: None)

    run_suite(checkpoint, "inspect", **quiet)
    ours = {p.name: p.read_bytes() for p in (out / "inspect").iterdir()}
    run_suite(checkpoint, "inspect", random_init_seed=1, **quiet)
    assert {p.name: p.read_bytes() for p in (out / "inspect").iterdir()} == ours
    baseline = out / "random_init" / "inspect"
    assert sorted(p.name for p in baseline.iterdir()) == sorted(ours)
    random, trained = (np.load(d / "attention_distance.npy") for d in (baseline, out / "inspect"))
    assert not np.array_equal(random, trained)


@pytest.mark.timeout(60)
@pytest.mark.usefixtures("only_new_objects_scanned")  # the scans below read what the test made, not the whole heap
def test_run_inspection_holds_one_batch_of_attention_at_a_time(tmp_path):
    """Every image's attention of every layer was kept on the host (~65 GB for ViT-L/16 at 384px on 128 images): when
    each forward pass starts, no attention map of a batch before the last may be alive, copies included."""
    import gc
    import warnings

    torch.manual_seed(0)
    model = build_model("vit_tiny_debug", num_classes=10)
    images = torch.rand(12, 3, 32, 32) * 2 - 1
    config = insp.InspectConfig(num_images=12, num_rollout_images=3, batch_size=2)
    tokens = model.pos_embed.shape[1]
    forward, alive = model.forward_attention, []

    def forward_attention(batch, **reduction):
        gc.collect()
        with warnings.catch_warnings():  # isinstance reads every object's __class__, deprecated ones' too
            warnings.simplefilter("ignore")
            maps = [o for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.shape[-2:] == (tokens, tokens)]
        alive.append(sum(t.numel() for t in maps))
        return forward(batch, **reduction)

    model.forward_attention = forward_attention
    insp.run_inspection(model, images, tmp_path, config)
    one_batch = model.config.depth * config.batch_size * model.config.num_heads * tokens * tokens
    assert len(alive) == 6 and max(alive) <= one_batch, f"attention values alive per forward pass: {alive}"
    with torch.no_grad():  # the batches' sums give the mean over all images at once
        everything = insp.mean_attention_distance(forward(images), grid=(8, 8), cell_pixels=4)
    np.testing.assert_allclose(np.load(tmp_path / "attention_distance.npy"), everything, rtol=1e-12)
