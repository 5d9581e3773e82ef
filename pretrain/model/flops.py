"""Analytic compute and size of a ViT from its config alone (no model is built).

A multiply-add is 2 FLOPs. Per encoder layer with N tokens (class token included), width D and MLP size M:

    N·D·3D  (q, k, v)  +  2·N²·D  (q kᵀ and A v)  +  N·D²  (out)  +  2·N·D·M  (MLP)

multiply-adds, plus embedding, stem and head; norms, softmax, GELU and biases are ignored, as by timm. Training is
3 × forward. ``as_run=True`` counts the last layer at the class token alone, as `VisionTransformer` runs it
(docs/reference.md §5).
"""

from __future__ import annotations

import dataclasses
import math

from pretrain.model.resnet import root_width
from pretrain.model.vit import ViTConfig


def _conv_out(size: int, stride: int) -> int:
    return math.ceil(size / stride)  # TF "SAME"


def _stem_macs_and_params(config: ViTConfig, image_size: int) -> tuple[int, int, int]:
    """(MACs, parameters, output channels) of the stem."""
    if config.hybrid_stages is None:
        return 0, 0, config.in_chans
    width = root_width(config.hybrid_width)
    size = _conv_out(image_size, 2)
    macs = size * size * width * 7 * 7 * config.in_chans
    params = 7 * 7 * config.in_chans * width + 2 * width  # conv_root + gn_root
    size = _conv_out(size, 2)  # max-pool
    cin = width
    for s, num_units in enumerate(config.hybrid_stages):
        features = width * 2**s
        cout = 4 * features
        for u in range(num_units):
            stride = 2 if (s > 0 and u == 0) else 1
            out = _conv_out(size, stride)
            macs += size * size * cin * features  # conv1 1x1, unstrided
            macs += out * out * 9 * features * features  # conv2 3x3, strided
            macs += out * out * features * cout  # conv3 1x1
            params += cin * features + 9 * features * features + features * cout + 2 * (2 * features + cout)
            if cin != cout or stride != 1:
                macs += out * out * cin * cout  # conv_proj
                params += cin * cout + 2 * cout
            cin, size = cout, out
    return macs, params, cin


def stem_channels(config: ViTConfig) -> int:
    """Channels the patch embedding sees."""
    return _stem_macs_and_params(config, config.image_size)[2]


def forward_macs(config: ViTConfig, image_size: int | None = None, *, as_run: bool = False) -> int:
    """Multiply-adds of one image's forward pass (`image_size`: default the config's)."""
    image_size = image_size or config.image_size
    if image_size % config.stride:
        raise ValueError(f"image_size={image_size} is not a multiple of the model's patch stride {config.stride}")
    D, M = config.width, config.mlp_dim
    stem_macs, _, stem_channels = _stem_macs_and_params(config, image_size)
    num_patches = (image_size // config.stride) ** 2
    N = num_patches + (config.pool == "token")
    patch_embed = num_patches * config.patch_size**2 * stem_channels * D
    layer = N * D * 3 * D + 2 * N * N * D + N * D * D + 2 * N * D * M
    layers = config.depth * layer
    if as_run and config.pool == "token":  # the last layer's queries: the class token alone
        layers += N * D * 3 * D + 2 * N * D + D * D + 2 * D * M - layer
    head_in = config.representation_size or D
    head = (D * config.representation_size if config.representation_size else 0) + head_in * config.num_classes
    return stem_macs + patch_embed + layers + head


def forward_flops(config: ViTConfig, image_size: int | None = None, *, as_run: bool = False) -> int:
    """FLOPs of one image's forward pass."""
    return 2 * forward_macs(config, image_size, as_run=as_run)


def train_flops(config: ViTConfig, image_size: int | None = None, *, as_run: bool = False) -> int:
    """3 × forward (no activation recomputation)."""
    return 3 * forward_flops(config, image_size, as_run=as_run)


def param_count(config: ViTConfig) -> int:
    """Parameters of `VisionTransformer(config)`."""
    D, M = config.width, config.mlp_dim
    _, stem_params, stem_channels = _stem_macs_and_params(config, config.image_size)
    patch_embed = config.patch_size**2 * stem_channels * D + D
    tokens = config.num_patches + (config.pool == "token")
    embeddings = tokens * D + (D if config.pool == "token" else 0)  # position embeddings + class token
    layer = 2 * 2 * D + (3 * D * D + 3 * D) + (D * D + D) + (D * M + M) + (M * D + D)
    pre_logits = D * config.representation_size + config.representation_size if config.representation_size else 0
    head = (config.representation_size or D) * config.num_classes + config.num_classes
    return stem_params + patch_embed + embeddings + config.depth * layer + 2 * D + pre_logits + head


def describe(config: ViTConfig, image_size: int | None = None) -> dict[str, float]:
    image_size = image_size or config.image_size
    return {
        "params_m": param_count(dataclasses.replace(config, image_size=image_size)) / 1e6,
        "forward_gmacs": forward_macs(config, image_size) / 1e9,
        "forward_gflops": forward_flops(config, image_size) / 1e9,
        "train_gflops": train_flops(config, image_size) / 1e9,
    }
