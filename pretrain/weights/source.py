"""What a weights source is, for loading, export and evals alike. Torch-free.

A source is an official `.npz`, a checkpoint, a run folder or its `checkpoints/` (the newest COMPLETE checkpoint),
a `save_pretrained` or HF folder, or one file of such a folder. A checkpoint is used only COMPLETE and intact.
A source in object storage (``s3://``, ``gs://``) is copied to ``$VITSCALE_CACHE/weights/`` first (`fetch`): only
the files directly in the folder, never `deepspeed/`; a copy is named by its listing (names, sizes, mtimes).
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import time
from pathlib import Path

import fsspec

from data_pipeline.manifest import store_info
from data_pipeline.paths import cache_dir, command_line_path, is_remote, quiet_stores
from pretrain.checkpoint import checksums, run_folder
from pretrain.checkpoint.run_folder import CHECKPOINTS, COMPLETE, CONFIG_FILE, WEIGHTS_FILE

HF_CONFIG = "config.json"  # transformers' config
FOLDER_FILES = (WEIGHTS_FILE, CONFIG_FILE, HF_CONFIG)  # a path to one of these stands for its folder
FETCHED = ".fetched"  # written last into a complete remote copy


class DamagedCheckpointError(ValueError):
    """A COMPLETE checkpoint whose weights fail their checksums."""


class UnreachableError(OSError):
    """An HTTP source whose server cannot be reached."""


def resolve(source: str | Path) -> Path:
    """`locate`, then DamagedCheckpointError if the checkpoint's weights fail their checksums."""
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
    """`locate`, FileNotFoundError as a ValueError naming ``setting``."""
    try:
        return locate(source)
    except FileNotFoundError as error:
        raise ValueError(f"{setting}={source!r}: {error}") from None


def locate(source: str | Path) -> Path:
    """The file or folder ``source`` names (a remote one's local copy), unverified; FileNotFoundError for a run
    without a COMPLETE checkpoint."""
    path = fetch(str(source)) if is_remote(source) else command_line_path(source)
    if path.is_file() and path.name in FOLDER_FILES:
        path = path.parent
    run = path.parent if path.name == CHECKPOINTS else path
    if path.is_dir() and not run_folder.looks_like_checkpoint(path) and (run / CHECKPOINTS).is_dir():
        latest = run_folder.latest_checkpoint(run)
        if latest is None:
            raise _no_checkpoint(source)
        path = latest
    return path


def fetch(url: str) -> Path:
    """The local copy of ``url``: a folder, or the file of a single-file source (an ``.npz``). FileNotFoundError
    for nothing there or no COMPLETE checkpoint; OSError for the storage's refusals (credentials, network);
    ImportError without its filesystem (the `s3` / `gs` extras)."""
    try:
        with quiet_stores():
            return _fetch(url)
    except (FileNotFoundError, ImportError, UnreachableError):
        raise
    except Exception as error:  # e.g. botocore's NoCredentialsError, gcsfs's "Forbidden" on two lines
        raise OSError(f"{url}: {type(error).__name__}: {' '.join(str(error).split())}") from error


def _fetch(url: str) -> Path:
    # a cached client may hold an earlier environment's credentials
    fs, root = fsspec.core.url_to_fs(url, skip_instance_cache=True)
    root = root.rstrip("/")
    protocol = url.split("://", 1)[0]
    info = _info(fs, root, url)
    if info["type"] == "file":
        if Path(root).name not in FOLDER_FILES:
            return _copy(fs, protocol, _parent(root), [info]) / Path(root).name
        root = _parent(root)
    entries = fs.ls(root, detail=True)
    names = {Path(e["name"]).name for e in entries}
    if COMPLETE not in names and (Path(root).name == CHECKPOINTS or CHECKPOINTS in names):
        root = _newest_complete(fs, root if Path(root).name == CHECKPOINTS else f"{root}/{CHECKPOINTS}", url)
        entries = fs.ls(root, detail=True)
    files = [e for e in entries if e["type"] == "file"]
    if not files:
        raise FileNotFoundError(f"{url}: no files in it; pass a checkpoint, run or weights folder, or an .npz file")
    return _copy(fs, protocol, root, files)


