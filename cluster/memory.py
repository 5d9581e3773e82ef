"""Per-GPU memory arithmetic for data-parallel ViT training under DeepSpeed ZeRO.

Model states follow the ZeRO paper's accounting (Rajbhandari et al., 2020) for mixed precision with Adam:

| state                         | bytes / param | replicated until | note                                         |
|-------------------------------|---------------|------------------|----------------------------------------------|
| training weights (bf16)       | 2             | stage 3          | fp32 training: 4, and no separate master copy |
| gradients (bf16)              | 2             | stage 2          | fp32 training: 4                              |
| fp32 gradient partition       | 4             | (stage >= 2 only)| `grad_accum_dtype: fp32` keeps one per rank   |
| optimizer: fp32 master + m, v | 12            | stage 1          | fp32 training: m, v only = 8                  |

For ViT-H/14 (632.05M parameters) on 64 GPUs this gives 10.1 GB without ZeRO, 2.65 GB (ZeRO-1), 1.44 GB
(ZeRO-2) and 0.20 GB (ZeRO-3): docs/reference.md §7's figures, which the tests check.

Activations are counted per token per layer (Korthikanti et al., 2022, "Reducing Activation Recomputation",
§4.1, re-derived for this model: SDPA, no dropout masks unless dropout > 0). Saved for backward, in elements
per token per layer: LN1 input D, qkv input D, q k v 3D, SDPA output / proj input D, LN2 input D, fc1 input D
(8·D), then the GELU input and fc2 input (2·m, m the MLP width) —
i.e. (8·D + 2·m) elements per token per layer with SDPA, where m is the MLP width; eager attention adds the
softmax output (heads · N elements). At 2 bytes that is 16·D + 4·m bytes: for ViT-H/14 at 224 (N = 257 tokens,
32 layers) 40,960 B × 257 × 32 = 337 MB per image, the measured figure in docs/reference.md §7. Dropout adds one-byte
masks (2·D per token per layer). With per-block activation checkpointing only each block's input (D elements)
is kept, plus one block's full activations while it is recomputed.
"""

from __future__ import annotations

from dataclasses import dataclass

GB = 1e9  # decimal gigabytes, as GPU data sheets and docs/reference.md §7 count them


@dataclass(frozen=True)
class ModelStateMemory:
    """Bytes per GPU for parameters, gradients and optimizer states."""

    params: float
    grads: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer


def model_state_bytes(num_params: int, zero_stage: int, world_size: int, precision: str) -> ModelStateMemory:
    """ZeRO stage 0-3 per-GPU model-state memory for Adam (see the module docstring's table)."""
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage={zero_stage}; use 0, 1, 2 or 3")
    if precision not in ("bf16", "fp32"):
        raise ValueError(f"precision={precision!r}; use 'bf16' or 'fp32'")
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be >= 1")
    P, N = float(num_params), float(world_size)
    if precision == "bf16":
        weight_b, grad_b, opt_b = 2.0, 2.0, 12.0
        # ZeRO-2/3 with bf16 keep an fp32 partition of the reduced gradients for the fp32 optimizer step.
        grad_partition_b = 4.0
    else:
        weight_b, grad_b, opt_b = 4.0, 4.0, 8.0
        grad_partition_b = 0.0  # the fp32 gradients are the optimizer's input already
    params = P * weight_b / (N if zero_stage >= 3 else 1.0)
    if zero_stage >= 2:
        grads = P * (grad_b + grad_partition_b) / N
    else:
        grads = P * grad_b
    optimizer = P * opt_b / (N if zero_stage >= 1 else 1.0)
    return ModelStateMemory(params=params, grads=grads, optimizer=optimizer)


def tokens_per_image(image_size: int, patch_size: int, hybrid_stride: int | None = None) -> int:
    """Sequence length N including the class token; hybrids see (image / stride)² patches of size 1."""
    stride = hybrid_stride if hybrid_stride else patch_size
    return (image_size // stride) ** 2 + 1


def activation_bytes_per_image(
    *,
    tokens: int,
    width: int,
    mlp_dim: int,
    depth: int,
    num_heads: int,
    precision: str,
    dropout: float = 0.0,
    activation_checkpointing: bool = False,
    sdpa: bool = True,
) -> float:
    """Bytes of activations one image keeps for the backward pass (transformer encoder only)."""
    elem = 2.0 if precision == "bf16" else 4.0
    per_token_layer = elem * (8 * width + 2 * mlp_dim)  # (N, D)-shaped saves + the two (N, m) MLP tensors
    if not sdpa:
        per_token_layer += elem * num_heads * tokens  # the (h, N, N) softmax output, one row per token
    if dropout > 0:
        per_token_layer += 2 * width  # one-byte masks after attention-out and MLP
    one_layer = per_token_layer * tokens
    if activation_checkpointing:
        # Block inputs for every layer, plus one block's activations alive during its recomputation.
        return elem * width * tokens * depth + one_layer
    return one_layer * depth


def fits(total_bytes: float, capacity_bytes: float) -> bool:
    return total_bytes <= capacity_bytes
