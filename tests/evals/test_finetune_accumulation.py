"""Fine-tuning that fits (docs/vtab.md, "Fine-tuning memory"): micro-batches accumulate to the full-batch step, bf16
autocast on request, activation checkpointing, and the options load from suite YAML. The real vit_tiny_debug on CPU.
"""

from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from evals.finetune import FinetuneOptions, _augment, accuracy, autocast_dtype, train_classifier
from evals.suites import load_suite
from pretrain.config.precision import decide
from pretrain.model.vit import build_model

STEPS = 4  # 24 images in batches of 8: step 4 starts a second epoch (a fresh permutation)
GEN = torch.Generator().manual_seed(0)
IMAGES = torch.rand(24, 3, 32, 32, generator=GEN) * 2 - 1
LABELS = np.arange(24) % 3
# Augmentation on: its random draws must be the full batch's, whatever the micro-batch size.
OPTS = FinetuneOptions(steps=STEPS, batch_size=8, warmup_steps=1, crop_padding=2, flip=True)


def _finetune(opts: FinetuneOptions, num_images: int = 24, **overrides):
    """Parameters, the train loss after each step, test accuracy and the log lines (timings dropped) of one run."""
    images, labels = IMAGES[:num_images], LABELS[:num_images]
    targets = torch.as_tensor(labels)
    logs = []

    def train_loss(model) -> float:
        with torch.no_grad():
            return F.cross_entropy(model.eval()(images), targets).item()

    torch.manual_seed(1)
    model = build_model("vit_tiny_debug", **overrides)
    run = dict(steps=STEPS, opts=opts, log=logs.append, measure_at=range(1, STEPS + 1), measure=train_loss)
    model, losses = train_classifier(model, images, labels, num_classes=3, lr=0.03, **run)
    params = torch.cat([p.detach().flatten() for p in model.parameters()])
    return params, losses, accuracy(model, IMAGES, LABELS), [line.rsplit(" (", 1)[0] for line in logs]


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


# vit_tiny_debug fine-tunes without dropout, as the shipped configs' B/16 augreg checkpoints do. With dropout each
# forward draws its own masks from torch's generator, so micro-batches see other masks (the same distribution).
@pytest.mark.parametrize("num_images, micro", [(24, 2), (24, 4), (6, 4)], ids=["micro2", "micro4", "uneven"])
def test_accumulated_step_equals_the_full_batch_step(num_images, micro):
    # "uneven": 6 images clip the batch of 8 to 6, split 4 + 2; each part weighs its share of the batch.
    full = _finetune(OPTS, num_images)
    accumulated = _finetune(replace(OPTS, micro_batch_size=micro), num_images)
    assert _max_diff(full[0], accumulated[0]) <= 1e-6
    assert sorted(full[1]) == sorted(accumulated[1]) == list(range(1, STEPS + 1))
    assert all(abs(full[1][s] - accumulated[1][s]) <= 1e-6 for s in full[1])
    assert full[2] == accumulated[2] and full[3] == accumulated[3]  # accuracy; logged losses at 4 decimals


def test_activation_checkpointing_follows_the_option_and_keeps_the_numbers():
    plain = _finetune(OPTS)
    checkpointed = _finetune(replace(OPTS, activation_checkpointing=True))
    assert _max_diff(plain[0], checkpointed[0]) <= 1e-6 and plain[3] == checkpointed[3]
    # A checkpoint pre-trained with it on (model.json keeps the flag) fine-tunes as the option says.
    model = build_model("vit_tiny_debug", grad_checkpointing=True)
    train_classifier(model, IMAGES, LABELS, num_classes=3, lr=0.03, steps=1, opts=OPTS)
    assert not model.grad_checkpointing and not model.config.grad_checkpointing


def _record_forward_modes(model) -> list[tuple[bool, bool]]:
    """(grad enabled, CPU autocast enabled) inside each forward of ``model``, appended as it runs."""
    modes = []
    model.register_forward_hook(lambda *_: modes.append((torch.is_grad_enabled(), torch.is_autocast_enabled("cpu"))))
    return modes