def _info(fs, root: str, url: str) -> dict:
    """``root``'s fsspec info; FileNotFoundError for nothing there, UnreachableError for an HTTP server that cannot be
    reached (fsspec's HTTP info raises FileNotFoundError for any failure, the connection's as its cause)."""
    try:
        return fs.info(root)
    except (FileNotFoundError, NotADirectoryError) as error:
        if url.startswith(("http://", "https://")) and isinstance(error.__cause__, OSError):
            raise UnreachableError(
                f"{url}: the server could not be reached ({' '.join(str(error.__cause__).split())}); check the "
                "host and port, and that the server is up"
            ) from None
    raise FileNotFoundError(f"{url}: nothing there; pass a checkpoint, run or weights folder, or an .npz file")


def _parent(root: str) -> str:
    """The folder of a store path; an HTTP path is a whole URL, which Path would make ``http:/host``."""
    return root.rstrip("/").rpartition("/")[0]


def _newest_complete(fs, checkpoints: str, url: str) -> str:
    folders = {run_folder.parse_step(Path(p.rstrip("/")).name): p.rstrip("/") for p in fs.ls(checkpoints, detail=False)}
    for step in sorted((s for s in folders if s is not None), reverse=True):
        if store_info(fs, f"{folders[step]}/{COMPLETE}") is not None:
            return folders[step]
    raise _no_checkpoint(url)


def _no_checkpoint(run: str | Path) -> FileNotFoundError:
    return FileNotFoundError(
        f"{run} is a run folder without a COMPLETE checkpoint; wait for its first save, or pass a checkpoint folder "
        "(<run>/checkpoints/step_XXXXXXXX)"
    )


def _copy(fs, protocol: str, folder: str, files: list[dict]) -> Path:
    """``files`` (fsspec `info` dicts in ``folder``) copied to a cache folder named by their listing."""
    stamp = ("LastModified", "mtime", "updated")  # S3's, local's, GCS's
    listing = sorted(
        (Path(f["name"]).name, f.get("size"), str(next((f[k] for k in stamp if k in f), ""))) for f in files
    )
    key = hashlib.sha256(json.dumps([protocol, folder, listing]).encode()).hexdigest()[:16]
    local = cache_dir() / "weights" / key / Path(folder).name
    url = folder if "://" in folder else f"{protocol}://{folder}"  # HTTP's paths are URLs
    marker = json.dumps({"source": url, "files": listing}) + "\n"
    if (local / FETCHED).is_file():
        if (local / FETCHED).read_text() != marker:  # an older marker without the source
            (local / FETCHED).write_text(marker)
        return local
    local.mkdir(parents=True, exist_ok=True)
    _remove_killed_parts(local)
    total, started = sum(f.get("size") or 0 for f in files), time.monotonic()
    print(f"fetching {url}: {len(files)} file(s), {total / 1e9:.3g} GB, to {local}", flush=True)
    for f in files:
        name = Path(f["name"]).name
        partial = local / f"{name}{_part_suffix()}{os.getpid()}"
        fs.get(f["name"], str(partial))
        os.replace(partial, local / name)
    (local / FETCHED).write_text(marker)
    seconds = time.monotonic() - started
    print(f"fetched {url} in {seconds:.1f} s ({total / 1e6 / max(seconds, 1e-3):.3g} MB/s)", flush=True)
    return local


def _part_suffix() -> str:
    """A file being fetched is ``<name>.part-<host>-<pid>``: a cache on a shared filesystem has other hosts' too."""
    return f".part-{socket.gethostname()}-"


def _remove_killed_parts(local: Path) -> None:
    """Delete the partial files of this host's killed fetches: each as big as its file, and the fetch that follows
    writes its own."""
    for partial in local.glob(f"*{_part_suffix()}*"):
        pid = partial.name.rpartition("-")[2]
        if pid.isdigit() and not _running(int(pid)):
            partial.unlink(missing_ok=True)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        pass
    return True


def origin(path: Path) -> str:
    """A remote source's URL for its local copy, else ``path``."""
    folder = path if path.is_dir() else path.parent
    try:
        source = json.loads((folder / FETCHED).read_text())["source"]
    except (OSError, ValueError, TypeError, KeyError):  # not a copy
        return str(path)
    return source if folder == path else f"{source}/{path.name}"
