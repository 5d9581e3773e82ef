"""The process group of a training rank: joining it, the CPU build lock DeepSpeed can leave behind, and ending it.

`init_distributed` joins (or creates) the group from RANK / WORLD_SIZE / LOCAL_RANK, the same under torchrun, the
DeepSpeed launcher and Ray Train (which creates the group itself); gloo on CPU, nccl on CUDA. `finish_distributed`
tears every group down so that a finished rank exits normally with no gloo thread left, and `exit_rank` ends the
process (docs/reference.md §7, "Ending a rank").
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
    """``cuda`` where torch sees a GPU, unless ``DS_ACCELERATOR=cpu`` asks DeepSpeed for the CPU: then the model, its
    optimizer and the process group (gloo) stay on the CPU although a GPU is there (docs/reference.md §7, §8)."""
    if os.environ.get("DS_ACCELERATOR") == "cpu":
        return "cpu"
    return "cuda" if torch.cuda.is_available() else "cpu"


# DeepSpeed modules a training rank imports without using them: the ZeRO optimizers import DeepSpeed's Muon
# optimizer only to ask `isinstance(optimizer, MuonWithAuxAdam)` (and bind `muon_update` where Muon groups would be
# updated), and that module `torch.compile`s two functions at import, which imports Inductor.
MUON_MODULES = ("deepspeed.runtime.zero.muon.muon_optimizer", "deepspeed.runtime.zero.muon.original_muon")
MUON_NAMES = ("MuonWithAuxAdam", "muon_update", "adam_update")


def import_deepspeed() -> types.ModuleType:
    """``import deepspeed`` for a training process, without two imports it would make for DeepSpeed features this
    project never runs (docs/performance.md, "A rank's start"): about 2 CPU-seconds of every rank's start.

    - DeepSpeed's autotuner imports MLflow when it can (``deepspeed/autotuning/autotuner.py``), at ``import
      deepspeed``; the autotuner is never run here. MLflow is hidden while DeepSpeed is imported, so that its
      autotuner finds none; the rank that logs imports MLflow itself, when it makes its `tracking.tracker.Tracker`.
    - DeepSpeed's Muon modules (`MUON_MODULES`) stand for a light module whose `MuonWithAuxAdam` is a class nothing
      instantiates, and whose updates refuse to run: this project's optimizer is always torch's AdamW
      (`pretrain.config.optim.build_optimizer`), so DeepSpeed's checks answer as with the real module, and no Muon
      update is ever called. A process that imported the real modules first keeps them.
    Idempotent; ``DS_ACCELERATOR`` must be set before the first call, as before any import of DeepSpeed."""
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
        if os.environ.get("LOCAL_RANK", "0") == "0":  # one process per machine, or two could remove a live lock
            remove_stale_build_lock(SHM_COMM_OP)
    deepspeed = import_deepspeed()  # DS_ACCELERATOR must be set before its first import

    if not dist.is_initialized():
        _import_world_defaults()  # before the default group exists, or they keep it alive for good
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

    Its ten collectives take ``group=group.WORLD`` as a default argument (torch/distributed/nn/functional.py), which
    Python evaluates once, at import. torch imports the module lazily, through `torch._dynamo`, at the first
    optimizer's `add_param_group`, i.e. after the default group is created: the functions' ``__defaults__`` then hold
    that group for the rest of the process, and destroying it (which for gloo only removes it from torch's maps) leaves
    its C++ object, two ``pt_gloo_runloop`` threads and a ``gloo_tcp_loop`` thread running until the interpreter is torn
    down (docs/reference.md §7). Imported first, the defaults are None: the default group at call time."""
    import torch.distributed.nn.functional  # noqa: F401


def _release_destroyed_groups() -> None:
    """Drop the destroyed groups that `torch.distributed.nn.functional`'s default arguments still hold, so that the
    last reference goes and the groups' gloo threads are joined now, not during interpreter teardown.

    They hold the default group when the module was imported after it was created: by a caller that made the group
    itself (`init_distributed` imports the module first, `_import_world_defaults`). Called once every group is
    destroyed; None is what the defaults are when the module is imported with no group."""
    functional = sys.modules.get("torch.distributed.nn.functional")
    if functional is None:
        return
    for function in vars(functional).values():
        defaults = getattr(function, "__defaults__", None) or ()
        if any(isinstance(d, dist.ProcessGroup) for d in defaults):
            function.__defaults__ = tuple(None if isinstance(d, dist.ProcessGroup) else d for d in defaults)


# DeepSpeed's CPU communication op, JIT-built by torch's extension builder on the first CPU start (docs/reference.md §7)
SHM_COMM_OP = "deepspeed_shm_comm"
STALE_LOCK_S = 900  # the op builds in about a minute here; no live build holds its lock this long
ORPHAN_LOCK_S = 30  # a lock no process here holds open, this old, was left by a killed one


def remove_stale_build_lock(op: str) -> Path | None:
    """Remove the build lock of torch JIT extension ``op`` if it was left by a killed process; return its path then.

    torch's builder holds ``<build dir>/lock`` open while it checks (about a second at every start) or builds the op,
    and every other process waits, silently and forever, while that file exists. A process killed in that window
    leaves the file behind, and from then on every DeepSpeed start on the machine hangs (docs/reference.md §8). Left
    behind: no process on this machine has it open and it is older than ``ORPHAN_LOCK_S`` (the builder keeps its
    descriptor open until it deletes the file), or, where that cannot be seen, older than any build takes."""
    from torch.utils.cpp_extension import _get_build_directory  # where torch puts (and locks) the op's build

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
    """Whether a process on this machine has ``path`` open (Linux /proc; processes of other users are not visible);
    None where /proc cannot tell."""
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
    """Tear the process groups down once every rank is done (a no-op when there are none).

    The barrier comes first: a rank that exits while its peer is still in a collective makes the peer's gloo threads
    abort the process. DeepSpeed's destroy also drops the groups DeepSpeed caches, which torch's alone leaves alive,
    and `_release_destroyed_groups` the references torch keeps in default arguments: when this returns, every group
    is freed and its gloo threads are joined (docs/reference.md §7).
    """
    if not dist.is_initialized():
        return
    import deepspeed.comm

    dist.barrier()
    deepspeed.comm.destroy_process_group()
    _release_destroyed_groups()


def exit_rank(code: int) -> NoReturn:
    """End a training process with ``code`` once its results are written.

    After `finish_distributed` no process group is left and no gloo thread runs, and the rank exits normally. A rank
    that leaves with a group still alive, on an error path that returns before the teardown (its peers may still be
    in a collective, so no barrier), runs the exit handlers (logging, multiprocessing, ...) and flushes the standard
    streams, then leaves with ``os._exit``: finalizing the interpreter would destroy that live gloo group during
    Python's teardown, where its threads can abort the process (docs/reference.md §7).
    """
    if dist.is_available() and dist.is_initialized():
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


def mean_over_ranks(value: torch.Tensor) -> float:
    """The mean of a scalar tensor over all ranks (a collective)."""
    value = value.detach().float().clone()
    dist.all_reduce(value)
    return value.item() / dist.get_world_size()


def broadcast(value: Any) -> Any:
    """Rank 0's ``value`` on every rank (a collective)."""
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]
