"""What the `python -m` entry points of every package share: reading a user's YAML file and making an output folder.

Both fail with one ValueError that names the file (and the line) and the fix; each ``main()`` prints it as
``error: ...`` and exits 2. It lives here because every package may import data_pipeline (docs/interfaces.md),
and it imports nothing heavy so that quick commands (``cluster.jobs``, ``evals.ui``) stay quick.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml


def parse_yaml(text: str, where: str) -> Any:
    """``yaml.safe_load(text)``; a syntax error becomes ValueError naming ``where``, the line and the column."""
    try:
        return yaml.safe_load(text)
    except yaml.MarkedYAMLError as error:
        mark = error.problem_mark or error.context_mark
        at = f", line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = error.problem or error.context or "syntax error"
        # "while parsing a flow sequence" started at an earlier line is often where the mistake is (an unclosed [).
        context = ""
        if error.context and error.context_mark is not None and error.context_mark is not mark:
            context = f" ({error.context} that starts at line {error.context_mark.line + 1})"
        raise ValueError(
            f"{where}{at}: invalid YAML: {problem}{context}; fix the syntax there (close brackets and quotes, "
            "indent nested keys, quote values that contain ': ' or start with [ { * & !)"
        ) from None
    except yaml.YAMLError as error:  # a control character (ReaderError): a position, no line mark
        position, at = getattr(error, "position", None), ""
        if isinstance(position, int):
            line = text[:position].count("\n") + 1
            at = f", line {line}"
        reason = str(error).splitlines()[0]
        raise ValueError(f"{where}{at}: invalid YAML: {reason}; remove it (plain UTF-8 text only)") from None


def read_yaml(path: str | Path, what: str) -> Any:
    """The parsed content of the YAML file ``path`` (None when empty); ``what`` names it in errors ("recipe")."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(
            f"{what} {path} is not a text file (byte {error.start} is not UTF-8); point at a YAML file"
        ) from None
    except OSError as error:
        raise ValueError(f"cannot read {what} {path}: {error.strerror or error}; give a readable YAML file") from None
    return parse_yaml(text, f"{what} {path}")


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
