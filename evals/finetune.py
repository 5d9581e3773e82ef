"""Fine-tuning transfer (ViT paper App. B.1.1, Table 4), in plain PyTorch — no DeepSpeed needed for a head swap.

Protocol: drop the pre-training head *and* the pre-logits layer, attach a zero-initialised linear head
(``model.reset_classifier(K)``); SGD with momentum 0.9, no weight decay, gradient clipping at global norm 1,
linear warmup then cosine decay to 0; fine-tuning at a new resolution interpolates the position embeddings
(the context's ``load_model(image_size=N)`` → ``pretrain.weights``). The learning rate is chosen from a grid on a
held-out slice of train (seeded permutation), then one final run on the full train split is scored on test.

Splits are held in memory (``evals.features.load_images``), which suits VTAB-1k (1000 images) and the built-in
sets; ``max_train_examples`` bounds it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from evals.evaluator import EvalOutput, ResultRow
from evals.features import check_sizes, load_images, resolve_split


@dataclass(frozen=True)
class FinetuneOptions:
    """Options of a ``type: finetune`` suite entry; the schedule fields are also VTAB's ``finetune`` protocol."""

    datasets: tuple[str, ...] = ("digits",)
    train_split: str = "train"
    test_split: str = "test"
    image_size: int | None = None  # fine-tuning resolution; None keeps the checkpoint's (else pos-embed interp.)
    resize_size: int | None = None  # square resize before the centre crop; None: no crop
    steps: int = 500
    batch_size: int = 128
    lr_grid: tuple[float, ...] = (0.003, 0.01, 0.03)
    warmup_steps: int = 50
    momentum: float = 0.9
    grad_clip: float = 1.0
    holdout_fraction: float = 0.1  # slice of train held out to choose the lr
    selection_steps: int | None = None  # steps of each lr-search run; None: same as ``steps``
    crop_padding: int = 0  # random-crop augmentation: pad by this many pixels (reflect) and crop back; 0 = off
    flip: bool = False  # random horizontal flips (off by default: wrong for digits and position tasks)
    seed: int = 0
    max_train_examples: int = 50_000
    eval_batch_size: int = 256

    def __post_init__(self):
        if not self.datasets:
            raise ValueError("'datasets' is empty; name at least one dataset folder (e.g. [digits])")
        if self.steps < 1 or (self.selection_steps is not None and self.selection_steps < 1):
            raise ValueError(f"steps must be >= 1; got steps={self.steps}, selection_steps={self.selection_steps}")
        if not self.lr_grid or any(lr <= 0 for lr in self.lr_grid):
            raise ValueError(f"lr_grid must be non-empty positive learning rates; got {list(self.lr_grid)}")
        if not 0.0 < self.holdout_fraction < 1.0:
            raise ValueError(f"holdout_fraction must be in (0, 1); got {self.holdout_fraction}")
        if self.warmup_steps < 0 or self.crop_padding < 0:
            raise ValueError("warmup_steps and crop_padding must be >= 0")
        check_sizes(self, ("image_size", "resize_size", "batch_size", "max_train_examples", "eval_batch_size"))


def warmup_cosine(step: int, total_steps: int, warmup_steps: int) -> float:
    """Multiplier of the base lr: linear from 1/warmup to 1 over ``warmup_steps``, then cosine to 0."""
    warmup = min(warmup_steps, total_steps - 1)
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total_steps - warmup)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def _augment(images: torch.Tensor, padding: int, flip: bool, gen: torch.Generator) -> torch.Tensor:
    if padding:
        b, _, h, w = images.shape
        padded = F.pad(images, (padding,) * 4, mode="reflect")  # (B, 3, H+2p, W+2p)
        dy = torch.randint(0, 2 * padding + 1, (b,), generator=gen)
        dx = torch.randint(0, 2 * padding + 1, (b,), generator=gen)
        images = torch.stack([padded[i, :, dy[i] : dy[i] + h, dx[i] : dx[i] + w] for i in range(b)])
    if flip:
        mask = torch.rand(images.shape[0], generator=gen) < 0.5
        images = torch.where(mask[:, None, None, None], images.flip(-1), images)
    return images


