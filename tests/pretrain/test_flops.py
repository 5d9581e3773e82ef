"""pretrain.model.flops against the published figures and against a count taken from the running model."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pretrain.model.flops import describe, forward_flops, forward_macs, param_count, train_flops
from pretrain.model.vit import MODEL_NAMES, build_model, model_config

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("one_torch_thread")]


# docs/reference.md §1 / timm: parameters with a 1000-class head, in millions
PAPER_PARAMS_M = {"vit_ti16": 5.72, "vit_s16": 22.05, "vit_b16": 86.57, "vit_l16": 304.33, "vit_h14": 632.05}
# docs/reference.md §5: forward GMACs per image at 224
PAPER_GMACS = {"vit_ti16": 1.26, "vit_s16": 4.61, "vit_b32": 4.41, "vit_b16": 17.58, "vit_l16": 61.6, "vit_h14": 167.4}


@pytest.mark.parametrize("name", list(PAPER_PARAMS_M))
def test_param_count_equals_paper(name):
    assert round(param_count(model_config(name)) / 1e6, 2) == PAPER_PARAMS_M[name]


@pytest.mark.parametrize("name", list(PAPER_GMACS))
def test_forward_gmacs_within_one_percent(name):
    gmacs = forward_macs(model_config(name)) / 1e9
    assert abs(gmacs - PAPER_GMACS[name]) / PAPER_GMACS[name] < 0.01, gmacs


@pytest.mark.parametrize("name", MODEL_NAMES)
@pytest.mark.parametrize(
    "head", [{}, {"representation_size": 40, "num_classes": 21}, {"pool": "gap", "num_classes": 0}]
)
def test_param_count_equals_the_built_model(name, head):
    overrides = {"depth": 1, **head}
    with torch.device("meta"):  # shapes only: no memory, no initialization cost
        model = build_model(name, **overrides)
    assert param_count(model_config(name, **overrides)) == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(("width_factor", "stages"), [(0.5, (1, 2)), (1.5, (1,)), (2, ()), (0.5, (1, 1, 1, 1))])
def test_fractional_width_hybrids_are_counted_as_built(width_factor, stages):
    # The stem is int(64 * width_factor) wide, as the model builds it (0.5 → 32 channels, not 0 or 64).
    size = 2 * 4 * 2 ** max(len(stages) - 1, 0)
    overrides = dict(image_size=size, patch_size=1, depth=1, hybrid_stages=stages, hybrid_width=width_factor)
    model = build_model("vit_tiny_debug", **overrides).eval()
    assert param_count(model.config) == sum(p.numel() for p in model.parameters())
    assert forward_macs(model.config, as_run=True) == _measured_macs(model, torch.zeros(1, 3, size, size))


def _measured_macs(model, images) -> int:
    """Multiply-adds of every conv and dense layer actually run, plus the two attention matmuls per layer."""
    total = 0

    def count(module, inputs, output):
        nonlocal total
        if isinstance(module, nn.Conv2d):
            k = module.weight[0].numel()  # Cin · kh · kw per output value
            total += output.numel() // output.shape[0] * k
        elif isinstance(module, nn.Linear):
            total += output.numel() // output.shape[0] * module.in_features

    hooks = [m.register_forward_hook(count) for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
    with torch.no_grad():
        model(images)
    for h in hooks:
        h.remove()
    tokens, D = model.pos_embed.shape[1:]
    queries = [tokens] * model.config.depth
    if model.cls_token is not None:
        queries[-1] = 1  # the last block attends from the class token alone
    return total + sum(2 * q * tokens * D for q in queries)


@pytest.mark.parametrize(
    ("name", "overrides"),
    [
        ("vit_tiny_debug", {}),
        ("vit_tiny_debug", {"pool": "gap", "representation_size": 32}),
        ("r26_vit_s32", {"depth": 1, "image_size": 96}),
        ("r50_vit_b16", {"depth": 1, "image_size": 48}),
    ],
)
def test_forward_macs_equal_a_count_of_the_running_model(name, overrides):
    model = build_model(name, **overrides).eval()
    size = model.config.image_size
    assert forward_macs(model.config, as_run=True) == _measured_macs(model, torch.zeros(1, 3, size, size))


def test_as_run_counts_the_last_layer_at_the_class_token_alone():
    config = model_config("vit_s16")
    N, D, M = 197, 384, 1536
    skipped = (N - 1) * (2 * N * D + D * D + 2 * D * M)  # the other tokens' attention, output projection and MLP
    assert forward_macs(config) - forward_macs(config, as_run=True) == skipped
    assert 0.06 < 3 * 2 * skipped / train_flops(config) < 0.08  # 6.3% of a ViT-S/16 training step
    assert train_flops(config, as_run=True) == 3 * forward_flops(config, as_run=True)
    gap = model_config("vit_s16", pool="gap")
    assert forward_macs(gap, as_run=True) == forward_macs(gap)  # no class token: every token is pooled


def test_training_is_three_forwards_and_resolution_scales():
    config = model_config("vit_b16")
    assert forward_flops(config) == 2 * forward_macs(config)
    assert train_flops(config) == 3 * forward_flops(config)
    at_384 = forward_macs(config, image_size=384) / 1e9
    assert 55.0 < at_384 < 56.0  # timm lists 55.5 GMACs for B/16 at 384
    assert describe(config)["params_m"] == pytest.approx(86.57, abs=0.005)
    with pytest.raises(ValueError, match="not a multiple of the model's patch stride 16"):
        forward_macs(config, image_size=230)
    hybrid, plain = model_config("r50_vit_b16"), config
    assert forward_macs(hybrid) > forward_macs(plain)  # the ResNet stem's convolutions are counted
