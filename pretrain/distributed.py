"""A training rank's process group: joining it (`init_distributed`), ending it (`finish_distributed`, `exit_rank`),
and the DeepSpeed import and CPU build lock that come before (`import_deepspeed`, `remove_stale_build_lock`).

The same code runs under torchrun, the DeepSpeed launcher and Ray Train (which creates the group itself).
docs/reference.md §7, "Ending a rank".
"""

from __future__ import annotations

import atexit
import os
import socket
import sys
import time
import types
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from pretrain.config.ds_config import resolve_backend
from pretrain.config.train_config import TrainConfig


@dataclass(frozen=True)
class Placement:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device


def training_device_type() -> str:
    """``cuda`` where torch sees a GPU, unless ``DS_ACCELERATOR=cpu`` puts DeepSpeed, and so everything, on the CPU
    (docs/reference.md §7)."""
    if os.environ.get("DS_ACCELERATOR") == "cpu":
        return "cpu"
    return "cuda" if torch.cuda.is_available() else "cpu"


# Imported by the ZeRO optimizers only for isinstance checks; they torch.compile at import, which imports Inductor.
MUON_MODULES = ("deepspeed.runtime.zero.muon.muon_optimizer", "deepspeed.runtime.zero.muon.original_muon")
MUON_NAMES = ("MuonWithAuxAdam", "muon_update", "adam_update")


def import_deepspeed() -> types.ModuleType:
    """``import deepspeed`` without its imports for features never run here (docs/performance.md, "A rank's start"):
    MLflow is hidden while it imports, and `MUON_MODULES` get a stand-in whose functions refuse to run (the optimizer
    is always AdamW). Idempotent; set ``DS_ACCELERATOR`` before the first call."""
    if "deepspeed" in sys.modules:
        return sys.modules["deepspeed"]
    for name in MUON_MODULES:
        sys.modules.setdefault(name, _muon_stand_in(name))
    hide_mlflow = "mlflow" not in sys.modules
    if hide_mlflow:
        sys.modules["mlflow"] = None  # type: ignore[assignment]  # `import mlflow` raises ImportError
    try:
        import deepspeed
    finally:
        if hide_mlflow:
            del sys.modules["mlflow"]
    return deepspeed


def _muon_stand_in(name: str) -> types.ModuleType:
    module = types.ModuleType(name, f"vitscale's stand-in for {name}: pretrain.distributed.import_deepspeed.")

    class MuonWithAuxAdam:  # never instantiated: isinstance() is False, as for the real class here
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            raise RuntimeError(_MUON_REFUSED)

    def refuse(*args: Any, **kwargs: Any) -> NoReturn:
        raise RuntimeError(_MUON_REFUSED)

    module.MuonWithAuxAdam = MuonWithAuxAdam  # type: ignore[attr-defined]
    module.muon_update = module.adam_update = refuse  # type: ignore[attr-defined]
    return module


_MUON_REFUSED = (
    "DeepSpeed's Muon optimizer is not loaded in a vitscale training process (pretrain.distributed.import_deepspeed): "
    "vitscale trains with torch's AdamW"
)


def init_distributed(config: TrainConfig) -> Placement:
    """Join (or create) the process group from RANK / WORLD_SIZE / LOCAL_RANK; gloo on CPU, nccl on CUDA."""
    device_type = training_device_type()
    if device_type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before deepspeed is imported anywhere
        if os.environ.get("LOCAL_RANK", "0") == "0":  # one process per machine
            remove_stale_build_lock(SHM_COMM_OP)
    deepspeed = import_deepspeed()  # DS_ACCELERATOR must be set before its first import

    if not dist.is_initialized():
        _import_world_defaults()  # before the default group exists
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
    """Import `torch.distributed.nn.functional` while no default process group exists.

    Its collectives take ``group=group.WORLD`` as a default argument, evaluated at import. Imported after the group
    exists (torch does so lazily, at the first `add_param_group`), the defaults would keep the group and its gloo
    threads alive until interpreter teardown (docs/reference.md §7). Imported first, the defaults are None."""
    import torch.distributed.nn.functional  # noqa: F401


