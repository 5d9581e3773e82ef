"""Loading weights: official JAX `.npz`, safetensors + `model.json`, training checkpoints; `load_model` takes any.
`load_npz` reads VT and big_vision (BV) releases and reproduces their logits (docs/reference.md §2).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import zipfile
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from safetensors.torch import load_file

from data_pipeline.paths import write_text_atomically
from pretrain.checkpoint import run_folder
from pretrain.checkpoint.run_folder import CONFIG_FILE, WEIGHTS_FILE
from pretrain.model.resnet import GN_GROUPS, stem_out_channels, stem_stride
from pretrain.model.vit import VisionTransformer, ViTConfig
from pretrain.weights import source as weights_source
from pretrain.weights.export import is_hf_folder, read_hf_folder, write_safetensors
from pretrain.weights.hf import config_from_hf_dict, from_hf_state_dict, hf_config, to_hf_state_dict
from pretrain.weights.source import HF_CONFIG

__all__ = [
    "from_hf_state_dict",
    "hf_config",
    "load_checkpoint_model",
    "load_model",
    "load_npz",
    "load_pretrained",
    "read_model_config",
    "resize_model",
    "resize_pos_embed",
    "save_pretrained",
    "to_hf_state_dict",
]


# Fields the weights determine; overrides must agree
ARCHITECTURE_FIELDS = tuple("patch_size width depth num_heads mlp_dim pool hybrid_stages hybrid_width in_chans".split())
# Fields ``checkpoint.init_from`` weights must share with the model: another head, pool or resolution is a fine-tune
INIT_FIELDS = tuple(f for f in ARCHITECTURE_FIELDS if f != "pool")
_HEAD_FIELDS = ("num_classes", "representation_size", "head_bias_init")


def resize_pos_embed(posemb: torch.Tensor, new_grid: tuple[int, int], num_prefix_tokens: int = 1) -> torch.Tensor:
    """Resize (1, P+N, D) position embeddings as VT: prefix rows kept, grid bilinear, align_corners=True."""
    if posemb.ndim != 3 or posemb.shape[0] != 1:
        raise ValueError(f"position embeddings must be (1, P+N, D), got {tuple(posemb.shape)}")
    prefix, grid = posemb[:, :num_prefix_tokens], posemb[0, num_prefix_tokens:]
    g = math.isqrt(grid.shape[0])
    if g * g != grid.shape[0]:
        raise ValueError(
            f"{grid.shape[0]} position embeddings (after {num_prefix_tokens} prefix rows) are not a square grid"
        )
    gh, gw = new_grid
    if (gh, gw) == (g, g):
        return posemb.clone()
    x = grid.reshape(1, g, g, -1).permute(0, 3, 1, 2).double()  # (1, D, g, g)
    x = F.interpolate(x, size=(gh, gw), mode="bilinear", align_corners=True)
    x = x.permute(0, 2, 3, 1).reshape(1, gh * gw, -1).to(posemb.dtype)  # (1, gh·gw, D)
    return torch.cat([prefix, x], dim=1)


# --- official .npz


def _read_npz(path: Path) -> dict[str, np.ndarray]:
    """Read eagerly, so bad files fail here."""
    if path.is_dir():
        raise ValueError(f"{path} is a folder, not an .npz file; pass the path of an official .npz checkpoint")
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint file at {path}; check the path")
    with open(path, "rb") as f:
        magic = f.read(6)
    if not magic:
        raise ValueError(f"{path} is empty (0 bytes): the download or copy did not finish; fetch the file again")
    if magic.startswith(b"\x80"):
        raise ValueError(
            f"{path} is a pickle, not an .npz archive; pickled data is never loaded (it can run arbitrary code) — "
            "official ViT checkpoints are plain .npz archives of numeric arrays"
        )
    if not magic.startswith((b"PK", b"\x93NUMPY")):
        raise ValueError(
            f"{path} is neither a zip archive nor a NumPy file (it starts with {magic!r}), so not an .npz "
            "checkpoint; official ViT checkpoints are .npz archives of numeric arrays"
        )
    try:
        npz = np.load(path, allow_pickle=False)
        if not isinstance(npz, np.lib.npyio.NpzFile):
            raise ValueError(f"{path} is a single .npy array, not an .npz checkpoint of named arrays")
        with npz:
            arrays = {key: npz[key] for key in npz.files}
    except ValueError as e:
        if "pickle" in str(e).lower():
            raise ValueError(
                f"{path} contains pickled data, which is never loaded (it can run arbitrary code); "
                "official ViT checkpoints are plain .npz archives of numeric arrays"
            ) from None
        if "single .npy" in str(e):
            raise
        raise ValueError(f"{path} is not a readable .npz archive: {e}") from None
    except (zipfile.BadZipFile, EOFError, OSError) as e:
        raise ValueError(
            f"{path} is truncated or not an .npz archive ({type(e).__name__}: {e}); download it again"
        ) from None
    if not arrays:
        raise ValueError(f"{path} is an .npz archive without any array, not a ViT checkpoint")
    for key, value in arrays.items():
        if not isinstance(value, np.ndarray):
            raise ValueError(f"{path} is a zip archive but not an .npz checkpoint: member {key!r} is not a NumPy array")
        if value.dtype.kind not in "biuf":
            raise ValueError(
                f"{path}: array {key!r} has dtype {value.dtype}, not numbers; official checkpoints store float "
                "arrays (re-save bfloat16 weights as float32)"
            )
    return arrays


def _array(p: dict[str, np.ndarray], key: str, ndim: int) -> np.ndarray:
    """KeyError if missing."""
    value = p[key]
    if value.ndim != ndim:
        raise ValueError(f"array {key!r} has shape {value.shape}, but official checkpoints give it {ndim} dimensions")
    return value


def _strip_prefix(arrays: dict[str, np.ndarray], path: Path) -> dict[str, np.ndarray]:
    """Drop whatever prefix precedes `embedding/kernel` (`params/`, `opt/target/`)."""
    roots = [
        k[: -len("embedding/kernel")] for k in arrays if k == "embedding/kernel" or k.endswith("/embedding/kernel")
    ]
    roots = [r for r in roots if not r.endswith("pos_")]
    if not roots:
        sample = ", ".join(sorted(arrays)[:8])
        raise ValueError(
            f"{path} is not a ViT checkpoint: no 'embedding/kernel' (patch embedding) array; keys start with: {sample}"
        )
    root = min(roots, key=len)
    return {k[len(root) :]: v for k, v in arrays.items() if k.startswith(root)}


def _encoder_blocks(p: dict[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
    """Per block, its arrays keyed `ln1/…, attn/…, ln2/…, mlp/…` (submodules numbered in call order); BV's `scan`
    layout (a leading depth axis) unstacked."""
    per_block: dict[int, dict[str, np.ndarray]] = {}
    stacked = {
        k[len("Transformer/encoderblock/") :]: v for k, v in p.items() if k.startswith("Transformer/encoderblock/")
    }
    if stacked:
        if any(v.ndim == 0 for v in stacked.values()):
            raise ValueError("'Transformer/encoderblock/' (scan layout) holds a scalar; its arrays need a depth axis")
        depth = next(iter(stacked.values())).shape[0]
        for i in range(depth):
            per_block[i] = {k: v[i] for k, v in stacked.items()}
    for k, v in p.items():
        m = re.match(r"Transformer/encoderblock_(\d+)/(.+)$", k)
        if m:
            per_block.setdefault(int(m.group(1)), {})[m.group(2)] = v
    if not per_block:
        raise ValueError("not a ViT checkpoint: no 'Transformer/encoderblock_*' arrays")
    if sorted(per_block) != list(range(len(per_block))):
        raise ValueError(f"encoder blocks are not numbered 0..{len(per_block) - 1}: found {sorted(per_block)}")
    blocks = []
    for i in range(len(per_block)):
        by_module: dict[str, list[tuple[int, str]]] = {}
        for name in {k.split("/")[0] for k in per_block[i]}:
            m = re.fullmatch(r"(\w+)_(\d+)", name)
            if not m:
                raise ValueError(f"encoder block {i} has an unexpected submodule {name!r}")
            by_module.setdefault(m.group(1), []).append((int(m.group(2)), name))
        try:
            (ln1, ln2), (attn,), (mlp,) = (
                [n for _, n in sorted(by_module[kind])]
                for kind in ("LayerNorm", "MultiHeadDotProductAttention", "MlpBlock")
            )
        except (KeyError, ValueError):
            raise ValueError(f"encoder block {i} has unexpected submodules {sorted(by_module)}") from None
        rename = {ln1: "ln1", attn: "attn", ln2: "ln2", mlp: "mlp"}
        blocks.append({rename[k.split("/")[0]] + "/" + k.split("/", 1)[1]: v for k, v in per_block[i].items()})
    return blocks


def _hybrid_stages(p: dict[str, np.ndarray]) -> tuple[int, ...] | None:
    """Units per ResNet stage from the `block{s}/unit{u}` names; None without a ResNet stem."""
    units: dict[int, int] = {}
    for k in p:
        m = re.match(r"block(\d+)/unit(\d+)/", k)
        if m:
            units[int(m.group(1))] = max(units.get(int(m.group(1)), 0), int(m.group(2)))
    if not units:  # the official root-only stem
        return () if "conv_root/kernel" in p else None
    if sorted(units) != list(range(1, len(units) + 1)):
        raise ValueError(f"hybrid ResNet stages are not numbered block1..block{len(units)}: found {sorted(units)}")
    return tuple(units[s] for s in range(1, len(units) + 1))


# VT, older BV (with the class row), current BV (without; the row count tells)
_POSEMB_KEYS = ("Transformer/posembed_input/pos_embedding", "Transformer/pos_embedding", "pos_embedding")


def _npz_config(p: dict[str, np.ndarray], blocks: list[dict[str, np.ndarray]]) -> tuple[ViTConfig, np.ndarray]:
    """The arrays' architecture, and the position embeddings with the class slot (1, P+N, D)."""
    patch, _, in_chans, width = _array(p, "embedding/kernel", 4).shape
    pool = "token" if "cls" in p else "gap"
    if "MAPHead_0/probe" in p or any(k.startswith("MAPHead_0/") for k in p):
        raise ValueError("big_vision 'map' (attention-pooling) heads are not supported; pool must be 'token' or 'gap'")
    posemb_key = next((k for k in _POSEMB_KEYS if k in p), None)
    if posemb_key is None:
        raise ValueError(
            f"no learned position embeddings (looked for {', '.join(_POSEMB_KEYS)}); fixed sincos2d embeddings "
            "(big_vision posemb='sincos2d') are not supported"
        )
    posemb = _array(p, posemb_key, 3)
    rows = posemb.shape[1]
    if pool == "token" and math.isqrt(rows) ** 2 == rows:
        posemb = np.concatenate([np.zeros_like(posemb[:, :1]), posemb], axis=1)  # no class row: a zero one
    num_patches = posemb.shape[1] - (pool == "token")
    grid = math.isqrt(num_patches)
    if grid * grid != num_patches:
        raise ValueError(f"position embeddings {posemb.shape} do not describe a square grid of patches")
    stages = _hybrid_stages(p)
    hybrid_width = 1
    if stages is not None:  # embedding/kernel reads the stem's channels
        stem_channels = in_chans
        _, _, in_chans, root_channels = _array(p, "conv_root/kernel", 4).shape
        if root_channels % GN_GROUPS:
            raise ValueError(
                f"conv_root/kernel has {root_channels} output channels (width factor {root_channels / 64:g}), which "
                f"the {GN_GROUPS}-group GroupNorms of the official ResNet stem cannot divide, so no official model "
                "has this root; the checkpoint is inconsistent"
            )
        hybrid_width = root_channels / 64  # exact (`pretrain.model.resnet.root_width`)
        if stem_channels != stem_out_channels(stages, hybrid_width):
            raise ValueError(
                f"embedding/kernel reads {stem_channels} channels but a ResNet stem with stages {stages} and a "
                f"{root_channels}-channel root (width factor {hybrid_width:g}) produces "
                f"{stem_out_channels(stages, hybrid_width)}; the checkpoint is inconsistent"
            )
    query = _array(blocks[0], "attn/query/kernel", 3)  # (D, heads, head_dim)
    config = ViTConfig(
        image_size=grid * patch * (stem_stride(stages) if stages is not None else 1),
        patch_size=patch,
        width=width,
        depth=len(blocks),
        num_heads=query.shape[1],
        mlp_dim=_array(blocks[0], "mlp/Dense_0/kernel", 2).shape[1],
        num_classes=_array(p, "head/kernel", 2).shape[1] if "head/kernel" in p else 0,
        pool=pool,
        representation_size=_array(p, "pre_logits/kernel", 2).shape[1] if "pre_logits/kernel" in p else None,
        gelu_approximate="tanh",  # Flax nn.gelu default
        hybrid_stages=stages,
        hybrid_width=hybrid_width,
        in_chans=in_chans,
    )
    return config, posemb


