"""Training tasks: the one module DeepSpeed wraps, `forward(images, labels) -> (loss, metrics)`.

A task owns the model and its loss, so the engine sees a single module and checkpoints hold everything that
trains. Tasks are registered by name in `TASKS` (``register_task``); `build_task(config, model)` picks one by
`config.task.name`. Other modules add tasks (e.g. masked patch prediction) with ``@register_task("mpp")``.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from pretrain.config import TrainConfig


def _as_targets(labels: torch.Tensor, num_classes: int, dtype: torch.dtype) -> torch.Tensor:
    """Int labels (B,) → one-hot (B, K); soft / multi-hot targets (B, K) (e.g. after mixup) pass through."""
    if labels.ndim == 1:
        return F.one_hot(labels.long(), num_classes).to(dtype)
    if labels.shape[-1] != num_classes:
        raise ValueError(f"targets have {labels.shape[-1]} classes but the model's head has {num_classes}")
    return labels.to(dtype)


def softmax_xent(logits: torch.Tensor, labels: torch.Tensor, label_smoothing: float = 0.0) -> torch.Tensor:
    """Mean over the batch of −Σ_k t_k log softmax(z)_k, with t smoothed to (1 − ε) t + ε / K."""
    num_classes = logits.shape[-1]
    targets = _as_targets(labels, num_classes, logits.dtype)  # (B, K)
    if label_smoothing:
        targets = targets * (1.0 - label_smoothing) + label_smoothing / num_classes
    return -(targets * F.log_softmax(logits, dim=-1)).sum(dim=-1).mean()


def sigmoid_xent(logits: torch.Tensor, labels: torch.Tensor, label_smoothing: float = 0.0) -> torch.Tensor:
    """Binary cross-entropy per class, summed over classes and averaged over the batch (the i21k loss)."""
    if label_smoothing:
        raise ValueError("label smoothing is defined for softmax_xent only; set loss.label_smoothing=0")
    targets = _as_targets(labels, logits.shape[-1], logits.dtype)  # (B, K)
    return F.binary_cross_entropy_with_logits(logits, targets, reduction="none").sum(dim=-1).mean()


LOSSES: dict[str, Callable[..., torch.Tensor]] = {"softmax_xent": softmax_xent, "sigmoid_xent": sigmoid_xent}


class ClassificationTask(nn.Module):
    """Image classification: logits = model(images); loss from `LOSSES`; top-1 accuracy against the argmax target."""

    def __init__(self, model: nn.Module, loss: str = "softmax_xent", label_smoothing: float = 0.0):
        super().__init__()
        if loss not in LOSSES:
            raise ValueError(f"loss.type={loss!r} is unknown; use one of {list(LOSSES)}")
        self.model = model
        self.loss_name = loss
        self.label_smoothing = label_smoothing

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        logits = self.model(images).float()  # (B, K); the loss in fp32 even when the weights are bf16
        loss = LOSSES[self.loss_name](logits, labels, self.label_smoothing)
        with torch.no_grad():
            target = labels if labels.ndim == 1 else labels.argmax(dim=-1)
            accuracy = (logits.argmax(dim=-1) == target).float().mean()
        return loss, {"accuracy": accuracy}


TaskBuilder = Callable[["TrainConfig", nn.Module], nn.Module]
TASKS: dict[str, TaskBuilder] = {}


def register_task(name: str) -> Callable[[TaskBuilder], TaskBuilder]:
    """Decorator adding ``builder(config, model) -> nn.Module`` to `TASKS` under ``name``."""

    def add(builder: TaskBuilder) -> TaskBuilder:
        if name in TASKS and TASKS[name] is not builder:
            raise ValueError(f"task {name!r} is registered twice")
        TASKS[name] = builder
        return builder

    return add


@register_task("classification")
def _build_classification(config: TrainConfig, model: nn.Module) -> nn.Module:
    if config.task.options:
        raise ValueError(f"task.options={config.task.options} given, but the classification task takes none")
    return ClassificationTask(model, config.loss.type, config.loss.label_smoothing)


# Modules that register tasks on import; imported lazily so this file never depends on them.
TASK_MODULES = ("pretrain.mpp",)


def registered_tasks() -> dict[str, TaskBuilder]:
    """`TASKS` after importing every task module that exists in this checkout."""
    for module in TASK_MODULES:
        if importlib.util.find_spec(module) is not None:
            importlib.import_module(module)
    return TASKS


def build_task(config: TrainConfig, model: nn.Module) -> nn.Module:
    """The module DeepSpeed wraps: ``forward(images, labels) -> (loss, metrics dict of scalar tensors)``."""
    tasks = registered_tasks()
    if config.task.name not in tasks:
        raise ValueError(f"task.name={config.task.name!r} is not registered; use one of {sorted(tasks)}")
    return tasks[config.task.name](config, model)
