"""The project root (relative paths start there, for a Ray job and a shell alike), the remote-URL rule and its
clients' quiet, the user's cache folder, whole-file replacement and names made safe for folders.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parent.parent
RECIPE_DIR = PROJECT_ROOT / "configs"  # experiment recipes (pretrain.config.train_config)
SUITES_DIR = RECIPE_DIR / "evals"  # eval suites (evals.suites)


def safe_name(text: str, fill: str = "-") -> str:
    """``text`` with each run of characters other than letters, digits, '.', '_' and '-' as ``fill``, none at the
    ends and no leading '.' (never '..', the folder above): a folder's, a run's or a profile's name
    (cluster.profiles.SAFE_NAME); "" when nothing is left."""
    return re.sub(r"[^A-Za-z0-9._-]+", fill, text).lstrip(fill + ".").rstrip(fill)


def is_remote(url: str | Path) -> bool:
    """``s3://``, ``gs://``, ``https://`` … are remote; ``file://`` and plain paths are local."""
    url = str(url)
    return "://" in url and not url.startswith("file://")


STORE_LOGGERS = ("gcsfs", "s3fs", "botocore", "aiobotocore")  # they log each retry, with a traceback


class _QuietStores:
    """The store clients' loggers at CRITICAL while any remote read runs: its caller's one error says what failed."""

    def __init__(self) -> None:
        self.reads, self.lock = 0, threading.Lock()
        self.levels: dict[str, int] = {}

    def enter(self) -> None:
        with self.lock:
            self.reads += 1
            if self.reads == 1:
                self.levels = {name: logging.getLogger(name).level for name in STORE_LOGGERS}
                for name in STORE_LOGGERS:
                    logging.getLogger(name).setLevel(logging.CRITICAL)

    def leave(self) -> None:
        with self.lock:
            self.reads -= 1
            if self.reads == 0:
                for name, level in self.levels.items():
                    logging.getLogger(name).setLevel(level)


QUIET_STORES = _QuietStores()


@contextlib.contextmanager
def quiet_stores() -> Iterator[None]:
    QUIET_STORES.enter()
    try:
        yield
    finally:
        QUIET_STORES.leave()


def cache_dir() -> Path:
    """``$VITSCALE_CACHE``, else ~/.cache/vitscale."""
    return Path(os.environ.get("VITSCALE_CACHE") or Path.home() / ".cache" / "vitscale")


def command_line_path(path: str | Path) -> Path:
    """A local path as a command line gives it: ``file://`` stripped, ``~`` expanded, relative to the current
    directory (`resolve_path` takes a recipe's from the project root)."""
    return Path(str(path).removeprefix("file://")).expanduser()


def resolve_path(path: str | Path) -> Path:
    """A local path (``file://`` stripped, ``~`` expanded), relative paths taken from the project root."""
    text = str(path)
    p = Path(text[len("file://") :] if text.startswith("file://") else text).expanduser()
    return p if p.is_absolute() else PROJECT_ROOT / p


def resolve_location(url: str | Path) -> str:
    return str(url) if is_remote(url) else str(resolve_path(url))


def replace_atomically(path: Path, write: Callable[[Path], object]) -> None:
    """Replace ``path`` whole or not at all: ``write(tmp)`` fills a file beside it, then one rename."""
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_text_atomically(path: Path, text: str) -> None:
    replace_atomically(path, lambda tmp: tmp.write_text(text))