def _conv(kernel: np.ndarray) -> np.ndarray:
    return kernel.transpose(3, 2, 0, 1)  # HWIO → OIHW


def _npz_state_dict(p: dict[str, np.ndarray], blocks, posemb: np.ndarray, config: ViTConfig) -> dict[str, np.ndarray]:
    D = config.width
    sd = {
        "patch_embed.proj.weight": _conv(p["embedding/kernel"]),
        "patch_embed.proj.bias": p["embedding/bias"],
        "pos_embed": posemb,
        "norm.weight": p["Transformer/encoder_norm/scale"],
        "norm.bias": p["Transformer/encoder_norm/bias"],
    }
    if config.pool == "token":
        sd["cls_token"] = p["cls"]
    for i, b in enumerate(blocks):
        pre = f"blocks.{i}."
        qkv = [b[f"attn/{n}/kernel"].reshape(D, D).T for n in ("query", "key", "value")]
        sd[pre + "attn.qkv.weight"] = np.concatenate(qkv, axis=0)
        sd[pre + "attn.qkv.bias"] = np.concatenate([b[f"attn/{n}/bias"].reshape(D) for n in ("query", "key", "value")])
        sd[pre + "attn.proj.weight"] = b["attn/out/kernel"].reshape(D, D).T  # (heads, hd, D) → (D_out, heads·hd)
        sd[pre + "attn.proj.bias"] = b["attn/out/bias"]
        for ours, theirs in (("norm1", "ln1"), ("norm2", "ln2")):
            sd[pre + ours + ".weight"], sd[pre + ours + ".bias"] = b[theirs + "/scale"], b[theirs + "/bias"]
        for ours, theirs in (("fc1", "Dense_0"), ("fc2", "Dense_1")):
            sd[pre + f"mlp.{ours}.weight"] = b[f"mlp/{theirs}/kernel"].T
            sd[pre + f"mlp.{ours}.bias"] = b[f"mlp/{theirs}/bias"]
    if config.representation_size:
        sd["pre_logits.0.weight"], sd["pre_logits.0.bias"] = p["pre_logits/kernel"].T, p["pre_logits/bias"]
    if config.num_classes:
        sd["head.weight"], sd["head.bias"] = p["head/kernel"].T, p["head/bias"]
    for key, value in p.items():  # hybrid stem: names match the official ones below `patch_embed.backbone`
        m = re.match(r"(conv_root|gn_root|block\d+/unit\d+/(?:conv|gn)(?:\d|_proj))/(kernel|scale|bias)$", key)
        if not m:
            continue
        module = re.sub(r"(block\d+)/(unit\d+)/", r"stages.\1.units.\2.", m.group(1))
        if m.group(2) == "kernel":
            sd[f"patch_embed.backbone.{module}.weight"] = _conv(_array(p, key, 4))
        else:  # GroupNorm scale/bias; older Flax stored (1, 1, 1, C)
            sd[f"patch_embed.backbone.{module}.{'weight' if m.group(2) == 'scale' else 'bias'}"] = value.reshape(-1)
    return sd


