"""Hugging Face `transformers` ViT state dicts and configs, both ways.

HF's ViT has no pre-logits, ``gap`` or hybrid stem. Key layouts: the Hub's (transformers < 5 and every file,
`vit.encoder.layer.N...`) and transformers ≥ 5's in memory (`vit.layers.N...`); `from_hf_state_dict` reads both.
"""

from __future__ import annotations

import functools
import re

import torch

from pretrain.model.vit import VisionTransformer, ViTConfig

_GELU_TO_HF = {"none": "gelu", "tanh": "gelu_pytorch_tanh"}
_GELU_FROM_HF = {"gelu": "none", "gelu_pytorch_tanh": "tanh", "gelu_new": "tanh"}
HF_LN_EPS = 1e-12  # transformers.ViTConfig's default layer_norm_eps, for a config.json without one

# ours → HF's
_TOP_KEYS = {
    "cls_token": "vit.embeddings.cls_token",
    "pos_embed": "vit.embeddings.position_embeddings",
    "patch_embed.proj.weight": "vit.embeddings.patch_embeddings.projection.weight",
    "patch_embed.proj.bias": "vit.embeddings.patch_embeddings.projection.bias",
    "norm.weight": "vit.layernorm.weight",
    "norm.bias": "vit.layernorm.bias",
}
# Per block: ours → (Hub, transformers ≥ 5); q, k, v split from our qkv
_BLOCK_KEYS = {
    "norm1": ("layernorm_before", "layernorm_before"),
    "q": ("attention.attention.query", "attention.q_proj"),
    "k": ("attention.attention.key", "attention.k_proj"),
    "v": ("attention.attention.value", "attention.v_proj"),
    "attn.proj": ("attention.output.dense", "attention.o_proj"),
    "norm2": ("layernorm_after", "layernorm_after"),
    "mlp.fc1": ("intermediate.dense", "mlp.fc1"),
    "mlp.fc2": ("output.dense", "mlp.fc2"),
}
_LAYER_PREFIX = {"hub": "vit.encoder.layer.", "v5": "vit.layers."}


class NotInHFViT(ValueError):
    """The architecture has a part HF's ViT cannot hold."""


# What to do instead: export the weights to the layout that holds every model, or keep the .npz they are in
TO_NPZ = (
    "the official .npz layout holds every vitscale ViT "
    "(`python -m pretrain.weights export SOURCE OUT.npz --format npz`)"
)
NPZ_ALREADY = (
    "SOURCE is already an official .npz, the layout that holds every vitscale ViT, and HF's cannot: use the .npz "
    "as it is (checkpoint.init_from, `python -m evals.run --weights`)"
)


def check_convertible(config: ViTConfig, instead: str = TO_NPZ) -> None:
    """NotInHFViT naming each part HF's ViT cannot hold, then what to do ``instead``."""
    problems = []
    if config.pool != "token":
        problems.append("pool='gap' (HF ViT classifies from the class token)")
    if config.representation_size:
        problems.append(
            f"a pre-logits layer (representation_size={config.representation_size}; HF's classifier reads the class "
            "token directly — reset_classifier(num_classes) drops the layer, as fine-tuning does)"
        )
    if config.hybrid_stages is not None:
        problems.append(f"a ResNet hybrid stem (hybrid_stages={config.hybrid_stages}; HF's ViT has a patch embedding)")
    if problems:
        raise NotInHFViT("cannot express in HF ViTForImageClassification: " + "; ".join(problems) + " — " + instead)


def hf_refusal(config: ViTConfig) -> str | None:
    """Why HF's ViT cannot hold ``config`` (`NotInHFViT`'s message), or None: the plan and the job's end ask it."""
    try:
        check_convertible(config)
    except NotInHFViT as why:
        return str(why)
    return None


