"""Test helper: official-layout ViT `.npz` files with random weights, and an independent NumPy forward pass.

The arrays are built from shapes alone (never from `pretrain.model.vit`), in the key layouts docs/reference.md §2 lists,
and `reference_logits` evaluates them the way the Flax code does (NHWC, HWIO kernels, DenseGeneral einsums,
TF-SAME padding, weight standardization), in float64. A loader that reproduces these logits maps every array
to the right place.
"""

from __future__ import annotations

import math
import re

import numpy as np

VT_BLOCK_NAMES = ("LayerNorm_0", "MultiHeadDotProductAttention_1", "LayerNorm_2", "MlpBlock_3")  # pre-Linen
BV_BLOCK_NAMES = ("LayerNorm_0", "MultiHeadDotProductAttention_0", "LayerNorm_1", "MlpBlock_0")  # Linen


def official_arrays(
    *,
    width=32,
    depth=2,
    heads=4,
    mlp=64,
    patch=4,
    grid=4,
    num_classes=5,
    pool="token",
    representation_size=None,
    stages=None,
    width_factor=1,
    layout="vt",
    old_groupnorm=False,
    seed=0,
) -> dict[str, np.ndarray]:
    """Random float32 arrays named as a VT (`layout="vt"`) or big_vision (`"bv"`) checkpoint would name them.

    `stages` (units per ResNet stage; `()` = the root alone) adds the hybrid's ResNet stem, whose root has
    `int(64 * width_factor)` channels and stage s `root · 2^s` bottleneck features, as VT `models_vit.py` builds it.
    """
    rng = np.random.default_rng(seed)

    def rand(*shape, scale=None):
        scale = scale if scale is not None else 1.0 / math.sqrt(shape[0] if len(shape) > 1 else 4.0)
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    p: dict[str, np.ndarray] = {}
    in_chans = 3
    if stages is not None:
        root = int(64 * width_factor)
        p["conv_root/kernel"] = rand(7, 7, 3, root, scale=0.1)
        gn_shape = (lambda c: (1, 1, 1, c)) if old_groupnorm else (lambda c: (c,))
        p["gn_root/scale"], p["gn_root/bias"] = 1 + rand(*gn_shape(root), scale=0.1), rand(*gn_shape(root), scale=0.1)
        cin = root
        for s, units in enumerate(stages):
            f = root * 2**s
            for u in range(units):
                pre = f"block{s + 1}/unit{u + 1}/"
                shapes = {"conv1": (1, 1, cin, f), "conv2": (3, 3, f, f), "conv3": (1, 1, f, 4 * f)}
                if u == 0:
                    shapes["conv_proj"] = (1, 1, cin, 4 * f)
                for name, shape in shapes.items():
                    p[pre + name + "/kernel"] = rand(*shape, scale=0.1)
                    gn = "gn" + name[4:] if name != "conv_proj" else "gn_proj"
                    p[pre + gn + "/scale"] = 1 + rand(*gn_shape(shape[-1]), scale=0.1)
                    p[pre + gn + "/bias"] = rand(*gn_shape(shape[-1]), scale=0.1)
                cin = 4 * f
        in_chans = cin
    p["embedding/kernel"] = rand(patch, patch, in_chans, width, scale=1.0 / math.sqrt(patch * patch * in_chans))
    p["embedding/bias"] = rand(width, scale=0.1)
    n = grid * grid
    if pool == "token":
        p["cls"] = rand(1, 1, width, scale=0.5)
    if layout == "vt":
        p["Transformer/posembed_input/pos_embedding"] = rand(1, n + (pool == "token"), width, scale=0.5)
    else:
        p["pos_embedding"] = rand(1, n, width, scale=0.5)
    names = VT_BLOCK_NAMES if layout == "vt" else BV_BLOCK_NAMES
    hd = width // heads
    for i in range(depth):
        pre = f"Transformer/encoderblock_{i}/"
        ln1, attn, ln2, mlp_name = (pre + n_ for n_ in names)
        for ln in (ln1, ln2):
            p[ln + "/scale"], p[ln + "/bias"] = 1 + rand(width, scale=0.1), rand(width, scale=0.1)
        for qkv in ("query", "key", "value"):
            p[f"{attn}/{qkv}/kernel"], p[f"{attn}/{qkv}/bias"] = rand(width, heads, hd), rand(heads, hd, scale=0.1)
        p[f"{attn}/out/kernel"], p[f"{attn}/out/bias"] = rand(heads, hd, width, scale=1 / math.sqrt(width)), rand(width)
        p[f"{mlp_name}/Dense_0/kernel"], p[f"{mlp_name}/Dense_0/bias"] = rand(width, mlp), rand(mlp, scale=0.1)
        p[f"{mlp_name}/Dense_1/kernel"], p[f"{mlp_name}/Dense_1/bias"] = rand(mlp, width), rand(width, scale=0.1)
    p["Transformer/encoder_norm/scale"], p["Transformer/encoder_norm/bias"] = 1 + rand(width), rand(width)
    feat = width
    if representation_size:
        p["pre_logits/kernel"], p["pre_logits/bias"] = rand(width, representation_size), rand(representation_size)
        feat = representation_size
    if num_classes:
        p["head/kernel"], p["head/bias"] = rand(feat, num_classes), rand(num_classes)
    return p


