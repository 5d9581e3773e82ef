"""Bad input as one ValueError naming the path or field, the value and the fix; ``main()`` prints it and exits 2.
Ctrl-C as one line saying what is kept, exit 130. Every package may import it (docs/design.md, "Packages, what each
owns, and the import rules").
"""

from __future__ import annotations

import multiprocessing
import signal
import sys
import tempfile
import threading
from pathlib import Path

from data_pipeline.paths import is_remote

INTERRUPTED = 130  # the shell's status for a command stopped by Ctrl-C (128 + SIGINT)


def to_stderr(line: str) -> None:
    """``line`` and its newline in one write: stderr is unbuffered, and print's two writes (the text, then the
    newline) from ranks sharing one terminal or log interleave (``...move this one awaypython -m ...``)."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def fail(prog: str, message: object, status: int = 2) -> int:
    """Print bad input's one line as argparse prints its own errors, ``<prog>: error: <message>`` (``prog`` is
    ``python -m <module>``, the parser's); the exit status (2, as argparse's)."""
    to_stderr(f"{prog}: error: {message}")
    return status


def interrupted(prog: str, kept: str) -> int:
    """Print Ctrl-C's one line, ``prog`` (``python -m <module>``), what is ``kept`` and how to go on, instead of a
    traceback; the exit status."""
    start = "\n" if sys.stderr.isatty() else ""  # off the terminal's ^C and any progress bar
    to_stderr(f"{start}{prog}: interrupted; {kept}")
    return INTERRUPTED


def ignore_interrupt() -> None:
    """Pool initializer: Ctrl-C reaches the whole process group; a worker ignores it and its parent stops the pool
    (``terminate``), so there is one line, not a traceback per worker, nor a pool waiting for a task that died."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def spawned_pool(processes: int):
    """A "spawn" Pool whose workers ignore Ctrl-C from their first instruction: they inherit SIGINT ignored across
    exec, where `ignore_interrupt` runs only after their interpreter started (a Ctrl-C before: "Fatal Python error:
    init_import_site"). The parent ignores it only while it starts them."""
    context = multiprocessing.get_context("spawn")
    if threading.current_thread() is not threading.main_thread():  # signal.signal is the main thread's
        return context.Pool(processes, ignore_interrupt)
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        return context.Pool(processes, ignore_interrupt)
    finally:
        signal.signal(signal.SIGINT, previous)


def positive(value: float, name: str) -> None:
    if not value > 0:
        raise ValueError(f"{name}={value} must be > 0")


def at_least(value: float, low: float, name: str) -> None:
    if not value >= low:
        raise ValueError(f"{name}={value} must be >= {low}")


def local_path(path: str | Path, option: str) -> Path:
    """``path`` as a ``Path`` to write to; ValueError naming ``option`` for a URL."""
    if is_remote(str(path)):
        raise ValueError(
            f"{option} {path}: object storage; this command writes to a filesystem path: write to a local or shared "
            "folder, then copy it to the bucket (e.g. `gcloud storage cp -r` or `aws s3 sync`)"
        )
    return Path(path)


def file_in_the_way(path: Path) -> Path | None:
    """The file at ``path``, or at the nearest of its parents that exists, where a folder must go; else None."""
    existing = next((p for p in (path, *path.parents) if p.exists()), None)
    return existing if existing is not None and not existing.is_dir() else None


def _folder_problem(folder: Path) -> str | None:
    if folder.exists() and not folder.is_dir():
        return f"{folder} is a file, not a folder"
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        return f"cannot create the folder {folder} ({error.strerror or error})"
    return None


def output_folder(path: str | Path, option: str) -> Path:
    """Create the output folder ``path``; ValueError naming ``option`` when it cannot be one."""
    path = local_path(path, option)
    problem = _folder_problem(path)
    if problem:
        raise ValueError(f"{option} {path}: {problem}; choose a writable folder path (it is created if absent)")
    return path


def output_file(path: str | Path, option: str) -> Path:
    """Check that the file ``path`` can be written (its folder is created, a scratch file made there and removed),
    before the work whose end writes it; ValueError naming ``option``."""
    path = local_path(path, option)
    problem = f"{path} is a folder" if path.is_dir() else _folder_problem(path.parent)
    if problem is None:
        try:
            tempfile.NamedTemporaryFile(dir=path.parent, prefix=f"{path.name}.").close()
        except OSError as error:
            problem = f"cannot write in {path.parent} ({error.strerror or error})"
    if problem:
        raise ValueError(f"{option} {path}: {problem}; give the path of a file in a writable folder")
    return path
