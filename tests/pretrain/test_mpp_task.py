"""Masked patch prediction (paper §4.6): corruption proportions, 3-bit colour targets, determinism, learning; and
``classification_mpp``, labels and MPP from one pass (the demo's task)."""

import math
from dataclasses import replace

import pytest
import torch

from pretrain.config.train_config import load_config
from pretrain.model.mpp import MaskedPatchPrediction, MPPConfig, corruption_plan, mean_color_targets
from pretrain.model.tasks import (
    LOSSES,
    ClassificationWithMPP,
    LossConfig,
    TaskConfig,
    check_config,
    classification_mpp_options,
)
from pretrain.model.vit import build_model, model_config


def test_corruption_proportions_are_exact_per_image():
    cfg = MPPConfig()
    plan = corruption_plan(8, 64, cfg, torch.Generator().manual_seed(0))
    assert plan.corrupted.sum(1).tolist() == [32] * 8  # 50% of 64
    assert plan.masked.sum(1).tolist() == [round(0.8 * 32)] * 8  # 26 → [mask]
    assert plan.randomised.sum(1).tolist() == [round(0.1 * 32)] * 8  # 3 → another patch
    kept = plan.corrupted & ~plan.masked & ~plan.randomised
    assert kept.sum(1).tolist() == [32 - 26 - 3] * 8  # 3 unchanged but still predicted
    assert not (plan.masked & plan.randomised).any()
    assert (plan.masked | plan.randomised).logical_and(~plan.corrupted).sum() == 0
    flat = torch.arange(8 * 64).view(8, 64)
    src = plan.source[plan.randomised]
    assert ((src >= 0) & (src < 8 * 64)).all() and (src != flat[plan.randomised]).all()  # never itself
    assert (plan.source[~plan.randomised] == -1).all()


def test_corruption_fractions_over_many_draws_match_the_paper():
    plan = corruption_plan(400, 196, MPPConfig(), torch.Generator().manual_seed(1))
    c = plan.corrupted.float().mean().item()
    m = plan.masked.sum().item() / plan.corrupted.sum().item()
    r = plan.randomised.sum().item() / plan.corrupted.sum().item()
    assert c == pytest.approx(0.5) and m == pytest.approx(0.8, abs=0.01) and r == pytest.approx(0.1, abs=0.01)
    # Every position is corrupted about equally often (no positional bias in the draw).
    per_position = plan.corrupted.float().mean(0)
    assert per_position.min() > 0.38 and per_position.max() < 0.62


def test_corruption_is_deterministic_given_the_generator():
    a = corruption_plan(4, 16, MPPConfig(), torch.Generator().manual_seed(7))
    b = corruption_plan(4, 16, MPPConfig(), torch.Generator().manual_seed(7))
    c = corruption_plan(4, 16, MPPConfig(), torch.Generator().manual_seed(8))
    assert torch.equal(a.corrupted, b.corrupted) and torch.equal(a.source, b.source)
    assert not torch.equal(a.corrupted, c.corrupted)


def test_mean_color_targets_quantise_each_channel_to_eight_levels():
    images = torch.empty(1, 3, 8, 8)
    # Patch (0,0): r=-1, g=0, b=+1 → levels 0, 4, 7 → 0*64 + 4*8 + 7 = 39.
    images[:, 0, :4, :4], images[:, 1, :4, :4], images[:, 2, :4, :4] = -1.0, 0.0, 1.0
    # Patch (0,1): half -1 / half +1 in red → mean 0 → level 4; g=b=-0.8 → floor(0.1*8)=0 → 4*64 = 256.
    images[:, 0, :4, 4:8] = torch.tensor([-1.0, 1.0]).repeat_interleave(2).view(1, 4).expand(4, 4)
    images[:, 1:, :4, 4:8] = -0.8
    # Patch (1,0): all channels 0.99 → level 7 each → 511.  Patch (1,1): all -0.3 → floor(0.35*8)=2 → 2*73 = 146.
    images[:, :, 4:, :4] = 0.99
    images[:, :, 4:, 4:] = -0.3
    t = mean_color_targets(images, patch_pixels=4)
    assert t.tolist() == [[39, 256, 511, 146]]
    assert t.dtype == torch.int64