def hf_config_dict(config: ViTConfig, labels: list[str] | tuple[str, ...] | None = None) -> dict:
    """The HF `config.json`, without transformers. A headless model is a ViTModel whose ``last_hidden_state[:, 0]``
    is our ``forward`` (load with ``add_pooling_layer=False``)."""
    check_convertible(config)
    if labels is not None and len(labels) != config.num_classes:
        raise ValueError(f"{len(labels)} class names for a head of {config.num_classes} classes")
    names = list(labels) if labels is not None else [f"LABEL_{i}" for i in range(config.num_classes)]
    head = {"id2label": {str(i): n for i, n in enumerate(names)}, "label2id": {n: i for i, n in enumerate(names)}}
    return {
        "architectures": ["ViTForImageClassification" if config.num_classes else "ViTModel"],
        "model_type": "vit",
        "hidden_size": config.width,
        "num_hidden_layers": config.depth,
        "num_attention_heads": config.num_heads,
        "intermediate_size": config.mlp_dim,
        "hidden_act": _GELU_TO_HF[config.gelu_approximate],
        "hidden_dropout_prob": config.dropout,
        "attention_probs_dropout_prob": config.attention_dropout,
        "initializer_range": 0.02,
        "layer_norm_eps": config.layer_norm_eps,
        "image_size": config.image_size,
        "patch_size": config.patch_size,
        "num_channels": config.in_chans,
        "qkv_bias": True,
        "encoder_stride": config.patch_size,
        "torch_dtype": "float32",
        **(head if config.num_classes else {}),
    }


_HF_CONFIG_ARGS = (  # the `hf_config_dict` fields `hf_config` passes on
    "hidden_size num_hidden_layers num_attention_heads intermediate_size hidden_act hidden_dropout_prob "
    "attention_probs_dropout_prob layer_norm_eps image_size patch_size num_channels qkv_bias"
).split()


def hf_config(config: ViTConfig):
    """The `transformers.ViTConfig` of the same architecture."""
    from transformers import ViTConfig as HFViTConfig  # optional dependency

    fields = hf_config_dict(config)
    hf = HFViTConfig(**{k: fields[k] for k in _HF_CONFIG_ARGS})
    hf.num_labels = max(config.num_classes, 1)  # a property, not an __init__ argument in transformers 5
    return hf


def config_from_hf(hf) -> ViTConfig:
    """Our ViTConfig for a `transformers.ViTConfig`."""
    return config_from_hf_dict({**hf.to_dict(), "num_labels": hf.num_labels})


def config_from_hf_dict(hf: dict) -> ViTConfig:
    """Our ViTConfig for an HF `config.json` (HF's defaults where absent); non-GELU activations are refused."""
    act = hf.get("hidden_act", "gelu")
    if act not in _GELU_FROM_HF:
        raise ValueError(f"HF hidden_act={act!r} has no ViT equivalent; expected one of {list(_GELU_FROM_HF)}")
    if not hf.get("qkv_bias", True):
        raise ValueError("HF qkv_bias=false has no ViT equivalent: the ViT's q, k, v projections have biases")
    image_size, patch_size = hf.get("image_size", 224), hf.get("patch_size", 16)
    image_size = image_size if isinstance(image_size, int) else image_size[0]
    patch_size = patch_size if isinstance(patch_size, int) else patch_size[0]
    architectures = hf.get("architectures") or ["ViTForImageClassification"]
    classifier = any(a.endswith("ForImageClassification") for a in architectures)
    num_labels = hf.get("num_labels", len(hf.get("id2label") or {}) or 2)  # HF's default
    return ViTConfig(
        image_size=image_size,
        patch_size=patch_size,
        width=hf.get("hidden_size", 768),
        depth=hf.get("num_hidden_layers", 12),
        num_heads=hf.get("num_attention_heads", 12),
        mlp_dim=hf.get("intermediate_size", 3072),
        num_classes=num_labels if classifier else 0,
        gelu_approximate=_GELU_FROM_HF[act],
        dropout=hf.get("hidden_dropout_prob", 0.0),
        attention_dropout=hf.get("attention_probs_dropout_prob", 0.0),
        in_chans=hf.get("num_channels", 3),
        layer_norm_eps=hf.get("layer_norm_eps", HF_LN_EPS),
    )


