"""The model contract over every registered variant, and the paper-specific details of pretrain.model.vit."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pretrain.model.resnet import pad_same, same_padding
from pretrain.model.vit import (
    EXPLICIT_ATTENTION_MAX_TOKENS,
    MODEL_NAMES,
    SIZES,
    VisionTransformer,
    ViTConfig,
    build_model,
    explicit_attention,
    gelu_tanh_as_sigmoid,
    model_config,
    use_explicit_attention,
)

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("one_torch_thread")]


def _small_overrides(name: str) -> dict:
    """Shrink depth and resolution (two patches per side) but keep the variant's width, heads, MLP and patch."""
    if name == "vit_tiny_debug":
        return {"num_classes": 7}
    stride = model_config(name).stride
    return {"depth": 1, "image_size": 2 * stride, "num_classes": 7}


def _make_all_parameters_reachable(model: VisionTransformer) -> None:
    # The zero-init head and the zero-init last GroupNorm of each ResNet unit (both on purpose) would zero the
    # gradient of everything behind them; give them non-zero values so every parameter's gradient is informative.
    with torch.no_grad():
        if isinstance(model.head, nn.Linear):
            model.head.weight.normal_(std=0.1)
        for m in model.modules():
            if isinstance(m, nn.GroupNorm):
                m.weight.fill_(1.0)


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_every_variant_forward_backward(name):
    torch.manual_seed(0)
    model = build_model(name, **_small_overrides(name))
    reference = model_config(name)
    assert (model.config.width, model.config.num_heads, model.config.mlp_dim, model.config.patch_size) == (
        reference.width,
        reference.num_heads,
        reference.mlp_dim,
        reference.patch_size,
    )
    _make_all_parameters_reachable(model)
    size = model.config.image_size
    images = torch.rand(2, 3, size, size) * 2 - 1
    logits = model(images)
    assert logits.shape == (2, 7)
    assert torch.isfinite(logits).all()
    F.cross_entropy(logits, torch.tensor([1, 3])).backward()
    for pname, p in model.named_parameters():
        assert p.grad is not None, f"{name}: no gradient for {pname}"
        assert torch.isfinite(p.grad).all(), f"{name}: non-finite gradient for {pname}"
        assert p.grad.abs().sum() > 0, f"{name}: zero gradient for {pname}"


def test_size_table_matches_paper_table_1():
    # (layers, width, MLP size, heads) of paper Table 1
    expected = {"B": (12, 768, 3072, 12), "L": (24, 1024, 4096, 16), "H": (32, 1280, 5120, 16)}
    for size, (depth, width, mlp, heads) in expected.items():
        assert SIZES[size] == dict(width=width, depth=depth, mlp_dim=mlp, num_heads=heads)
    assert model_config("r50_vit_b16").hybrid_stages == (3, 4, 9)
    assert model_config("r50_vit_l32").hybrid_stages == (3, 4, 6, 3)
    assert model_config("r26_vit_s32").hybrid_stages == (2, 2, 2, 2)
    assert model_config("r50_vit_b16").grid_size == 14 and model_config("r50_vit_l32").grid_size == 7
    assert model_config("vit_h14").grid_size == 16


def test_unknown_name_lists_valid_names():
    with pytest.raises(ValueError, match="valid names: vit_tiny_debug, vit_ti16"):
        build_model("vit_giant")
    with pytest.raises(ValueError, match="unknown ViTConfig overrides"):
        build_model("vit_b16", hidden_size=3)


def test_image_not_multiple_of_patch_is_a_clear_error():
    model = build_model("vit_tiny_debug")
    with pytest.raises(ValueError, match=r"30x30 is not a multiple of the patch stride 4"):
        model(torch.zeros(1, 3, 30, 30))
    hybrid = build_model("r26_vit_s32", depth=1, image_size=64)
    with pytest.raises(ValueError, match=r"48x48 is not a multiple of the patch stride 32 \(ResNet stem stride 32"):
        hybrid(torch.zeros(1, 3, 48, 48))
    with pytest.raises(ValueError, match="image_size=30 is not a multiple of the patch stride 4"):
        ViTConfig(image_size=30, patch_size=4, width=64, depth=1, num_heads=4, mlp_dim=64)


