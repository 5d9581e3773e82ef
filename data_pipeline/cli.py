"""What the `python -m` entry points of every package share: making the folder or file a command writes.

Both fail with one ValueError that names the path, the option and the fix; each ``main()`` prints it as
``error: ...`` and exits 2. It lives here because every package may import data_pipeline (docs/interfaces.md),
and it imports nothing heavy so that quick commands (``cluster.jobs``, ``tracking.ui``) stay quick. Reading a
user's YAML file is `pretrain.config.typed_yaml`'s.
"""

from __future__ import annotations

from pathlib import Path


def _folder_problem(folder: Path) -> str | None:
    """Create ``folder`` (and its parents); what stands in the way, or None."""
    if folder.exists() and not folder.is_dir():
        return f"{folder} is a file, not a folder"
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as error:  # a parent that is a file, no permission, a read-only filesystem
        return f"cannot create the folder {folder} ({error.strerror or error})"
    return None


def output_folder(path: str | Path, option: str) -> Path:
    """Create the folder ``path`` for a command's output before any work is spent on it.

    ValueError naming ``option`` (e.g. ``--out``) when it cannot be a folder: a file is in the way, no permission.
    """
    path = Path(path)
    problem = _folder_problem(path)
    if problem:
        raise ValueError(f"{option} {path}: {problem}; choose a writable folder path (it is created if absent)")
    return path


def output_file(path: str | Path, option: str) -> Path:
    """Check that a command can write the file ``path`` at its end (creating its folder now), so that a bad path
    fails before the work, not after it. ValueError naming ``option`` otherwise."""
    path = Path(path)
    problem = f"{path} is a folder" if path.is_dir() else _folder_problem(path.parent)
    if problem:
        raise ValueError(f"{option} {path}: {problem}; give the path of a file in a writable folder")
    return path
