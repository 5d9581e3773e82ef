"""Fine-tuning transfer (ViT paper App. B.1.1; docs/reference.md §4) in plain PyTorch: a head swap needs no DeepSpeed.
A learning-curve point at N steps (``eval_steps``) is the final run N steps into its full schedule. Only the drawn
train images are kept, as uint8; test streams (docs/vtab.md, "Fine-tuning memory").
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field
from typing import Literal, get_args

import numpy as np
import torch
import torch.nn.functional as F

from data_pipeline.stream.augment import float_images_on, to_float_images
from evals.evaluator import EvalOutput, ResultRow
from evals.features import (
    StreamedSplit,
    check_sizes,
    load_drawn,
    resolve_split,
    shared_models_on_host,
    split_info,
)
from pretrain.config.precision import decide
from tracking import keys

Precision = Literal["auto", "bf16", "fp32"]  # auto: bf16 autocast on a GPU with bf16 tensor cores, else plain fp32


@dataclass(frozen=True)
class FinetuneOptions:
    """A ``type: finetune`` suite entry; VTAB's ``finetune`` protocol uses its schedule."""

    datasets: tuple[str, ...] = ("digits",)
    train_split: str = "train"
    test_split: str = "test"
    image_size: int | None = None  # None: the checkpoint's (else pos-embed interpolation)
    resize_size: int | None = None  # square resize before the centre crop; None: no crop
    steps: int = 500
    batch_size: int = 128
    lr_grid: tuple[float, ...] = (0.003, 0.01, 0.03)
    warmup_steps: int = 50
    momentum: float = 0.9
    grad_clip: float = 1.0  # global-norm clip; 0: none (as the recipe's optim.grad_clip)
    holdout_fraction: float = 0.1  # held out of train to choose the lr (without train_examples)
    train_examples: int | None = None  # VTAB-1k: 800, one seeded draw with val; None: all of train
    val_examples: int | None = None  # VTAB-1k: 200
    eval_steps: tuple[int, ...] = ()  # learning curve: the final run's test accuracy after these steps
    selection_steps: int | None = None  # steps of each lr-search run; None: ``steps``
    crop_padding: int = 0  # random crop: reflect-pad by this many pixels, crop back; 0 = off
    flip: bool = False  # random horizontal flips (wrong for digits and position tasks)
    seed: int = 0
    max_train_examples: int = 50_000
    eval_batch_size: int = 256
    micro_batch_size: int | None = None  # images per forward/backward, accumulated into one step; None: one pass
    precision: Precision = "auto"  # autocast of training and evaluation forwards; fp32 weights and optimizer
    activation_checkpointing: bool = False  # recompute each block in backward (the model's set_grad_checkpointing)

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
        if self.grad_clip < 0:
            raise ValueError(f"grad_clip must be >= 0 (0: no clipping); got {self.grad_clip}")
        if (self.train_examples is None) != (self.val_examples is None):
            raise ValueError(
                f"set train_examples and val_examples together (VTAB-1k: 800 and 200), or neither; got "
                f"train_examples={self.train_examples}, val_examples={self.val_examples}"
            )
        if self.train_examples is not None and self.holdout_fraction != FinetuneOptions.holdout_fraction:
            raise ValueError(
                "holdout_fraction is unused when train_examples/val_examples set the held-out slice; drop one of them"
            )
        bad = [n for n in self.eval_steps if not 1 <= n <= self.steps]
        if bad or len(set(self.eval_steps)) != len(self.eval_steps):
            raise ValueError(f"eval_steps must be distinct steps in 1..steps={self.steps}; got {list(self.eval_steps)}")
        check_sizes(
            self,
            "image_size resize_size batch_size max_train_examples eval_batch_size train_examples val_examples "
            "micro_batch_size".split(),
        )
        micro, batch = self.micro_batch_size, self.batch_size
        if micro is not None and batch % micro:
            divisor = max(d for d in range(1, micro + 1) if batch % d == 0)
            raise ValueError(
                f"micro_batch_size={micro} does not divide batch_size={batch}; use a divisor of batch_size "
                f"(e.g. micro_batch_size={divisor}) or null for one pass over the whole batch"
            )
        if self.precision not in get_args(Precision):
            raise ValueError(f"precision={self.precision!r} is unknown; use one of {list(get_args(Precision))}")
        if self.image_size is not None:  # else the checkpoint's, checked when it loads (evals.runner)
            check_crop_padding(self.crop_padding, self.image_size, "crop_padding")


