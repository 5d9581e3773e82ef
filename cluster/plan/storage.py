"""What a run's storage needs: the vitscale extra that gives fsspec each remote scheme, and whether this machine has it.

The job's runtime env installs the extras on the cluster (`storage_extras`); the plan says when this machine lacks
one to read the manifest (`missing_storage`).
"""

from __future__ import annotations

from dataclasses import dataclass

from data_pipeline.paths import is_remote
from pretrain.config.train_config import TrainConfig


@dataclass(frozen=True)
class StorageExtra:
    """An optional dependency group of vitscale that gives fsspec one more storage scheme."""

    name: str  # `pip install 'vitscale[<name>]'`
    requirement: str  # = pyproject.toml [project.optional-dependencies] (a test keeps them equal)
    module: str  # the module fsspec imports for the scheme


STORAGE_EXTRAS = {
    "s3": StorageExtra("s3", "s3fs>=2024.2", "s3fs"),
    "gcs": StorageExtra("gcs", "gcsfs>=2024.2", "gcsfs"),
}
SCHEME_EXTRAS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs"}  # URL scheme → extra


def url_scheme(url: str) -> str | None:
    """`s3://bucket/x` → "s3"; None for a local path."""
    return url.split("://", 1)[0].lower() if is_remote(url) else None


def storage_urls(config: TrainConfig) -> list[str]:
    """Where the run reads data from: training shards and eval shard folders."""
    return [config.data.train, config.evals.data_root]


def storage_extras(urls: list[str]) -> list[StorageExtra]:
    """The vitscale extras the remote schemes among `urls` need."""
    names = [SCHEME_EXTRAS[s] for s in map(url_scheme, urls) if s in SCHEME_EXTRAS]
    return [STORAGE_EXTRAS[n] for n in dict.fromkeys(names)]


def missing_storage(urls: list[str]) -> list[str]:
    """One sentence per remote scheme among `urls` whose fsspec filesystem cannot be imported on this machine."""
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
            else:  # a scheme vitscale has no extra for: fsspec's own message names the package
                missing.append(f"{scheme}:// is not readable here: {exc}")
        except ValueError:
            missing.append(f"{scheme}:// is not a storage scheme fsspec knows; use s3://, gs:// or a shared path")
    return missing