def test_other_resolution_at_forward_points_to_resizing():
    model = build_model("vit_tiny_debug")
    with pytest.raises(ValueError, match="differs from the model's image_size 32.*load_pretrained"):
        model(torch.zeros(1, 3, 64, 64))
    with pytest.raises(ValueError, match=r"expected images \(B, 3, H, W\)"):
        model(torch.zeros(3, 32, 32))


def test_config_validation_names_the_field():
    with pytest.raises(ValueError, match="width=100 is not divisible by num_heads=3"):
        ViTConfig(width=100, num_heads=3)
    with pytest.raises(ValueError, match="pool must be 'token' or 'gap'"):
        ViTConfig(pool="map")
    with pytest.raises(ValueError, match="gelu_approximate"):
        ViTConfig(gelu_approximate="erf")
    config = ViTConfig.from_dict({**ViTConfig(hybrid_stages=[3, 4, 9], patch_size=1).to_dict()})
    assert config.hybrid_stages == (3, 4, 9)
    with pytest.raises(ValueError, match="unknown ViTConfig fields"):
        ViTConfig.from_dict({"widht": 3})


@pytest.mark.parametrize(("width_factor", "stages"), [(0.5, (1, 1)), (1.5, (2,)), (0.5, ())])
def test_fractional_width_hybrid_builds_the_official_widths_and_trains(width_factor, stages):
    # VT models_vit.py: root int(64 * wf) channels, stage s has root * 2**s bottleneck features (4x out).
    size = 2 * 4 * 2 ** max(len(stages) - 1, 0)
    dims = dict(image_size=size, patch_size=1, width=32, depth=1, num_heads=4, mlp_dim=64, num_classes=3)
    config = ViTConfig(**dims, hybrid_stages=stages, hybrid_width=width_factor, dropout=0.1)
    model = VisionTransformer(config)
    root = int(64 * width_factor)
    stem = model.patch_embed.backbone
    assert stem.conv_root.weight.shape == (root, 3, 7, 7) and stem.gn_root.num_groups == 32
    for s in range(len(stages)):
        unit = stem.stages[f"block{s + 1}"].units["unit1"]
        assert unit.conv2.weight.shape[:2] == (root * 2**s, root * 2**s)
        assert unit.conv3.weight.shape[0] == 4 * root * 2**s
    assert stem.out_channels == (4 * root * 2 ** (len(stages) - 1) if stages else root)
    assert model.patch_embed.proj.weight.shape[1] == stem.out_channels
    assert stem.stride == config.stride == (4 if not stages else 4 * 2 ** (len(stages) - 1))
    torch.manual_seed(0)
    _make_all_parameters_reachable(model)
    logits = model.train()(torch.rand(2, 3, size, size) * 2 - 1)
    F.cross_entropy(logits, torch.tensor([0, 2])).backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name


def test_hybrid_width_accepts_what_the_official_code_accepts():
    def hybrid(width_factor):
        return ViTConfig(image_size=32, patch_size=1, hybrid_stages=(1, 1), hybrid_width=width_factor)

    assert hybrid(0.5).hybrid_width == 0.5
    assert hybrid(2.0).hybrid_width == 2 and isinstance(hybrid(2.0).hybrid_width, int)  # model.json keeps "2"
    assert hybrid(3).hybrid_width == 3
    # int(64 * 0.51) = 32 channels: the official code builds it, and so do we (the root width decides).
    assert (
        VisionTransformer(dataclasses.replace(hybrid(0.51), depth=1)).patch_embed.backbone.conv_root.out_channels == 32
    )
    assert ViTConfig.from_dict(hybrid(1.5).to_dict()) == hybrid(1.5)
    for bad, message in [
        (0.25, r"hybrid_width=0.25 gives a ResNet root of int\(64 \* 0.25\) = 16 channels.*0.5, 1, 1.5 or 2"),
        (0.75, r"= 48 channels, which the 32 groups of its GroupNorms cannot divide"),
        (0, "hybrid_width must be a positive number"),
        (-1, "hybrid_width must be a positive number"),
        (True, "hybrid_width must be a positive number"),
        ("1", "hybrid_width must be a positive number"),
        (float("nan"), "hybrid_width must be a positive number"),
        (float("inf"), "hybrid_width must be a positive number"),
    ]:
        with pytest.raises(ValueError, match=message):
            hybrid(bad)
    with pytest.raises(ValueError, match=r"hybrid_stages must be a tuple of positive unit counts"):
        ViTConfig(image_size=32, patch_size=1, hybrid_stages=(1, 0))


