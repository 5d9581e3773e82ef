"""evals.inspect on a real (tiny) VisionTransformer: every figure is written, non-blank, with finite metrics."""

import math

import matplotlib.image
import numpy as np
import pytest
import torch

from evals import inspect as insp
from pretrain.model import build_model


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
