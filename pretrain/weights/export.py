"""Weights out: a Hugging Face `transformers` folder or the official JAX `.npz` (`export`); HF folders read back.

- ``hf``: ``config.json``, ``model.safetensors`` (Hub key layout, for transformers 4 and 5) and
  ``preprocessor_config.json``; `ViTForImageClassification.from_pretrained(OUT)` gives our logits. No pre-logits,
  ``gap`` or hybrid models. Writing needs no transformers.
- ``npz``: the official layout (docs/reference.md §2); every vitscale ViT but exact-erf GELU.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import zipfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
import yaml
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from data_pipeline.manifest import read_dataset_info
from data_pipeline.paths import replace_atomically, write_text_atomically
from pretrain.checkpoint import run_folder
from pretrain.checkpoint.run_folder import CONFIG_YAML, WEIGHTS_FILE
from pretrain.model.vit import LN_EPS, VisionTransformer, ViTConfig
from pretrain.weights.hf import config_from_hf_dict, hf_config_dict, state_dict_from_hf, to_hf_state_dict
from pretrain.weights.source import HF_CONFIG

FORMATS = ("hf", "npz")
HF_PREPROCESSOR = "preprocessor_config.json"
NPZ_NAME = "model.npz"  # when OUT is a folder
HF_FILES = (HF_CONFIG, WEIGHTS_FILE, HF_PREPROCESSOR)  # what `save_hf` writes
EVALS = "evals"  # what `python -m evals.run --weights FOLDER` adds to it (docs/contracts.md, "Checkpoints")
# VT's block names, in call order
_BLOCK_NAMES = ("LayerNorm_0", "MultiHeadDotProductAttention_1", "LayerNorm_2", "MlpBlock_3")


def checkpoint_step(source: Path) -> int | None:
    """A checkpoint's training step, else None."""
    if not (source / run_folder.TRAINER_STATE).is_file():
        return None
    return run_folder.TrainerState.read(source).step


def class_names(source: Path, num_classes: int) -> list[str] | None:
    """The class names of a checkpoint's local ``data.train`` if one per logit, else None; never raises."""
    try:
        config = yaml.safe_load((source / CONFIG_YAML).read_text())
        train = (config.get("data") or {}).get("train")
        if not train or "://" in str(train) or not Path(train).is_dir():
            return None
        names = read_dataset_info(train).class_names
    except (OSError, ValueError, AttributeError, yaml.YAMLError):
        return None
    return list(names) if len(names) == num_classes and len(set(names)) == num_classes else None


def check_folder_out(out: Path, names: tuple[str, ...], source: Path | None = None) -> None:
    """ValueError, before anything is written, unless the folder ``out`` may get the files ``names``: it is not
    ``source``, lies in no checkpoint (`_check_not_in_checkpoints`) and holds nothing else (new, empty, or what an
    earlier export wrote, its leftover temporaries and the ``evals/`` of an eval of it too)."""
    _check_not_source(out, source)
    others = sorted(p.name for p in out.iterdir() if p.name.partition(".tmp")[0] not in names) if out.is_dir() else []
    if EVALS in others and (out / EVALS).is_dir() and any((out / name).is_file() for name in names):
        others.remove(EVALS)  # an earlier export's eval results: kept as they are
    if others:
        raise ValueError(
            f"OUT {out} holds {others[0]}, which this command does not write (a checkpoint, run or other weights "
            "folder?), so it would mix with or replace what is there; pass a new or empty folder"
        )
    _check_not_in_checkpoints(out, source, "folder")


def check_npz_out(out: Path, source: Path) -> None:
    """ValueError, before anything is written, unless the .npz `save_npz` writes for ``out`` is not ``source``, lies
    in no checkpoint and is either absent or an .npz archive (an earlier export); a folder ``out`` as in
    `check_folder_out`."""
    if out.is_dir():
        check_folder_out(out, (NPZ_NAME,), source)
    path = npz_path(out)
    _check_not_source(path, source)
    _check_not_in_checkpoints(path, source, "file")
    if path.exists() and not _is_npz(path):
        raise ValueError(
            f"OUT {path} exists and is not an .npz archive, so it is not replaced; pass a new file path, or a folder "
            f"(it gets {NPZ_NAME})"
        )