def test_equations_1_to_4_compose():
    torch.manual_seed(0)
    model = build_model("vit_tiny_debug", representation_size=48).eval()
    images = torch.rand(3, 3, 32, 32) * 2 - 1
    patches = model.embed_patches(images)
    assert patches.shape == (3, 64, 64)  # (B, N, D): 8x8 patches of 4x4
    tokens = model.encode(patches)
    assert tokens.shape == (3, 65, 64)
    torch.testing.assert_close(tokens, model.forward_tokens(images))
    features = model.forward_features(images)
    torch.testing.assert_close(features, torch.tanh(model.pre_logits[0](tokens[:, 0])))
    torch.testing.assert_close(model(images), model.head(features))
    # eq. 1 by hand: patch i is the conv of pixels of row i // 8, column i % 8 (row-major flattening)
    patch_5 = images[:, :, 0:4, 20:24]
    expected = torch.einsum("bchw,dchw->bd", patch_5, model.patch_embed.proj.weight) + model.patch_embed.proj.bias
    torch.testing.assert_close(patches[:, 5], expected)


@pytest.mark.parametrize("setting", ["fp32", "bf16", "checkpointing", "hybrid"])
def test_the_last_block_computes_the_class_token_alone_and_trains_the_same(setting):
    """`forward_features` runs the last block at the class token only: the features and every parameter's gradient
    are those of pooling `forward_tokens` (the whole last block), up to rounding (the last block's weight gradients
    sum fewer rows); bf16 runs the explicit attention kernel, the hybrid its ResNet stem."""
    torch.manual_seed(0)
    name, overrides = ("r26_vit_s32", {"image_size": 64, "depth": 2}) if setting == "hybrid" else ("vit_tiny_debug", {})
    model = build_model(name, num_classes=10, representation_size=48, **overrides).train()
    model.set_grad_checkpointing(setting == "checkpointing")
    torch.nn.init.normal_(model.head.weight, std=0.1)  # the zero-initialised head would give zero gradients
    images = torch.rand(3, 3, model.config.image_size, model.config.image_size) * 2 - 1
    mlp_rows = []
    model.blocks[-1].mlp.register_forward_hook(lambda module, inputs, output: mlp_rows.append(inputs[0].shape[1]))
    dtype = torch.bfloat16 if setting == "bf16" else torch.float32
    results = []
    for features_of in (model.forward_features, lambda x: model.pre_logits(model.pool(model.forward_tokens(x)))):
        with torch.autocast("cpu", dtype=dtype, enabled=setting == "bf16"):
            features = features_of(images)
            loss = model.head(features).float().square().mean()
        results.append((features, torch.autograd.grad(loss, list(model.parameters()))))
    assert mlp_rows == [1, model.pos_embed.shape[1]]  # the class token alone, then every token
    (features, grads), (expected, expected_grads) = results
    tolerance = {"atol": 2e-2, "rtol": 2e-2} if setting == "bf16" else {"atol": 1e-5, "rtol": 1e-5}
    torch.testing.assert_close(features, expected, **tolerance)
    for (param_name, _), grad, expected_grad in zip(model.named_parameters(), grads, expected_grads):
        torch.testing.assert_close(grad, expected_grad, **tolerance, msg=param_name)


def test_gap_model_has_no_class_token_and_averages():
    model = build_model("vit_tiny_debug", pool="gap", num_classes=0).eval()
    assert model.cls_token is None and model.num_prefix_tokens == 0
    assert model.pos_embed.shape == (1, 64, 64)
    images = torch.rand(2, 3, 32, 32)
    tokens = model.forward_tokens(images)
    assert tokens.shape == (2, 64, 64)
    torch.testing.assert_close(model(images), tokens.mean(1))  # no head: forward returns the features