def check_crop_padding(padding: int, size: int, setting: str) -> None:
    """ValueError unless reflect padding can pad ``size``-pixel images by ``padding``: at most ``size - 1``."""
    if padding >= size:
        raise ValueError(
            f"{setting}: {padding} must be smaller than the image size {size} (reflect padding mirrors at most "
            f"{size - 1} pixels); use at most {size - 1}"
        )


def autocast_dtype(precision: str, device: str, cuda_bf16: bool | None = None) -> torch.dtype | None:
    """bf16 for ``bf16``, and for ``auto`` on CUDA where pre-training's rule (`decide`) picks it: not on a GPU without
    bf16 tensor cores, which emulates it. ``cuda_bf16``: None → `cuda_bf16_units` (True until CUDA is set up: a plan).
    None (plain fp32) otherwise."""
    if precision == "auto" and torch.device(device).type == "cuda":
        return torch.bfloat16 if decide("auto", "cuda", cuda_bf16=cuda_bf16).precision == "bf16" else None
    return torch.bfloat16 if precision == "bf16" else None


def _autocast(device: str, dtype: torch.dtype | None):
    return contextlib.nullcontext() if dtype is None else torch.autocast(torch.device(device).type, dtype=dtype)


def warmup_cosine(step: int, total_steps: int, warmup_steps: int) -> float:
    """Multiplier of the base lr: linear from 1/warmup to 1 over ``warmup_steps``, then cosine to 0."""
    warmup = min(warmup_steps, total_steps - 1)
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total_steps - warmup)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def _on_device(images: torch.Tensor, device: str) -> torch.Tensor:
    """Float32 images on ``device``; uint8 pixels are converted there (`float_images_on`: a quarter of the bytes)."""
    return float_images_on(images, torch.device(device)) if images.dtype == torch.uint8 else images.to(device)


def _augment(images: torch.Tensor, padding: int, flip: bool, gen: torch.Generator) -> torch.Tensor:
    """Reflect-pad + random crop, random flips; ``images`` unchanged if neither is on."""
    if not (padding or flip):
        return images
    if images.dtype == torch.uint8:  # to [-1, 1] as the stream does; first is the same: padding and flips copy values
        images = to_float_images([images])
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


def _micro_batches(x: torch.Tensor, y: torch.Tensor, micro: int | None) -> list[tuple]:
    """``(images, labels, share of the batch)`` per micro-batch; share None for one pass."""
    if micro is None or micro >= len(y):
        return [(x, y, None)]
    return [(xs, ys, len(ys) / len(y)) for xs, ys in zip(x.split(micro), y.split(micro))]


def _accumulate_gradients(model, x, y, micro: int | None, dtype, where: str) -> torch.Tensor:
    """Backward of the batch's mean cross-entropy; returns it detached. ``FloatingPointError`` on a non-finite loss."""
    total = None
    for xs, ys, weight in _micro_batches(x, y, micro):
        with _autocast(x.device.type, dtype):
            loss = F.cross_entropy(model(xs), ys)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"fine-tuning loss is {loss.item()} at {where}; lower the lr")
        if weight is None:  # one pass: exactly the unscaled loss
            loss.backward()
            return loss.detach()
        (loss * weight).backward()  # the gradients sum to the batch mean's
        total = loss.detach() * weight if total is None else total + loss.detach() * weight
    return total


DROPOUT_STREAM = 1  # the dropout seed: (opts.seed, this), another stream than the data order's