def _check_not_in_checkpoints(out: Path, source: Path | None, kind: str) -> None:
    """ValueError if the ``kind`` ("file", "folder") ``out`` would lie in SOURCE, a checkpoint or a run's
    ``checkpoints/``, however deep."""
    folder = next((p for p in out.absolute().parents if _mixes_with_checkpoints(p, source)), None)
    if folder is not None:
        raise ValueError(
            f"OUT {out} would be a stray {kind} in {folder} "
            "(SOURCE, a checkpoint or a run's checkpoints/, whose retention deletes it with the checkpoint); pass a "
            "path outside it"
        )


def _mixes_with_checkpoints(folder: Path, source: Path | None) -> bool:
    """Whether what is put in ``folder`` would lie in SOURCE, in a checkpoint (deleted whole by retention) or among
    the checkpoints of a run (where retention and the next save delete folders)."""
    if not folder.is_dir():
        return False
    if source is not None and source.is_dir() and folder.samefile(source) or run_folder.looks_like_checkpoint(folder):
        return True
    if folder.name != run_folder.CHECKPOINTS:
        return False
    return any(run_folder.parse_step(p.name) is not None for p in folder.iterdir())


def _check_not_source(out: Path, source: Path | None) -> None:
    if source is not None and out.exists() and source.exists() and out.samefile(source):
        raise ValueError(f"OUT {out} is SOURCE itself: writing it would destroy what is read; pass a new path")


def _is_npz(path: Path) -> bool:
    try:
        with zipfile.ZipFile(path) as archive:
            return all(name.endswith(".npy") for name in archive.namelist())
    except (OSError, zipfile.BadZipFile):
        return False


def is_hf_folder(path: Path) -> bool:
    """A folder with ``config.json`` (model_type "vit") beside ``model.safetensors``."""
    if not (path / HF_CONFIG).is_file() or not (path / WEIGHTS_FILE).is_file():
        return False
    try:
        return json.loads((path / HF_CONFIG).read_text()).get("model_type") == "vit"
    except (ValueError, AttributeError):
        return False


def read_hf_folder(path: Path) -> tuple[ViTConfig, dict[str, torch.Tensor]]:
    """Our config and weights of an HF ViT folder (either key layout)."""
    try:
        fields = json.loads((path / HF_CONFIG).read_text())
        config = config_from_hf_dict(fields)
        weights = load_file(str(path / WEIGHTS_FILE))
    except SafetensorError as e:
        raise ValueError(f"{path / WEIGHTS_FILE} is not a readable safetensors file ({e}); write it again") from None
    except (ValueError, TypeError) as e:
        raise ValueError(f"{path / HF_CONFIG} is not a ViT config this reads: {e}") from None
    state = state_dict_from_hf(weights, config)
    classes = len(state["head.bias"]) if "head.bias" in state else config.num_classes
    if classes != config.num_classes:
        raise ValueError(
            f"{path / HF_CONFIG} gives {config.num_classes} classes (num_labels, id2label) but the classifier in "
            f"{WEIGHTS_FILE} has {classes}; make its id2label and label2id (and num_labels, if set) give {classes}"
        )
    return config, state


def preprocessor_config(config: ViTConfig) -> dict:
    """HF ViTImageProcessor settings for the training input: resize to the model's side, x / 127.5 - 1."""
    return {
        "image_processor_type": "ViTImageProcessor",
        "do_resize": True,
        "size": {"height": config.image_size, "width": config.image_size},
        "resample": 2,  # PIL bilinear
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": [0.5] * config.in_chans,
        "image_std": [0.5] * config.in_chans,
    }