# --------------------------------------------------------------------------------------------- NumPy forward


def _conv_same(x, kernel, stride, padding="SAME"):
    """NHWC conv with an HWIO kernel, TensorFlow padding semantics."""
    kh, kw = kernel.shape[:2]
    if padding == "SAME":
        x = _pad_same(x, kh, stride, 0.0)
    windows = np.lib.stride_tricks.sliding_window_view(x, (kh, kw), axis=(1, 2))[:, ::stride, ::stride]
    return np.einsum("bhwcij,ijco->bhwo", windows, kernel)  # windows (B, H', W', C, kh, kw)


def _pad_same(x, k, stride, value):
    pads = []
    for size in x.shape[1:3]:
        total = max((math.ceil(size / stride) - 1) * stride + k - size, 0)
        pads.append((total // 2, total - total // 2))
    return np.pad(x, ((0, 0), pads[0], pads[1], (0, 0)), constant_values=value)


def _std_conv(x, kernel, stride):
    k = kernel.astype(np.float64)
    k = (k - k.mean(axis=(0, 1, 2))) / (k.std(axis=(0, 1, 2)) + 1e-5)
    return _conv_same(x, k, stride)


def _group_norm(x, scale, bias, groups=32, eps=1e-6):
    B, H, W, C = x.shape
    g = x.reshape(B, H, W, groups, C // groups)
    mean = g.mean(axis=(1, 2, 4), keepdims=True)
    var = g.var(axis=(1, 2, 4), keepdims=True)
    g = (g - mean) / np.sqrt(var + eps)
    return g.reshape(B, H, W, C) * scale.reshape(-1) + bias.reshape(-1)


def _layer_norm(x, scale, bias, eps=1e-6):
    mean = x.mean(-1, keepdims=True)
    var = x.var(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * scale + bias


def _gelu_tanh(x):
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def _resnet(p, x, stages):
    relu = lambda t: np.maximum(t, 0)  # noqa: E731
    x = relu(_group_norm(_std_conv(x, p["conv_root/kernel"], 2), p["gn_root/scale"], p["gn_root/bias"]))
    x = _pad_same(x, 3, 2, -np.inf)
    x = np.lib.stride_tricks.sliding_window_view(x, (3, 3), axis=(1, 2))[:, ::2, ::2].max(axis=(-2, -1))
    for s, units in enumerate(stages):
        for u in range(units):
            pre = f"block{s + 1}/unit{u + 1}/"
            stride = 2 if (s > 0 and u == 0) else 1
            gn = lambda t, n, pre=pre: _group_norm(t, p[pre + n + "/scale"], p[pre + n + "/bias"])  # noqa: E731
            residual = x
            if pre + "conv_proj/kernel" in p:
                residual = gn(_std_conv(x, p[pre + "conv_proj/kernel"], stride), "gn_proj")
            y = relu(gn(_std_conv(x, p[pre + "conv1/kernel"], 1), "gn1"))
            y = relu(gn(_std_conv(y, p[pre + "conv2/kernel"], stride), "gn2"))
            y = gn(_std_conv(y, p[pre + "conv3/kernel"], 1), "gn3")
            x = relu(residual + y)
    return x


def reference_logits(p: dict[str, np.ndarray], images_nhwc: np.ndarray, *, layout="vt", stages=None) -> np.ndarray:
    """The Flax model's output for arrays `p` (no prefix) on float images (B, H, W, 3) in [-1, 1]; float64."""
    p = {k: np.asarray(v, np.float64) for k, v in p.items()}
    x = images_nhwc.astype(np.float64)
    if stages is not None:
        x = _resnet(p, x, stages)
    kernel = p["embedding/kernel"]
    x = _conv_same(x, kernel, kernel.shape[0], padding="VALID") + p["embedding/bias"]
    B, gh, gw, D = x.shape
    x = x.reshape(B, gh * gw, D)
    token = "cls" in p
    if layout == "bv":  # big_vision adds position embeddings before prepending the class token
        x = x + p["pos_embedding"]
    if token:
        x = np.concatenate([np.broadcast_to(p["cls"], (B, 1, D)), x], axis=1)
    if layout == "vt":
        x = x + p["Transformer/posembed_input/pos_embedding"]
    names = VT_BLOCK_NAMES if layout == "vt" else BV_BLOCK_NAMES
    i = 0
    while f"Transformer/encoderblock_{i}/{names[0]}/scale" in p:
        ln1, attn, ln2, mlp = (f"Transformer/encoderblock_{i}/{n}" for n in names)
        y = _layer_norm(x, p[ln1 + "/scale"], p[ln1 + "/bias"])
        q, k, v = (
            np.einsum("bnd,dhk->bnhk", y, p[f"{attn}/{n}/kernel"]) + p[f"{attn}/{n}/bias"]
            for n in ("query", "key", "value")
        )
        logits = np.einsum("bqhk,bshk->bhqs", q, k) / math.sqrt(q.shape[-1])
        weights = np.exp(logits - logits.max(-1, keepdims=True))
        weights /= weights.sum(-1, keepdims=True)
        o = np.einsum("bhqs,bshk->bqhk", weights, v)
        x = x + np.einsum("bqhk,hkd->bqd", o, p[f"{attn}/out/kernel"]) + p[f"{attn}/out/bias"]
        y = _layer_norm(x, p[ln2 + "/scale"], p[ln2 + "/bias"])
        y = _gelu_tanh(y @ p[mlp + "/Dense_0/kernel"] + p[mlp + "/Dense_0/bias"])
        x = x + y @ p[mlp + "/Dense_1/kernel"] + p[mlp + "/Dense_1/bias"]
        i += 1
    x = _layer_norm(x, p["Transformer/encoder_norm/scale"], p["Transformer/encoder_norm/bias"])
    x = x[:, 0] if token else x.mean(axis=1)
    if "pre_logits/kernel" in p:
        x = np.tanh(x @ p["pre_logits/kernel"] + p["pre_logits/bias"])
    if "head/kernel" in p:
        x = x @ p["head/kernel"] + p["head/bias"]
    return x


# --------------------------------------------------------------------------------------------- our model → official


def arrays_from_model(model) -> dict[str, np.ndarray]:
    """A `pretrain.model.vit.VisionTransformer`'s weights under the VT checkpoint names (the inverse of `load_npz`).

    Written from the official layout (HWIO kernels, (D, heads, head_dim) attention kernels, VT block names), so
    a save → `load_npz` round trip checks both directions of the mapping.
    """
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    config = model.config
    D, heads = config.width, config.num_heads
    hd = D // heads
    hwio = lambda w: w.transpose(2, 3, 1, 0)  # noqa: E731  OIHW → HWIO
    p = {
        "embedding/kernel": hwio(sd["patch_embed.proj.weight"]),
        "embedding/bias": sd["patch_embed.proj.bias"],
        "Transformer/posembed_input/pos_embedding": sd["pos_embed"],
        "Transformer/encoder_norm/scale": sd["norm.weight"],
        "Transformer/encoder_norm/bias": sd["norm.bias"],
    }
    if "cls_token" in sd:
        p["cls"] = sd["cls_token"]
    for i in range(config.depth):
        ours, (ln1, attn, ln2, mlp) = f"blocks.{i}.", (f"Transformer/encoderblock_{i}/{n}" for n in VT_BLOCK_NAMES)
        for ln, norm in ((ln1, "norm1"), (ln2, "norm2")):
            p[ln + "/scale"], p[ln + "/bias"] = sd[ours + norm + ".weight"], sd[ours + norm + ".bias"]
        weights = np.split(sd[ours + "attn.qkv.weight"], 3)  # each (D_out, D_in)
        biases = np.split(sd[ours + "attn.qkv.bias"], 3)
        for name, w, b in zip(("query", "key", "value"), weights, biases):
            p[f"{attn}/{name}/kernel"], p[f"{attn}/{name}/bias"] = w.T.reshape(D, heads, hd), b.reshape(heads, hd)
        p[f"{attn}/out/kernel"] = sd[ours + "attn.proj.weight"].T.reshape(heads, hd, D)
        p[f"{attn}/out/bias"] = sd[ours + "attn.proj.bias"]
        for dense, fc in (("Dense_0", "fc1"), ("Dense_1", "fc2")):
            p[f"{mlp}/{dense}/kernel"] = sd[f"{ours}mlp.{fc}.weight"].T
            p[f"{mlp}/{dense}/bias"] = sd[f"{ours}mlp.{fc}.bias"]
    if config.representation_size:
        p["pre_logits/kernel"], p["pre_logits/bias"] = sd["pre_logits.0.weight"].T, sd["pre_logits.0.bias"]
    if config.num_classes:
        p["head/kernel"], p["head/bias"] = sd["head.weight"].T, sd["head.bias"]
    for key, value in sd.items():  # patch_embed.backbone.stages.block1.units.unit1.conv1.weight → block1/unit1/conv1
        if not key.startswith("patch_embed.backbone."):
            continue
        name = key[len("patch_embed.backbone.") :]
        module, param = re.sub(r"^stages\.(block\d+)\.units\.(unit\d+)\.", r"\1/\2/", name).rsplit(".", 1)
        if module.rsplit("/", 1)[-1].startswith("conv"):
            p[module + "/kernel"] = hwio(value)
        else:
            p[module + "/" + ("scale" if param == "weight" else "bias")] = value
    return {k: np.ascontiguousarray(v) for k, v in p.items()}
