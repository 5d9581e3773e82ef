"""Hugging Face's ViT beside vitscale's, for the step benchmarks (`bench.train`, `bench.gpu.step`): `hf_model`, a
``transformers`` ViT of a vitscale `ViTConfig`'s shape; `compile_hf_layers`, its encoder layers torch.compile'd as
vitscale compiles its blocks; `logits_of`, a model's images -> logits call, either implementation.
"""

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


def compile_hf_layers(model: torch.nn.Module) -> None:
    """torch.compile each of HF's encoder layers in place, as vitscale's ``compile_blocks`` does its blocks."""
    layers = next(m for m in model.modules() if isinstance(m, torch.nn.ModuleList))  # ViTModel's encoder layers
    for layer in layers:
        layer.compile()


def logits_of(model: torch.nn.Module) -> Callable:
    if isinstance(model, VisionTransformer):
        return model
    return lambda x: model(pixel_values=x).logits
