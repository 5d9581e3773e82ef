"""Checkpoints: save (atomically), find, resume, keep the last k.

Layout (docs/interfaces.md): ``<run_dir>/checkpoints/step_XXXXXXXX/`` holds
  deepspeed/            the engine state (model, optimizer, ZeRO partitions of every rank)
  model.safetensors     consolidated weights + model.json (the ViTConfig): what evals and users load
  trainer_state.json    step, images seen, every rank's stream position and RNG states
  config.yaml           the resolved TrainConfig
  COMPLETE              written last
Everything is written into ``step_XXXXXXXX.tmp``, renamed, and only then marked COMPLETE, so a crash mid-write
leaves a folder without the marker that nothing reads, and the previous checkpoint stays the newest loadable one.

Resume order (`find_start`): the newest COMPLETE checkpoint in the run folder > ``checkpoint.resume_from`` >
``checkpoint.init_from`` (weights only) > scratch.
"""

from __future__ import annotations

import base64
import json
import os
import random
import shutil
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from pretrain.config import TrainConfig, resolve_path

CHECKPOINTS = "checkpoints"
COMPLETE = "COMPLETE"
TRAINER_STATE = "trainer_state.json"
DEEPSPEED_DIR = "deepspeed"


def step_name(step: int) -> str:
    return f"step_{step:08d}"


def checkpoint_root(run_dir: str | Path) -> Path:
    return resolve_path(run_dir) / CHECKPOINTS


def is_complete(path: str | Path) -> bool:
    return (Path(path) / COMPLETE).is_file()


def complete_checkpoints(run_dir: str | Path) -> list[Path]:
    """COMPLETE checkpoint folders of a run, oldest first; ``.tmp`` and unmarked folders are ignored."""
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        name = path.name
        if path.is_dir() and name.startswith("step_") and name[5:].isdigit() and is_complete(path):
            found.append((int(name[5:]), path))
    return [path for _, path in sorted(found)]


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    found = complete_checkpoints(run_dir)
    return found[-1] if found else None


def read_trainer_state(checkpoint_dir: str | Path) -> dict[str, Any]:
    path = Path(checkpoint_dir)
    if not is_complete(path):
        raise ValueError(f"{path} is not a complete checkpoint (no {COMPLETE} marker); it was never finished")
    return json.loads((path / TRAINER_STATE).read_text())


@dataclass(frozen=True)
class StartPoint:
    kind: str  # "run" (newest checkpoint of this run) | "resume_from" | "init_from" | "scratch"
    path: Path | None


def find_start(config: TrainConfig) -> StartPoint:
    """Where training starts, by the documented resume order."""
    latest = latest_checkpoint(config.checkpoint.dir)
    if latest is not None:
        return StartPoint("run", latest)
    c = config.checkpoint
    if c.resume_from is not None:
        path = resolve_path(c.resume_from)
        if not is_complete(path):
            raise ValueError(f"checkpoint.resume_from={c.resume_from!r} has no {COMPLETE} marker; point it elsewhere")
        return StartPoint("resume_from", path)
    if c.init_from is not None:
        return StartPoint("init_from", resolve_path(c.init_from))
    return StartPoint("scratch", None)


# --------------------------------------------------------------------------------------------- RNG state


