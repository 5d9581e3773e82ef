"""What a weights source is: the one rule that loading, export and evals share (no torch here).

A source is an official `.npz`, a checkpoint, a run folder or its `checkpoints/` (the newest COMPLETE checkpoint),
a `save_pretrained` or HF folder, or one file of such a folder. A checkpoint is used only COMPLETE and intact.

A source in object storage (``s3://``, ``gs://``: fsspec URLs) is copied to ``$VITSCALE_CACHE/weights/`` first
(`fetch`), with only what loading reads: the files directly in the checkpoint or weights folder, never a
checkpoint's `deepspeed/` optimizer state (several times the weights). A copy is named by the listing it was made
from (names, sizes, modification times), so the same remote files are fetched once.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import fsspec

from data_pipeline.paths import cache_dir, is_remote
from pretrain.checkpoint import checksums, run_folder
from pretrain.checkpoint.run_folder import CHECKPOINTS, COMPLETE, CONFIG_FILE, WEIGHTS_FILE

HF_CONFIG = "config.json"  # transformers' config file, beside its model.safetensors
FOLDER_FILES = (WEIGHTS_FILE, CONFIG_FILE, HF_CONFIG)  # a path to one of these stands for its folder
FETCHED = ".fetched"  # written last into a complete copy of a remote source


class DamagedCheckpointError(ValueError):
    """A COMPLETE checkpoint whose weights no longer match the checksums written at save."""


def resolve(source: str | Path) -> Path:
    """`locate`, and DamagedCheckpointError for a COMPLETE checkpoint whose weights fail their checksums."""
    path = locate(source)
    if run_folder.is_complete(path):
        verdict = checksums.verify(path, only=checksums.WEIGHT_FILES)
        if not verdict.ok:
            raise DamagedCheckpointError(
                f"checkpoint {path} is damaged: {verdict.problem}; use an intact one (`python -m pretrain.checkpoint "
                "verify <run folder>` lists them)"
            )
    return path


def locate_setting(source: str, setting: str) -> Path:
    """`locate` for a config setting: its FileNotFoundError as a ValueError naming ``setting``."""
    try:
        return locate(source)
    except FileNotFoundError as error:
        raise ValueError(f"{setting}={source!r}: {error}") from None


def locate(source: str | Path) -> Path:
    """The file or folder whose weights ``source`` names, unverified; FileNotFoundError for a run without a COMPLETE
    checkpoint. Anything else is for the loader to judge. A remote source is its local copy (`fetch`)."""
    path = fetch(str(source)) if is_remote(source) else Path(source)
    if path.is_file() and path.name in FOLDER_FILES:
        path = path.parent
    run = path.parent if path.name == CHECKPOINTS else path
    if path.is_dir() and not run_folder.looks_like_checkpoint(path) and (run / CHECKPOINTS).is_dir():
        latest = run_folder.latest_checkpoint(run)
        if latest is None:
            raise FileNotFoundError(
                f"{source} is a run folder without a COMPLETE checkpoint; wait for its first save, or pass a "
                "checkpoint folder (<run>/checkpoints/step_XXXXXXXX)"
            )
        path = latest
    return path


def fetch(url: str) -> Path:
    """The local copy of remote weights source ``url``: a folder, or the file itself for a single-file source (an
    official ``.npz``). FileNotFoundError, naming the URL, for nothing there or a run without a COMPLETE checkpoint;
    OSError naming it for the storage's refusals (credentials, network); ImportError without the storage's
    filesystem (the `s3` / `gs` extras)."""
    try:
        return _fetch(url)
    except (OSError, ImportError):  # FileNotFoundError included
        raise
    except Exception as error:  # the storage client's own (botocore's NoCredentialsError is no OSError)
        raise OSError(f"{url}: {type(error).__name__}: {error}") from error


def _fetch(url: str) -> Path:
    # A client of its own: a cached one may hold the credentials and endpoint of an earlier environment
    fs, root = fsspec.core.url_to_fs(url, skip_instance_cache=True)
    root = root.rstrip("/")
    protocol = url.split("://", 1)[0]
    if fs.isfile(root):
        if Path(root).name not in FOLDER_FILES:
            return _copy(fs, protocol, Path(root).parent.as_posix(), [fs.info(root)]) / Path(root).name
        root = Path(root).parent.as_posix()
    if not fs.isdir(root):
        raise FileNotFoundError(f"{url}: nothing there; pass a checkpoint, run or weights folder, or an .npz file")
    entries = fs.ls(root, detail=True)
    names = {Path(e["name"]).name for e in entries}
    if COMPLETE not in names and (Path(root).name == CHECKPOINTS or CHECKPOINTS in names):
        root = _newest_complete(fs, root if Path(root).name == CHECKPOINTS else f"{root}/{CHECKPOINTS}", url)
        entries = fs.ls(root, detail=True)
    files = [e for e in entries if e["type"] == "file"]
    if not files:
        raise FileNotFoundError(f"{url}: no files in it; pass a checkpoint, run or weights folder, or an .npz file")
    return _copy(fs, protocol, root, files)


def _newest_complete(fs, checkpoints: str, url: str) -> str:
    folders = {run_folder.parse_step(Path(p.rstrip("/")).name): p.rstrip("/") for p in fs.ls(checkpoints, detail=False)}
    for step in sorted((s for s in folders if s is not None), reverse=True):
        if fs.exists(f"{folders[step]}/{COMPLETE}"):
            return folders[step]
    raise FileNotFoundError(
        f"{url} is a run folder without a COMPLETE checkpoint; wait for its first save, or pass a checkpoint folder "
        "(<run>/checkpoints/step_XXXXXXXX)"
    )


def _copy(fs, protocol: str, folder: str, files: list[dict]) -> Path:
    """``files`` (fsspec `info` dicts, all in ``folder``) copied into a cache folder named after their listing."""
    stamp = ("LastModified", "mtime", "updated")  # S3's, local's, GCS's
    listing = sorted(
        (Path(f["name"]).name, f.get("size"), str(next((f[k] for k in stamp if k in f), ""))) for f in files
    )
    key = hashlib.sha256(json.dumps([protocol, folder, listing]).encode()).hexdigest()[:16]
    local = cache_dir() / "weights" / key / Path(folder).name
    marker = json.dumps({"source": f"{protocol}://{folder}", "files": listing}) + "\n"
    if (local / FETCHED).is_file():
        if (local / FETCHED).read_text() != marker:  # a copy made before the marker named its source
            (local / FETCHED).write_text(marker)
        return local
    local.mkdir(parents=True, exist_ok=True)
    for f in files:
        name = Path(f["name"]).name
        partial = local / f"{name}.part{os.getpid()}"
        fs.get(f["name"], str(partial))
        os.replace(partial, local / name)
    (local / FETCHED).write_text(marker)
    return local


def origin(path: Path) -> str:
    """Where weights that `resolve` returned live: a remote source's URL for its local copy, else ``path`` itself."""
    folder = path if path.is_dir() else path.parent
    try:
        source = json.loads((folder / FETCHED).read_text())["source"]
    except (OSError, ValueError, TypeError, KeyError):  # not a copy (or one from before the URL was kept)
        return str(path)
    return source if folder == path else f"{source}/{path.name}"