def test_attention_weights_path_matches_sdpa():
    torch.manual_seed(0)
    model = build_model("vit_tiny_debug").eval()
    images = torch.rand(2, 3, 32, 32) * 2 - 1
    weights = model.forward_attention(images)
    assert len(weights) == 4 and weights[0].shape == (2, 4, 65, 65)
    torch.testing.assert_close(weights[2].sum(-1), torch.ones(2, 4, 65))
    x = model._embed_tokens(model.embed_patches(images))
    for block in model.blocks:
        explicit, _ = block.forward_with_weights(x)
        torch.testing.assert_close(explicit, block(x), atol=1e-5, rtol=1e-5)
        x = explicit


def test_cpu_bf16_attention_is_explicit_and_matches_sdpa():
    # In bf16 on a CPU the model computes attention as GEMMs + softmax (faster than the fused kernel there); fp32,
    # long sequences and other devices keep SDPA, so fp32 numerics are untouched.
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 65, 16, requires_grad=True) for _ in range(3))
    assert not use_explicit_attention(q)
    assert use_explicit_attention(q.bfloat16())
    assert not use_explicit_attention(torch.zeros(1, 1, EXPLICIT_ATTENTION_MAX_TOKENS + 1, 8, dtype=torch.bfloat16))
    reference = F.scaled_dot_product_attention(q, k, v)
    torch.testing.assert_close(explicit_attention(q, k, v, 0.0), reference, atol=1e-6, rtol=1e-5)
    qb, kb, vb = (t.detach().bfloat16().requires_grad_() for t in (q, k, v))
    out = explicit_attention(qb, kb, vb, 0.0)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), reference, atol=2e-2, rtol=2e-2)
    grad = torch.randn_like(reference)
    reference.backward(grad)
    out.backward(grad.bfloat16())
    for low, high in ((qb, q), (kb, k), (vb, v)):
        torch.testing.assert_close(low.grad.float(), high.grad, atol=5e-2, rtol=5e-2)
    model = build_model("vit_tiny_debug", num_classes=5).eval()
    images = torch.rand(2, 3, 32, 32) * 2 - 1
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(images)
    torch.testing.assert_close(logits.float(), model(images), atol=5e-2, rtol=5e-2)
    dropped = explicit_attention(qb, kb, vb, 0.5)  # attention dropout on the weights, as SDPA's dropout_p
    assert dropped.shape == out.shape and not torch.equal(dropped, out)


def test_gelu_default_is_tanh_and_switchable():
    assert build_model("vit_tiny_debug").blocks[0].mlp.act.approximate == "tanh"
    assert build_model("vit_tiny_debug", gelu_approximate="none").blocks[0].mlp.act.approximate == "none"


def test_gelu_as_sigmoid_is_the_tanh_gelu():
    """x sigmoid(2u) is 0.5 x (1 + tanh(u)): equal to torch's tanh-GELU up to float rounding, in fp32 and bf16."""
    x = torch.linspace(-12, 12, 100_001)
    torch.testing.assert_close(gelu_tanh_as_sigmoid(x), F.gelu(x, approximate="tanh"), atol=1e-6, rtol=1e-6)
    xb = x.bfloat16()
    out, ref = gelu_tanh_as_sigmoid(xb), F.gelu(xb, approximate="tanh")
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref.float(), atol=1e-6, rtol=2**-8)  # at most one bf16 step apart
    # Both compute in fp32 and round once: for |x| <= 3 they rarely differ. Below -3 torch's 1 + tanh(u) cancels
    # (relative error up to 100% in fp32 by x = -10), x sigmoid(2u) does not (1.2e-5 against fp64).
    assert (out != ref)[x.abs() <= 3].float().mean() < 0.01
    x64 = torch.linspace(-10, -3, 1001, dtype=torch.float64)
    exact = x64 * torch.sigmoid(2 * (2 / math.pi) ** 0.5 * (x64 + 0.044715 * x64**3))
    assert ((gelu_tanh_as_sigmoid(x64.float()) - exact) / exact).abs().max() < 1e-4


@pytest.fixture
def inductor_config():
    """Inductor's config, its ``compile_threads`` put back after the test. Not with ``monkeypatch.setattr``: the
    config keeps its values outside the module's ``__dict__``, so pytest's undo deletes the setting, and every later
    compile in that xdist worker failed ("torch._inductor.config.compile_threads does not exist")."""
    import torch._inductor.config as config

    previous = config.compile_threads
    yield config
    config.compile_threads = previous