def train_classifier(
    model,
    images: torch.Tensor,
    labels: np.ndarray,
    *,
    num_classes: int,
    lr: float,
    steps: int,
    opts: FinetuneOptions,
    device: str = "cpu",
    log: Callable[[str], None] | None = None,
):
    """Fine-tune ``model`` in place on (images (N,3,S,S), labels (N,)) with a fresh zero-initialised head.

    Minibatches walk seeded per-epoch permutations of the data (``opts.seed``), so a run is reproducible.
    Raises ``FloatingPointError`` on a non-finite loss rather than training on garbage.
    """
    model.reset_classifier(num_classes)  # drops pre-logits too (representation_size=None): paper App. B.1.1
    model.to(device).train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=lr, momentum=opts.momentum, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: warmup_cosine(s, steps, opts.warmup_steps))
    targets = torch.as_tensor(labels, dtype=torch.long)
    gen = torch.Generator().manual_seed(opts.seed)
    order, cursor = torch.randperm(len(targets), generator=gen), 0
    batch = min(opts.batch_size, len(targets))
    start = time.perf_counter()
    for step in range(steps):
        if cursor + batch > len(order):  # next epoch: a fresh permutation, the tail of the last one dropped
            order, cursor = torch.randperm(len(targets), generator=gen), 0
        idx = order[cursor : cursor + batch]
        cursor += batch
        x = _augment(images[idx], opts.crop_padding, opts.flip, gen).to(device)  # (B, 3, S, S)
        loss = F.cross_entropy(model(x), targets[idx].to(device))
        if not torch.isfinite(loss):
            raise FloatingPointError(f"fine-tuning loss is {loss.item()} at step {step} (lr={lr}); lower the lr")
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, opts.grad_clip)
        optimizer.step()
        schedule.step()
        if log is not None and (step + 1) % max(1, steps // 4) == 0:
            log(
                f"finetune: lr={lr:g} step {step + 1}/{steps} loss {loss.item():.4f} "
                f"({time.perf_counter() - start:.1f}s)"
            )
    return model


@torch.inference_mode()
def accuracy(model, images: torch.Tensor, labels: np.ndarray, *, batch_size: int = 256, device: str = "cpu") -> float:
    """Top-1 accuracy (fraction) of ``model``'s logits on in-memory images."""
    model.eval()
    correct = 0
    for i in range(0, len(images), batch_size):
        logits = model(images[i : i + batch_size].to(device))  # (B, K)
        correct += int((logits.argmax(1).cpu().numpy() == labels[i : i + batch_size]).sum())
    return correct / len(images)


def select_lr_and_evaluate(
    make_model: Callable[[], torch.nn.Module],
    train: tuple,
    val: tuple,
    test: tuple,
    *,
    num_classes: int,
    opts: FinetuneOptions,
    device: str = "cpu",
    log=None,
):
    """The protocol: one run per lr on ``train`` scored on ``val``; the best lr (ties → smaller) is re-run on
    ``train + val`` and scored on ``test``. Each run starts from a fresh ``make_model()``.

    Returns ``(test_accuracy, best_lr, {lr: val_accuracy})``.
    """
    val_scores = {}
    for lr in opts.lr_grid:
        model = train_classifier(
            make_model(),
            *train,
            num_classes=num_classes,
            lr=lr,
            steps=opts.selection_steps or opts.steps,
            opts=opts,
            device=device,
            log=log,
        )
        val_scores[float(lr)] = accuracy(model, *val, batch_size=opts.eval_batch_size, device=device)
        if log is not None:
            log(f"finetune: lr={lr:g} held-out accuracy {val_scores[float(lr)]:.4f}")
    best_lr = max(sorted(val_scores), key=lambda lr: val_scores[lr])  # max keeps the first (smallest) of ties
    full_images = torch.cat([train[0], val[0]])
    full_labels = np.concatenate([train[1], val[1]])
    model = train_classifier(
        make_model(),
        full_images,
        full_labels,
        num_classes=num_classes,
        lr=best_lr,
        steps=opts.steps,
        opts=opts,
        device=device,
        log=log,
    )
    return accuracy(model, *test, batch_size=opts.eval_batch_size, device=device), best_lr, val_scores


def holdout_split(num_examples: int, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train indices, held-out indices) from one seeded permutation; at least one example on each side."""
    if num_examples < 2:
        raise ValueError(f"fine-tuning needs at least 2 training examples to hold one out; got {num_examples}")
    perm = np.random.default_rng(seed).permutation(num_examples)
    held = min(num_examples - 1, max(1, round(fraction * num_examples)))
    return perm[held:], perm[:held]


def evaluate(ctx, opts: FinetuneOptions) -> EvalOutput:
    """Suite entry: ``finetune/<dataset>/accuracy`` (test top-1) per dataset, the chosen ``finetune/<dataset>/lr``,
    and the held-out accuracy of every lr of the grid (``sweep`` rows: the table only)."""
    size = int(opts.image_size or ctx.model.config.image_size)
    out = EvalOutput()
    for name in opts.datasets:
        kw = dict(image_size=size, resize_size=opts.resize_size, batch_size=opts.eval_batch_size)
        images, labels, info = load_images(
            resolve_split(ctx.data_root, name, opts.train_split), limit=opts.max_train_examples, **kw
        )
        test_images, test_labels, test_info = load_images(resolve_split(ctx.data_root, name, opts.test_split), **kw)
        if test_info.num_classes != info.num_classes:
            raise ValueError(f"{name}: train declares {info.num_classes} classes, test {test_info.num_classes}")
        keep, held = holdout_split(len(labels), opts.holdout_fraction, opts.seed)
        start = time.perf_counter()
        acc, lr, val_scores = select_lr_and_evaluate(
            lambda: ctx.load_model(image_size=size),
            (images[keep], labels[keep]),
            (images[held], labels[held]),
            (test_images, test_labels),
            num_classes=info.num_classes,
            opts=opts,
            device=ctx.device,
            log=ctx.log,
        )
        seconds = time.perf_counter() - start
        key, grid = f"finetune/{name}", list(opts.lr_grid)
        detail = f"lr={lr:g} from {grid} on {len(held)} held-out; {opts.steps} steps at {size}px"
        out.rows.append(ResultRow("finetune", name, f"{key}/accuracy", acc, count=len(test_labels), detail=detail))
        out.rows.append(ResultRow("finetune", name, f"{key}/lr", lr, count=len(held), detail=f"chosen from {grid}"))
        out.rows += [
            ResultRow("finetune", name, f"{key}/holdout_accuracy", score, count=len(held), status="sweep",
                      detail=f"lr={grid_lr:g}")
            for grid_lr, score in val_scores.items()
        ]  # fmt: skip
        ctx.log(f"finetune: {name} test accuracy {acc:.4f} (lr {lr:g}, {seconds:.0f}s)")
    return out