def load_npz(path: str | Path, image_size: int | None = None, **overrides) -> VisionTransformer:
    """An official JAX checkpoint's model. Another `image_size` resizes the position embeddings; head overrides
    reset the head; architecture overrides must agree with the file."""
    path = Path(path)
    p = _strip_prefix(_read_npz(path), path)
    try:
        blocks = _encoder_blocks(p)
        config, posemb = _npz_config(p, blocks)
        state = _npz_state_dict(p, blocks, posemb, config)
    except KeyError as e:
        raise ValueError(f"{path} is not a complete ViT checkpoint: missing array {e}") from None
    except ValueError as e:  # name the file
        raise ValueError(f"{path} is not a valid ViT checkpoint: {e}") from None
    return _finish(
        config, {k: torch.from_numpy(np.asarray(v, np.float32)) for k, v in state.items()}, path, image_size, overrides
    )


def _finish(config: ViTConfig, state: dict, source, image_size: int | None, overrides: dict) -> VisionTransformer:
    valid = {f.name for f in dataclasses.fields(ViTConfig)}
    unknown = sorted(set(overrides) - valid)
    if unknown:
        raise ValueError(f"unknown ViTConfig overrides {unknown}; valid fields: {sorted(valid)}")
    for name in ARCHITECTURE_FIELDS:
        if name in overrides and overrides[name] != getattr(config, name):
            raise ValueError(
                f"{name}={overrides[name]!r} contradicts the weights in {source} ({name}={getattr(config, name)!r}); "
                "architecture fields are read from the weights — drop this override"
            )
    head = {k: overrides.pop(k) for k in _HEAD_FIELDS if k in overrides}
    free = {k: v for k, v in overrides.items() if k not in ARCHITECTURE_FIELDS}
    with torch.device("meta"):  # every parameter comes from `state`
        model = VisionTransformer(dataclasses.replace(config, **free))
    state = {k: v.float().contiguous() for k, v in state.items()}  # fp32 (exact from bf16); callers cast
    try:
        missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    except RuntimeError as e:  # shape mismatches
        raise ValueError(f"weights in {source} do not fit the inferred model: {e}") from None
    if missing or unexpected:
        found = [
            f"{what} {_some(names)}" for what, names in (("missing", missing), ("unexpected", unexpected)) if names
        ]
        raise ValueError(f"weights in {source} do not fit the model their config describes: {', '.join(found)}")
    if image_size is not None and image_size != config.image_size:
        try:
            resize_model(model, image_size)
        except ValueError as e:
            raise ValueError(f"cannot run the weights in {source} at image_size={image_size}: {e}") from None
    if any(head.get(k, getattr(config, k)) != getattr(config, k) for k in head):
        model.reset_classifier(
            head.get("num_classes", config.num_classes),
            head.get("representation_size", config.representation_size),
            head_bias_init=head.get("head_bias_init", 0.0),
        )
    return model