def test_bf16_autocast_trains_and_evaluates_without_gradients():
    torch.manual_seed(1)
    model = build_model("vit_tiny_debug")
    modes = _record_forward_modes(model)
    opts = replace(OPTS, micro_batch_size=4, precision="bf16")
    train_classifier(model, IMAGES, LABELS, num_classes=3, lr=0.03, steps=2, opts=opts)
    assert modes == [(True, True)] * 4  # 2 steps x 2 micro-batches, each under autocast
    assert all(p.dtype == torch.float32 and torch.isfinite(p).all() for p in model.parameters())  # fp32 weights
    modes.clear()
    acc = accuracy(model, IMAGES, LABELS, batch_size=16, dtype=torch.bfloat16)
    assert 0.0 <= acc <= 1.0 and modes == [(False, True)] * 2  # evaluation: no autograd, autocast
    modes.clear()
    accuracy(model, IMAGES, LABELS, batch_size=16)
    assert modes == [(False, False)] * 2


def test_precision_auto_is_bf16_on_cuda_only():
    assert autocast_dtype("auto", "cpu") is None and autocast_dtype("fp32", "cpu") is None
    assert autocast_dtype("auto", "cuda") == torch.bfloat16 and autocast_dtype("auto", "cuda:1") == torch.bfloat16
    assert autocast_dtype("fp32", "cuda") is None and autocast_dtype("bf16", "cpu") == torch.bfloat16


def test_precision_auto_follows_pretrainings_rule_on_gpus_without_bf16_tensor_cores():
    # A V100 or T4 (compute capability < 8.0) emulates bf16: pre-training's `decide` trains there in fp32, so do evals.
    for has_units in (False, True):
        trains_in = decide("auto", "cuda", cuda_bf16=has_units).precision
        assert autocast_dtype("auto", "cuda:0", cuda_bf16=has_units) == (torch.bfloat16 if has_units else None)
        assert trains_in == ("bf16" if has_units else "fp32")
        assert autocast_dtype("bf16", "cuda", cuda_bf16=has_units) == torch.bfloat16  # asked for: kept
        assert autocast_dtype("auto", "cpu", cuda_bf16=has_units) is None


def test_micro_batch_size_must_divide_batch_size(tmp_path):
    with pytest.raises(ValueError, match=r"micro_batch_size=3 does not divide batch_size=8.*micro_batch_size=2"):
        FinetuneOptions(batch_size=8, micro_batch_size=3)
    with pytest.raises(ValueError, match=r"micro_batch_size must be >= 1"):
        FinetuneOptions(batch_size=8, micro_batch_size=0)
    suite = tmp_path / "bad.yaml"
    suite.write_text("name: bad\nevaluators:\n  - type: vtab\n    finetune: {batch_size: 512, micro_batch_size: 48}\n")
    with pytest.raises(ValueError, match=r"micro_batch_size=48 does not divide batch_size=512.*=32") as raised:
        load_suite(suite)
    assert str(suite) in str(raised.value)
    suite.write_text("name: bad\nevaluators:\n  - type: finetune\n    precision: fp16\n")
    with pytest.raises(ValueError, match=r"precision='fp16' is unknown; use one of auto"):
        load_suite(suite)


def test_the_options_load_from_suite_yaml(tmp_path):
    (spec,) = load_suite("vtab1k").evaluators
    ft = spec.options.finetune
    assert ft.batch_size % ft.micro_batch_size == 0 and ft.batch_size // ft.micro_batch_size > 1
    assert (ft.precision, ft.activation_checkpointing) == ("auto", False)
    suite = tmp_path / "ft.yaml"
    suite.write_text(
        "name: ft\nevaluators:\n  - type: finetune\n    batch_size: 64\n    micro_batch_size: 16\n"
        "    precision: fp32\n    activation_checkpointing: true\n"
    )
    (spec,) = load_suite(suite).evaluators
    assert spec.options == FinetuneOptions(
        batch_size=64, micro_batch_size=16, precision="fp32", activation_checkpointing=True
    )