@functools.lru_cache(maxsize=1)
def installed_layout() -> str:
    """The installed transformers' layout: "v5" or "hub" (also without transformers)."""
    try:
        from transformers import ViTConfig as HFViTConfig
        from transformers import ViTForImageClassification
    except ImportError:
        return "hub"
    tiny = HFViTConfig(
        hidden_size=4, num_hidden_layers=1, num_attention_heads=1, intermediate_size=4, image_size=2, patch_size=2
    )
    tiny.num_labels = 1
    keys = ViTForImageClassification(tiny).state_dict().keys()
    return "v5" if any(k.startswith("vit.layers.") for k in keys) else "hub"


def to_hf_state_dict(model: VisionTransformer, layout: str = "auto") -> dict[str, torch.Tensor]:
    """Our weights under HF ViTForImageClassification keys; `layout`: "auto" (installed) | "hub" | "v5"."""
    config = model.config
    check_convertible(config)
    layout = installed_layout() if layout == "auto" else layout
    if layout not in _LAYER_PREFIX:
        raise ValueError(f"layout must be 'auto', 'hub' or 'v5', got {layout!r}")
    column = 0 if layout == "hub" else 1
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    out = {theirs: sd[ours] for ours, theirs in _TOP_KEYS.items()}
    if config.num_classes:
        out["classifier.weight"], out["classifier.bias"] = sd["head.weight"], sd["head.bias"]
    for i in range(config.depth):
        ours = f"blocks.{i}."
        sd[ours + "q.weight"], sd[ours + "k.weight"], sd[ours + "v.weight"] = sd[ours + "attn.qkv.weight"].chunk(3)
        sd[ours + "q.bias"], sd[ours + "k.bias"], sd[ours + "v.bias"] = sd[ours + "attn.qkv.bias"].chunk(3)
        for name, theirs in _BLOCK_KEYS.items():
            for param in ("weight", "bias"):
                out[f"{_LAYER_PREFIX[layout]}{i}.{theirs[column]}.{param}"] = sd[f"{ours}{name}.{param}"].contiguous()
    return out


def from_hf_state_dict(state_dict: dict[str, torch.Tensor], config) -> VisionTransformer:
    """A VisionTransformer from HF weights (either layout, with or without `vit.`)."""
    if not isinstance(config, ViTConfig):
        config = config_from_hf(config)
    model = VisionTransformer(config)
    try:
        model.load_state_dict(state_dict_from_hf(state_dict, config), strict=True)
    except RuntimeError as e:
        raise ValueError(f"HF weights do not fit {config}: {e}") from None
    return model


def state_dict_from_hf(state_dict: dict[str, torch.Tensor], config: ViTConfig) -> dict[str, torch.Tensor]:
    """HF ViT weights (either layout) under our names; a pooler is ignored."""
    check_convertible(config)
    hf = {re.sub(r"^(?!vit\.|classifier\.)", "vit.", k): v for k, v in state_dict.items()}
    layout = "v5" if any(k.startswith("vit.layers.") for k in hf) else "hub"
    column = 0 if layout == "hub" else 1
    layers = {int(m.group(1)) for k in hf if (m := re.match(re.escape(_LAYER_PREFIX[layout]) + r"(\d+)\.", k))}
    if layers != set(range(config.depth)):
        raise ValueError(f"HF state dict has {len(layers)} encoder layers, config.depth={config.depth}")

    def take(key: str) -> torch.Tensor:
        if key not in hf:
            raise ValueError(f"HF state dict has no {key!r} (layout {layout!r}); is it a ViT of this config?")
        return hf[key]

    sd = {ours: take(theirs) for ours, theirs in _TOP_KEYS.items()}
    if config.num_classes:
        sd["head.weight"], sd["head.bias"] = take("classifier.weight"), take("classifier.bias")
    for i in range(config.depth):
        theirs = {name: f"{_LAYER_PREFIX[layout]}{i}.{keys[column]}" for name, keys in _BLOCK_KEYS.items()}
        ours = f"blocks.{i}."
        for param in ("weight", "bias"):
            sd[f"{ours}attn.qkv.{param}"] = torch.cat([take(f"{theirs[n]}.{param}") for n in ("q", "k", "v")])
            for name in ("norm1", "attn.proj", "norm2", "mlp.fc1", "mlp.fc2"):
                sd[f"{ours}{name}.{param}"] = take(f"{theirs[name]}.{param}")
    return sd
