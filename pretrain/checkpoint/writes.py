"""One rank's writes of one checkpoint save (`SaveAttempt`): each file's size and checksum, and the first failure.

A failed write is recorded, not raised: a rank raising out of a collective DeepSpeed save would leave the others
waiting until the process-group timeout. The ranks exchange attempts; if any failed, all raise `CheckpointSaveError`.
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

# A full disk or failing storage, as Python, torch's writers and safetensors raise it
WRITE_ERRORS = (OSError, RuntimeError, SafetensorError)
_NO_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
_NO_SPACE_TEXT = ("no space left", "disk quota exceeded", "storagefull", "os error 28")
_ALMOST_FULL_BYTES = 1 << 20


class CheckpointSaveError(ValueError):
    """A save that failed on some rank; its staging folder is removed. A ValueError: the user fixes it (the CLI exits
    2). Not ``retryable``: a restarted worker group would fail again, so under Ray the job fails at once."""

    retryable = False


@dataclass(frozen=True)
class WriteFailure:
    """A rank's first failed write."""

    rank: int
    path: str
    error: str  # "OSError: [Errno 28] No space left on device"
    no_space: bool  # the disk (or the quota) is full


@dataclass
class SaveAttempt:
    """One rank's part of a save into ``staging``: ``written`` (relative path → size, checksum), ``failure``."""

    staging: Path
    rank: int
    written: dict[str, tuple[int, str]] = field(default_factory=dict)
    failure: WriteFailure | None = None

    def write(self, path: Path, action: Callable[[], object], record: bool = True) -> None:
        """Run ``action`` (writing ``path``) unless a write failed; record its failure or (``record``) the file's
        size and checksum, read back while in the page cache."""
        if self.failure is not None:
            return
        try:
            action()
            if record and path.is_file():
                self.written[path.relative_to(self.staging).as_posix()] = checksums.entry(path)
        except WRITE_ERRORS as error:
            # torch's "unexpected pos" has no errno: an (almost) full disk is the tell
            free = _free_bytes(path)
            no_space = _says_no_space(error) or (free is not None and free < _ALMOST_FULL_BYTES)
            self.failure = WriteFailure(self.rank, str(path), f"{type(error).__name__}: {error}", no_space)

    @contextlib.contextmanager
    def routing(self, engine) -> Iterator[None]:
        """Route the engine's writes (state files, folders, recovery scripts) through `write`."""
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
        """Rank 0, last: record the staging folder's files no rank recorded."""
        for path in sorted(self.staging.rglob("*")):
            name = path.relative_to(self.staging).as_posix()
            if path.is_file() and name not in self.written and name != run_folder.CHECKSUMS:
                self.write(path, lambda: None)


def _says_no_space(error: BaseException) -> bool:
    """Whether ``error`` or its causes say so."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in _NO_SPACE_ERRNOS:
            return True
        if any(text in str(seen).lower() for text in _NO_SPACE_TEXT):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def folder_bytes(folder: Path) -> int:
    """A checkpoint's saved bytes: ``checksums.json``'s total, else all files but ``evals/`` and ``universal/``."""
    with contextlib.suppress(ValueError):  # a damaged record: count the files
        if (entries := checksums.expected(folder)) is not None:
            return sum(size for size, _ in entries.values())
    later = (folder / "evals", folder / "universal")
    return sum(
        p.stat().st_size for p in folder.rglob("*") if p.is_file() and not any(p.is_relative_to(d) for d in later)
    )


def failure_message(failure: WriteFailure, staging: Path, written_bytes: int) -> str:
    """One line: the failed save, where and why, space needed and free, what is kept, the fix. ``written_bytes``:
    what the removed staging folder held."""
    run_dir = staging.parent.parent
    final = staging.name.removesuffix(run_folder.STAGING_SUFFIX)
    newest = run_folder.latest_checkpoint(run_dir)
    if newest is not None:
        need = f"a checkpoint needs about {_mb(folder_bytes(newest))} (the size of {newest.name})"
        kept = f"the earlier checkpoints are intact (newest: {newest.name})"
    else:
        need = f"a checkpoint needs more than {_mb(written_bytes)} (what was written before the failure)"
        kept = "no earlier checkpoint exists"
    said = f"writing {failure.path} (rank {failure.rank}: {failure.error})"
    if not failure.no_space:  # permissions, an I/O error, a mount gone: more space would not help
        return (
            f"checkpoint {final} was not saved: a write failed {said}; its partial files were removed and {kept}; "
            f"make {staging.parent} writable again (its permissions, its mount)"
        )
    free = _free_bytes(staging.parent)
    space = f"{staging.parent} has {_mb(free)} free" if free is not None else f"{staging.parent} is not readable"
    return (
        f"checkpoint {final} was not saved: no space left on device {said}; {need} and {space} now; its partial "
        f"files were removed and {kept}; free space (or lower checkpoint.keep_last)"
    )


def _free_bytes(path: Path) -> int | None:
    """At ``path``'s nearest existing parent; None if unreadable."""
    for candidate in (path, *path.parents):
        try:
            if candidate.exists():
                return shutil.disk_usage(candidate).free
        except OSError:
            return None
    return None


def _mb(size: int) -> str:
    return f"{size / 1e6:.1f} MB"
