"""The Vision Transformer of Dosovitskiy et al., "An Image is Worth 16x16 Words" (ICLR 2021), equations 1-4:

    z_0 = [x_class; x_p^1 E; ...; x_p^N E] + E_pos          (1)  embed_patches + encode
    z'_l = MSA(LN(z_{l-1})) + z_{l-1}                        (2)  Block.forward (`# eq. 2`)
    z_l = MLP(LN(z'_l)) + z'_l                               (3)  Block.forward (`# eq. 3`)
    y = LN(z_L^0)                                            (4)  encode (final LN) + pool

It matches the official JAX model (VT `models_vit.py`, docs/reference.md §1): official checkpoints reproduce their
logits. Images: float (B, C, H, W) in [-1, 1].
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from pretrain.model.resnet import ResNetStem, check_width_factor, stem_stride

LN_EPS = 1e-6  # Flax's default; torch's 1e-5 changes official checkpoints' logits


def _is_int(value) -> bool:
    """An int, not a bool (JSON's `true` is Python's True, an int)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value) -> bool:
    """An int or float, not a bool."""
    return _is_int(value) or isinstance(value, float)


@dataclass(frozen=True)
class ViTConfig:
    """The architecture; saved as `model.json`."""

    image_size: int = 224  # square input side
    patch_size: int = 16  # 1 for hybrids (the ResNet stem downsamples)
    width: int = 768  # D, "hidden size"
    depth: int = 12  # encoder blocks
    num_heads: int = 12
    mlp_dim: int = 3072
    num_classes: int = 1000  # 0: no head (forward returns the features)
    pool: str = "token"  # "token" (class token) | "gap" (mean of all tokens)
    representation_size: int | None = None  # pre-logits Dense+tanh width; None: none
    head_bias_init: float = 0.0  # −10 for sigmoid i21k pre-training
    dropout: float = 0.0  # after the position embedding, attention output and both MLP layers
    attention_dropout: float = 0.0  # on the attention weights
    gelu_approximate: str = "tanh"  # "tanh" (JAX checkpoints) | "none" (exact erf, timm / HF)
    hybrid_stages: tuple[int, ...] | None = None  # hybrid ResNet units per stage; () = root only
    hybrid_width: int | float = 1  # ResNet width factor: int(64 * factor) root channels
    grad_checkpointing: bool = False  # recompute each block in backward
    in_chans: int = 3
    layer_norm_eps: float = LN_EPS  # every LayerNorm's; an HF folder's own (theirs default to 1e-12)

    def __post_init__(self) -> None:
        if self.hybrid_stages is not None and not isinstance(self.hybrid_stages, tuple):
            # YAML/JSON give lists; a tuple stays hashable
            object.__setattr__(self, "hybrid_stages", tuple(int(s) for s in self.hybrid_stages))
        # model.json says 1, not 1.0
        check_width_factor(self.hybrid_width, "ViTConfig.hybrid_width")
        factor = float(self.hybrid_width)
        object.__setattr__(self, "hybrid_width", int(factor) if factor.is_integer() else factor)
        for name in ("image_size", "patch_size", "width", "depth", "num_heads", "mlp_dim", "in_chans"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise ValueError(f"ViTConfig.{name} must be a positive int, got {value!r}")
        if not _is_int(self.num_classes) or self.num_classes < 0:
            raise ValueError(f"ViTConfig.num_classes must be an int >= 0 (0 = no head), got {self.num_classes!r}")
        eps = self.layer_norm_eps
        if not _is_real(eps) or not 0 < eps < 1:
            raise ValueError(f"ViTConfig.layer_norm_eps must be a number in (0, 1), e.g. 1e-6, got {eps!r}")
        if self.width % self.num_heads:
            raise ValueError(
                f"ViTConfig.width={self.width} is not divisible by num_heads={self.num_heads}; "
                "choose a width that is a multiple of the number of heads"
            )
        if self.pool not in ("token", "gap"):
            raise ValueError(f"ViTConfig.pool must be 'token' or 'gap', got {self.pool!r}")
        if self.gelu_approximate not in ("tanh", "none"):
            raise ValueError(f"ViTConfig.gelu_approximate must be 'tanh' or 'none', got {self.gelu_approximate!r}")
        size = self.representation_size
        if size is not None and (not _is_int(size) or size < 1):
            raise ValueError(
                f"ViTConfig.representation_size must be an int >= 1, or absent for no pre-logits layer; got {size!r}"
            )
        if not _is_real(self.head_bias_init) or not math.isfinite(self.head_bias_init):
            raise ValueError(f"ViTConfig.head_bias_init must be a finite number, got {self.head_bias_init!r}")
        for name in ("dropout", "attention_dropout"):
            if not _is_real(getattr(self, name)) or not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"ViTConfig.{name} must be in [0, 1), got {getattr(self, name)}")
        if self.hybrid_stages is not None and any(s < 1 for s in self.hybrid_stages):
            raise ValueError(
                f"ViTConfig.hybrid_stages must be a tuple of positive unit counts (() = the root conv alone), "
                f"got {self.hybrid_stages}"
            )
        if self.image_size % self.stride:
            suggestion = max(1, round(self.image_size / self.stride)) * self.stride
            raise ValueError(
                f"ViTConfig.image_size={self.image_size} is not a multiple of the patch stride {self.stride} "
                f"({self._stride_description()}); use e.g. image_size={suggestion}"
            )

    @property
    def stride(self) -> int:
        """Input pixels per token side."""
        return self.patch_size * (stem_stride(self.hybrid_stages) if self.hybrid_stages is not None else 1)

    @property
    def grid_size(self) -> int:
        return self.image_size // self.stride

    @property
    def num_patches(self) -> int:
        return self.grid_size**2

    @property
    def num_features(self) -> int:
        """Width of `forward_features`."""
        return self.representation_size or self.width

    def _stride_description(self) -> str:
        if self.hybrid_stages is not None:
            return f"ResNet stem stride {stem_stride(self.hybrid_stages)} x patch {self.patch_size}"
        return f"patch size {self.patch_size}"

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        if d["hybrid_stages"] is not None:
            d["hybrid_stages"] = list(d["hybrid_stages"])
        return d

    @classmethod
    def from_dict(cls, d: dict) -> ViTConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown ViTConfig fields {unknown}; valid fields are {sorted(known)}")
        return cls(**d)


