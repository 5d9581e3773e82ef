"""Masked patch prediction: the paper's self-supervised pre-training task (§4.6, App. B.1.2).

Corrupt 50% of the patch embeddings of each image — of those, 80% are replaced by a learned [mask] embedding, 10%
by the embedding of another, random patch and 10% left unchanged — run the encoder, and predict each corrupted
patch's 3-bit mean colour (per channel, the patch's mean in [-1, 1] quantised to 8 levels → 8³ = 512 classes)
from its output token with a linear head. Corruption happens after the patch projection (eq. 1) and before the
class token and position embeddings are added, so position information stays intact, as in BERT.

Counts are exact per image (round(50% of N) corrupted; round(80%) / round(10%) of those masked / replaced), which
makes the proportions testable and the batch loss equally weighted across images. In training the random choices
come from torch's global CPU generator, which the trainer seeds for each micro-batch by its position in the run
(seed, optimizer step, global micro-batch index: `pretrain.randomness.model_randomness`), as it does for dropout: a
resumed run, or one resumed at another world size, draws the same corruptions as an uninterrupted one, and the task
keeps no random state of its own.

`pretrain.model.tasks` registers this task as ``mpp`` (recipe ``task.name: mpp``, its options ``task.options``): the
builder is `build_mpp_task`, the options' check `MPPConfig.from_options`, and `planned_model` what the cluster planner
counts.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pretrain.model.vit import VisionTransformer, ViTConfig

__all__ = [
    "MPPConfig",
    "CorruptionPlan",
    "MaskedPatchPrediction",
    "added_parameters",
    "build_mpp_task",
    "corruption_plan",
    "mean_color_targets",
    "planned_model",
]


@dataclass(frozen=True)
class MPPConfig:
    """Options of the ``mpp`` task (recipe ``task.options``); defaults are the paper's.

    corrupt_fraction: share of patches per image that are corrupted and predicted (paper 0.5; 0.15 was worse).
    mask_fraction / random_fraction: of the corrupted patches, the share replaced by the [mask] embedding and by
        another random patch's embedding; the rest stay unchanged (paper 0.8 / 0.1 / 0.1).
    color_bits: bits per channel of the predicted mean colour (paper 3 → 512 classes).
    """

    corrupt_fraction: float = 0.5
    mask_fraction: float = 0.8
    random_fraction: float = 0.1
    color_bits: int = 3

    def __post_init__(self) -> None:
        if not 0.0 < self.corrupt_fraction <= 1.0:
            raise ValueError(f"task.options.corrupt_fraction must be in (0, 1], got {self.corrupt_fraction}")
        if self.mask_fraction < 0 or self.random_fraction < 0 or self.mask_fraction + self.random_fraction > 1:
            raise ValueError(
                "task.options.mask_fraction and random_fraction must be ≥ 0 and sum to ≤ 1 (the rest stays "
                f"unchanged), got {self.mask_fraction} and {self.random_fraction}"
            )
        if not 1 <= self.color_bits <= 8:
            raise ValueError(f"task.options.color_bits must be in 1..8, got {self.color_bits}")

    @property
    def num_colors(self) -> int:
        return 2 ** (3 * self.color_bits)

    @classmethod
    def from_options(cls, options: dict[str, Any], task: str = "mpp", also: tuple[str, ...] = ()) -> MPPConfig:
        """The options of a recipe's ``task.options``; ValueError naming an unknown or out-of-range one. ``also``:
        the options of ``task`` that are not MPP's (the caller has taken them out of ``options``)."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            valid = sorted(known | set(also))
            raise ValueError(f"task.options has unknown keys {unknown} for task {task!r}; known: {valid}")
        return cls(**options)


def mean_color_targets(images: torch.Tensor, patch_pixels: int, bits: int = 3) -> torch.Tensor:
    """The class index of each patch's quantised mean colour → ``(B, N)`` int64, N row-major.

    Each channel's mean over the patch, in [-1, 1], maps to level floor((m + 1) / 2 · 2^bits) clipped to
    [0, 2^bits − 1]; the index is r · 4^bits + g · 2^bits + b (for 3 bits: r·64 + g·8 + b, 0..511).
    """
    if images.ndim != 4 or images.shape[1] != 3:
        raise ValueError(f"mean_color_targets needs RGB images (B, 3, H, W), got {tuple(images.shape)}")
    means = F.avg_pool2d(images.float(), kernel_size=patch_pixels, stride=patch_pixels)  # (B, 3, gh, gw)
    levels = 2**bits
    q = torch.floor((means.clamp(-1.0, 1.0) + 1.0) / 2.0 * levels).clamp(0, levels - 1).long()
    index = (q[:, 0] * levels + q[:, 1]) * levels + q[:, 2]  # (B, gh, gw)
    return index.flatten(1)  # (B, N)


