"""Bad input as one ValueError: the folder or file a `python -m` command writes, made before any work is spent on
it, and a config value's range (`positive`, `at_least`, for every package's config sections).

Each ValueError names the path or field, the value and the fix; each ``main()`` prints it as ``error: ...`` and
exits 2. Every package may import data_pipeline (docs/design.md, "Packages, what each owns, and
the import rules"); nothing heavy is imported, so quick commands stay quick.
"""

from __future__ import annotations

from pathlib import Path

from data_pipeline.paths import is_remote


def positive(value: float, name: str) -> None:
    """A config value that must be > 0 (NaN is not): ValueError ``name=value must be > 0``."""
    if not value > 0:
        raise ValueError(f"{name}={value} must be > 0")


def at_least(value: float, low: float, name: str) -> None:
    """A config value that must be >= ``low`` (NaN is not): ValueError ``name=value must be >= low``."""
    if not value >= low:
        raise ValueError(f"{name}={value} must be >= {low}")


def local_path(path: str | Path, option: str) -> Path:
    """``path`` as a ``Path`` for a command to write to; ValueError naming ``option`` for a URL, refused before
    anything is created (``Path`` would make the local folder ``gs:/bucket`` of ``gs://bucket``)."""
    if is_remote(str(path)):
        raise ValueError(
            f"{option} {path}: object storage; this command writes to a filesystem path: write to a local or shared "
            "folder, then copy it to the bucket (e.g. `gcloud storage cp -r` or `aws s3 sync`)"
        )
    return Path(path)


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
    path = local_path(path, option)
    problem = _folder_problem(path)
    if problem:
        raise ValueError(f"{option} {path}: {problem}; choose a writable folder path (it is created if absent)")
    return path


def output_file(path: str | Path, option: str) -> Path:
    """Check that the file ``path`` can be written later (its folder is created now); ValueError naming ``option``."""
    path = local_path(path, option)
    problem = f"{path} is a folder" if path.is_dir() else _folder_problem(path.parent)
    if problem:
        raise ValueError(f"{option} {path}: {problem}; give the path of a file in a writable folder")
    return path