@contextlib.contextmanager
def _seeded_dropout(seed: int, device: str):
    """torch's host generator, and ``device``'s, seeded from ``seed`` for the body, then restored: the dropout masks
    of a run do not depend on what ran before it in the process, and the caller's random state is untouched."""
    seed = int(np.random.SeedSequence((seed, DROPOUT_STREAM)).generate_state(1)[0])
    where = torch.device(device)
    if where.type == "cpu":
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(seed)
            yield
        return
    backend = torch.get_device_module(where.type)
    index = backend.current_device() if where.index is None else where.index
    with torch.random.fork_rng(devices=[index], device_type=where.type):
        torch.default_generator.manual_seed(seed)
        with backend.device(index):
            backend.manual_seed(seed)  # the current device's generator: ``index``'s
        yield


def _prepare(model, num_classes: int, opts: FinetuneOptions, device: str) -> None:
    """Fresh zero-initialised head, ``opts``' activation checkpointing, on ``device`` in train mode."""
    model.reset_classifier(num_classes)  # drops pre-logits too (representation_size=None): paper App. B.1.1
    if hasattr(model, "set_grad_checkpointing"):  # timm's name; set either way (model.json may carry it on)
        model.set_grad_checkpointing(opts.activation_checkpointing)
    elif opts.activation_checkpointing:
        raise ValueError(f"{type(model).__name__} has no set_grad_checkpointing; set activation_checkpointing: false")
    model.to(device).train()


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
    measure_at: Collection[int] = (),
    measure: Callable[[torch.nn.Module], float] | None = None,
) -> tuple[torch.nn.Module, dict[int, float]]:
    """Fine-tune ``model`` in place (fresh zero head; data order, augmentation and dropout seeded by ``opts.seed``) on
    float32 or uint8 images; returns it and ``{step: measure(model)}`` for ``measure_at`` (which does not change the
    run)."""
    with _seeded_dropout(opts.seed, device):
        _prepare(model, num_classes, opts, device)
        dtype = autocast_dtype(opts.precision, device)
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.SGD(params, lr=lr, momentum=opts.momentum, weight_decay=0.0)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: warmup_cosine(s, steps, opts.warmup_steps))
        targets = torch.as_tensor(labels, dtype=torch.long)
        gen = torch.Generator().manual_seed(opts.seed)
        order, cursor = torch.randperm(len(targets), generator=gen), 0
        batch = min(opts.batch_size, len(targets))
        curve, start = {}, time.perf_counter()
        for step in range(steps):
            if cursor + batch > len(order):  # next epoch: a fresh permutation, the tail of the last one dropped
                order, cursor = torch.randperm(len(targets), generator=gen), 0
            idx = order[cursor : cursor + batch]
            cursor += batch
            # Drawn and augmented whole before the micro-batch split: the data stream does not depend on it.
            x = _on_device(_augment(images[idx], opts.crop_padding, opts.flip, gen), device)  # (B, 3, S, S) float32
            optimizer.zero_grad(set_to_none=True)
            y = targets[idx].to(device)
            loss = _accumulate_gradients(model, x, y, opts.micro_batch_size, dtype, f"step {step} (lr={lr})")
            if opts.grad_clip:  # max_norm 0 would zero every gradient
                torch.nn.utils.clip_grad_norm_(params, opts.grad_clip)
            optimizer.step()
            schedule.step()
            if measure is not None and step + 1 in measure_at:
                curve[step + 1] = measure(model)
                model.train()  # measure() leaves the model in eval mode
            if log is not None and (step + 1) % max(1, steps // 4) == 0:
                log(
                    f"finetune: lr={lr:g} step {step + 1}/{steps} loss {loss.item():.4f} "
                    f"({time.perf_counter() - start:.1f}s)"
                )
        return model, curve


@torch.inference_mode()
def accuracy_over(
    model, batches: Iterable[tuple[torch.Tensor, np.ndarray]], *, device: str = "cpu", dtype: torch.dtype | None = None
) -> float:
    """Top-1 accuracy (fraction) over ``(images, labels)`` batches, one in memory at a time."""
    model.eval()
    correct = total = 0
    for images, labels in batches:
        with _autocast(device, dtype):
            logits = model(_on_device(images, device))  # (B, K)
        correct += int((logits.argmax(1).cpu().numpy() == np.asarray(labels)).sum())
        total += len(labels)
    if not total:
        raise ValueError("accuracy over no images: the split is empty")
    return correct / total


def accuracy(
    model,
    images: torch.Tensor,
    labels: np.ndarray,
    *,
    batch_size: int = 256,
    device: str = "cpu",
    dtype: torch.dtype | None = None,
) -> float:
    """`accuracy_over` in-memory images and labels, in slices of ``batch_size``."""
    slices = ((images[i : i + batch_size], labels[i : i + batch_size]) for i in range(0, len(images), batch_size))
    return accuracy_over(model, slices, device=device, dtype=dtype)


@dataclass(frozen=True)
class FinetuneResult:
    """``val_scores``: each lr's held-out accuracy; ``curve``: ``{step: test top-1}``."""

    accuracy: float
    lr: float
    val_scores: dict[float, float]
    curve: dict[int, float] = field(default_factory=dict)


def select_lr_and_evaluate(
    make_model: Callable[[], torch.nn.Module],
    train: tuple,
    val: tuple,
    test: Iterable[tuple[torch.Tensor, np.ndarray]],
    *,
    num_classes: int,
    opts: FinetuneOptions,
    device: str = "cpu",
    log=None,
) -> FinetuneResult:
    """One run per lr on ``train`` scored on ``val``; the best lr (ties → smaller) re-run on ``train + val``, scored on
    ``test``'s batches. Every run starts from a fresh ``make_model()``."""
    val_scores = {}
    run = dict(num_classes=num_classes, opts=opts, device=device, log=log)
    for lr in opts.lr_grid:
        try:
            model, _ = train_classifier(make_model(), *train, lr=lr, steps=opts.selection_steps or opts.steps, **run)
        except FloatingPointError as error:  # a diverged lr loses the search; it does not end the evaluation
            val_scores[float(lr)] = math.nan
            if log is not None:
                log(f"finetune: lr={lr:g} diverged, not chosen ({error})")
            continue
        dtype = autocast_dtype(opts.precision, device)  # as the run's: asked once a model is there (CUDA set up)
        val_scores[float(lr)] = accuracy(model, *val, batch_size=opts.eval_batch_size, device=device, dtype=dtype)
        if log is not None:
            log(f"finetune: lr={lr:g} held-out accuracy {val_scores[float(lr)]:.4f}")
        del model  # with its gradients, before the next run's: one fine-tuned model on the device at a time
    finite = [lr for lr in sorted(val_scores) if not math.isnan(val_scores[lr])]
    if not finite:
        raise FloatingPointError(f"fine-tuning diverged at every lr of the grid {list(opts.lr_grid)}; use lower lrs")
    best_lr = max(finite, key=lambda lr: val_scores[lr])  # max keeps the first (smallest) of ties
    full = torch.cat([train[0], val[0]]), np.concatenate([train[1], val[1]])

    def on_test(m) -> float:
        return accuracy_over(m, test, device=device, dtype=autocast_dtype(opts.precision, device))

    at = set(opts.eval_steps) - {opts.steps}  # the last step is the final score, measured once below
    model, curve = train_classifier(
        make_model(), *full, lr=best_lr, steps=opts.steps, measure_at=at, measure=on_test, **run
    )
    final = on_test(model)
    if opts.steps in opts.eval_steps:
        curve[opts.steps] = final
    return FinetuneResult(final, best_lr, val_scores, dict(sorted(curve.items())))


def holdout_split(num_examples: int, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train, held-out) indices from one seeded permutation, at least one on each side."""
    if num_examples < 2:
        raise ValueError(f"fine-tuning needs at least 2 training examples to hold one out; got {num_examples}")
    perm = np.random.default_rng(seed).permutation(num_examples)
    held = min(num_examples - 1, max(1, round(fraction * num_examples)))
    return perm[held:], perm[:held]


def vtab_indices(num_examples: int, train_examples: int, val_examples: int, seed: int):
    """Disjoint (train800, val200) indices from one seeded permutation of the train split."""
    need = train_examples + val_examples
    if num_examples < need:
        raise ValueError(
            f"the train split has {num_examples} images but VTAB needs {need} "
            f"({train_examples} train + {val_examples} val); write a larger train split"
        )
    perm = np.random.default_rng(seed).permutation(num_examples)
    return perm[:train_examples], perm[train_examples:need]


def train_val_split(num_examples: int, opts: FinetuneOptions) -> tuple[np.ndarray, np.ndarray]:
    """VTAB-1k's draw when ``train_examples`` is set, else the held-out slice."""
    if opts.train_examples is not None:
        return vtab_indices(num_examples, opts.train_examples, opts.val_examples, opts.seed)
    return holdout_split(num_examples, opts.holdout_fraction, opts.seed)


def _rows(name: str, result: FinetuneResult, opts: FinetuneOptions, size: int, counts: tuple) -> list[ResultRow]:
    num_train, num_held, num_test = counts
    grid = list(opts.lr_grid)
    trained_on = f"{num_train} + {num_held}" if opts.train_examples is not None else f"{num_train + num_held}"
    lr = f"lr={result.lr:g}"
    detail = f"{lr} from {grid} on {num_held} held-out; {opts.steps} steps at {size}px on {trained_on}"

    def row(metric: str, value: float, count: int, detail: str, status: str = "ok") -> ResultRow:
        return ResultRow("finetune", name, metric, value, count=count, status=status, detail=detail)

    rows = [
        row(keys.finetune_accuracy(name), result.accuracy, num_test, detail),
        row(f"finetune/{name}/lr", result.lr, num_held, f"chosen from {grid}"),
    ]
    rows += [
        row(keys.finetune_accuracy_at(name, n), acc, num_test, f"test top-1 after {n} of {opts.steps} steps ({lr})")
        for n, acc in result.curve.items()
    ]
    rows += [
        row(f"finetune/{name}/holdout_accuracy", score, num_held, f"lr={grid_lr:g}", "sweep")  # NaN: diverged
        for grid_lr, score in result.val_scores.items()
    ]
    return rows


def drawn_splits(split_dir, keep, held, *, image_size: int, resize_size: int | None, batch_size: int):
    """``((images, labels) at keep, (images, labels) at held)``, uint8, read in one pass."""
    images, labels, _ = load_drawn(
        split_dir, np.concatenate([keep, held]), image_size=image_size, resize_size=resize_size, batch_size=batch_size
    )
    n = len(keep)
    return (images[:n], labels[:n]), (images[n:], labels[n:])


def evaluate(ctx, opts: FinetuneOptions) -> EvalOutput:
    """Suite entry: per dataset, test top-1, the chosen lr, the curve, each lr's held-out accuracy."""
    size = int(opts.image_size or ctx.model.config.image_size)
    out = EvalOutput()
    for name in opts.datasets:
        train_dir = resolve_split(ctx.data_root, name, opts.train_split)
        test_dir = resolve_split(ctx.data_root, name, opts.test_split)
        info, test_info = split_info(train_dir), split_info(test_dir)
        if test_info.num_classes != info.num_classes:
            raise ValueError(f"{name}: train declares {info.num_classes} classes, test {test_info.num_classes}")
        # A draw over the first max_train_examples of train (its manifest's count); only the drawn are read.
        keep, held = train_val_split(min(info.num_samples, opts.max_train_examples), opts)
        sizes = dict(image_size=size, resize_size=opts.resize_size, batch_size=opts.eval_batch_size)
        train, val = drawn_splits(train_dir, keep, held, **sizes)
        start = time.perf_counter()
        with shared_models_on_host(ctx):
            result = select_lr_and_evaluate(
                lambda: ctx.load_model(image_size=size),
                train,
                val,
                StreamedSplit(test_dir, **sizes),
                num_classes=info.num_classes,
                opts=opts,
                device=ctx.device,
                log=ctx.log,
            )
        out.rows += _rows(name, result, opts, size, (len(keep), len(held), test_info.num_samples))
        curve = ", ".join(f"{n}: {acc:.4f}" for n, acc in result.curve.items())
        ctx.log(
            f"finetune: {name} test accuracy {result.accuracy:.4f} (lr {result.lr:g}, "
            f"{time.perf_counter() - start:.0f}s)" + (f"; after N steps {{{curve}}}" if curve else "")
        )
    return out
