"""One rank's writes of one checkpoint save: the sizes and checksums of what it wrote (for ``checksums.json``) and the
first write that failed, so that a full disk or any other write error becomes one decision every rank agrees on.

Why a failed write is recorded rather than raised: a DeepSpeed save is collective (``engine.save_checkpoint`` holds
barriers and all-reduces). A rank that raised out of it while the others went on would leave them waiting in their
next collective until the process-group timeout (``deepspeed.timeout_minutes``, 30 by default). So every write of a
save goes through `SaveAttempt.write`, which records the first failure and skips the rank's later writes; DeepSpeed's
own writes are routed there for the length of the save (`SaveAttempt.routing`). After the writes the ranks exchange
their attempts (`pretrain.checkpointer.save_checkpoint`); if one failed, rank 0 removes the staging folder and every
rank raises the same `CheckpointSaveError`, whose message `failure_message` writes.
"""

from __future__ import annotations

import contextlib
import errno
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from safetensors import SafetensorError

from pretrain.checkpoint import checksums, run_folder

# What a write raises when the disk is full or the storage fails: OSError from Python's files (ENOSPC, EIO, EDQUOT),
# RuntimeError from torch's writers ("unexpected pos", "basic_ios::clear: iostream error", "file write failed"),
# SafetensorError from safetensors ("I/O error: No space left on device").
WRITE_ERRORS = (OSError, RuntimeError, SafetensorError)
_NO_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
_NO_SPACE_TEXT = ("no space left", "disk quota exceeded", "storagefull", "os error 28")
_ALMOST_FULL_BYTES = 1 << 20


class CheckpointSaveError(ValueError):
    """A checkpoint save that failed on some rank (a full disk, any write error). Its staging folder is removed and
    the earlier checkpoints are untouched. A ValueError, like every condition the user fixes (here: free space), so
    ``python -m pretrain.train`` reports it in one line and exits 2. Not ``retryable``: a restarted worker group would
    resume from the newest checkpoint and save into the same storage again, so under Ray the job fails at once with
    this message (`cluster.driver.watchdog.final_failure`) instead of spending ``max_failures`` restarts on it."""

    retryable = False


@dataclass(frozen=True)
class WriteFailure:
    """The first write that failed on one rank."""

    rank: int
    path: str
    error: str  # "OSError: [Errno 28] No space left on device"
    no_space: bool  # the error itself says the disk (or the quota) is full


@dataclass
class SaveAttempt:
    """One rank's part of one save into ``staging``: ``written`` (relative path → size, checksum) and ``failure``."""

    staging: Path
    rank: int
    written: dict[str, tuple[int, str]] = field(default_factory=dict)
    failure: WriteFailure | None = None

    def write(self, path: Path, action: Callable[[], object], record: bool = True) -> None:
        """Run ``action`` (which writes ``path``) unless an earlier write failed; record its failure, or the file's
        size and checksum (``record``; read back while it is in the page cache)."""
        if self.failure is not None:
            return
        try:
            action()
            if record and path.is_file():
                self.written[path.relative_to(self.staging).as_posix()] = checksums.entry(path)
        except WRITE_ERRORS as error:
            # torch's zip writer says "unexpected pos" without an errno: a disk with (almost) nothing free says more
            free = _free_bytes(path)
            no_space = _says_no_space(error) or (free is not None and free < _ALMOST_FULL_BYTES)
            self.failure = WriteFailure(self.rank, str(path), f"{type(error).__name__}: {error}", no_space)

    @contextlib.contextmanager
    def routing(self, engine) -> Iterator[None]:
        """DeepSpeed's writes during ``engine.save_checkpoint`` (its state files, its folders, its recovery scripts)
        go through `write`: this engine only, for the length of the block."""
        ce = engine.checkpoint_engine
        save, makedirs, copy = ce.save, ce.makedirs, engine._copy_recovery_script
        ce.save = lambda state_dict, path: self.write(Path(path), lambda: save(state_dict, path))
        ce.makedirs = lambda path, exist_ok=False: self.write(
            Path(path), lambda: makedirs(path, exist_ok=exist_ok), record=False
        )
        engine._copy_recovery_script = lambda path: self.write(Path(path), lambda: copy(path), record=False)
        try:
            yield
        finally:
            ce.save, ce.makedirs, engine._copy_recovery_script = save, makedirs, copy

    def record_rest(self) -> None:
        """Rank 0, last: the size and checksum of every file in the staging folder no rank recorded (the files it
        wrote itself outside DeepSpeed's state files)."""
        for path in sorted(self.staging.rglob("*")):
            name = path.relative_to(self.staging).as_posix()
            if path.is_file() and name not in self.written and name != run_folder.CHECKSUMS:
                self.write(path, lambda: None)


def _says_no_space(error: BaseException) -> bool:
    """Whether ``error`` (or what caused it) says the disk or the quota is full."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in _NO_SPACE_ERRNOS:
            return True
        if any(text in str(seen).lower() for text in _NO_SPACE_TEXT):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def folder_bytes(folder: Path) -> int:
    """The bytes of a checkpoint as its save wrote them (what ``checksums.json`` lists, else every file but the evals'
    and the universal conversion's, which come later)."""
    try:
        entries = checksums.expected(folder)
    except ValueError:
        entries = None
    if entries is not None:
        return sum(size for size, _ in entries.values())
    later = (folder / "evals", folder / "universal")
    return sum(
        p.stat().st_size for p in folder.rglob("*") if p.is_file() and not any(p.is_relative_to(d) for d in later)
    )


def failure_message(failure: WriteFailure, staging: Path, written_bytes: int) -> str:
    """The one line that says which save failed, where, why, how much space a checkpoint needs against what is free,
    that nothing else was lost, and the fix. Rank 0 writes it once the staging folder is gone (``written_bytes``: what
    it held); `pretrain.checkpointer.Checkpointer` adds what the run does next (``checkpoint.on_save_error``)."""
    run_dir = staging.parent.parent
    final = staging.name.removesuffix(run_folder.STAGING_SUFFIX)
    newest = run_folder.latest_checkpoint(run_dir)
    if newest is not None:
        need = f"a checkpoint needs about {_mb(folder_bytes(newest))} (the size of {newest.name})"
        kept = f"the earlier checkpoints are intact (newest: {newest.name})"
    else:
        need = f"a checkpoint needs more than {_mb(written_bytes)} (what was written before the failure)"
        kept = "no earlier checkpoint exists"
    free = _free_bytes(staging.parent)
    space = f"{staging.parent} has {_mb(free)} free" if free is not None else f"{staging.parent} is not readable"
    what = "no space left on device" if failure.no_space else "a write failed"
    return (
        f"checkpoint {final} was not saved: {what} writing {failure.path} (rank {failure.rank}: {failure.error}); "
        f"{need} and {space} now; its partial files were removed and {kept}; free space (or lower "
        "checkpoint.keep_last)"
    )


def _free_bytes(path: Path) -> int | None:
    """Free bytes on the filesystem of ``path`` (its nearest existing parent); None where that cannot be read."""
    for candidate in (path, *path.parents):
        try:
            if candidate.exists():
                return shutil.disk_usage(candidate).free
        except OSError:
            return None
    return None


def _mb(size: int) -> str:
    return f"{size / 1e6:.1f} MB"
