"""Defects found in the model area: `checkpoint.init_from` across pools, `auto` precision on GPUs without bf16."""

from __future__ import annotations

import pytest
import torch

from pretrain import checkpointer as ckpt
from pretrain.config.precision import decide
from pretrain.model.vit import build_model
from pretrain.weights.formats import resize_pos_embed, save_pretrained

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("one_torch_thread")]


@pytest.mark.parametrize("image_size", [32, 48])  # the source's 8x8 grid, and a 12x12 one
def test_init_from_a_class_token_model_keeps_the_patch_position_embeddings_of_a_gap_model(tmp_path, image_size):
    """Before, the class row made `pos_embed` one row too long: all of it stayed fresh (a warning said so), and the
    fine-tune lost every learned position; as in big_vision, whose position embeddings have no class row."""
    torch.manual_seed(0)
    source = build_model("vit_tiny_debug", num_classes=10)
    save_pretrained(source, tmp_path / "src")
    torch.manual_seed(1)
    gap = build_model("vit_tiny_debug", image_size=image_size, pool="gap", num_classes=4)
    with pytest.warns(UserWarning, match="kept the fresh initialisation"):
        skipped = ckpt.init_weights(gap, tmp_path / "src", image_size=image_size)
    assert skipped == ["head.bias", "head.weight"]
    grid = image_size // 4
    expected = resize_pos_embed(source.pos_embed.detach(), (grid, grid))[:, 1:]  # the patch rows, class row dropped
    assert gap.pos_embed.shape == (1, grid * grid, 64)
    assert torch.equal(gap.pos_embed.detach(), expected)


def test_init_from_a_gap_model_keeps_its_patch_rows_and_a_fresh_class_row(tmp_path):
    torch.manual_seed(0)
    source = build_model("vit_tiny_debug", pool="gap", num_classes=10)
    save_pretrained(source, tmp_path / "src")
    torch.manual_seed(1)
    token = build_model("vit_tiny_debug", num_classes=4)
    fresh = token.pos_embed.detach().clone()
    with pytest.warns(UserWarning, match="kept the fresh initialisation"):
        skipped = ckpt.init_weights(token, tmp_path / "src", image_size=32)
    assert skipped == ["cls_token", "head.bias", "head.weight"]
    assert torch.equal(token.pos_embed[:, 1:].detach(), source.pos_embed.detach())
    assert torch.equal(token.pos_embed[:, :1].detach(), fresh[:, :1])  # the source has no class token to place


def test_auto_precision_is_fp32_on_a_gpu_without_bf16_tensor_cores():
    """Before, `auto` took bf16 on every CUDA GPU: on a V100 or T4 (compute capability 7.x) bf16 is emulated, many
    times slower. docs/performance.md: no fp16, so fp32 there."""
    old = decide("auto", "cuda", cuda_bf16=False)
    assert (old.precision, old.rule) == ("fp32", "cuda")
    assert "no bf16 tensor cores" in old.reason
    assert decide("probe", "cuda", cuda_bf16=False).precision == "fp32"
    assert decide("auto", "cuda", cuda_bf16=True).precision == "bf16"
    assert decide("bf16", "cuda", cuda_bf16=False).precision == "bf16"  # as the recipe says
    assert decide("auto", "cuda", cuda_bf16=False, resumed=("bf16", "step_00000300")).precision == "bf16"


@pytest.mark.parametrize("representation_size", [None, 16])  # fresh pre-logits too
def test_reset_classifier_follows_the_models_dtype(representation_size):
    """Before, the new head (and fresh pre-logits) were fp32 whatever the model's dtype: a bf16 model's next forward
    failed with "mat1 and mat2 must have the same dtype"."""
    torch.manual_seed(0)
    model = build_model("vit_tiny_debug", num_classes=10).to(torch.bfloat16).eval()
    model.reset_classifier(5, representation_size=representation_size)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    logits = model(torch.rand(2, 3, 32, 32, dtype=torch.bfloat16))
    assert logits.shape == (2, 5) and logits.dtype == torch.bfloat16


def test_forward_attention_runs_in_eval_mode_whatever_the_models_mode():
    """Before, a model left in train mode (every fresh model is) applied its dropout after the position embedding and
    in each block: the weights differed call to call and from the eval-mode ones."""
    torch.manual_seed(0)
    model = build_model("vit_tiny_debug", dropout=0.3)
    images = torch.rand(2, 3, 32, 32) * 2 - 1
    training = model.forward_attention(images)
    assert model.training  # its mode is the caller's
    expected = model.eval().forward_attention(images)
    assert all(torch.equal(a, b) for a, b in zip(training, expected))