@pytest.mark.timeout(300)
def test_compiled_blocks_match_eager_and_keep_parameter_names(monkeypatch, inductor_config):
    """`compile_blocks` (training's ``model.compile``) changes neither the parameter names nor, beyond float
    rounding, the outputs and gradients; the compiled MLP runs the sigmoid form of the tanh-GELU; a block's hooks
    run outside its compiled code. It builds its kernels with the workers it is given (a CPU rank: its own threads),
    unless TORCHINDUCTOR_COMPILE_THREADS says."""
    monkeypatch.delenv("TORCHINDUCTOR_COMPILE_THREADS", raising=False)
    torch.manual_seed(0)
    eager = build_model("vit_tiny_debug", num_classes=5)
    compiled = build_model("vit_tiny_debug", num_classes=5)
    compiled.load_state_dict(eager.state_dict())
    compiled.compile_blocks(compile_threads=1)
    assert inductor_config.compile_threads == 1
    assert list(compiled.state_dict()) == list(eager.state_dict())
    images = torch.rand(4, 3, 32, 32) * 2 - 1
    for model in (eager, compiled):
        model(images).square().sum().backward()
    torch.testing.assert_close(compiled(images), eager(images), atol=1e-5, rtol=1e-5)
    for (name, a), b in zip(eager.named_parameters(), compiled.parameters()):
        torch.testing.assert_close(b.grad, a.grad, atol=1e-5, rtol=1e-4, msg=name)
    calls, hooks = [], []
    torch.compiler.reset()  # compile again, so that the trace below calls the function
    traced = lambda h: calls.append(h.shape) or gelu_tanh_as_sigmoid(h)  # noqa: E731
    monkeypatch.setattr("pretrain.model.vit.gelu_tanh_as_sigmoid", traced)
    # A block's own hooks (ZeRO-3 gathers its parameters in such hooks) run eagerly around its compiled forward:
    # traced into it, they recompiled per layer.
    in_compiled = lambda *args: hooks.append(torch.compiler.is_compiling())  # noqa: E731
    compiled.blocks[0].register_forward_pre_hook(in_compiled)
    compiled.blocks[0].register_forward_hook(in_compiled)
    compiled(images)
    assert calls, "the compiled blocks did not trace the sigmoid-form GELU"
    assert hooks == [False, False], hooks
    monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "3")
    build_model("vit_tiny_debug", num_classes=5).compile_blocks(compile_threads=2)
    assert inductor_config.compile_threads == 1  # left as it was: with the variable set, Inductor's reading decides


def test_initialization_follows_the_official_code():
    torch.manual_seed(0)
    model = build_model("vit_b16", depth=2, image_size=64, head_bias_init=-10.0)
    assert torch.count_nonzero(model.head.weight) == 0
    assert torch.all(model.head.bias == -10.0)
    assert torch.count_nonzero(model.cls_token) == 0
    assert abs(model.pos_embed.std().item() - 0.02) < 0.002
    q = model.blocks[0].attn.qkv.weight[:768]  # xavier-uniform on a (768, 768) fan: bound sqrt(6 / 1536)
    assert q.abs().max() <= (6 / 1536) ** 0.5 and q.abs().max() > 0.9 * (6 / 1536) ** 0.5
    assert model.blocks[0].mlp.fc1.bias.abs().max() < 1e-5  # normal(1e-6)
    assert model.blocks[0].norm1.eps == 1e-6 and model.norm.eps == 1e-6
    hybrid = build_model("r26_vit_s32", depth=1, image_size=64)
    unit = hybrid.patch_embed.backbone.stages["block1"].units["unit1"]
    assert torch.count_nonzero(unit.gn3.weight) == 0 and unit.gn1.eps == 1e-6 and unit.gn1.num_groups == 32


def test_zero_head_predicts_its_bias():
    model = build_model("vit_tiny_debug", num_classes=5, head_bias_init=-10.0).eval()
    torch.testing.assert_close(model(torch.rand(2, 3, 32, 32)), torch.full((2, 5), -10.0))


