"""The model's randomness (dropout) is a pure function of (seed, step, global micro-batch): nothing drawn from the
global generators outside it (a DataLoader created at a resume or an epoch rollover, a checkpoint write) shifts it,
and it leaves the global generators as it found them. The 2-process resume test in test_train_distributed.py checks
the same end to end."""

from __future__ import annotations

import torch

from pretrain.model.vit import build_model
from pretrain.randomness import model_randomness

CPU = torch.device("cpu")


def _model(grad_checkpointing: bool = False):
    torch.manual_seed(0)
    model = build_model("vit_tiny_debug", image_size=16, num_classes=4, dropout=0.1, attention_dropout=0.1)
    torch.nn.init.normal_(model.head.weight, std=0.1)  # the head starts at zero: the logits would not move
    model.set_grad_checkpointing(grad_checkpointing)
    return model.train()


def _forward_backward(model, x, *position):
    model.zero_grad()
    with model_randomness(*position, device=CPU):
        out = model(x)
        out.square().sum().backward()
    return out.detach(), [p.grad.clone() for p in model.parameters()]


def test_dropout_depends_on_the_position_only_and_leaves_the_global_generator_alone(one_torch_thread):
    model = _model()
    x = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(5)
    first, _ = _forward_backward(model, x, 0, 7, 1)
    torch.rand(1000)  # other code drawing from the global generator in between (e.g. a new DataLoader iterator)
    torch.manual_seed(99)
    before = torch.get_rng_state()
    again, _ = _forward_backward(model, x, 0, 7, 1)
    assert torch.equal(first, again)
    assert torch.equal(torch.get_rng_state(), before)  # restored: the context draws nothing from the global stream
    with torch.no_grad():
        model.eval()
        plain = model(x)
        model.train()
    assert not torch.equal(first, plain)  # dropout is on: a position that changes nothing would prove nothing
    for other in [(1, 7, 1), (0, 8, 1), (0, 7, 0)]:  # seed, step, global micro-batch index
        assert not torch.equal(first, _forward_backward(model, x, *other)[0]), other


def test_activation_checkpointing_recomputes_the_same_dropout_masks(one_torch_thread):
    x = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(2))
    out, grads = _forward_backward(_model(), x, 0, 3, 0)
    out_ckpt, grads_ckpt = _forward_backward(_model(grad_checkpointing=True), x, 0, 3, 0)
    assert torch.equal(out, out_ckpt)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(grads, grads_ckpt))