# --- the encoder


# CPU bf16 attention up to this many tokens is faster as two GEMMs than SDPA (docs/performance.md, "Attention kernel
# per device and precision").
EXPLICIT_ATTENTION_MAX_TOKENS = 640


def use_explicit_attention(q: torch.Tensor) -> bool:
    return q.device.type == "cpu" and q.dtype == torch.bfloat16 and q.shape[-2] <= EXPLICIT_ATTENTION_MAX_TOKENS


def explicit_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float) -> torch.Tensor:
    """softmax(q kᵀ / sqrt(hd)) v on (B, h, N, hd); weights rounded to q's dtype, as flash does."""
    weights = ((q * q.shape[-1] ** -0.5) @ k.transpose(-2, -1)).softmax(dim=-1)  # (B, h, N, N)
    if dropout_p:
        weights = F.dropout(weights, dropout_p)
    return weights @ v


class Attention(nn.Module):
    """Multi-head self-attention with eq. 2's output dropout; one (D, 3D) qkv projection."""

    def __init__(self, config: ViTConfig):
        super().__init__()
        self.num_heads = config.num_heads
        self.head_dim = config.width // config.num_heads
        self.qkv = nn.Linear(config.width, 3 * config.width)
        self.proj = nn.Linear(config.width, config.width)
        self.attention_dropout = config.attention_dropout
        self.dropout = nn.Dropout(config.dropout)

    def _heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        B, N, D = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim)
        return qkv.permute(2, 0, 3, 1, 4).unbind(0)  # q, k, v: each (B, h, N, hd)

    def _merge(self, y: torch.Tensor) -> torch.Tensor:
        B, h, N, hd = y.shape
        return self.dropout(self.proj(y.transpose(1, 2).reshape(B, N, h * hd)))  # (B, N, D)

    def forward(self, x: torch.Tensor, queries: int | None = None) -> torch.Tensor:
        """(B, N, D) → (B, N, D); with ``queries``, the first ``queries`` tokens' outputs (B, queries, D)."""
        q, k, v = self._heads(x)
        if queries is not None:
            q = q[:, :, :queries].contiguous()  # (B, h, queries, hd)
        dropout_p = self.attention_dropout if self.training else 0.0
        if use_explicit_attention(q):
            y = explicit_attention(q, k, v, dropout_p)
        else:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p)  # softmax(q kᵀ / sqrt(hd)) v
        return self._merge(y)

    def forward_with_weights(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward` in eval mode, plus the softmax weights (B, h, N, N)."""
        q, k, v = self._heads(x)
        weights = torch.softmax((q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim), dim=-1)  # (B, h, N, N)
        return self._merge(weights @ v), weights


# tanh-GELU, 0.5 x (1 + tanh(u)) with u = sqrt(2/pi) (x + 0.044715 x^3), is x sigmoid(2u): 2u = x (A + B x^2).
_GELU_A = 2 * math.sqrt(2 / math.pi)
_GELU_B = _GELU_A * 0.044715


def gelu_tanh_as_sigmoid(x: torch.Tensor) -> torch.Tensor:
    """``F.gelu(x, approximate="tanh")`` as x · sigmoid(2u) in fp32, for compiled blocks (docs/performance.md,
    "Compiled blocks"). More accurate below x = -3."""
    xf = x.float()
    return (xf * torch.sigmoid(xf * (_GELU_A + _GELU_B * xf * xf))).to(x.dtype)


class MLP(nn.Module):
    """Dense(D → mlp) · GELU · Dropout · Dense(mlp → D) · Dropout (paper eq. 3, VT `MlpBlock`)."""

    def __init__(self, config: ViTConfig):
        super().__init__()
        self.fc1 = nn.Linear(config.width, config.mlp_dim)
        self.act = nn.GELU(approximate=config.gelu_approximate)
        self.fc2 = nn.Linear(config.mlp_dim, config.width)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, N, D) → (B, N, D)
        h = self.fc1(x)
        if self.act.approximate == "tanh" and torch.compiler.is_compiling():
            h = gelu_tanh_as_sigmoid(h)  # eager keeps torch's kernel and numerics
        else:
            h = self.act(h)
        return self.dropout(self.fc2(self.dropout(h)))


class Block(nn.Module):
    """Pre-LN Transformer encoder block."""

    def __init__(self, config: ViTConfig):
        super().__init__()
        self.norm1 = nn.LayerNorm(config.width, eps=config.layer_norm_eps)
        self.attn = Attention(config)
        self.norm2 = nn.LayerNorm(config.width, eps=config.layer_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, queries: int | None = None) -> torch.Tensor:
        """As `Attention.forward`."""
        if queries is None:
            x = x + self.attn(self.norm1(x))  # eq. 2
        else:
            x = x[:, :queries] + self.attn(self.norm1(x), queries)
        return x + self.mlp(self.norm2(x))  # eq. 3

    def forward_with_weights(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y, weights = self.attn.forward_with_weights(self.norm1(x))
        x = x + y
        return x + self.mlp(self.norm2(x)), weights


class PatchEmbed(nn.Module):
    """x_p E of eq. 1: a conv, kernel = stride = patch size, on pixels or the hybrid's features."""

    def __init__(self, config: ViTConfig):
        super().__init__()
        self.backbone = None
        in_channels = config.in_chans
        if config.hybrid_stages is not None:
            self.backbone = ResNetStem(config.hybrid_stages, config.hybrid_width, config.in_chans)
            in_channels = self.backbone.out_channels
        self.proj = nn.Conv2d(in_channels, config.width, config.patch_size, stride=config.patch_size)

    def forward(self, images: torch.Tensor) -> torch.Tensor:  # (B, C, H, W) → (B, N, D), N row-major
        x = images if self.backbone is None else self.backbone(images)
        return self.proj(x).flatten(2).transpose(1, 2)


# --- the model


class VisionTransformer(nn.Module):
    """ViT and R+ViT hybrid with a timm-like API, for `config.image_size` square inputs."""

    def __init__(self, config: ViTConfig):
        super().__init__()
        self.config = config
        D = config.width
        self.patch_embed = PatchEmbed(config)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, D)) if config.pool == "token" else None
        num_prefix = 1 if config.pool == "token" else 0
        self.pos_embed = nn.Parameter(torch.zeros(1, num_prefix + config.num_patches, D))
        self.pos_drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.depth))
        self.norm = nn.LayerNorm(D, eps=config.layer_norm_eps)
        self.grad_checkpointing = config.grad_checkpointing
        self._build_head(config.num_classes, config.representation_size, config.head_bias_init)
        if not self.pos_embed.is_meta:  # meta `normal_` would import torch._dynamo
            self._init_weights()

    # --- construction

    def _build_head(self, num_classes: int, representation_size: int | None, head_bias_init: float) -> None:
        D = self.config.width
        if representation_size:
            dense = nn.Linear(D, representation_size)
            self.pre_logits: nn.Module = nn.Sequential(dense, nn.Tanh())
            _lecun_normal_(dense.weight)
            nn.init.zeros_(dense.bias)
        else:
            self.pre_logits = nn.Identity()
        self._build_classifier(num_classes, representation_size or D, head_bias_init)

    def _build_classifier(self, num_classes: int, num_features: int, head_bias_init: float) -> None:
        self.head: nn.Module = nn.Linear(num_features, num_classes) if num_classes > 0 else nn.Identity()
        if isinstance(self.head, nn.Linear):
            # Zero kernel: fine-tuning starts from the features, not from noise
            nn.init.zeros_(self.head.weight)
            nn.init.constant_(self.head.bias, head_bias_init)

    def _init_weights(self) -> None:
        """The official init (docs/reference.md §1): xavier-uniform kernels; q, k, v each on a (D, D) fan."""
        nn.init.normal_(self.pos_embed, std=0.02)
        _lecun_normal_(self.patch_embed.proj.weight)
        assert self.patch_embed.proj.bias is not None
        nn.init.zeros_(self.patch_embed.proj.bias)
        for block in self.blocks:
            assert isinstance(block, Block)
            for w in block.attn.qkv.weight.chunk(3, dim=0):
                nn.init.xavier_uniform_(w)
            nn.init.zeros_(block.attn.qkv.bias)
            nn.init.xavier_uniform_(block.attn.proj.weight)
            nn.init.zeros_(block.attn.proj.bias)
            for fc in (block.mlp.fc1, block.mlp.fc2):
                nn.init.xavier_uniform_(fc.weight)
                nn.init.normal_(fc.bias, std=1e-6)
        if self.patch_embed.backbone is not None:
            for m in self.patch_embed.backbone.modules():
                if isinstance(m, nn.Conv2d):
                    _lecun_normal_(m.weight)

    # --- eq. 1-4

    def embed_patches(self, images: torch.Tensor) -> torch.Tensor:
        """Eq. 1 without class token and position embedding: (B, C, H, W) → (B, N, D)."""
        self._check_images(images)
        return self.patch_embed(images)

    def encode(self, patch_tokens: torch.Tensor) -> torch.Tensor:
        """Class token, position embeddings, blocks, final LN: (B, N, D) → (B, N+1, D) ((B, N, D) for "gap")."""
        return self.norm(self._run_blocks(self._embed_tokens(patch_tokens)))  # eq. 4's LN, on every token

    def _run_blocks(self, x: torch.Tensor, last_queries: int | None = None) -> torch.Tensor:
        """The blocks over (B, T, D); the last outputs only the first ``last_queries`` tokens if given."""
        last = len(self.blocks) - 1
        for i, block in enumerate(self.blocks):
            queries = last_queries if i == last else None
            if self.grad_checkpointing and self.training and torch.is_grad_enabled():
                x = checkpoint(block, x, queries, use_reentrant=False)
            else:
                x = block(x, queries)
        return x

    def forward_tokens(self, images: torch.Tensor) -> torch.Tensor:
        """Final-LN output, class token first where there is one: (B, C, H, W) → (B, T, D), T = N+1 (N with gap)."""
        return self.encode(self.embed_patches(images))

    def pool(self, tokens: torch.Tensor) -> torch.Tensor:  # (B, T, D) → (B, D)
        return tokens[:, 0] if self.config.pool == "token" else tokens.mean(dim=1)

    def forward_features(self, images: torch.Tensor) -> torch.Tensor:
        """Pre-logits features (B, D'): pooled `forward_tokens`, the class token from the last block alone
        (docs/performance.md, "The last block computes the class token alone")."""
        if self.cls_token is None:
            return self.pre_logits(self.pool(self.forward_tokens(images)))
        x = self._run_blocks(self._embed_tokens(self.embed_patches(images)), last_queries=1)  # (B, 1, D)
        return self.pre_logits(self.norm(x)[:, 0])

    def forward_head(self, features: torch.Tensor) -> torch.Tensor:  # (B, D') → (B, num_classes)
        return self.head(features)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """Logits (B, num_classes); (B, D') features when the model has no head (num_classes=0)."""
        return self.forward_head(self.forward_features(images))

    @torch.no_grad()
    def forward_attention(self, images: torch.Tensor, reduce=None) -> list:
        """Per layer, the softmax weights (B, heads, T, T): T = N+1 with the class token at index 0, N with gap. With
        ``reduce``, ``reduce(layer, weights)`` instead, each layer's weights freed before the next layer runs: all of
        them at once are ~16 GB for ViT-L/16 at 384 px on 32 images. Always in eval mode: no dropout."""
        was_training = self.training
        self.eval()
        try:
            x = self._embed_tokens(self.embed_patches(images))
            out = []
            for layer, block in enumerate(self.blocks):
                assert isinstance(block, Block)
                x, w = block.forward_with_weights(x)
                out.append(w if reduce is None else reduce(layer, w))
                del w
            return out
        finally:
            self.train(was_training)

    def _embed_tokens(self, patch_tokens: torch.Tensor) -> torch.Tensor:
        B, N, D = patch_tokens.shape
        expected = self.pos_embed.shape[1] - self.num_prefix_tokens
        if N != expected or D != self.config.width:
            raise ValueError(
                f"encode expects patch tokens (B, {expected}, {self.config.width}), got {tuple(patch_tokens.shape)}"
            )
        x = patch_tokens
        if self.cls_token is not None:
            x = torch.cat([self.cls_token.expand(B, -1, -1), x], dim=1)  # (B, N+1, D)
        return self.pos_drop(x + self.pos_embed)

    def _check_images(self, images: torch.Tensor) -> None:
        if images.ndim != 4 or images.shape[1] != self.config.in_chans:
            raise ValueError(f"expected images (B, {self.config.in_chans}, H, W), got shape {tuple(images.shape)}")
        H, W = images.shape[-2:]
        stride = self.config.stride
        if H % stride or W % stride:
            raise ValueError(
                f"image size {H}x{W} is not a multiple of the patch stride {stride} "
                f"({self.config._stride_description()}); resize or crop the images to a multiple of {stride}"
            )
        size = self.config.image_size
        if (H, W) != (size, size):
            raise ValueError(
                f"image size {H}x{W} differs from the model's image_size {size}; resize the images to {size}x{size}, "
                "or load the weights for the new size with pretrain.weights.formats.load_pretrained(..., image_size=N) "
                "(which interpolates the position embeddings)"
            )

    # --- timm-like API

    @property
    def num_prefix_tokens(self) -> int:
        return 0 if self.cls_token is None else 1

    @property
    def num_features(self) -> int:
        return self.config.num_features

    def reset_classifier(
        self, num_classes: int, representation_size: int | None = None, head_bias_init: float = 0.0
    ) -> None:
        """A zero-initialized head (paper App. B.1.1); `config` follows. `representation_size`: None drops pre-logits,
        the current size keeps them, another builds them fresh."""
        device, dtype = self.pos_embed.device, self.pos_embed.dtype  # a bf16 or CUDA model gets a bf16 or CUDA head
        keep_pre_logits = bool(representation_size) and representation_size == self.config.representation_size
        self.config = dataclasses.replace(
            self.config, num_classes=num_classes, representation_size=representation_size, head_bias_init=head_bias_init
        )
        if keep_pre_logits:
            self._build_classifier(num_classes, self.config.num_features, head_bias_init)
        else:
            self._build_head(num_classes, representation_size, head_bias_init)
        self.pre_logits.to(device, dtype)
        self.head.to(device, dtype)

    def no_weight_decay(self) -> set[str]:
        """All but kernels."""
        return {name for name, p in self.named_parameters() if p.ndim <= 1 or name in ("cls_token", "pos_embed")}

    def compile_blocks(self, compile_threads: int | None = None) -> None:
        """torch.compile each block's ``forward`` in place, so hooks (ZeRO-3's gathering) run eagerly
        (docs/performance.md, "Compiled blocks"). ``compile_threads``: Inductor's build workers, process-wide (None:
        one per core), unless ``TORCHINDUCTOR_COMPILE_THREADS`` is set."""
        if compile_threads is not None and "TORCHINDUCTOR_COMPILE_THREADS" not in os.environ:
            import torch._inductor.config as inductor_config

            inductor_config.compile_threads = max(1, compile_threads)
        for block in self.blocks:
            block.forward = torch.compile(block.forward)

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        self.grad_checkpointing = enable
        self.config = dataclasses.replace(self.config, grad_checkpointing=enable)


def _lecun_normal_(w: torch.Tensor) -> None:
    """Flax's default kernel init: truncated normal (±2σ) with variance 1/fan_in."""
    std = math.sqrt(1.0 / w[0].numel()) / 0.87962566103423978  # the std of a unit normal truncated to ±2
    nn.init.trunc_normal_(w, std=std, a=-2 * std, b=2 * std)


# --- variants

# Paper Table 1 (+ VT configs)
SIZES: dict[str, dict[str, int]] = {
    "debug": dict(width=64, depth=4, mlp_dim=256, num_heads=4),
    "Ti": dict(width=192, depth=12, mlp_dim=768, num_heads=3),
    "S": dict(width=384, depth=12, mlp_dim=1536, num_heads=6),
    "B": dict(width=768, depth=12, mlp_dim=3072, num_heads=12),
    "L": dict(width=1024, depth=24, mlp_dim=4096, num_heads=16),
    "H": dict(width=1280, depth=32, mlp_dim=5120, num_heads=16),
}

# name → (size, patch size, hybrid ResNet stages, default image size)
VARIANTS: dict[str, tuple[str, int, tuple[int, ...] | None, int]] = {
    "vit_tiny_debug": ("debug", 4, None, 32),
    "vit_ti16": ("Ti", 16, None, 224),
    "vit_s16": ("S", 16, None, 224),
    "vit_s32": ("S", 32, None, 224),
    "vit_b32": ("B", 32, None, 224),
    "vit_b16": ("B", 16, None, 224),
    "vit_b8": ("B", 8, None, 224),
    "vit_l32": ("L", 32, None, 224),
    "vit_l16": ("L", 16, None, 224),
    "vit_h14": ("H", 14, None, 224),
    "r50_vit_b16": ("B", 1, (3, 4, 9), 224),  # ResNet-50 stages 1-3: stride 16
    "r50_vit_l32": ("L", 1, (3, 4, 6, 3), 224),  # full ResNet-50: stride 32
    "r26_vit_s32": ("S", 1, (2, 2, 2, 2), 224),
}
MODEL_NAMES: tuple[str, ...] = tuple(VARIANTS)


def model_config(name: str, **overrides) -> ViTConfig:
    """A registered variant's ViTConfig, fields overridden (e.g. image_size=384)."""
    if name not in VARIANTS:
        raise ValueError(f"unknown model name {name!r}; valid names: {', '.join(MODEL_NAMES)}")
    size, patch, stages, image_size = VARIANTS[name]
    fields = dict(SIZES[size], patch_size=patch, hybrid_stages=stages, image_size=image_size)
    valid = {f.name for f in dataclasses.fields(ViTConfig)}
    unknown = sorted(set(overrides) - valid)
    if unknown:
        raise ValueError(f"unknown ViTConfig overrides {unknown} for {name!r}; valid fields: {sorted(valid)}")
    return ViTConfig(**{**fields, **overrides})


def build_model(name: str, **overrides) -> VisionTransformer:
    """A freshly initialized registered variant."""
    return VisionTransformer(model_config(name, **overrides))
