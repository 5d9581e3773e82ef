"""What a run's storage needs: the vitscale extra that gives fsspec each remote scheme, and whether this machine has it.

A run reads its training shards and its eval shard folders (`storage_urls`) from local paths or fsspec URLs.
`s3://` needs vitscale[s3] (s3fs) and `gs://` vitscale[gcs] (gcsfs): the job's runtime env installs them on the
cluster (`storage_extras`), and the plan says when this machine lacks them to read the manifest (`missing_storage`).
"""

from __future__ import annotations

from dataclasses import dataclass

from data_pipeline.paths import is_remote
from pretrain.config.train_config import TrainConfig


@dataclass(frozen=True)
class StorageExtra:
    """An optional dependency group of vitscale that gives fsspec one more storage scheme."""

    name: str  # `pip install 'vitscale[<name>]'`
    requirement: str  # what it installs = pyproject.toml [project.optional-dependencies] (a test keeps them equal)
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
    """Where the run reads data from (training shards, eval shard folders): what its filesystems must reach."""
    return [config.data.train, config.evals.data_root]


def storage_extras(urls: list[str]) -> list[StorageExtra]:
    """The vitscale extras the remote schemes among `urls` need (`s3://` → vitscale[s3], `gs://` → vitscale[gcs])."""
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