def test_reset_classifier_drops_or_keeps_pre_logits():
    model = build_model("vit_tiny_debug", representation_size=32, num_classes=100)
    trained = model.pre_logits[0].weight.detach().clone()
    model.reset_classifier(10, representation_size=32)
    assert torch.equal(model.pre_logits[0].weight, trained)
    assert model.head.weight.shape == (10, 32) and torch.count_nonzero(model.head.weight) == 0
    model.reset_classifier(3)  # the fine-tuning protocol: the whole head goes
    assert isinstance(model.pre_logits, nn.Identity) and model.head.weight.shape == (3, 64)
    assert model.config.num_classes == 3 and model.config.representation_size is None
    model.reset_classifier(0)
    assert model(torch.rand(1, 3, 32, 32)).shape == (1, 64)


def test_no_weight_decay_is_everything_but_kernels():
    model = build_model("r26_vit_s32", depth=1, image_size=64, representation_size=16)
    names = model.no_weight_decay()
    assert {"cls_token", "pos_embed", "norm.weight", "blocks.0.attn.qkv.bias", "head.bias"} <= names
    assert "patch_embed.backbone.gn_root.weight" in names
    for kernel in ("blocks.0.attn.qkv.weight", "blocks.0.mlp.fc1.weight", "head.weight", "pre_logits.0.weight"):
        assert kernel not in names
    assert "patch_embed.backbone.conv_root.weight" not in names


def test_grad_checkpointing_gives_identical_gradients():
    torch.manual_seed(0)
    model = build_model("vit_tiny_debug")
    _make_all_parameters_reachable(model)
    images = torch.rand(2, 3, 32, 32)

    def grads():
        model.zero_grad()
        model(images).square().mean().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    plain = grads()
    model.set_grad_checkpointing(True)
    assert model.config.grad_checkpointing
    checkpointed = grads()
    for n in plain:
        torch.testing.assert_close(checkpointed[n], plain[n], rtol=1e-5, atol=1e-7)


def test_dropout_only_in_training():
    model = build_model("vit_tiny_debug", dropout=0.3, attention_dropout=0.3, num_classes=0)
    images = torch.rand(2, 3, 32, 32)
    model.train()
    assert not torch.allclose(model(images), model(images))
    model.eval()
    torch.testing.assert_close(model(images), model(images))


def test_tf_same_padding_is_asymmetric_and_max_pool_pads_minus_inf():
    assert same_padding(224, 7, 2) == (2, 3)  # total 5: the extra pixel at the bottom/right
    assert same_padding(112, 3, 2) == (0, 1)
    assert same_padding(56, 3, 1) == (1, 1)
    assert same_padding(56, 1, 2) == (0, 0)
    x = torch.full((1, 1, 4, 4), -5.0)
    pooled = F.max_pool2d(pad_same(x, 3, 2, value=float("-inf")), 3, 2)
    assert torch.all(pooled == -5.0)  # zero padding would leak 0 into the border windows


def test_config_is_frozen_and_replace_validates():
    config = model_config("vit_b16")
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.width = 3
    with pytest.raises(ValueError, match="not a multiple"):
        dataclasses.replace(config, image_size=225)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["vit_tiny_debug", "r26_vit_s32"])
def test_cuda_bf16_matches_fp32_and_trains_with_checkpointing(name):
    # Not run on the CPU box (conftest skips it with the reason); exercises SDPA's fused CUDA kernels under bf16, and
    # for the hybrid the ResNet stem's weight-standardized convolutions and GroupNorms. The forward is compared as
    # initialized (the head aside): with every residual unit's last GroupNorm at 1 instead of 0 the random hybrid is
    # chaotic, and rounding its convolutions' inputs to bf16 on the CPU moved its logits by 11% of their range (1.6%
    # as initialized); bf16 allows 3% here.
    torch.manual_seed(0)
    model = build_model(name, **{**_small_overrides(name), "num_classes": 10})
    with torch.no_grad():
        model.head.weight.normal_(std=0.1)  # zero-initialized on purpose; all-zero logits would compare nothing
    size = model.config.image_size
    images = torch.rand(4, 3, size, size) * 2 - 1
    with torch.no_grad():
        expected = model.eval()(images)
    model = model.cuda()
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        got = model(images.cuda()).float().cpu()
    torch.testing.assert_close(got, expected, atol=max(5e-2, 0.03 * expected.abs().max().item()), rtol=5e-2)
    _make_all_parameters_reachable(model)
    model.train().set_grad_checkpointing(True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = F.cross_entropy(model(images.cuda()).float(), torch.arange(4, device="cuda"))
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
