"""Loading DeepSpeed's engine files with `torch.load(weights_only=True)`, its few pickled objects allow-listed."""

from __future__ import annotations

import importlib
import pickle
from pathlib import Path

import torch

# The only non-tensor objects in DeepSpeed's state files (ZeRO 0-3, fp32 and bf16)
DEEPSPEED_SAFE_GLOBALS = (
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.utils.tensor_fragment.fragment_address",
)


def allowed_globals() -> list:
    return [getattr(importlib.import_module(m), a) for m, _, a in (n.rpartition(".") for n in DEEPSPEED_SAFE_GLOBALS)]


def _load(path, allowed: list, map_location=None):
    """``torch.load`` weights-only; a file it cannot read is a ValueError naming it."""
    try:
        with torch.serialization.safe_globals(allowed):
            return torch.load(path, map_location=map_location, weights_only=True)
    except torch.OutOfMemoryError:
        raise
    # A checkpoint without checksums.json reaches here unchecked: a cut or foreign file is bad input, not a bug. torch
    # reads a cut file as RuntimeError, or as OSError (EINVAL) when it is under the zip reader's 64 KiB look-back.
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError) as error:
        reason = str(error).strip().split("\n")[0].split(". ")[0] or type(error).__name__
        raise ValueError(
            f"{path} cannot be loaded ({reason}): resume from another checkpoint (checkpoint.resume_from, "
            "`python -m pretrain.checkpoint verify <run folder>` lists them) or move this one away"
        ) from None


def load_weights_only(checkpoint_engine) -> None:
    """Make the engine's reader refuse arbitrary pickles (DeepSpeed loads weights_only=False)."""
    allowed = allowed_globals()

    def load(path: str, map_location=None):
        return _load(path, allowed, map_location)

    checkpoint_engine.load = load  # this engine only; DeepSpeed's class is left alone


def check_weights_only(folder: Path) -> None:
    """Open every engine file under ``folder`` weights-only, before DeepSpeed's universal-checkpoint code unpickles
    them unguarded; ValueError naming a file that fails."""
    allowed = allowed_globals()
    for path in sorted(folder.rglob("*.pt")):
        _load(path, allowed, map_location="cpu")