@dataclass(frozen=True)
class CorruptionPlan:
    """Which patches are corrupted and how; all ``(B, N)``.

    corrupted: predicted patches (masked ∪ randomised ∪ kept). masked: replaced by the [mask] embedding.
    source: for randomised patches, the flat index b·N + n of the patch whose embedding replaces it; −1 elsewhere.
    """

    corrupted: torch.Tensor
    masked: torch.Tensor
    source: torch.Tensor

    @property
    def randomised(self) -> torch.Tensor:
        return self.source >= 0


def corruption_plan(batch: int, num_patches: int, config: MPPConfig, generator: torch.Generator) -> CorruptionPlan:
    """Draw the corruption of a batch; deterministic given the generator's state."""
    if num_patches < 2:
        raise ValueError(f"masked patch prediction needs at least 2 patches per image, got {num_patches}")
    n_corrupt = max(1, round(config.corrupt_fraction * num_patches))
    n_mask = round(config.mask_fraction * n_corrupt)
    n_random = min(round(config.random_fraction * n_corrupt), n_corrupt - n_mask)
    # A random permutation per image: its first n_corrupt positions are corrupted, split mask | random | kept.
    order = torch.rand(batch, num_patches, generator=generator).argsort(dim=1)  # (B, N)
    role = torch.full((batch, num_patches), 3, dtype=torch.long)  # 0 mask, 1 random, 2 kept, 3 clean
    rank_role = torch.full((num_patches,), 3, dtype=torch.long)
    rank_role[:n_mask] = 0
    rank_role[n_mask : n_mask + n_random] = 1
    rank_role[n_mask + n_random : n_corrupt] = 2
    role.scatter_(1, order, rank_role.expand(batch, -1).contiguous())
    # "Another random patch": any patch of the batch except this one (offset 1..B·N−1, so never itself).
    total = batch * num_patches
    flat = torch.arange(total).view(batch, num_patches)
    offset = torch.randint(1, total, (batch, num_patches), generator=generator)
    source = torch.where(role == 1, (flat + offset) % total, torch.full_like(flat, -1))
    return CorruptionPlan(corrupted=role < 3, masked=role == 0, source=source)