def save_hf(model: VisionTransformer, out: Path, labels: list[str] | None = None) -> Path:
    """Write the HF folder ``out``, each file whole or not at all, a new folder removed again if a write fails;
    ValueError, before writing, for a model HF cannot hold. A headless model is a ViTModel, keys without ``vit.``."""
    config = model.config
    fields = hf_config_dict(config, labels)  # refuses first
    state = to_hf_state_dict(model, layout="hub")
    if not config.num_classes:
        state = {k.removeprefix("vit."): v for k, v in state.items()}
    tensors = {k: v.detach().float().cpu().contiguous() for k, v in state.items()}
    with new_folder(out):
        write_safetensors(tensors, out / WEIGHTS_FILE)
        write_text_atomically(out / HF_CONFIG, json.dumps(fields, indent=2) + "\n")
        write_text_atomically(out / HF_PREPROCESSOR, json.dumps(preprocessor_config(config), indent=2) + "\n")
    return out


def write_safetensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """Write ``path`` whole or not at all, with the mode any new file gets here (safetensors' own is 0600, which
    colleagues on a shared filesystem cannot read); OSError naming ``path`` and the cause when it cannot be written."""
    metadata = {"format": "pt", "producer": "vitscale"}

    def write(tmp: Path) -> None:
        try:
            save_file(tensors, str(tmp), metadata=metadata)
        except SafetensorError as error:  # e.g. "I/O error: No space left on device (os error 28)"
            raise OSError(f"cannot write {path}: {error}") from error
        os.chmod(tmp, 0o666 & ~_umask())

    replace_atomically(path, write)


