"""Training tasks: the module DeepSpeed wraps, `forward(images, labels) -> (loss, metrics)`, and the recipe sections
``loss`` and ``task``. A task owns the model and its loss, so checkpoints hold all that trains. `TASKS` maps
``task.name`` to a `Task` (``@register_task`` adds more).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from pretrain.model import mpp
from pretrain.model.vit import VisionTransformer, ViTConfig

LossType = Literal["softmax_xent", "sigmoid_xent"]  # loss.type: the keys of LOSSES


@dataclass(frozen=True)
class LossConfig:
    """Recipe section ``loss`` (`LOSSES`)."""

    type: LossType = "sigmoid_xent"  # softmax_xent | sigmoid_xent (summed over classes)
    label_smoothing: float = 0.0  # softmax_xent only


@dataclass(frozen=True)
class TaskConfig:
    """Recipe section ``task``."""

    name: str = "classification"  # "classification" | "mpp" | "classification_mpp"
    options: dict[str, Any] = field(default_factory=dict)  # checked by the task


class TaskSettings(Protocol):
    """What a task reads of `TrainConfig`."""

    @property
    def task(self) -> TaskConfig: ...

    @property
    def loss(self) -> LossConfig: ...

    @property
    def seed(self) -> int: ...  # MPP's evaluation corruption


def _as_targets(labels: torch.Tensor, num_classes: int, dtype: torch.dtype) -> torch.Tensor:
    """Int labels (B,) → one-hot (B, K); (B, K) targets pass through."""
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
    """Binary cross-entropy summed over classes, mean over the batch (the i21k loss)."""
    if label_smoothing:
        raise ValueError("label smoothing is defined for softmax_xent only; set loss.label_smoothing=0")
    targets = _as_targets(labels, logits.shape[-1], logits.dtype)  # (B, K)
    return F.binary_cross_entropy_with_logits(logits, targets, reduction="none").sum(dim=-1).mean()


LOSSES: dict[str, Callable[..., torch.Tensor]] = {"softmax_xent": softmax_xent, "sigmoid_xent": sigmoid_xent}


def _check_loss(loss: str) -> None:
    if loss not in LOSSES:
        raise ValueError(f"loss.type={loss!r} is unknown; use one of {list(LOSSES)}")


def _labels_loss(
    logits: torch.Tensor, labels: torch.Tensor, loss: str, label_smoothing: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(`LOSSES[loss]`, top-1 accuracy vs. the argmax target) of fp32 logits (B, K)."""
    value = LOSSES[loss](logits, labels, label_smoothing)
    with torch.no_grad():
        target = labels if labels.ndim == 1 else labels.argmax(dim=-1)
        accuracy = (logits.argmax(dim=-1) == target).float().mean()
    return value, accuracy


class ClassificationTask(nn.Module):
    """A loss from `LOSSES` on model(images); metric ``accuracy``."""

    def __init__(self, model: nn.Module, loss: str = "softmax_xent", label_smoothing: float = 0.0):
        super().__init__()
        _check_loss(loss)
        self.model = model
        self.loss_name = loss
        self.label_smoothing = label_smoothing

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        logits = self.model(images).float()  # (B, K)
        loss, accuracy = _labels_loss(logits, labels, self.loss_name, self.label_smoothing)
        return loss, {"accuracy": accuracy}


