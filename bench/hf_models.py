"""Hugging Face's ViT in a vitscale `ViTConfig`'s shape, for the step benchmarks (`bench.train`, `bench.gpu.step`)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from pretrain.model.vit import VisionTransformer, ViTConfig


def hf_model(config: ViTConfig, attn: str) -> torch.nn.Module:
    from transformers import ViTConfig as HFViTConfig
    from transformers import ViTForImageClassification

    hf_config = HFViTConfig(
        hidden_size=config.width,
        num_hidden_layers=config.depth,
        num_attention_heads=config.num_heads,
        intermediate_size=config.mlp_dim,
        image_size=config.image_size,
        patch_size=config.patch_size,
        num_labels=config.num_classes,
        hidden_act="gelu_pytorch_tanh",
        layer_norm_eps=1e-6,
        qkv_bias=True,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        attn_implementation=attn,
    )
    return ViTForImageClassification(hf_config)


def compile_layers(model: torch.nn.Module) -> None:
    """torch.compile a model's blocks in place: vitscale's ``compile_blocks``, or each of HF's encoder layers."""
    if isinstance(model, VisionTransformer):
        return model.compile_blocks()
    for layer in next(m for m in model.modules() if isinstance(m, torch.nn.ModuleList)):  # ViTModel's encoder layers
        layer.compile()


def logits_of(model: torch.nn.Module) -> Callable:
    """images -> logits, for either implementation."""
    if isinstance(model, VisionTransformer):
        return model
    return lambda x: model(pixel_values=x).logits
