"""Reading an eval split through ``EvalStream``: streamed (`StreamedSplit`), only drawn samples (`load_drawn`), frozen
features (`extract_features`) or its first images (`load_images`). Square resize to ``resize_size`` (None: no crop),
centre crop to ``image_size``, pixels in [-1, 1]; a label outside the declared classes raises.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import fsspec
import numpy as np
import torch

from data_pipeline.builtin import sets as builtin
from data_pipeline.cli import file_in_the_way
from data_pipeline.manifest import MANIFEST_FILE, is_shard_folder, read_dataset_info, store_info
from data_pipeline.paths import is_remote, quiet_stores
from data_pipeline.stream.eval_stream import EvalStream
from data_pipeline.write.vtab_tfds import TASKS as VTAB_TFDS_TASKS


@dataclass(frozen=True)
class SplitInfo:
    path: str | Path  # a `data_location`
    num_classes: int
    num_samples: int


def data_location(root: str | Path) -> str | Path:
    """A remote URL (``s3://``, ``memory://`` …) as a string, else a local `Path` (``file://`` stripped)."""
    if is_remote(root):
        return str(root).rstrip("/")
    return Path(str(root).removeprefix("file://"))


# docs/vtab.md, "Data on object storage, streamed": each client's own environment
_CREDENTIALS = {
    "s3": "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and AWS_ENDPOINT_URL for a store other than AWS)",
    "gs": "run `gcloud auth application-default login` or set GOOGLE_APPLICATION_CREDENTIALS (STORAGE_EMULATOR_HOST "
    "for another endpoint)",
}


def check_data_root(root: str | Path) -> None:
    """ValueError naming --data-root for a root that cannot hold shard folders: a file, or a path under one; a store
    that refuses or cannot be reached (credentials, network), or whose fsspec extra is missing. Asked once, quietly."""
    where = data_location(root)
    if isinstance(where, Path):
        if file := file_in_the_way(where):
            raise ValueError(
                f"--data-root {root}: {file} is a file, not a folder; pass the folder that holds the "
                "<dataset>/<split>/ shard folders (built-in sets missing there are generated in it)"
            )
        return
    try:
        with quiet_stores():
            fs, path = fsspec.core.url_to_fs(where)
            store_info(fs, path)
    except ImportError as error:  # no s3fs / gcsfs: the vitscale[s3] / vitscale[gcs] extra
        raise ValueError(f"--data-root {root}: {error}") from None
    except Exception as error:  # noqa: BLE001 — botocore's NoCredentialsError, gcsfs's refusals, a network error
        reason = f"{type(error).__name__}: {' '.join(str(error).split())[:300]}"
        fix = _CREDENTIALS.get(where.split("://")[0], "give its fsspec client credentials")
        raise ValueError(
            f"--data-root {root} cannot be read ({reason}); {fix}, or check the URL and the network"
        ) from None


def split_info(split_dir: str | Path) -> SplitInfo:
    """ValueError naming the fix for a non-shard folder."""
    path = data_location(split_dir)
    if not is_shard_folder(path):
        raise ValueError(
            f"{path} is not a shard folder (no {MANIFEST_FILE}); write it with data_pipeline "
            "(e.g. `python -m data_pipeline.builtin NAME --out ROOT`) or point --data-root at the right folder"
        )
    info = read_dataset_info(path)
    return SplitInfo(path=path, num_classes=int(info.num_classes), num_samples=int(info.num_samples))


def _labels(parts: list, info: SplitInfo) -> np.ndarray:
    """The label batches read, concatenated; ValueError for none or one outside the declared classes."""
    labels = np.concatenate(parts) if parts else np.zeros(0, np.int64)
    if labels.size == 0:
        raise ValueError(f"{info.path} yielded no samples; the split is empty")
    if labels.min() < 0 or labels.max() >= info.num_classes:
        bad = int(labels.max()) if labels.max() >= info.num_classes else int(labels.min())
        raise ValueError(
            f"{info.path}: label {bad} is outside the declared classes 0..{info.num_classes - 1} "
            f"(dataset.json num_classes={info.num_classes}); fix the labels or the declared class count"
        )
    return labels


def _batches(
    info: SplitInfo,
    image_size: int,
    resize_size: int | None,
    batch_size: int,
    *,
    float_images: bool = True,
    stop_after: int | None = None,
):
    """The split's batches, at least the first ``stop_after`` samples (None: all); then raise if the stream skipped bad
    labels."""
    stream = EvalStream(
        str(info.path), batch_size=batch_size, image_size=image_size, resize_size=resize_size, float_images=float_images
    )
    seen = 0
    for batch in stream:
        yield batch
        seen += len(batch[1])
        if stop_after is not None and seen >= stop_after:
            break
    bad = stream.stats.get("label_out_of_range", 0) + stream.stats.get("bad_labels", 0)
    if bad:
        raise ValueError(
            f"{info.path}: {bad} sample(s) have labels outside the declared classes 0..{info.num_classes - 1} "
            f"(dataset.json num_classes={info.num_classes}); fix the labels or the declared class count"
        )
    lost = {k: v for k, v in stream.stats.items() if v and k not in ("label_out_of_range", "bad_labels")}
    if lost:
        warnings.warn(
            f"{info.path}: the stream could not read every sample ({lost}); scores cover the rest", stacklevel=2
        )


def load_images(
    split_dir: str | Path, *, image_size: int, resize_size: int | None = None, batch_size: int = 256, limit=None
) -> tuple[torch.Tensor, np.ndarray, SplitInfo]:
    """The split (or its first ``limit`` samples) in memory: float32 images (N, 3, S, S), labels (N,)."""
    info = split_info(split_dir)
    images, labels, seen = [], [], 0
    for batch_images, batch_labels in _batches(info, image_size, resize_size, batch_size):
        images.append(torch.as_tensor(batch_images, dtype=torch.float32))
        labels.append(np.asarray(batch_labels, dtype=np.int64))
        seen += len(labels[-1])
        if limit is not None and seen >= limit:
            break  # _labels still checks what was read
    labels = _labels(labels, info)[:limit]  # first: it raises for an empty split
    return torch.cat(images)[:limit], labels, info


def stream_split(
    split_dir: str | Path, *, image_size: int, resize_size: int | None = None, batch_size: int = 256
) -> Iterator[tuple[torch.Tensor, np.ndarray]]:
    """The split's float32 (images, labels) batches; ValueError after the last for an empty split or bad labels."""
    info = split_info(split_dir)
    seen = 0
    for images, labels in _batches(info, image_size, resize_size, batch_size):
        seen += len(labels)
        yield images, np.asarray(labels, dtype=np.int64)
    if not seen:
        _labels([], info)


@dataclass(frozen=True)
class StreamedSplit:
    """A split streamed from its shards at each iteration: never whole in RAM."""

    path: str | Path  # a `data_location`
    image_size: int
    resize_size: int | None = None
    batch_size: int = 256

    def __iter__(self) -> Iterator[tuple[torch.Tensor, np.ndarray]]:
        return stream_split(
            self.path, image_size=self.image_size, resize_size=self.resize_size, batch_size=self.batch_size
        )


def load_drawn(
    split_dir: str | Path, indices, *, image_size: int, resize_size: int | None = None, batch_size: int = 256
) -> tuple[torch.Tensor, np.ndarray, SplitInfo]:
    """uint8 images and labels at the distinct stream positions ``indices``, in their order, read in one pass."""
    info = split_info(split_dir)
    indices = np.asarray(indices, dtype=np.int64)
    if len(indices) == 0 or indices.min() < 0 or indices.max() >= info.num_samples:
        raise ValueError(f"{info.path}: positions to draw must lie in 0..{info.num_samples - 1} (its manifest's count)")
    order = np.argsort(indices, kind="stable")
    wanted = indices[order]  # sorted positions; order[j]: the output row of wanted[j]
    assert not np.any(wanted[1:] == wanted[:-1]), "drawn positions must be distinct"
    images = torch.empty((len(indices), 3, image_size, image_size), dtype=torch.uint8)
    labels = np.empty(len(indices), np.int64)
    start = 0  # stream position of the batch's first sample
    last = int(wanted[-1]) + 1
    batches = _batches(info, image_size, resize_size, batch_size, float_images=False, stop_after=last)
    for pixels, batch_labels in batches:
        lo, hi = np.searchsorted(wanted, [start, start + len(batch_labels)])
        rows, slots = wanted[lo:hi] - start, order[lo:hi]
        images[torch.from_numpy(slots)] = pixels[torch.from_numpy(rows)]
        labels[slots] = np.asarray(batch_labels, dtype=np.int64)[rows]
        start += len(batch_labels)
    if start < last:
        raise ValueError(
            f"{info.path}: the stream read {start} of the {info.num_samples} samples its manifest lists, but the draw "
            f"needs position {last - 1}; repair the split (`python -m data_pipeline.validate {info.path}`)"
        )
    return images, labels, info


@torch.inference_mode()
def extract_features(
    model,
    split_dir: str | Path,
    *,
    image_size: int | None = None,
    resize_size: int | None = None,
    batch_size: int = 256,
    device: str = "cpu",
    cache: dict | None = None,
) -> tuple[np.ndarray, np.ndarray, SplitInfo]:
    """Pre-logits features (N, D') float32 and labels (N,); ``cache`` reuses them for the same split, sizes, model and
    batch size (another batch size rounds other bits: an entry's scores must not depend on the entries before it)."""
    size = int(image_size or model.config.image_size)
    where = data_location(split_dir)
    key = (str(where if is_remote(where) else where.resolve()), size, resize_size, batch_size, id(model))
    if cache is not None and key in cache:
        return cache[key]
    info = split_info(split_dir)
    was_training = model.training
    model.eval()
    features, labels = [], []
    try:
        for batch_images, batch_labels in _batches(info, size, resize_size, batch_size):
            images = torch.as_tensor(batch_images, dtype=torch.float32).to(device)
            features.append(model.forward_features(images).float().cpu().numpy())  # (B, D')
            labels.append(np.asarray(batch_labels, dtype=np.int64))
    finally:
        model.train(was_training)
    labels = _labels(labels, info)  # first: it raises for an empty split
    result = (np.concatenate(features), labels, info)
    if cache is not None:
        cache[key] = result
    return result


def check_sizes(opts, names=("image_size", "resize_size", "batch_size")) -> None:
    """ValueError for a size option < 1."""
    for name in names:
        value = getattr(opts, name)
        if value is not None and value < 1:
            raise ValueError(f"{name} must be >= 1 (or null for the default); got {value}")


RESIZED_MODEL = "resized model"  # ctx.feature_cache key (with the size) of a resized copy of the shared model


@contextlib.contextmanager
def shared_models_on_host(ctx):
    """The shared model and its resized copies on the host while an evaluator trains its own on ``ctx.device``:
    fine-tuning's memory there is the fine-tuned model's alone (docs/vtab.md); back on the device afterwards."""
    models = [ctx.model, *(m for k, m in ctx.feature_cache.items() if isinstance(k, tuple) and k[0] == RESIZED_MODEL)]
    for model in models:
        model.to("cpu")  # in place: the same parameters, so the features cached under id(model) stay valid
    try:
        yield
    finally:
        for model in models:
            model.to(ctx.device)


def suite_features(ctx, split_dir: str | Path, opts) -> tuple[np.ndarray, np.ndarray, SplitInfo]:
    """`extract_features` with the context's model, device and cache and the entry's sizes; at another
    ``image_size``, a copy resized to it (position embeddings interpolated), loaded once per size."""
    model = ctx.model
    if opts.image_size is not None and opts.image_size != model.config.image_size:
        key = (RESIZED_MODEL, int(opts.image_size))
        if key not in ctx.feature_cache:
            ctx.feature_cache[key] = ctx.load_model(image_size=int(opts.image_size)).eval().to(ctx.device)
        model = ctx.feature_cache[key]
    return extract_features(
        model,
        split_dir,
        image_size=opts.image_size,
        resize_size=opts.resize_size,
        batch_size=opts.batch_size,
        device=ctx.device,
        cache=ctx.feature_cache,
    )


def resolve_split(data_root: str | Path, dataset: str, split: str, *, generate_builtin: bool = True) -> str | Path:
    """``<data_root>/<dataset>/<split>`` (a `data_location`); a missing built-in is generated if allowed (locally)."""
    root = data_location(data_root)
    if is_remote(root):
        url = f"{root}/{dataset}/{split}"
        if is_shard_folder(url):
            return url
        raise _no_split(url, root, dataset, split, generate_builtin)
    path = root / dataset / split
    if is_shard_folder(path):
        return path
    if generate_builtin and dataset in builtin.BUILTIN_NAMES and split in builtin.SPLITS[dataset]:
        builtin.ensure(dataset, root)
        if is_shard_folder(path):
            return path
    raise _no_split(path, root, dataset, split, generate_builtin)


def _no_split(where: str | Path, root: str | Path, dataset: str, split: str, builtin_first: bool) -> ValueError:
    """The missing split ``where`` and the command that writes it: a built-in's generator, a VTAB-1k task's TFDS
    writer (docs/vtab.md), else the writer of any images, for a name this project does not know. A remote root is
    written locally, then copied (built-ins are never generated in a bucket)."""
    out = "DIR" if is_remote(root) else str(root)
    if dataset in builtin.BUILTIN_NAMES and split not in builtin.SPLITS[dataset]:  # its generator never writes it
        has = builtin.SPLITS[dataset]
        return ValueError(
            f"no shard folder at {where}: built-in dataset {dataset!r} has no split {split!r}, only "
            f"{' and '.join(has)}; name one in the suite entry (train_split / test_split, e.g. test_split: {has[-1]})"
        )
    unknown = ""
    if dataset in builtin.BUILTIN_NAMES and (builtin_first or dataset not in VTAB_TFDS_TASKS):
        command = f"`python -m data_pipeline.builtin {dataset} --out {out}`"
    elif dataset in VTAB_TFDS_TASKS:
        command = (
            f"`python -m data_pipeline.write --source tfds:TFDS_DIR --vtab {dataset} --split {split} --out "
            f"{out}/{dataset}/{split}` from the task's TFDS folder, docs/vtab.md"
        )
    else:
        unknown = (
            f"{dataset!r} is an unknown dataset (not built in: {', '.join(builtin.BUILTIN_NAMES)}; not a VTAB-1k "
            "task): fix the name, or "
        )
        command = f"`python -m data_pipeline.write --source IMAGES --split {split} --out {out}/{dataset}/{split}`"
    how = f"to a local folder DIR ({command}) and copy {dataset}/ to {root}" if is_remote(root) else f"({command})"
    return ValueError(
        f"no shard folder at {where}; {unknown}write it {how}, or pass --data-root pointing at the root that holds it"
    )
