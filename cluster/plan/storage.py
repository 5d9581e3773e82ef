"""What a run's storage needs: the vitscale extra that gives fsspec each remote scheme, and whether it is here."""

from __future__ import annotations

import posixpath
import threading
import time
from dataclasses import dataclass

from cluster.plan.errors import PlanError
from cluster.profiles import ClusterProfile, path_under
from data_pipeline.manifest import DatasetInfo, read_dataset_info
from data_pipeline.paths import QUIET_STORES, is_remote
from pretrain.config.train_config import TrainConfig


@dataclass(frozen=True)
class StorageExtra:
    name: str  # `pip install 'vitscale[<name>]'`
    requirement: str  # = pyproject.toml's (tested)
    module: str


STORAGE_EXTRAS = {
    "s3": StorageExtra("s3", "s3fs>=2024.2", "s3fs"),
    "gcs": StorageExtra("gcs", "gcsfs>=2024.2", "gcsfs"),
}
SCHEME_EXTRAS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs"}  # URL scheme → extra


def url_scheme(url: str) -> str | None:
    """`s3://bucket/x` → "s3"; None for a local path."""
    return url.split("://", 1)[0].lower() if is_remote(url) else None


def storage_urls(config: TrainConfig) -> list[str]:
    init_from = config.checkpoint.init_from
    return [config.data.train, config.evals.data_root, *([init_from] if init_from else [])]


def storage_extras(urls: list[str]) -> list[StorageExtra]:
    names = [SCHEME_EXTRAS[s] for s in map(url_scheme, urls) if s in SCHEME_EXTRAS]
    return [STORAGE_EXTRAS[n] for n in dict.fromkeys(names)]


def missing_storage(urls: list[str]) -> list[str]:
    """A sentence per remote scheme among `urls` whose fsspec filesystem cannot be imported here."""
    import fsspec

    missing = []
    for scheme in dict.fromkeys(filter(None, map(url_scheme, urls))):
        try:
            fsspec.get_filesystem_class(scheme)
        except ImportError as exc:
            extra = STORAGE_EXTRAS.get(SCHEME_EXTRAS.get(scheme, ""))
            if extra:
                missing.append(
                    f"{scheme}:// needs {extra.module}, not installed here: pip install 'vitscale[{extra.name}]'"
                )
            else:  # fsspec's own message names the package
                missing.append(f"{scheme}:// is not readable here: {exc}")
        except ValueError:
            missing.append(f"{scheme}:// is not a storage scheme fsspec knows; use s3://, gs:// or a shared path")
    return missing


# An unreachable store's client retries for minutes.
MANIFEST_WAIT_S = 30.0


def read_manifest(location: str) -> DatasetInfo:
    """`read_dataset_info`; object storage is read once per process, in a daemon thread, with TimeoutError once
    MANIFEST_WAIT_S have passed since that read began. The store clients' loggers are quiet while it reads."""
    if not is_remote(location):
        return read_dataset_info(location)
    if location not in _REMOTE_READS:
        _REMOTE_READS[location] = _start_read(location)
    reader, deadline, outcome = _REMOTE_READS[location]
    reader.join(max(0.0, deadline - time.monotonic()))
    if not outcome:
        raise TimeoutError(f"no answer from {location} in {MANIFEST_WAIT_S:g} s")
    if isinstance(outcome[0], Exception):
        raise outcome[0]
    return outcome[0]


_REMOTE_READS: dict[str, tuple[threading.Thread, float, list]] = {}  # location -> (reader, deadline, [outcome])


def _start_read(location: str) -> tuple[threading.Thread, float, list]:
    outcome: list = []

    def read() -> None:
        try:
            outcome.append(read_dataset_info(location))
        except Exception as error:  # noqa: BLE001 — raised in the caller's thread
            outcome.append(error)
        finally:
            QUIET_STORES.leave()

    QUIET_STORES.enter()
    reader = threading.Thread(target=read, name="plan-manifest-read", daemon=True)
    reader.start()
    return reader, time.monotonic() + MANIFEST_WAIT_S, outcome


# What every rank and the eval node write and read back: on several nodes it must be shared. Inputs (data, init
# weights) may be copied to every node's own disk, and are left as given.
SHARED_KEYS = ("checkpoint.dir", "logging.mlflow_tracking_uri")


def spans_nodes(profile: ClusterProfile) -> bool:
    """A remote job on several nodes (training or an eval node): a node-local path is another folder on each."""
    return not profile.is_local and (profile.hardware.nodes > 1 or bool(profile.evals.instance_type))


def _path_of(value: str) -> str | None:
    """The filesystem path ``value`` names (a SQLite or file store's too), None for object storage or a server."""
    for scheme in ("sqlite:///", "file://"):
        if value.startswith(scheme):
            return value.removeprefix(scheme)
    return None if "://" in value else value


def node_local_setting(profile: ClusterProfile, config: TrainConfig) -> None:
    """PlanError, on a remote profile, for a relative run folder or MLflow file store (the job would write it in its
    working folder, which Ray deletes) and, on several nodes, for one off the shared storage: each node would write
    and read its own copy (resume breaks, the eval node finds no checkpoint, MLflow forks)."""
    if profile.is_local:
        return
    s = profile.storage
    given = {"shared": s.shared, "checkpoints": s.checkpoints, "shards": s.shards}
    named = {k: v for k, v in given.items() if v and not (k == "checkpoints" and s.shared and path_under(v, s.shared))}
    roots = [v for v in named.values() if not is_remote(v)]
    for key in SHARED_KEYS:
        section, field = key.split(".")
        value = getattr(getattr(config, section), field)
        path = None if value is None else _path_of(str(value))
        if (
            path is None
            or posixpath.isabs(path)
            and (not spans_nodes(profile) or any(path_under(path, r) for r in roots))
        ):
            continue
        home = roots[0] if roots else s.checkpoints
        server = "http://HOST:5000" if _path_of(s.mlflow_tracking_uri) else s.mlflow_tracking_uri
        fix = (
            f"--run-name NAME (the run folder {s.checkpoints}/NAME) or a path under {home}"
            if key == "checkpoint.dir"
            else f"an MLflow server's URL, e.g. {server}"
        )
        if not posixpath.isabs(path):
            raise PlanError(
                f"{key}={value!r} is relative: the job would write it in its working folder, a copy of the project "
                f"that Ray deletes; give {fix}"
            )
        raise PlanError(
            f"{key}={value!r} would be each node's own copy: profile {profile.name}'s nodes share only "
            f"{' and '.join(f'{v} (storage.{k})' for k, v in named.items())}; give {fix}"
        )