def test_grad_clip_zero_disables_clipping_and_a_negative_one_is_refused():
    # As the recipe's optim.grad_clip (and DeepSpeed's gradient_clipping): 0 means no clipping. clip_grad_norm_ with
    # max_norm 0 zeroes every gradient (the model never moves from its zero head), a negative one reverses them.
    unclipped = _finetune(replace(OPTS, grad_clip=1e9))
    off = _finetune(replace(OPTS, grad_clip=0.0))
    assert _max_diff(off[0], unclipped[0]) == 0.0 and off[3] == unclipped[3]
    assert _max_diff(off[0], _finetune(OPTS)[0]) > 0  # the default clip at 1 does act on this run
    with pytest.raises(ValueError, match=r"grad_clip must be >= 0 \(0: no clipping\); got -1.0"):
        FinetuneOptions(grad_clip=-1.0)


def test_a_crop_padding_reflect_padding_cannot_make_is_refused_when_the_suite_loads(tmp_path):
    # Reflect padding mirrors at most size - 1 pixels: crop_padding >= the image size was a torch RuntimeError
    # traceback at the first fine-tuning step, after the images were read.
    assert _augment(IMAGES[:2], 31, False, torch.Generator()).shape == (2, 3, 32, 32)  # the limit itself works
    with pytest.raises(ValueError, match=r"^crop_padding: 32 must be smaller than the image size 32 .*at most 31"):
        FinetuneOptions(image_size=32, crop_padding=32)
    suite = tmp_path / "pad.yaml"
    suite.write_text(
        "name: pad\nevaluators:\n  - type: vtab\n    benchmark: ci\n    protocol: finetune\n    image_size: 32\n"
        "    finetune: {crop_padding: 40}\n"
    )
    with pytest.raises(ValueError, match=r"finetune\.crop_padding: 40 must be smaller than the image size 32"):
        load_suite(suite)


def test_an_lr_of_the_grid_that_diverges_loses_the_search_instead_of_ending_the_evaluation():
    """A grid is there to try lrs that may be too high: one whose loss turns NaN scores NaN on the held-out images
    and is not chosen (before: FloatingPointError ended the whole suite, every task of a VTAB-1k run with it)."""
    from evals.finetune import select_lr_and_evaluate

    def fresh():
        torch.manual_seed(1)
        return build_model("vit_tiny_debug")

    opts = replace(OPTS, steps=6, lr_grid=(0.03, 100.0), grad_clip=0.0, crop_padding=0, flip=False)
    train, val = (IMAGES[:16], LABELS[:16]), (IMAGES[16:], LABELS[16:])
    result = select_lr_and_evaluate(fresh, train, val, [(IMAGES, LABELS)], num_classes=3, opts=opts)
    assert result.lr == 0.03 and np.isnan(result.val_scores[100.0]) and 0.0 <= result.accuracy <= 1.0
    with pytest.raises(FloatingPointError, match=r"diverged at every lr of the grid \[100.0\]"):
        select_lr_and_evaluate(
            fresh, train, val, [(IMAGES, LABELS)], num_classes=3, opts=replace(opts, lr_grid=(100.0,))
        )


def test_dropout_is_seeded_by_the_options_and_leaves_the_global_random_state_alone():
    """The i21k recipes' checkpoints fine-tune with dropout 0.1. Before, its masks came from torch's global generator
    as it stood: the same suite on the same checkpoint scored differently after other work in the process (an earlier
    entry, another lr of the grid). Now ``opts.seed`` alone decides them, and the caller's state is as it was."""

    def run(opts: FinetuneOptions) -> torch.Tensor:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(1)
            model = build_model("vit_tiny_debug", dropout=0.1, attention_dropout=0.1)
        model, _ = train_classifier(model, IMAGES, LABELS, num_classes=3, lr=0.03, steps=STEPS, opts=opts)
        return torch.cat([p.detach().flatten() for p in model.parameters()])

    state = torch.get_rng_state()
    first = run(OPTS)
    assert torch.equal(torch.get_rng_state(), state)
    torch.rand(100)  # what ran before the second run
    assert torch.equal(run(OPTS), first)  # bit for bit
    assert _max_diff(run(replace(OPTS, seed=1)), first) > 0
