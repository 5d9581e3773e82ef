"""Making the folder or file a `python -m` command writes, before any work is spent on it.

Both helpers raise one ValueError naming the path, the option and the fix; each ``main()`` prints it as
``error: ...`` and exits 2. Every package may import data_pipeline (docs/design.md, "Packages, what each owns, and
the import rules"); nothing heavy is imported, so quick commands stay quick.
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
    """Create the output folder ``path``; ValueError naming ``option`` (e.g. ``--out``) when it cannot be one."""
    path = Path(path)
    problem = _folder_problem(path)
    if problem:
        raise ValueError(f"{option} {path}: {problem}; choose a writable folder path (it is created if absent)")
    return path


def output_file(path: str | Path, option: str) -> Path:
    """Check that the file ``path`` can be written later (its folder is created now); ValueError naming ``option``."""
    path = Path(path)
    problem = f"{path} is a folder" if path.is_dir() else _folder_problem(path.parent)
    if problem:
        raise ValueError(f"{option} {path}: {problem}; give the path of a file in a writable folder")
    return path