class ClassificationWithMPP(mpp.MaskedPatchPrediction):
    """Classification and ``mpp`` from one pass over the corrupted patches; loss = labels' + ``mpp_weight`` × MPP's
    (docs/demo.md, "Locality"). Metrics: ``accuracy``, ``mpp_accuracy``. The model keeps its classifier."""

    def __init__(
        self,
        model: VisionTransformer,
        config: mpp.MPPConfig,
        mpp_weight: float = 1.0,
        loss: str = "softmax_xent",
        label_smoothing: float = 0.0,
        seed: int = 0,
    ):
        super().__init__(model, config, seed=seed)
        _check_loss(loss)
        if not model.config.num_classes:
            raise ValueError("task classification_mpp classifies: the model needs a head (model.num_classes > 0)")
        self.mpp_weight = float(mpp_weight)
        self.loss_name = loss
        self.label_smoothing = label_smoothing

    def forward(
        self, images: torch.Tensor, labels: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        if labels is None:
            raise ValueError("task classification_mpp trains on labels: call it with (images, labels)")
        encoded, patch_loss, patch_accuracy = self.corrupted_pass(images)
        logits = self.model.forward_head(self.model.pre_logits(self.model.pool(encoded))).float()  # (B, K)
        labels_loss, accuracy = _labels_loss(logits, labels, self.loss_name, self.label_smoothing)
        return labels_loss + self.mpp_weight * patch_loss, {"accuracy": accuracy, "mpp_accuracy": patch_accuracy}


MPP_WEIGHT = "mpp_weight"  # classification_mpp's non-MPP option


def classification_mpp_options(options: dict[str, Any]) -> tuple[mpp.MPPConfig, float]:
    """(`mpp.MPPConfig`, ``mpp_weight``); ValueError names a bad option."""
    rest = dict(options)
    weight = rest.pop(MPP_WEIGHT, 1.0)
    if isinstance(weight, bool) or not isinstance(weight, int | float) or not weight > 0:
        raise ValueError(f"task.options.{MPP_WEIGHT}={weight!r} must be a number > 0 (the MPP loss's weight)")
    return mpp.MPPConfig.from_options(rest, task="classification_mpp", also=(MPP_WEIGHT,)), float(weight)


def _plan_classification_mpp(options: dict[str, Any], vit: ViTConfig) -> tuple[ViTConfig, int]:
    return vit, mpp.added_parameters(vit.width, classification_mpp_options(options)[0])


TaskBuilder = Callable[[TaskSettings, VisionTransformer], nn.Module]
OptionsCheck = Callable[[dict[str, Any]], object]
ModelPlan = Callable[[dict[str, Any], ViTConfig], tuple[ViTConfig, int]]
ModelCheck = Callable[[ViTConfig, Sequence[tuple[str, int]], str | None], None]  # (vit, (setting, size)s, name)


@dataclass(frozen=True)
class Task:
    build: TaskBuilder
    options: OptionsCheck | None  # run by `check_config`; None: the builder checks
    plan: ModelPlan  # see `planned_model`
    model: ModelCheck | None = None  # run by `check_config` on the model the recipe trains


TASKS: dict[str, Task] = {}


def register_task(
    name: str, options: OptionsCheck | None = None, plan: ModelPlan | None = None, model: ModelCheck | None = None
) -> Callable[[TaskBuilder], TaskBuilder]:
    """Decorator adding ``builder(config, model)`` to `TASKS`; ``options`` and ``model`` (does the task fit that
    model?) run before workers start; ``plan``: see `planned_model` (default: ``vit``, nothing added)."""

    def add(builder: TaskBuilder) -> TaskBuilder:
        if name in TASKS and TASKS[name].build is not builder:
            raise ValueError(f"task {name!r} is registered twice")
        TASKS[name] = Task(builder, options, plan or (lambda _, vit: (vit, 0)), model)
        return builder

    return add


def _no_options(options: dict[str, Any]) -> None:
    if options:
        raise ValueError(
            f"task.options={options} given, but the classification task takes none; set task.options={{}} (a base "
            "recipe's options for another task are kept when only task.name changes)"
        )


@register_task("classification", options=_no_options)
def _build_classification(config: TaskSettings, model: VisionTransformer) -> nn.Module:
    _no_options(config.task.options)
    return ClassificationTask(model, config.loss.type, config.loss.label_smoothing)


@register_task("mpp", options=mpp.MPPConfig.from_options, plan=mpp.planned_model, model=mpp.check_patches)
def _build_mpp(config: TaskSettings, model: VisionTransformer) -> nn.Module:
    return mpp.build_mpp_task(model, config.task.options, config.seed)


@register_task(
    "classification_mpp", options=classification_mpp_options, plan=_plan_classification_mpp, model=mpp.check_patches
)
def _build_classification_mpp(config: TaskSettings, model: VisionTransformer) -> nn.Module:
    patches, weight = classification_mpp_options(dict(config.task.options))
    return ClassificationWithMPP(model, patches, weight, config.loss.type, config.loss.label_smoothing, config.seed)


def _registered(name: str) -> Task:
    if name not in TASKS:
        raise ValueError(f"task.name={name!r} is not registered; use one of {sorted(TASKS)}")
    return TASKS[name]


def check_config(
    loss: LossConfig,
    task: TaskConfig,
    vit: ViTConfig | None = None,
    resolution_schedule: Sequence[Sequence[int]] = (),
    model: str | None = None,
) -> None:
    """ValueError naming a bad field and the fix. ``vit``: the model ``model`` (its name) the recipe trains, at
    ``data.image_size`` and at each size of ``data.resolution_schedule``."""
    if not 0.0 <= loss.label_smoothing < 1.0:
        raise ValueError(f"loss.label_smoothing={loss.label_smoothing} must be in [0, 1)")
    if loss.label_smoothing and loss.type != "softmax_xent":
        raise ValueError("loss.label_smoothing applies to softmax_xent only; set it to 0 or loss.type=softmax_xent")
    registered = _registered(task.name)
    if registered.options is not None:
        registered.options(dict(task.options))
    if registered.model is not None and vit is not None:
        sizes = [(f"data.resolution_schedule[{i}][1]", int(size)) for i, (_, size) in enumerate(resolution_schedule)]
        registered.model(vit, sizes, model)


def build_task(config: TaskSettings, model: VisionTransformer) -> nn.Module:
    """The module DeepSpeed wraps."""
    return _registered(config.task.name).build(config, model)


def planned_model(config: TaskSettings, vit: ViTConfig) -> tuple[ViTConfig, int]:
    """(the ViTConfig the task trains, the parameters it adds), for the cluster planner."""
    return _registered(config.task.name).plan(dict(config.task.options), vit)
