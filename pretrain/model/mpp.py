"""Masked patch prediction, the paper's self-supervised pre-training task (§4.6, App. B.1.2): task ``mpp``.

Corrupt 50% of each image's patch embeddings (of those, 80% become a learned [mask], 10% another patch's, 10% stay)
before position embeddings, and predict each corrupted patch's 3-bit mean colour (512 classes) from its output token.
Counts are exact per image. Training draws from torch's global generator, seeded per micro-batch by position
(`pretrain.randomness.model_randomness`), so a resume at any world size draws the same corruptions.
"""

from __future__ import annotations

from collections.abc import Iterable
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
    "check_patches",
    "corruption_plan",
    "mean_color_targets",
    "planned_model",
]


@dataclass(frozen=True)
class MPPConfig:
    """``task.options`` of ``mpp``; defaults are the paper's."""

    corrupt_fraction: float = 0.5  # of each image's patches, corrupted and predicted
    mask_fraction: float = 0.8  # of those, replaced by [mask]
    random_fraction: float = 0.1  # of those, replaced by another patch; the rest stay
    color_bits: int = 3  # per channel of the predicted mean colour

    def __post_init__(self) -> None:
        for f in fields(self):  # task.options are untyped YAML: 5e-1 is a string there
            value, integer = getattr(self, f.name), f.type == "int"
            if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
                hint = "; YAML reads numbers like 5e-1 as text: write 0.5" if isinstance(value, str) else ""
                raise ValueError(
                    f"task.options.{f.name}={value!r} must be {'an integer' if integer else 'a number'}{hint}"
                )
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
        """ValueError names a bad key. ``also``: ``task``'s other, already removed, keys."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            valid = sorted(known | set(also))
            raise ValueError(f"task.options has unknown keys {unknown} for task {task!r}; known: {valid}")
        return cls(**options)


def mean_color_targets(images: torch.Tensor, patch_pixels: int, bits: int = 3) -> torch.Tensor:
    """Each patch's mean-colour class (B, N): per channel floor((m + 1) / 2 · 2^bits), clipped, then
    (r·2^bits + g)·2^bits + b. Exact for 8-bit pixels in [-1, 1] in any float dtype."""
    if images.ndim != 4 or images.shape[1] != 3:
        raise ValueError(f"mean_color_targets needs RGB images (B, 3, H, W), got {tuple(images.shape)}")
    # Back to 0..255: bf16 moves a pixel's level by up to 1/4 and float32 by ~1e-5, which would shift the patches
    # whose mean sits at or near a class boundary; a level within that of a whole one is taken to be it.
    pixels = images.float().add(1.0).mul_(127.5)
    whole = pixels.round()
    pixels = torch.where((pixels - whole).abs_() < (0.3 if images.element_size() < 4 else 1e-3), whole, pixels)
    # float32 sums of whole levels are exact (< 2^24), and so is the floor of their correctly rounded quotient
    sums = F.avg_pool2d(pixels, kernel_size=patch_pixels, stride=patch_pixels, divisor_override=1)  # (B, 3, gh, gw)
    levels = 2**bits
    q = torch.floor(sums * levels / (255 * patch_pixels**2)).clamp(0, levels - 1).long()
    index = (q[:, 0] * levels + q[:, 1]) * levels + q[:, 2]  # (B, gh, gw)
    return index.flatten(1)  # (B, N)


@dataclass(frozen=True)
class CorruptionPlan:
    """Which patches are corrupted and how, all (B, N)."""

    corrupted: torch.Tensor  # predicted: masked, randomised or kept
    masked: torch.Tensor  # replaced by [mask]
    source: torch.Tensor  # randomised: the flat index b·N + n replacing it; −1 elsewhere

    @property
    def randomised(self) -> torch.Tensor:
        return self.source >= 0


def corruption_plan(batch: int, num_patches: int, config: MPPConfig, generator: torch.Generator) -> CorruptionPlan:
    """Draw a batch's corruption from ``generator``."""
    if num_patches < 2:
        raise ValueError(f"masked patch prediction needs at least 2 patches per image, got {num_patches}")
    n_corrupt = max(1, round(config.corrupt_fraction * num_patches))
    n_mask = round(config.mask_fraction * n_corrupt)
    n_random = min(round(config.random_fraction * n_corrupt), n_corrupt - n_mask)
    # per image, the first n_corrupt of a random permutation: mask | random | kept
    order = torch.rand(batch, num_patches, generator=generator).argsort(dim=1)  # (B, N)
    role = torch.full((batch, num_patches), 3, dtype=torch.long)  # 0 mask, 1 random, 2 kept, 3 clean
    rank_role = torch.full((num_patches,), 3, dtype=torch.long)
    rank_role[:n_mask] = 0
    rank_role[n_mask : n_mask + n_random] = 1
    rank_role[n_mask + n_random : n_corrupt] = 2
    role.scatter_(1, order, rank_role.expand(batch, -1).contiguous())
    # any other patch of the batch
    total = batch * num_patches
    flat = torch.arange(total).view(batch, num_patches)
    offset = torch.randint(1, total, (batch, num_patches), generator=generator)
    source = torch.where(role == 1, (flat + offset) % total, torch.full_like(flat, -1))
    return CorruptionPlan(corrupted=role < 3, masked=role == 0, source=source)


