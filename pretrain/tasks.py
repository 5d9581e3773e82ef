"""Training tasks: the one module DeepSpeed wraps, `forward(images, labels) -> (loss, metrics)`.

A task owns the model and its loss, so the engine sees a single module and checkpoints hold everything that
trains. Tasks are registered by name in `TASKS` (``register_task``); `build_task(config, model)` picks one by
`config.task.name`. Other modules add tasks (e.g. masked patch prediction) with ``@register_task("mpp")``;
`pretrain.config` imports each of them, so wherever a TrainConfig exists every task is registered.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:  # annotations only: pretrain.config imports this module
    from pretrain.config import LossConfig, TaskConfig, TrainConfig

LossType = Literal["softmax_xent", "sigmoid_xent"]  # loss.type: the keys of LOSSES


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


LOSSES: dict[LossType, Callable[..., torch.Tensor]] = {"softmax_xent": softmax_xent, "sigmoid_xent": sigmoid_xent}


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
# name → a function that parses `task.options` and raises ValueError naming the bad one (`check_config` runs it)
TASK_OPTIONS: dict[str, Callable[[dict], Any]] = {}


def register_task(name: str, options: Callable[[dict], Any] | None = None) -> Callable[[TaskBuilder], TaskBuilder]:
    """Decorator adding ``builder(config, model) -> nn.Module`` to `TASKS` under ``name``.

    ``options(task_options_dict)`` parses and checks the task's options, so that `TrainConfig.validate` rejects a
    bad one before any worker starts; the builder gets them unchecked otherwise.
    """

    def add(builder: TaskBuilder) -> TaskBuilder:
        if name in TASKS and TASKS[name] is not builder:
            raise ValueError(f"task {name!r} is registered twice")
        TASKS[name] = builder
        if options is not None:
            TASK_OPTIONS[name] = options
        return builder

    return add


def _no_options(options: dict) -> None:
    if options:
        raise ValueError(f"task.options={options} given, but the classification task takes none")


@register_task("classification", options=_no_options)
def _build_classification(config: TrainConfig, model: nn.Module) -> nn.Module:
    _no_options(config.task.options)
    return ClassificationTask(model, config.loss.type, config.loss.label_smoothing)


def check_config(loss: LossConfig, task: TaskConfig) -> None:
    """The loss and task sections (`TrainConfig.validate`); ValueError naming the field and the fix."""
    if not 0.0 <= loss.label_smoothing < 1.0:
        raise ValueError(f"loss.label_smoothing={loss.label_smoothing} must be in [0, 1)")
    if loss.label_smoothing and loss.type != "softmax_xent":
        raise ValueError("loss.label_smoothing applies to softmax_xent only; set it to 0 or loss.type=softmax_xent")
    if task.name not in TASKS:
        raise ValueError(f"task.name={task.name!r} is not registered; use one of {sorted(TASKS)}")
    if task.name in TASK_OPTIONS:
        TASK_OPTIONS[task.name](dict(task.options))


def build_task(config: TrainConfig, model: nn.Module) -> nn.Module:
    """The module DeepSpeed wraps: ``forward(images, labels) -> (loss, metrics dict of scalar tensors)``."""
    if config.task.name not in TASKS:
        raise ValueError(f"task.name={config.task.name!r} is not registered; use one of {sorted(TASKS)}")
    return TASKS[config.task.name](config, model)