def npz_architecture(path: Path) -> ViTConfig | None:
    """The architecture of an official .npz, from its arrays' headers alone (no weights read); None where they do not
    describe a ViT this reads (the load that follows says what is wrong)."""
    readers = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}
    try:
        arrays = {}
        with zipfile.ZipFile(path) as archive:
            for name in archive.namelist():
                with archive.open(name) as member:
                    shape, _, dtype = readers[np.lib.format.read_magic(member)](member)
                arrays[name.removesuffix(".npy")] = np.broadcast_to(np.zeros((), dtype), shape)  # shape, no data
        p = _strip_prefix(arrays, path)
        return _npz_config(p, _encoder_blocks(p))[0]
    except (OSError, ValueError, KeyError, TypeError, zipfile.BadZipFile):
        return None


def recorded_config(folder: Path) -> ViTConfig | None:
    """The architecture a weights or checkpoint folder's ``model.json`` (an HF folder's ``config.json``) records; None
    when absent or unreadable (the load that follows says what is wrong)."""
    try:
        if is_hf_folder(folder) and not (folder / CONFIG_FILE).exists():
            return config_from_hf_dict(json.loads((folder / HF_CONFIG).read_text()))
        return ViTConfig.from_dict(json.loads((folder / CONFIG_FILE).read_text()))
    except (OSError, ValueError, TypeError):
        return None


