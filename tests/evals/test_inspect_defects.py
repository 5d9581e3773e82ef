"""Two `inspect` entries of one suite run keep their own outputs; inspection holds one layer's attention at a time."""

import gc
import json
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from evals import inspection as insp
from evals.runner import run_suite
from evals.suites import load_suite
from pretrain.model.vit import build_model
from pretrain.weights.formats import save_pretrained

# What the eval scheduler runs when `inspect` and `inspect_rcdb` are due at one step (`merged_suite`): both entries
# unnamed, so both are named after their type.
MERGED = (
    "name: inspect+inspect_rcdb\nevaluators:\n"
    "  - {type: inspect, dataset: digits, split: test, num_images: 6, num_rollout_images: 2, batch_size: 4}\n"
    "  - {type: inspect, dataset: dsprites_loc, split: test, num_images: 6, num_rollout_images: 2, batch_size: 4}\n"
)


def test_repeated_entry_names_are_made_unique(tmp_path):
    path = tmp_path / "merged.yaml"
    path.write_text(
        "evaluators:\n  - {type: inspect}\n  - {type: inspect}\n  - {type: inspect, name: inspect_2}\n"
        "  - {type: inspect, name: probe}\n"
    )
    assert [spec.name for spec in load_suite(path).evaluators] == ["inspect", "inspect_2", "inspect_2_2", "probe"]
    for bad in ("a/b", "..", ""):
        path.write_text(f"evaluators:\n  - {{type: inspect, name: {json.dumps(bad)}}}\n")
        with pytest.raises(ValueError, match="name"):
            load_suite(path)


@pytest.mark.timeout(300)
def test_two_inspect_entries_of_one_suite_keep_their_own_figures_metrics_and_artifacts(
    tmp_path, eval_data_root, mlflow_uri
):
    """Both entries wrote <out>/inspect/ and the keys inspect/..., and the runner uploaded both sets of files flat
    under evals/step_N/: the second entry's figures and numbers replaced the first's everywhere."""
    from mlflow import MlflowClient

    from tracking.runs import create_run

    torch.manual_seed(0)
    checkpoint = tmp_path / "run" / "checkpoints" / "step_00000050"
    save_pretrained(build_model("vit_tiny_debug", num_classes=10), checkpoint)
    (checkpoint / "trainer_state.json").write_text(json.dumps({"step": 50, "images_seen": 3200}))
    (checkpoint / "COMPLETE").write_text("")
    suite = tmp_path / "merged.yaml"
    suite.write_text(MERGED)
    run_id = create_run(mlflow_uri, "inspect-merged", "tiny", params={})

    table = run_suite(
        checkpoint, suite, data_root=eval_data_root, mlflow_run_id=run_id, tracking_uri=mlflow_uri, log=lambda _: None
    )

    rows = table.to_pylist()
    first = {r["metric"]: r["value"] for r in rows if r["dataset"] == "digits"}
    second = {r["metric"]: r["value"] for r in rows if r["dataset"] == "dsprites_loc"}
    assert "inspect/mean_attention_distance/layer_1" in first  # the default entry keeps its keys
    assert "inspect_2/mean_attention_distance/layer_1" in second
    assert not set(first) & set(second)
    out = checkpoint / "evals"
    for entry, dataset in (("inspect", "digits"), ("inspect_2", "dsprites_loc")):
        ours = {r["metric"].split("/", 1)[1]: r["value"] for r in rows if r["dataset"] == dataset}
        distances = np.load(out / entry / "attention_distance.npy")
        assert ours["mean_attention_distance/layer_1"] == pytest.approx(float(distances[0].mean()), rel=1e-12)
        assert len(list((out / entry).glob("*.png"))) == 4
    assert not np.array_equal(*(np.load(out / e / "attention_distance.npy") for e in ("inspect", "inspect_2")))

    client = MlflowClient(tracking_uri=mlflow_uri)
    logged = {a.path for a in client.list_artifacts(run_id, "evals/step_00000050")}
    assert "evals/step_00000050/attention_distance.png" in logged  # the default entry's place, as before
    nested = {a.path for a in client.list_artifacts(run_id, "evals/step_00000050/inspect_2")}
    assert "evals/step_00000050/inspect_2/attention_distance.npy" in nested
    local = Path(client.download_artifacts(run_id, "evals/step_00000050/inspect_2/attention_distance.npy", tmp_path))
    np.testing.assert_array_equal(np.load(local), np.load(out / "inspect_2" / "attention_distance.npy"))
    for metric in ("inspect/mean_attention_distance/layer_1", "inspect_2/mean_attention_distance/layer_1"):
        assert [m.step for m in client.get_metric_history(run_id, metric)] == [50]