def test_corrupt_applies_mask_token_and_copies_random_sources():
    torch.manual_seed(0)
    task = MaskedPatchPrediction(build_model("vit_tiny_debug", num_classes=0))
    tokens = torch.randn(2, 64, 64)
    plan = corruption_plan(2, 64, task.config, torch.Generator().manual_seed(3))
    out = task.corrupt(tokens, plan)
    assert torch.equal(out[plan.masked], task.mask_token[0, 0].expand(int(plan.masked.sum()), -1))
    flat = tokens.reshape(-1, 64)
    assert torch.equal(out[plan.randomised], flat[plan.source[plan.randomised]])
    untouched = ~(plan.masked | plan.randomised)
    assert torch.equal(out[untouched], tokens[untouched])


def test_mpp_config_rejects_bad_options():
    with pytest.raises(ValueError, match="corrupt_fraction"):
        MPPConfig(corrupt_fraction=0.0)
    with pytest.raises(ValueError, match="sum to"):
        MPPConfig(mask_fraction=0.9, random_fraction=0.2)
    with pytest.raises(ValueError, match="unknown keys"):
        MPPConfig.from_options({"mask_ratio": 0.5})


def _palette_blocks(n: int, palette: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """2x2 blocks of 16 px, each one of 8 palette colours, plus noise: the colour of a corrupted 4-px patch can be
    learned first from the palette statistics, then from the visible patches of its block."""
    idx = torch.randint(0, len(palette), (n, 2, 2), generator=generator)
    images = palette[idx].permute(0, 3, 1, 2).repeat_interleave(16, dim=2).repeat_interleave(16, dim=3)
    return (images + 0.05 * torch.randn(images.shape, generator=generator)).clamp(-1, 1)  # (n, 3, 32, 32)


@pytest.mark.timeout(180)
def test_mpp_loss_decreases_on_a_tiny_model():
    torch.manual_seed(0)
    task = MaskedPatchPrediction(build_model("vit_tiny_debug", num_classes=0), seed=0)
    opt = torch.optim.AdamW(task.parameters(), lr=5e-3, weight_decay=0.0)
    data = torch.Generator().manual_seed(0)
    palette = torch.rand(8, 3, generator=data) * 2 - 1
    losses = []
    for _ in range(25):
        loss, metrics = task(_palette_blocks(16, palette, data), None)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        assert 0.0 <= metrics["accuracy"].item() <= 1.0
    assert losses[0] == pytest.approx(torch.log(torch.tensor(512.0)).item(), rel=1e-3)  # zero-init head
    assert int(task.draws) == 25
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    # log(512) = 6.24 at the start; 25 steps should at least learn the 8-colour marginal (log 8 = 2.08).
    assert last < first - 2.0, f"MPP loss did not fall: {first:.3f} → {last:.3f}"
    assert metrics["accuracy"].item() > 2 / 512


def test_classification_mpp_is_the_labels_loss_on_the_corrupted_pass_plus_mpp():
    torch.manual_seed(0)
    model = build_model("vit_tiny_debug", num_classes=10)
    task = ClassificationWithMPP(model, MPPConfig(corrupt_fraction=0.25), 0.5, "softmax_xent", 0.1, seed=3)
    alone = MaskedPatchPrediction(model, MPPConfig(corrupt_fraction=0.25), seed=3)  # the same model
    alone.head.load_state_dict(task.head.state_dict())
    alone.mask_token.data.copy_(task.mask_token.data)
    images, labels = torch.randn(6, 3, 32, 32), torch.randint(0, 10, (6,))
    torch.manual_seed(5)  # training corruptions come from the global generator (the trainer seeds it by position)
    loss, metrics = task(images, labels)
    assert loss.item() == pytest.approx(math.log(10) + 0.5 * math.log(512), rel=1e-4)  # both heads start at zero
    # The same corrupted pass, its parts recomputed by hand: labels loss on the pooled output + weight x MPP loss.
    torch.manual_seed(5)
    encoded, patch_loss, _ = alone.corrupted_pass(images)
    logits = model.forward_head(model.pre_logits(model.pool(encoded)))
    expected = LOSSES["softmax_xent"](logits, labels, 0.1) + 0.5 * patch_loss
    assert torch.equal(loss, expected)
    assert int(task.draws) == 1 and set(metrics) == {"accuracy", "mpp_accuracy"}
    # Only the [mask] embedding and the colour head are the task's own: the model keeps its classifier.
    extras = {n for n, _ in task.named_parameters() if not n.startswith("model.")}
    assert extras == {"mask_token", "head.weight", "head.bias"} and model.config.num_classes == 10
    with pytest.raises(ValueError, match="trains on labels"):  # the mpp task's labels are optional; these are not
        task(images)


@pytest.mark.timeout(180)
def test_classification_mpp_learns_both_and_replays_its_corruptions():
    def run(steps: int) -> tuple[list[float], ClassificationWithMPP]:
        torch.manual_seed(0)
        task = ClassificationWithMPP(build_model("vit_tiny_debug", num_classes=8), MPPConfig(), seed=1)
        opt = torch.optim.AdamW(task.parameters(), lr=5e-3, weight_decay=0.0)
        data = torch.Generator().manual_seed(0)
        palette = torch.rand(8, 3, generator=data) * 2 - 1
        losses = []
        for _ in range(steps):
            images = _palette_blocks(16, palette, data)
            labels = torch.cdist(images.mean((2, 3)), palette).argmin(1)  # the palette colour closest to the mean
            loss, _ = task(images, labels)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses, task

    losses, task = run(20)
    assert losses[0] == pytest.approx(math.log(8) + math.log(512), rel=1e-3)
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 2.0, losses
    assert int(task.draws) == 20
    assert run(20)[0] == losses  # the corruptions come from the seeded global generator: a second run is the same


def test_classification_mpp_options_and_model():
    assert classification_mpp_options({"corrupt_fraction": 0.25}) == (MPPConfig(corrupt_fraction=0.25), 1.0)
    assert classification_mpp_options({"mpp_weight": 2}) == (MPPConfig(), 2.0)
    for weight in (0, -1.0, "1", True):
        with pytest.raises(ValueError, match="mpp_weight=.* must be a number > 0"):
            check_config(LossConfig(), TaskConfig("classification_mpp", {"mpp_weight": weight}))
    with pytest.raises(ValueError, match=r"unknown keys \['weight'\] .* known: \[.*'mpp_weight'"):
        check_config(LossConfig(), TaskConfig("classification_mpp", {"weight": 1.0}))
    with pytest.raises(ValueError, match="needs a head"):
        ClassificationWithMPP(build_model("vit_tiny_debug", num_classes=0), MPPConfig())


def test_a_model_that_leaves_one_patch_per_image_is_refused_in_validation_naming_the_numbers_and_the_fix():
    """The hybrid r26_vit_s32 cuts a 32 px image into one patch (ResNet stem 16 x patch 2); MPP corrupts >= 1 patch
    of >= 2. `check_config` (run by validation and --dry-run) says so; so does the task's build, before DeepSpeed."""
    vit = model_config("r26_vit_s32", image_size=32, num_classes=10)
    said = (
        r"^model r26_vit_s32 at data\.image_size 32 leaves 1 patch per image \(one per 32x32 px\); masked patch "
        r"prediction needs >= 2: raise data\.image_size to 64 or set task\.name=classification$"
    )
    for task in ("mpp", "classification_mpp"):
        with pytest.raises(ValueError, match=said):
            check_config(LossConfig(), TaskConfig(task), vit, model="r26_vit_s32")
        check_config(LossConfig(), TaskConfig(task), replace(vit, image_size=64), model="r26_vit_s32")  # 4 patches
    check_config(LossConfig(), TaskConfig("classification"), vit, model="r26_vit_s32")  # one patch classifies
    with pytest.raises(ValueError, match=r"at data\.resolution_schedule\[1\]\[1\] 32 leaves 1 patch .* raise data\."):
        check_config(LossConfig(), TaskConfig("mpp"), replace(vit, image_size=64), [[0, 64], [5, 32]], "r26_vit_s32")
    with pytest.raises(ValueError, match=r"^the model at data\.image_size 32 leaves 1 patch per image"):
        ClassificationWithMPP(build_model("r26_vit_s32", image_size=32, num_classes=10), MPPConfig())
    with pytest.raises(ValueError, match=said):  # the recipe's validation (and so --dry-run)
        load_config("local_demo", ["model.name=r26_vit_s32"]).validate(2, check_paths=False)


@pytest.mark.parametrize(
    "options",
    [{"corrupt_fraction": "5e-1"}, {"mask_fraction": None}, {"random_fraction": "x"}, {"color_bits": 2.5}],
    ids=["yaml-string-exponent", "null", "text", "fractional-bits"],
)
def test_mpp_options_of_the_wrong_type_are_refused_naming_the_option(options):
    """YAML reads ``5e-1`` as a string: a recipe's option of the wrong type is one clear error before any work, not a
    TypeError in every rank's task build."""
    (name,) = options
    for task in ("mpp", "classification_mpp"):
        with pytest.raises(ValueError, match=rf"task\.options\.{name}=.* must be"):
            check_config(LossConfig(), TaskConfig(task, dict(options)))


def _eight_bit_targets(pixels: torch.Tensor, patch: int) -> torch.Tensor:
    """The targets by integer arithmetic: floor(patch sum · 8 / (255 · patch²)) per channel."""
    sums = torch.nn.functional.avg_pool2d(pixels.double(), patch, divisor_override=1).long()
    q = torch.div(sums * 8, 255 * patch * patch, rounding_mode="floor").clamp(0, 7)
    return ((q[:, 0] * 8 + q[:, 1]) * 8 + q[:, 2]).flatten(1)


def test_mean_color_targets_of_bf16_images_are_those_of_their_8_bit_pixels():
    """bf16 training hands the task bf16 images: their targets must still be the pixels' (a channel at 223 rounds
    to 0.75 in bf16, level 7 instead of 6)."""
    g = torch.Generator().manual_seed(0)
    smooth = torch.nn.functional.interpolate(torch.rand(8, 3, 7, 7, generator=g) * 255, size=112, mode="bilinear")
    pixels = (smooth + 8 * torch.randn(smooth.shape, generator=g)).clamp(0, 255).round()
    pixels[0, :, :16, :16] = 223  # a flat patch just under a level boundary
    images = pixels.mul(1 / 127.5).sub(1.0)  # the loader's normalisation
    expected = _eight_bit_targets(pixels, 16)
    assert expected[0, 0] == (6 * 8 + 6) * 8 + 6
    assert torch.equal(mean_color_targets(images, 16), expected)
    assert torch.equal(mean_color_targets(images.bfloat16(), 16), expected)
    assert torch.equal(mean_color_targets(images.half(), 16), expected)


def test_a_patch_mean_exactly_on_a_level_boundary_takes_the_upper_level():
    """floor is exact: a 16 px patch summing to 255 · 32 · k has mean colour k / 8 of the range, level k."""
    g = torch.Generator().manual_seed(1)
    pixels = torch.empty(7, 3, 16, 16)
    for k in range(1, 8):
        total = 255 * 32 * k
        flat = torch.full((256,), total // 256, dtype=torch.float32)
        flat[: total % 256] += 1
        pixels[k - 1] = flat[torch.randperm(256, generator=g)].view(1, 16, 16)
    targets = mean_color_targets(pixels.mul(1 / 127.5).sub(1.0), 16)
    assert targets.flatten().tolist() == [(k * 8 + k) * 8 + k for k in range(1, 8)]