def architecture_differences(
    have: ViTConfig, want: ViTConfig, fields: tuple[str, ...] = ARCHITECTURE_FIELDS
) -> list[str]:
    """``"width 64, not 384"`` for each of ``fields`` in which ``have`` differs from ``want``."""
    same = lambda v: list(v) if isinstance(v, (tuple, list)) else v  # noqa: E731 — JSON reads tuples as lists
    return [
        f"{name} {getattr(have, name)}, not {getattr(want, name)}"
        for name in fields
        if same(getattr(have, name)) != same(getattr(want, name))
    ]


class ArchitectureMismatchError(ValueError):
    """``checkpoint.init_from`` weights of another architecture than the recipe's model. Not ``retryable``: an
    ``.npz`` or URL is only read in the ranks, and a restarted worker group would read the same weights."""

    retryable = False


def check_init_architecture(have: ViTConfig, want: ViTConfig, origin: str) -> None:
    """`ArchitectureMismatchError` if ``checkpoint.init_from`` weights (``have``) are of another architecture than the
    model: a few same-shape tensors would be copied and the rest trained from scratch."""
    differ = architecture_differences(have, want, INIT_FIELDS)
    if differ:
        raise ArchitectureMismatchError(
            f"checkpoint.init_from={origin}: its weights are of another architecture than the recipe's model "
            f"({'; '.join(differ)}), so the run would train from a fresh initialisation; set model.name to the "
            "weights' model (and model.* to match), or point checkpoint.init_from at weights of this architecture"
        )