class MaskedPatchPrediction(nn.Module):
    """The ``mpp`` task: wraps a ``VisionTransformer`` so DeepSpeed trains encoder, [mask] token and head together.

    ``forward(images, labels) -> (loss, metrics)``; labels are ignored (self-supervised). The loss is the mean
    softmax cross-entropy over corrupted patches; metrics hold ``accuracy`` (top-1 over corrupted patches).
    """

    draws: torch.Tensor  # a buffer: training forward calls so far (see __init__)

    def __init__(self, model: VisionTransformer, config: MPPConfig = MPPConfig(), seed: int = 0):
        super().__init__()
        if model.config.in_chans != 3:
            raise ValueError("masked patch prediction predicts RGB colours; the model must take 3-channel images")
        self.model = model
        self.config = config
        self.seed = int(seed)  # the evaluation-mode corruption's seed
        width = model.config.width
        # BERT-style learned [mask] embedding, initialised like the position embeddings.
        self.mask_token = nn.Parameter(torch.empty(1, 1, width).normal_(std=0.02))
        self.head = nn.Linear(width, config.num_colors)
        nn.init.zeros_(self.head.weight)  # the initial prediction is uniform: loss starts at log(512)
        nn.init.zeros_(self.head.bias)
        # Training forward calls so far: a count in every checkpoint (the corruptions no longer depend on it; it stays
        # so that checkpoints of runs that keyed them by it still load).
        self.register_buffer("draws", torch.zeros((), dtype=torch.long))

    def no_weight_decay(self) -> set[str]:
        """The [mask] embedding is an embedding, not a weight matrix (the model's own names come from the model)."""
        return {"mask_token"}

    def external_parameters(self) -> list[nn.Parameter]:
        """The model's parameters this task reads outside the model's own ``forward``: the class token and the position
        embeddings, which `VisionTransformer.encode` adds to the corrupted tokens. ZeRO-3 gathers a parameter around
        its owner's ``forward``, so the engine registers these with this module (`pretrain.engine.build_engine`)."""
        return [p for p in (self.model.cls_token, self.model.pos_embed) if isinstance(p, nn.Parameter)]

    def corrupt(self, tokens: torch.Tensor, plan: CorruptionPlan) -> torch.Tensor:
        """Apply ``plan`` to patch embeddings ``(B, N, D)``; randomised patches take the *uncorrupted* source."""
        b, n, d = tokens.shape
        device = tokens.device
        masked = plan.masked.to(device).unsqueeze(-1)  # (B, N, 1)
        randomised = plan.randomised.to(device)
        source = plan.source.clamp_min(0).to(device)  # (B, N)
        swapped = tokens.reshape(b * n, d)[source.reshape(-1)].view(b, n, d)
        x = torch.where(randomised.unsqueeze(-1), swapped, tokens)
        return torch.where(masked, self.mask_token.to(tokens.dtype).expand(b, n, d), x)

    def corrupted_pass(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Encode ``images`` with a drawn corruption and predict the corrupted patches' colours: (the encoder's
        output tokens (B, P+N, D), the mean cross-entropy over corrupted patches, their top-1 accuracy)."""
        tokens = self.model.embed_patches(images)  # (B, N, D)
        b, n, _ = tokens.shape
        if self.training:
            # Seeded by the micro-batch's position when the trainer runs it (module docstring).
            plan = corruption_plan(b, n, self.config, torch.default_generator)
            self.draws += 1
        else:
            # Evaluation loss is reproducible regardless of how many training steps came before.
            plan = corruption_plan(b, n, self.config, torch.Generator().manual_seed(self.seed))
        encoded = self.model.encode(self.corrupt(tokens, plan))  # (B, P+N, D)
        patch_out = encoded[:, encoded.shape[1] - n :]  # (B, N, D), drop the class token if any
        corrupted = plan.corrupted.to(images.device)
        logits = self.head(patch_out[corrupted])  # (M, 512), M = corrupted patches in the batch
        targets = mean_color_targets(images, self.model.config.stride, self.config.color_bits).to(images.device)
        targets = targets[corrupted]  # (M,)
        loss = F.cross_entropy(logits.float(), targets)
        with torch.no_grad():
            accuracy = (logits.argmax(-1) == targets).float().mean()
        return encoded, loss, accuracy

    def forward(
        self, images: torch.Tensor, labels: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        _, loss, accuracy = self.corrupted_pass(images)
        return loss, {"accuracy": accuracy}


def build_mpp_task(model: VisionTransformer, options: dict[str, Any], seed: int) -> MaskedPatchPrediction:
    """The ``mpp`` task around ``model``: ``options`` are the recipe's ``task.options``, ``seed`` the run's seed.

    MPP has no use for a classification head; one the trainer built for the dataset's classes is dropped, since
    parameters that never get a gradient would only be dead weight in the optimizer and the checkpoint.
    """
    if model.config.num_classes:
        model.reset_classifier(0)
    return MaskedPatchPrediction(model, MPPConfig.from_options(dict(options)), seed=seed)


def added_parameters(width: int, config: MPPConfig) -> int:
    """The parameters `MaskedPatchPrediction` adds to a model of ``width`` D: the [mask] embedding (D) and the linear
    colour head (D x colours + colours)."""
    return width + width * config.num_colors + config.num_colors


def planned_model(options: dict[str, Any], vit: ViTConfig) -> tuple[ViTConfig, int]:
    """(the ViTConfig `build_mpp_task` trains from ``vit``, the parameters the task adds): the encoder without the
    classifier and its pre-logits (``reset_classifier(0)``), plus `added_parameters`."""
    encoder = replace(vit, num_classes=0, representation_size=None)
    return encoder, added_parameters(vit.width, MPPConfig.from_options(dict(options)))