def check_patches(vit: ViTConfig, sizes: Iterable[tuple[str, int]] = (), model: str | None = None) -> None:
    """ValueError unless ``vit`` cuts >= 2 patches per image at its image size and each (setting, size) of ``sizes``."""
    for setting, size in [("data.image_size", vit.image_size), *sizes]:
        patches = (size // vit.stride) ** 2  # as the model cuts them: a stride x stride square each
        if patches < 2:
            raise ValueError(
                f"{f'model {model}' if model else 'the model'} at {setting} {size} leaves {patches} "
                f"patch{'es' * (patches != 1)} per image (one per {vit.stride}x{vit.stride} px); masked "
                f"patch prediction needs >= 2: raise {setting} to {2 * vit.stride} or set task.name=classification"
            )


class MaskedPatchPrediction(nn.Module):
    """The ``mpp`` task: encoder, [mask] and colour head. Labels are ignored; metric ``accuracy``."""

    draws: torch.Tensor

    def __init__(self, model: VisionTransformer, config: MPPConfig = MPPConfig(), seed: int = 0):
        super().__init__()
        if model.config.in_chans != 3:
            raise ValueError("masked patch prediction predicts RGB colours; the model must take 3-channel images")
        check_patches(model.config)  # before DeepSpeed starts; `tasks.check_config` with the model: at validation
        self.model = model
        self.config = config
        self.seed = int(seed)  # for the evaluation corruption
        width = model.config.width
        self.mask_token = nn.Parameter(torch.empty(1, 1, width).normal_(std=0.02))
        self.head = nn.Linear(width, config.num_colors)
        nn.init.zeros_(self.head.weight)  # uniform start: loss log(num_colors)
        nn.init.zeros_(self.head.bias)
        # unused; checkpoints hold it
        self.register_buffer("draws", torch.zeros((), dtype=torch.long))

    def no_weight_decay(self) -> set[str]:
        """The [mask] embedding; the model names its own."""
        return {"mask_token"}

    def external_parameters(self) -> list[nn.Parameter]:
        """Model parameters used outside the model's ``forward``, for ZeRO-3 to gather."""
        return [p for p in (self.model.cls_token, self.model.pos_embed) if isinstance(p, nn.Parameter)]

    def corrupt(self, tokens: torch.Tensor, plan: CorruptionPlan) -> torch.Tensor:
        """Apply ``plan`` to (B, N, D); a randomised patch takes its source's *uncorrupted* embedding."""
        b, n, d = tokens.shape
        device = tokens.device
        masked = plan.masked.to(device).unsqueeze(-1)  # (B, N, 1)
        randomised = plan.randomised.to(device)
        source = plan.source.clamp_min(0).to(device)  # (B, N)
        swapped = tokens.reshape(b * n, d)[source.reshape(-1)].view(b, n, d)
        x = torch.where(randomised.unsqueeze(-1), swapped, tokens)
        return torch.where(masked, self.mask_token.to(tokens.dtype).expand(b, n, d), x)

    def corrupted_pass(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(tokens (B, P+N, D), colour cross-entropy, accuracy over corrupted patches)."""
        # before the encoder's activations: its float32 temporaries are a few images' size
        targets = mean_color_targets(images, self.model.config.stride, self.config.color_bits).to(images.device)
        tokens = self.model.embed_patches(images)  # (B, N, D)
        b, n, _ = tokens.shape
        if self.training:  # seeded by the trainer
            plan = corruption_plan(b, n, self.config, torch.default_generator)
            self.draws += 1
        else:  # the same at every evaluation
            plan = corruption_plan(b, n, self.config, torch.Generator().manual_seed(self.seed))
        encoded = self.model.encode(self.corrupt(tokens, plan))  # (B, P+N, D)
        patch_out = encoded[:, encoded.shape[1] - n :]  # (B, N, D)
        corrupted = plan.corrupted.to(images.device)
        logits = self.head(patch_out[corrupted])  # (M, num_colors): 512 at color_bits=3
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
    """The ``mpp`` task around ``model``, its head dropped (it would get no gradient)."""
    if model.config.num_classes:
        model.reset_classifier(0)
    return MaskedPatchPrediction(model, MPPConfig.from_options(dict(options)), seed=seed)


def added_parameters(width: int, config: MPPConfig) -> int:
    """[mask] and the colour head."""
    return width + width * config.num_colors + config.num_colors


def planned_model(options: dict[str, Any], vit: ViTConfig) -> tuple[ViTConfig, int]:
    """(``vit`` without head and pre-logits, `added_parameters`)."""
    encoder = replace(vit, num_classes=0, representation_size=None)
    return encoder, added_parameters(vit.width, MPPConfig.from_options(dict(options)))