def rng_state() -> dict[str, Any]:
    """This process's global RNG states (python, numpy, torch CPU, every visible CUDA device) as JSON-safe values.

    The model's dropout does not depend on them (``pretrain.train.model_randomness`` seeds it by position) and the
    data streams seed every choice by position too; these are restored so any other code drawing from the global
    generators continues exactly as well.
    """
    np_state = np.random.get_state()
    state = {
        "python": [random.getstate()[0], list(random.getstate()[1]), random.getstate()[2]],
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
    }
    if torch.cuda.is_available():
        state["cuda"] = [base64.b64encode(s.numpy().tobytes()).decode() for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(_bytes_tensor(state["torch"]))
    if "cuda" in state and torch.cuda.is_available():
        # Device i's state goes back to device i; a process that now sees fewer devices restores the ones it has.
        for index, saved in enumerate(state["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(_bytes_tensor(saved), index)


def _bytes_tensor(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8).clone()


# --------------------------------------------------------------------------------------------- save / load


def _gather(obj: Any) -> list[Any]:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _write_text(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def save_checkpoint(
    engine,
    model: torch.nn.Module,
    config: TrainConfig,
    *,
    step: int,
    images_seen: int,
    stream_state: dict[str, Any],
    metrics: dict[str, float] | None = None,
) -> Path:
    """Collective: every rank calls it. Returns the COMPLETE checkpoint folder (same path on every rank).

    ``model`` is the bare ViT inside the engine (consolidated into model.safetensors; gathered under ZeRO-3).
    """
    from pretrain.weights import save_pretrained

    rank = dist.get_rank() if dist.is_initialized() else 0
    root = checkpoint_root(config.checkpoint.dir)
    final, tmp = root / step_name(step), root / f"{step_name(step)}.tmp"
    if rank == 0:
        for stale in root.glob("step_*.tmp"):  # partial writes of crashed runs
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    engine.save_checkpoint(str(tmp / DEEPSPEED_DIR), tag=step_name(step), client_state={"step": step})
    stream_states, rng_states = _gather(_jsonable(stream_state)), _gather(rng_state())
    _save_consolidated(engine, model, tmp, rank, save_pretrained)
    if rank == 0:
        state = {
            "step": step,
            "images_seen": images_seen,
            "world_size": len(stream_states),
            "deepspeed_tag": step_name(step),
            "stream_states": stream_states,
            "rng_states": rng_states,
            "metrics": metrics or {},
            "saved_at": time.time(),
        }
        _write_text(tmp / TRAINER_STATE, json.dumps(state))
        _write_text(tmp / "config.yaml", config.to_yaml())
        if final.exists():  # the same step saved again (e.g. an unmarked folder of a crash): replace it whole
            shutil.rmtree(final)
        os.replace(tmp, final)
        # The marker goes in after the rename, so no ".tmp" folder ever looks complete to any reader.
        _write_text(final / COMPLETE, f"{step}\n")
        _prune(root, config.checkpoint.keep_last)
    _barrier()
    return final


def _save_consolidated(engine, model: torch.nn.Module, directory: Path, rank: int, save_pretrained) -> None:
    if engine.zero_optimization_stage() == 3:
        import deepspeed

        # Every rank must enter: gathering the partitioned parameters is a collective.
        with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=None):
            if rank == 0:
                save_pretrained(model, directory)
    elif rank == 0:
        save_pretrained(model, directory)


def _prune(root: Path, keep_last: int) -> None:
    prune_checkpoints(root.parent, keep_last)


def prune_checkpoints(run_dir: str | Path, keep_last: int) -> list[Path]:
    """Delete the COMPLETE checkpoints older than the newest ``keep_last``, except pinned ones; returns those deleted.

    A pinned checkpoint (evals scheduled on it, see `pin_checkpoint`) stays until it is unpinned and goes at a later
    prune: the next save's, or the driver's after its evals finished.
    """
    deleted = []
    for old in complete_checkpoints(run_dir)[:-keep_last]:
        if is_pinned(old):
            continue
        # Unmark first: a prune interrupted half-way leaves a folder nothing reads, never a "complete" fragment.
        (old / COMPLETE).unlink(missing_ok=True)
        shutil.rmtree(old, ignore_errors=True)
        deleted.append(old)
    return deleted


# A pin is a plain file in the checkpoint folder: training rank 0 sets it, the eval scheduler or the eval task
# (other processes, maybe other nodes on shared storage) clears it; nothing but the filesystem is involved.
PINNED = "PINNED"


def pin_checkpoint(checkpoint_dir: str | Path, reason: str) -> bool:
    """Keep ``checkpoint_dir`` through `checkpoint.keep_last` pruning until `unpin_checkpoint`; False if it is gone."""
    try:
        (Path(checkpoint_dir) / PINNED).write_text(f"{reason}\n")
    except FileNotFoundError:  # already pruned (or never written): nothing to keep
        return False
    return True


def unpin_checkpoint(checkpoint_dir: str | Path) -> None:
    (Path(checkpoint_dir) / PINNED).unlink(missing_ok=True)


def is_pinned(checkpoint_dir: str | Path) -> bool:
    return (Path(checkpoint_dir) / PINNED).is_file()


def release_pins(run_dir: str | Path) -> list[Path]:
    """Clear every pin of a run (left by a job that died before its evals finished); returns the unpinned folders."""
    root = checkpoint_root(run_dir)
    pinned = sorted(p.parent for p in root.glob(f"step_*/{PINNED}")) if root.is_dir() else []
    for folder in pinned:
        unpin_checkpoint(folder)
    return pinned


# The only non-tensor objects DeepSpeed pickles into its model/optimizer state files (ZeRO 0-3, fp32 and bf16 as
# checked here); allow-listing them lets every engine file load with torch.load(weights_only=True).
DEEPSPEED_SAFE_GLOBALS = (
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.utils.tensor_fragment.fragment_address",
)


def _load_weights_only(checkpoint_engine) -> None:
    """Make the engine's checkpoint reader refuse arbitrary pickles (DeepSpeed itself loads weights_only=False)."""
    import importlib

    allowed = []
    for name in DEEPSPEED_SAFE_GLOBALS:
        module, _, attr = name.rpartition(".")
        allowed.append(getattr(importlib.import_module(module), attr))

    def load(path: str, map_location=None):
        with torch.serialization.safe_globals(allowed):
            return torch.load(path, map_location=map_location, weights_only=True)

    checkpoint_engine.load = load  # this engine only; DeepSpeed's class is left alone


def load_checkpoint(engine, checkpoint_dir: Path, world_size: int) -> dict[str, Any]:
    """Collective: restore the engine (model + optimizer) and return the trainer state; RNG is restored by caller.

    Engine files are read with ``torch.load(weights_only=True)`` plus the allow-list above, so a tampered
    checkpoint cannot run code.
    """
    state = read_trainer_state(checkpoint_dir)
    if state["world_size"] != world_size:
        raise ValueError(
            f"checkpoint {checkpoint_dir} was written by {state['world_size']} ranks but this run has {world_size}; "
            "resume with the same world size (or convert it with DeepSpeed's ds_to_universal first)"
        )
    _load_weights_only(engine.checkpoint_engine)
    load_path, _ = engine.load_checkpoint(
        str(Path(checkpoint_dir) / DEEPSPEED_DIR), tag=state["deepspeed_tag"], load_lr_scheduler_states=False
    )
    if load_path is None:
        raise RuntimeError(f"DeepSpeed found no engine state under {checkpoint_dir}/{DEEPSPEED_DIR}")
    return state


def init_weights(model: torch.nn.Module, source: Path, image_size: int) -> list[str]:
    """Copy weights (same name and shape) from a model.safetensors folder or an official .npz into ``model``.

    Position embeddings are resized to ``image_size`` by the loader. Returns the names left at their
    initialisation (e.g. a head with another class count), which the caller reports.
    """
    from pretrain.weights import load_npz, load_pretrained

    src = load_npz(source, image_size=image_size) if source.suffix == ".npz" else load_pretrained(source, image_size)
    theirs = src.state_dict()
    mine = model.state_dict()
    usable = {k: v for k, v in theirs.items() if k in mine and mine[k].shape == v.shape}
    model.load_state_dict(usable, strict=False)
    skipped = sorted(set(mine) - set(usable))
    if skipped:
        warnings.warn(f"init_from {source}: kept the fresh initialisation for {skipped}", stacklevel=2)
    return skipped


def _jsonable(obj: Any) -> Any:
    """Stream states may hold numpy scalars/arrays or tuples; JSON keeps them as plain numbers and lists."""
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, np.generic):
        return obj.item()
    return obj
