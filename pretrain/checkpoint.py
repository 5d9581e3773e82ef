"""Checkpoints: save (atomically), resume, initialise from weights; the layout itself is `pretrain.run_folder`'s.

Each ``<run_dir>/checkpoints/step_XXXXXXXX/`` holds the engine state (``deepspeed/``, every rank's ZeRO partitions),
the consolidated weights (``model.safetensors`` + ``model.json``: what evals and users load), the `TrainerState`
(step, images seen, every rank's stream position and RNG states) and the resolved ``config.yaml``. It is written into
``step_XXXXXXXX.tmp``, renamed, and only then marked COMPLETE, so a crash mid-write leaves a folder without the marker
that nothing reads, and the previous checkpoint stays the newest loadable one.

Resume order (`find_start`): the newest COMPLETE checkpoint in the run folder > ``checkpoint.resume_from`` >
``checkpoint.init_from`` (weights only) > scratch.
"""

from __future__ import annotations

import base64
import importlib
import random
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from data_pipeline.paths import resolve_path
from pretrain import run_folder
from pretrain.config import TrainConfig
from pretrain.run_folder import DEEPSPEED_DIR, TrainerState
from pretrain.weights import load_npz, load_pretrained, save_pretrained


@dataclass(frozen=True)
class StartPoint:
    kind: str  # "run" (newest checkpoint of this run) | "resume_from" | "init_from" | "scratch"
    path: Path | None


def find_start(config: TrainConfig) -> StartPoint:
    """Where training starts, by the documented resume order."""
    latest = run_folder.latest_checkpoint(resolve_path(config.checkpoint.dir))
    if latest is not None:
        return StartPoint("run", latest)
    c = config.checkpoint
    if c.resume_from is not None:
        return StartPoint(
            "resume_from", run_folder.require_complete(resolve_path(c.resume_from), "checkpoint.resume_from")
        )
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
    rank = dist.get_rank() if dist.is_initialized() else 0
    run_dir = resolve_path(config.checkpoint.dir)
    tag = run_folder.step_name(step)
    tmp = run_folder.staging_dir(run_dir, step)
    if rank == 0:
        run_folder.start_staging(tmp)
    _barrier()
    engine.save_checkpoint(str(tmp / DEEPSPEED_DIR), tag=tag, client_state={"step": step})
    stream_states, rng_states = _gather(_jsonable(stream_state)), _gather(rng_state())
    _save_consolidated(engine, model, tmp, rank)
    if rank == 0:
        TrainerState(
            step=step,
            images_seen=images_seen,
            world_size=len(stream_states),
            deepspeed_tag=tag,
            stream_states=tuple(stream_states),
            rng_states=tuple(rng_states),
            metrics=metrics or {},
            saved_at=time.time(),
        ).write(tmp)
        run_folder.write_durably(tmp / run_folder.CONFIG_YAML, config.to_yaml())
        run_folder.publish(tmp)
        run_folder.prune_checkpoints(run_dir, config.checkpoint.keep_last)
    _barrier()
    return run_folder.checkpoint_dir(run_dir, step)


def _save_consolidated(engine, model: torch.nn.Module, directory: Path, rank: int) -> None:
    if engine.zero_optimization_stage() == 3:
        import deepspeed  # heavy optional external: only ZeRO-3 saves need it

        # Every rank must enter: gathering the partitioned parameters is a collective.
        with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=None):
            if rank == 0:
                save_pretrained(model, directory)
    elif rank == 0:
        save_pretrained(model, directory)


# The only non-tensor objects DeepSpeed pickles into its model/optimizer state files (ZeRO 0-3, fp32 and bf16 as
# checked here); allow-listing them lets every engine file load with torch.load(weights_only=True).
DEEPSPEED_SAFE_GLOBALS = (
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.utils.tensor_fragment.fragment_address",
)


def _load_weights_only(checkpoint_engine) -> None:
    """Make the engine's checkpoint reader refuse arbitrary pickles (DeepSpeed itself loads weights_only=False)."""
    allowed = []
    for name in DEEPSPEED_SAFE_GLOBALS:
        module, _, attr = name.rpartition(".")
        allowed.append(getattr(importlib.import_module(module), attr))

    def load(path: str, map_location=None):
        with torch.serialization.safe_globals(allowed):
            return torch.load(path, map_location=map_location, weights_only=True)

    checkpoint_engine.load = load  # this engine only; DeepSpeed's class is left alone


def load_checkpoint(engine, checkpoint_dir: Path, world_size: int) -> TrainerState:
    """Collective: restore the engine (model + optimizer) and return the trainer state; RNG is restored by caller.

    Engine files are read with ``torch.load(weights_only=True)`` plus the allow-list above, so a tampered
    checkpoint cannot run code.
    """
    state = TrainerState.read(checkpoint_dir)
    if state.world_size != world_size:
        raise ValueError(
            f"checkpoint {checkpoint_dir} was written by {state.world_size} ranks but this run has {world_size}; "
            "resume with the same world size (or convert it with DeepSpeed's ds_to_universal first)"
        )
    _load_weights_only(engine.checkpoint_engine)
    load_path, _ = engine.load_checkpoint(
        str(Path(checkpoint_dir) / DEEPSPEED_DIR), tag=state.deepspeed_tag, load_lr_scheduler_states=False
    )
    if load_path is None:
        raise RuntimeError(f"DeepSpeed found no engine state under {checkpoint_dir}/{DEEPSPEED_DIR}")
    return state


def init_weights(model: torch.nn.Module, source: Path, image_size: int) -> list[str]:
    """Copy weights (same name and shape) from a model.safetensors folder or an official .npz into ``model``.

    Position embeddings are resized to ``image_size`` by the loader. Returns the names left at their
    initialisation (e.g. a head with another class count), which the caller reports.
    """
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