def _attention_alive(tokens: int) -> int:
    """Attention weights ``(b, heads, T, T)`` that a Python name keeps alive, in values."""
    gc.collect()
    with warnings.catch_warnings():  # isinstance reads every object's __class__, deprecated ones' too
        warnings.simplefilter("ignore")
        return sum(
            o.numel()
            for o in gc.get_objects()
            if isinstance(o, torch.Tensor) and o.ndim == 4 and o.shape[-2:] == (tokens, tokens)
        )


@pytest.mark.timeout(120)
@pytest.mark.parametrize("pool", ["token", "gap"])
def test_inspection_holds_one_layer_of_attention_at_a_time(tmp_path, pool, monkeypatch, only_new_objects_scanned):
    """`forward_attention` returned every layer's attention of a batch at once (~16 GB on the device for ViT-L/16 at
    384 px, batch 32); the analyses reduce them layer by layer, so when a block starts no earlier layer's weights may
    be alive. The numbers stay those of the all-at-once analyses."""
    torch.manual_seed(0)
    model = build_model("vit_tiny_debug", num_classes=10, pool=pool)
    images = torch.rand(10, 3, 32, 32) * 2 - 1
    config = insp.InspectConfig(num_images=10, num_rollout_images=5, batch_size=4)
    tokens = model.pos_embed.shape[1]
    alive = []
    # As each block starts (forward_with_weights calls its first LayerNorm; the block itself is not called).
    hooks = [
        block.norm1.register_forward_pre_hook(lambda *_: alive.append(_attention_alive(tokens)))
        for block in model.blocks
    ]
    drawn, plot = {}, insp.plot_rollout

    def plot_rollout(images, maps, *args):  # the rollout maps drawn
        drawn["maps"] = maps
        return plot(images, maps, *args)

    monkeypatch.setattr(insp, "plot_rollout", plot_rollout)
    try:
        insp.run_inspection(model, images, tmp_path, config)
    finally:
        for hook in hooks:
            hook.remove()

    assert len(alive) == 3 * model.config.depth  # three batches
    assert max(alive) == 0, f"attention values alive as each block starts: {alive}"
    with torch.no_grad():
        everything = model.forward_attention(images)
    grid = (8, 8)
    distances = insp.mean_attention_distance(everything, grid, cell_pixels=4, num_prefix_tokens=model.num_prefix_tokens)
    np.testing.assert_allclose(np.load(tmp_path / "attention_distance.npy"), distances, rtol=1e-12)
    maps = insp.rollout_maps([w[:5] for w in everything], grid, model.num_prefix_tokens)
    np.testing.assert_allclose(drawn["maps"], maps, rtol=1e-12, atol=1e-15)


@pytest.mark.timeout(120)
def test_a_named_fewshot_entry_logs_its_own_keys(tmp_path, eval_data_root):
    """Every evaluator but inspect keyed its metrics by its type whatever the entry's name: two few-shot entries (a
    suite's own, or two suites merged at one checkpoint) logged one `fewshot/mean/1shot`, MLflow keeping the later."""
    torch.manual_seed(0)
    checkpoint = tmp_path / "step_00000010"
    save_pretrained(build_model("vit_tiny_debug", num_classes=10), checkpoint)
    suite = tmp_path / "two.yaml"
    entry = "{type: fewshot, datasets: [digits], shots: [1], seeds: [0], batch_size: 16, resize_size: null"
    suite.write_text(f"name: two\nevaluators:\n  - {entry}}}\n  - {entry}, name: fewshot_big}}\n")
    rows = run_suite(checkpoint, suite, data_root=eval_data_root, log=lambda _: None).to_pylist()
    metrics = [r["metric"] for r in rows if r["status"] == "ok"]
    assert "fewshot/mean/1shot" in metrics and "fewshot_big/mean/1shot" in metrics
    assert len(metrics) == len(set(metrics)), metrics