def _some(names: list[str], shown: int = 6) -> str:
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return f"{names[:shown]}{more}"


@torch.no_grad()
def resize_model(model: VisionTransformer, image_size: int) -> None:
    """Make `model` run at `image_size`: position embeddings interpolated in place."""
    config = dataclasses.replace(model.config, image_size=image_size)  # validates divisibility
    new = resize_pos_embed(model.pos_embed.data, (config.grid_size, config.grid_size), model.num_prefix_tokens)
    model.pos_embed = torch.nn.Parameter(new, requires_grad=model.pos_embed.requires_grad)
    model.config = config


# --- safetensors


def save_pretrained(model: VisionTransformer, directory: str | Path) -> None:
    """Write `model.safetensors` (in the model's dtype) and `model.json`, each whole or not at all (`write_safetensors`:
    OSError naming the file when it cannot be written)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().cpu().contiguous().clone() for k, v in model.state_dict().items()}
    write_safetensors(state, directory / WEIGHTS_FILE)
    write_text_atomically(directory / CONFIG_FILE, json.dumps(model.config.to_dict(), indent=2) + "\n")


def load_pretrained(directory: str | Path, image_size: int | None = None, **overrides) -> VisionTransformer:
    """Load what `save_pretrained` wrote, or an HF ViT folder; `image_size` and overrides as in `load_npz`."""
    directory = Path(directory)
    if not directory.is_dir():
        if directory.exists():
            raise ValueError(f"{directory} is a file, not a folder; pass the folder that holds {WEIGHTS_FILE}")
        raise FileNotFoundError(f"no weights folder at {directory}; check the path")
    if is_hf_folder(directory) and not (directory / CONFIG_FILE).exists():  # an export, as `checkpoint.init_from`
        config, state = read_hf_folder(directory)
        return _finish(config, state, directory, image_size, overrides)
    for name in (WEIGHTS_FILE, CONFIG_FILE):
        if not (directory / name).is_file():
            raise FileNotFoundError(
                f"{directory} has no {name}; expected a folder written by save_pretrained or "
                f"`python -m pretrain.weights convert` ({WEIGHTS_FILE} + {CONFIG_FILE})"
            )
    return _finish(
        read_model_config(directory), _read_safetensors(directory / WEIGHTS_FILE), directory, image_size, overrides
    )


def read_model_config(directory: Path) -> ViTConfig:
    """The architecture `save_pretrained` wrote beside the weights (a checkpoint's too), without reading them."""
    config_path = directory / CONFIG_FILE
    try:
        fields = json.loads(config_path.read_text())
        if not isinstance(fields, dict):
            raise ValueError(f"it holds a JSON {type(fields).__name__}, not an object of ViTConfig fields")
        return ViTConfig.from_dict(fields)
    except (ValueError, TypeError) as e:  # JSON, Unicode, ViTConfig
        raise ValueError(
            f"{config_path} is not a valid model config: {e}; it should be the {CONFIG_FILE} save_pretrained writes"
        ) from None


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(path))
    except SafetensorError as e:
        raise ValueError(
            f"{path} is not a readable safetensors file ({e}); it is damaged or was not fully copied — write it again"
        ) from None