def _umask() -> int:
    """The process's umask, read without setting it where /proc tells it (os.umask sets it, racing other threads'
    file creation)."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    umask = os.umask(0o022)
    os.umask(umask)
    return umask


@contextlib.contextmanager
def new_folder(folder: Path) -> Iterator[None]:
    """Make ``folder`` (and its missing parents) for the body's writes; if it raises, remove what this made, so a
    failed write leaves no new folder behind, and add the fix to an OSError (a full disk, say)."""
    made = [p for p in (folder, *folder.parents) if not p.exists()]
    folder.mkdir(parents=True, exist_ok=True)
    try:
        yield
    except BaseException as error:
        if made:
            shutil.rmtree(made[-1], ignore_errors=True)
        if isinstance(error, OSError):
            raise OSError(f"{error}; make room there or write elsewhere, then run the command again") from error
        raise


def npz_arrays(model: VisionTransformer) -> dict[str, np.ndarray]:
    """Weights under the official names, float32 (the inverse of `load_npz`)."""
    config = model.config
    if config.gelu_approximate != "tanh":
        raise ValueError(
            "gelu_approximate='none' (exact erf GELU) cannot be expressed in the official .npz layout: the official "
            "code computes Flax's nn.gelu, the tanh form, and the file has no field to say otherwise; export it with "
            "--format hf (HF's hidden_act='gelu' is the exact form)"
        )
    if config.layer_norm_eps != LN_EPS:
        raise ValueError(
            f"layer_norm_eps={config.layer_norm_eps:g} (an HF folder's) cannot be expressed in the official .npz "
            f"layout, whose LayerNorms are Flax's eps {LN_EPS:g}; export it with --format hf, which keeps it"
        )
    sd = {k: v.detach().float().cpu().numpy() for k, v in model.state_dict().items()}
    D, heads = config.width, config.num_heads
    p = {
        "embedding/kernel": _hwio(sd["patch_embed.proj.weight"]),
        "embedding/bias": sd["patch_embed.proj.bias"],
        "Transformer/posembed_input/pos_embedding": sd["pos_embed"],  # class slot first
        "Transformer/encoder_norm/scale": sd["norm.weight"],
        "Transformer/encoder_norm/bias": sd["norm.bias"],
    }
    if "cls_token" in sd:
        p["cls"] = sd["cls_token"]
    for i in range(config.depth):
        p.update(_block_arrays(sd, i, D, heads))
    if config.representation_size:
        p["pre_logits/kernel"], p["pre_logits/bias"] = sd["pre_logits.0.weight"].T, sd["pre_logits.0.bias"]
    if config.num_classes:
        p["head/kernel"], p["head/bias"] = sd["head.weight"].T, sd["head.bias"]
    p.update(_stem_arrays(sd))
    return {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in p.items()}


def _hwio(weight: np.ndarray) -> np.ndarray:
    return weight.transpose(2, 3, 1, 0)  # OIHW → HWIO


def _block_arrays(sd: dict[str, np.ndarray], i: int, D: int, heads: int) -> dict[str, np.ndarray]:
    """Block ``i``; our qkv (3D, D) split into (D, heads, head_dim) kernels."""
    ours = f"blocks.{i}."
    ln1, attn, ln2, mlp = (f"Transformer/encoderblock_{i}/{name}" for name in _BLOCK_NAMES)
    hd = D // heads
    p = {}
    for ln, norm in ((ln1, "norm1"), (ln2, "norm2")):
        p[ln + "/scale"], p[ln + "/bias"] = sd[ours + norm + ".weight"], sd[ours + norm + ".bias"]
    weights, biases = np.split(sd[ours + "attn.qkv.weight"], 3), np.split(sd[ours + "attn.qkv.bias"], 3)
    for name, w, b in zip(("query", "key", "value"), weights, biases):
        p[f"{attn}/{name}/kernel"], p[f"{attn}/{name}/bias"] = w.T.reshape(D, heads, hd), b.reshape(heads, hd)
    p[f"{attn}/out/kernel"] = sd[ours + "attn.proj.weight"].T.reshape(heads, hd, D)
    p[f"{attn}/out/bias"] = sd[ours + "attn.proj.bias"]
    for dense, fc in (("Dense_0", "fc1"), ("Dense_1", "fc2")):
        p[f"{mlp}/{dense}/kernel"] = sd[f"{ours}mlp.{fc}.weight"].T
        p[f"{mlp}/{dense}/bias"] = sd[f"{ours}mlp.{fc}.bias"]
    return p


def _stem_arrays(sd: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A hybrid's stem under the official names."""
    p = {}
    for key, value in sd.items():
        if not key.startswith("patch_embed.backbone."):
            continue
        name = re.sub(r"^stages\.(block\d+)\.units\.(unit\d+)\.", r"\1/\2/", key.removeprefix("patch_embed.backbone."))
        module, param = name.rsplit(".", 1)
        if module.rsplit("/", 1)[-1].startswith("conv"):
            p[module + "/kernel"] = _hwio(value)
        else:
            p[module + "/" + ("scale" if param == "weight" else "bias")] = value
    return p


def npz_path(out: Path) -> Path:
    """The file `save_npz` writes for ``out``."""
    return out / NPZ_NAME if out.is_dir() else out


def save_npz(model: VisionTransformer, out: Path) -> Path:
    """Write the official arrays to ``out`` (a folder: ``out/model.npz``), whole or not at all: np.savez's format,
    never pickled."""
    arrays = npz_arrays(model)  # refuses first
    path = npz_path(out)
    with new_folder(path.parent):
        try:
            replace_atomically(path, lambda tmp: _write_npz(arrays, tmp))
        except OSError as error:  # e.g. a full disk
            raise OSError(f"cannot write {path}: {error.strerror or error}") from error
    return path


def _write_npz(arrays: dict[str, np.ndarray], path: Path) -> None:
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as archive:
        for key, value in arrays.items():
            with archive.open(key + ".npy", "w", force_zip64=True) as member:
                np.lib.format.write_array(member, value, allow_pickle=False)


def export(model: VisionTransformer, out: Path, fmt: str, labels: list[str] | None = None) -> Path:
    """Returns what was written."""
    model = model.eval()
    if fmt == "hf":
        return save_hf(model, out, labels)
    if fmt == "npz":
        return save_npz(model, out)
    raise ValueError(f"unknown export format {fmt!r}; use one of {', '.join(FORMATS)}")
