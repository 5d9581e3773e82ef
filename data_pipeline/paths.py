"""The project root, path resolution for recipes and profiles, the remote-URL rule, the user's cache folder and
whole-file replacement.

Relative paths in recipes, profiles and suites are taken from the project root, not the working directory, so a Ray
job (in an uploaded copy of the project) and a shell in the checkout read the same files.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parent.parent
RECIPE_DIR = PROJECT_ROOT / "configs"  # experiment recipes (pretrain.config.train_config)
SUITES_DIR = RECIPE_DIR / "evals"  # eval suites (evals.suites)


def is_remote(url: str | Path) -> bool:
    """``s3://``, ``gs://``, ``https://`` … are remote (read through fsspec); ``file://`` and plain paths are local."""
    url = str(url)
    return "://" in url and not url.startswith("file://")


def cache_dir() -> Path:
    """This user's vitscale cache (measured rates, fetched weights): ``$VITSCALE_CACHE``, else ~/.cache/vitscale."""
    return Path(os.environ.get("VITSCALE_CACHE") or Path.home() / ".cache" / "vitscale")


def resolve_path(path: str | Path) -> Path:
    """A local path (``file://`` stripped, ``~`` expanded), relative paths taken from the project root."""
    text = str(path)
    p = Path(text[len("file://") :] if text.startswith("file://") else text).expanduser()
    return p if p.is_absolute() else PROJECT_ROOT / p


def resolve_location(url: str | Path) -> str:
    """What readers open: a remote URL as it is, a local path resolved (see `resolve_path`)."""
    return str(url) if is_remote(url) else str(resolve_path(url))


def replace_atomically(path: Path, write: Callable[[Path], object]) -> None:
    """Replace ``path`` whole or not at all: ``write(tmp)`` fills a per-process file beside it, then one rename.

    A reader sees the old file or the new one, never half. On an error the temporary file is removed and re-raised."""
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_text_atomically(path: Path, text: str) -> None:
    """`replace_atomically` with ``text`` as the new content."""
    replace_atomically(path, lambda tmp: tmp.write_text(text))