def load_checkpoint_model(checkpoint_dir: str | Path, image_size: int | None = None, **overrides) -> VisionTransformer:
    """A training checkpoint's model; one without `COMPLETE` raises `IncompleteCheckpointError`."""
    checkpoint_dir = Path(checkpoint_dir)
    if not checkpoint_dir.is_dir():
        raise FileNotFoundError(f"no checkpoint folder at {checkpoint_dir}")
    return load_pretrained(run_folder.require_complete(checkpoint_dir), image_size=image_size, **overrides)


def load_model(source: str | Path, image_size: int | None = None, **overrides) -> VisionTransformer:
    """The model of any weights source (`pretrain.weights.source`)."""
    source = weights_source.resolve(source)
    if source.is_file():
        if source.suffix == ".safetensors":
            _read_safetensors(source)  # report damage first
            raise ValueError(
                f"{source} is a bare safetensors file: the architecture lives in the {CONFIG_FILE} beside it; pass "
                f"a folder holding {WEIGHTS_FILE} + {CONFIG_FILE} (save_pretrained and `python -m pretrain.weights "
                "convert` write both)"
            )
        return load_npz(source, image_size=image_size, **overrides)  # judged by the bytes, not the name
    if not source.is_dir():
        raise FileNotFoundError(
            f"no file or folder at {source}; pass an official .npz, a training checkpoint or run folder, or a folder "
            "written by save_pretrained / `python -m pretrain.weights convert`"
        )
    if run_folder.looks_like_checkpoint(source):
        return load_checkpoint_model(source, image_size=image_size, **overrides)
    if is_hf_folder(source) and not (source / CONFIG_FILE).exists():
        config, state = read_hf_folder(source)
        return _finish(config, state, source, image_size, overrides)
    if not (source / WEIGHTS_FILE).exists() and not (source / CONFIG_FILE).exists():
        raise FileNotFoundError(
            f"{source} holds no weights (no {WEIGHTS_FILE} + {CONFIG_FILE}, no COMPLETE checkpoint); pass "
            "an official .npz, a training checkpoint folder (<run>/checkpoints/step_XXXXXXXX), a run folder or a "
            "folder written by save_pretrained / `python -m pretrain.weights convert`"
        )
    return load_pretrained(source, image_size=image_size, **overrides)