def _release_destroyed_groups() -> None:
    """Drop destroyed groups still held by `torch.distributed.nn.functional`'s default arguments (imported after a
    caller made the group itself), so their gloo threads are joined now, not at interpreter teardown."""
    functional = sys.modules.get("torch.distributed.nn.functional")
    if functional is None:
        return
    for function in vars(functional).values():
        defaults = getattr(function, "__defaults__", None) or ()
        if any(isinstance(d, dist.ProcessGroup) for d in defaults):
            function.__defaults__ = tuple(None if isinstance(d, dist.ProcessGroup) else d for d in defaults)


# DeepSpeed's CPU communication op, JIT-built on the first CPU start (docs/reference.md §7)
SHM_COMM_OP = "deepspeed_shm_comm"
STALE_LOCK_S = 900  # longer than any build holds the lock
ORPHAN_LOCK_S = 30  # a lock no process holds open, this old, was left by a killed one


def remove_stale_build_lock(op: str) -> Path | None:
    """Remove the build lock of torch JIT extension ``op`` if a killed process left it; return its path then.

    Every process waits forever while ``<build dir>/lock`` exists, so a builder killed while holding it hangs every
    later DeepSpeed start on the machine (docs/reference.md §7). Stale: no process here has it open and it is older
    than ``ORPHAN_LOCK_S``, or, where /proc cannot tell, older than any build takes."""
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
    print(
        f"vitscale: removed {lock}, a build lock left {age / 60:.0f} min ago by a process that was killed while "
        f"building or loading {op}; DeepSpeed would have waited on it forever",
        file=sys.stderr,
    )
    return lock


def _held_open(path: Path) -> bool | None:
    """Whether a process here has ``path`` open (other users' processes are not visible); None without /proc."""
    proc = Path("/proc")
    if not (proc / "self" / "fd").is_dir():
        return None
    target = str(path.resolve())
    for fd_dir in proc.glob("[0-9]*/fd"):
        try:
            if any(os.readlink(fd) == target for fd in fd_dir.iterdir()):
                return True
        except OSError:  # the process ended, or is not ours
            continue
    return False


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def finish_distributed() -> None:
    """Tear the process groups down once every rank is done; afterwards no gloo thread runs. The barrier comes first:
    a rank exiting while a peer is in a collective makes the peer's gloo threads abort it."""
    if not dist.is_initialized():
        return
    import deepspeed.comm

    dist.barrier()
    deepspeed.comm.destroy_process_group()
    _release_destroyed_groups()


def exit_rank(code: int) -> NoReturn:
    """End a training process with ``code`` once its results are written.

    After `finish_distributed` the rank exits normally. With a group still alive (an error path; peers may be in a
    collective, so no barrier) it runs the exit handlers, flushes stdout and stderr and leaves with ``os._exit``:
    interpreter teardown would destroy the live gloo group, whose threads can abort the process.
    """
    if dist.is_available() and dist.is_initialized():
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


class Readback:
    """A scalar still on the device, read (which waits for the device) the first time ``float()`` asks, then kept as
    a Python float and its tensor let go: the loop reads the loss and grad norm only at the logging cadence and
    before a save, so a GPU step never waits for its own end (docs/performance.md, "Host to device")."""

    __slots__ = ("_tensor", "_divisor", "_value")

    def __init__(self, value: torch.Tensor | float, divisor: int = 1):
        self._tensor: torch.Tensor | float | None = value
        self._divisor = divisor
        self._value: float | None = None

    def __float__(self) -> float:
        if self._value is None:
            value = self._tensor
            assert value is not None  # dropped only once read
            self._value = (value.item() if isinstance(value, torch.Tensor) else float(value)) / self._divisor
            self._tensor = None
        return self._value

    def __repr__(self) -> str:
        return f"Readback({self._value if self._value is not None else 'on the device'})"


def mean_over_ranks(value: torch.Tensor) -> Readback:
    """The mean of a scalar tensor over all ranks (a collective), read back when asked."""
    value = value.detach().float().clone()
    dist.all_reduce(value)
    return Readback(value, dist.get_world_size())


def broadcast(value: Any) -> Any:
    """Rank 0's ``value`` on every rank (a collective)."""
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]
