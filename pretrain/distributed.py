"""A training rank's process group: joining it, ending it (docs/reference.md §7, "Ending a rank"), and before it
the DeepSpeed import."""

from __future__ import annotations

import atexit
import os
import socket
import sys
import time
import types
import warnings
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from data_pipeline.cli import to_stderr
from pretrain.config.ds_config import resolve_backend
from pretrain.config.train_config import TrainConfig


@dataclass(frozen=True)
class Placement:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device


def training_device_type() -> str:
    """``cuda`` where torch sees a GPU, unless ``DS_ACCELERATOR=cpu`` (docs/reference.md §7)."""
    return "cpu" if os.environ.get("DS_ACCELERATOR") == "cpu" or not torch.cuda.is_available() else "cuda"


# imported by the ZeRO optimizers for isinstance checks; they import Inductor
MUON_MODULES = ("deepspeed.runtime.zero.muon.muon_optimizer", "deepspeed.runtime.zero.muon.original_muon")
MUON_NAMES = ("MuonWithAuxAdam", "muon_update", "adam_update")


# ZeRO's all-gather calls a torch function torch 2.13 deprecates: a FutureWarning from every rank of a world size > 1,
# about DeepSpeed's code, that no user can act on.
DEEPSPEEDS_DEPRECATED_CALL = r"`torch\.distributed\.all_gather_into_tensor` is deprecated"


def import_deepspeed() -> types.ModuleType:
    """``import deepspeed`` without MLflow or `MUON_MODULES` (docs/performance.md, "A rank's start")."""
    warnings.filterwarnings("ignore", message=DEEPSPEEDS_DEPRECATED_CALL, category=FutureWarning)
    if "deepspeed" in sys.modules:
        return sys.modules["deepspeed"]
    for name in MUON_MODULES:
        sys.modules.setdefault(name, _muon_stand_in(name))
    hide_mlflow = "mlflow" not in sys.modules
    if hide_mlflow:
        sys.modules["mlflow"] = None  # type: ignore[assignment]
    try:
        import deepspeed
    finally:
        if hide_mlflow:
            del sys.modules["mlflow"]
    return deepspeed


def _muon_stand_in(name: str) -> types.ModuleType:
    module = types.ModuleType(name, f"vitscale's stand-in for {name}: pretrain.distributed.import_deepspeed.")

    def refuse(*args: Any, **kwargs: Any) -> NoReturn:
        raise RuntimeError(_MUON_REFUSED)

    class MuonWithAuxAdam:  # isinstance() is False, as for the real class here
        __init__ = refuse

    module.MuonWithAuxAdam = MuonWithAuxAdam  # type: ignore[attr-defined]
    module.muon_update = module.adam_update = refuse  # type: ignore[attr-defined]
    return module


_MUON_REFUSED = (
    "DeepSpeed's Muon optimizer is not loaded in a vitscale training process (pretrain.distributed.import_deepspeed): "
    "vitscale trains with torch's AdamW"
)


def init_distributed(config: TrainConfig) -> Placement:
    """Join (or create) the process group from RANK / WORLD_SIZE / LOCAL_RANK."""
    device_type = training_device_type()
    if device_type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        if os.environ.get("LOCAL_RANK", "0") == "0":  # one process per machine
            remove_stale_build_lock(SHM_COMM_OP)
    deepspeed = import_deepspeed()

    if not dist.is_initialized():
        _import_world_defaults()
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        os.environ.setdefault("LOCAL_RANK", "0")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        backend = resolve_backend(config.deepspeed, device_type)
        deepspeed.init_distributed(
            dist_backend=backend, timeout=timedelta(minutes=config.deepspeed.timeout_minutes), auto_mpi_discovery=False
        )
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if device_type == "cuda" else torch.device("cpu")
    if device_type == "cuda":
        torch.cuda.set_device(device)
    return Placement(dist.get_rank(), dist.get_world_size(), local_rank, device)


def _import_world_defaults() -> None:
    """Import it while no default group exists: its default arguments would hold the group (docs/reference.md §7)."""
    import torch.distributed.nn.functional  # noqa: F401


def _release_destroyed_groups() -> None:
    """Drop destroyed groups held as default arguments, to join their threads now."""
    functional = sys.modules.get("torch.distributed.nn.functional")
    if functional is None:
        return
    for function in vars(functional).values():
        defaults = getattr(function, "__defaults__", None) or ()
        if any(isinstance(d, dist.ProcessGroup) for d in defaults):
            function.__defaults__ = tuple(None if isinstance(d, dist.ProcessGroup) else d for d in defaults)


SHM_COMM_OP = "deepspeed_shm_comm"  # DeepSpeed's CPU communication op, JIT-built
STALE_LOCK_S = 900  # longer than any build holds the lock
ORPHAN_LOCK_S = 30  # a lock no process holds open, this old, was left by a killed one


def remove_stale_build_lock(op: str) -> Path | None:
    """Remove the lock of JIT extension ``op`` if a killed process left it; its path then (docs/reference.md §7)."""
    from torch.utils.cpp_extension import _get_build_directory

    lock = Path(_get_build_directory(op, verbose=False)) / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return None
    held = _held_open(lock)
    if not (age > STALE_LOCK_S or (held is False and age > ORPHAN_LOCK_S)):
        return None
    lock.unlink(missing_ok=True)
    to_stderr(
        f"vitscale: removed {lock}, a build lock left {age / 60:.0f} min ago by a process that was killed while "
        f"building or loading {op}; DeepSpeed would have waited on it forever"
    )
    return lock


def _held_open(path: Path) -> bool | None:
    """Whether a process of ours has ``path`` open; None without /proc."""
    proc = Path("/proc")
    if not (proc / "self" / "fd").is_dir():
        return None
    target = str(path.resolve())
    for fd_dir in proc.glob("[0-9]*/fd"):
        try:
            if any(os.readlink(fd) == target for fd in fd_dir.iterdir()):
                return True
        except OSError:  # ended, or not ours
            continue
    return False


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def finish_distributed() -> None:
    """Tear the process groups down once every rank is done (a barrier first); afterwards no gloo thread runs."""
    if not dist.is_initialized():
        return
    import deepspeed.comm

    dist.barrier()
    deepspeed.comm.destroy_process_group()
    _release_destroyed_groups()


def exit_rank(code: int) -> NoReturn:
    """End a training process with ``code``; with a group alive, by ``os._exit`` (its teardown can abort)."""
    if dist.is_available() and dist.is_initialized():
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


class Readback:
    """A device scalar, read at the first ``float()`` (docs/performance.md, "Host to device")."""

    __slots__ = ("_tensor", "_divisor", "_value")

    def __init__(self, value: torch.Tensor | float, divisor: int = 1):
        self._tensor: torch.Tensor | float | None = value
        self._divisor = divisor
        self._value: float | None = None

    def __float__(self) -> float:
        if self._value is None:
            value = self._tensor
            assert value is not None
            self._value = (value.item() if isinstance(value, torch.Tensor) else float(value)) / self._divisor
            self._tensor = None
        return self._value

    def __repr__(self) -> str:
        return f"Readback({self._value if self._value is not None else 'on the device'})"


def mean_over_ranks(value: torch.Tensor) -> Readback:
    """Collective: the mean of a scalar tensor over all ranks."""
    value = value.detach().float().clone()
    dist.all_reduce(value)
    return Readback(value, dist.get_world_size())


def broadcast(value: Any) -> Any:
    """Collective: rank 0's ``value``."""
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]
