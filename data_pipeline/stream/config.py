"""`DataConfig`: the recipe's ``data:`` section."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from data_pipeline.builtin.sets import (
    ALIASES,
    BUILTIN_NAMES,
    BuiltinConfig,
    OtherSettings,
    check_folder,
    check_sizes,
    ensure,
    option_minimum,
    set_fields,
    unread_options,
)
from data_pipeline.cli import at_least, positive
from data_pipeline.manifest import is_shard_folder
from data_pipeline.paths import is_remote, resolve_path
from data_pipeline.stream.augment import AugmentConfig

START_METHODS = ("fork", "forkserver", "spawn")


@dataclass(frozen=True)
class DataConfig:
    """The same on every rank; each field's range is checked when it is made."""

    train: str = "data/imagenet21k/train"  # shard folder: a local path or an fsspec URL
    builtin: str | None = None  # a built-in set, generated at `train` when absent
    builtin_options: dict[str, Any] = field(default_factory=dict)  # BuiltinConfig sizes
    image_size: int = 224  # final training resolution
    # [[step, size], ...] from step 0 to image_size (pretrain.config.progressive); () = off
    resolution_schedule: tuple[tuple[int, int], ...] = ()
    global_batch_size: int = 4096  # images per optimizer step, all ranks
    micro_batch_size: int = 32  # images per rank per forward/backward
    epoch_images: int | None = None  # images per epoch for "ep" durations; None → dataset.json
    num_workers: int = 0  # DataLoader worker processes per rank
    # not fork: forking a threaded training process can hang the child
    loader_start_method: Literal["fork", "forkserver", "spawn"] = "forkserver"
    streams: int = 8  # the data order's streams (docs/design.md, "The training stream contract"); R divides it
    shuffle_buffer: int = 1000  # sample shuffle buffer per stream
    seed: int = 0  # stream seed: shard order, shuffle, augmentation
    mixup_alpha: float = 0.0  # mixup Beta(α, α); 0 disables
    # Inception crop, flip, RandAugment; null → resize only
    augment: AugmentConfig | None = field(default_factory=AugmentConfig)
    read_retries: int = 3  # of a failed shard read before it counts as damaged
    cache_mb: float = 256.0  # MiB per rank for the whole set decoded, if it fits; 0: off
    # where pixels become floats: "loader", "device" (uint8 sent), "auto" (device on a GPU)
    normalize_on: Literal["auto", "loader", "device"] = "auto"

    def __post_init__(self) -> None:
        self.check()

    @classmethod
    def for_stream(
        cls, train: Any, *, micro_batch_size: int, image_size: int, world_size: int = 1, **fields: Any
    ) -> DataConfig:
        """A config outside a recipe: G = m × world_size, P = world_size × max(1, num_workers) if that
        divides G else world_size, no augmentation, no cache."""
        G = fields.pop("global_batch_size", micro_batch_size * world_size)
        P = world_size * max(1, fields.get("num_workers", 0))
        fields.setdefault("streams", P if G % P == 0 else world_size)
        fields.setdefault("augment", None)
        fields.setdefault("cache_mb", 0.0)
        return cls(train=train, micro_batch_size=micro_batch_size, image_size=image_size, global_batch_size=G, **fields)

    def pixels_for(self, device_type: str) -> Literal["float", "uint8"]:
        on_device = self.normalize_on == "device" or (self.normalize_on == "auto" and device_type == "cuda")
        return "uint8" if on_device else "float"

    @property
    def builtin_root(self) -> Path:
        return resolve_path(self.train).parent.parent

    @property
    def generates_builtin(self) -> bool:
        """Whether ``train`` is the built-in set's own local folder, ``<root>/<builtin>/<split>``, where it is generated
        when absent. Another folder is the user's own shards (a recipe's data.train set, its data.builtin left), and
        object storage is read as it is: neither gets a set generated beside it."""
        if self.builtin is None or is_remote(self.train):
            return False
        return resolve_path(self.train).parent.name == ALIASES.get(self.builtin, self.builtin)

    def ensure_builtin(self) -> None:
        """Write the built-in training set at ``train`` unless there (`generates_builtin`), and refuse one there that
        was generated at other settings, as `make launch` does; before training, never by a rank."""
        if self.builtin is None or not self.generates_builtin:
            return
        try:
            if is_shard_folder(Path(self.train)):
                check_folder(self.builtin, self.builtin_root, **self.builtin_options)
            else:
                ensure(self.builtin, self.builtin_root, **self.builtin_options)
        except OtherSettings as error:
            raise self.other_settings(error) from None

    def other_settings(self, error: OtherSettings) -> ValueError:
        """The refusal of the training set's folder generated at other settings, with the recipe's fixes."""
        keep = " ".join(f"data.builtin_options.{k}={v}" for k, v in error.had.items())
        as_it_is = (
            f"to train on it as it is, set {keep}; " if all(isinstance(v, int) for v in error.had.values()) else ""
        )
        return ValueError(
            f"{error.folder / error.split} was generated with {error.differ}; {as_it_is}to generate it at the "
            f"recipe's settings, delete it (rm -r {error.folder}) or use another data.train"
        )

    def check(self) -> None:
        """ValueError naming ``data.<field>``, its value and the fix."""
        for name in ("image_size", "global_batch_size", "micro_batch_size", "streams"):
            positive(getattr(self, name), f"data.{name}")
        if self.epoch_images is not None:
            positive(self.epoch_images, "data.epoch_images")
        for name in ("num_workers", "read_retries", "cache_mb", "shuffle_buffer", "mixup_alpha", "seed"):
            at_least(getattr(self, name), 0, f"data.{name}")
        if self.seed >= 2**32:  # numpy reads it as two 32-bit words: (seed, epoch) would be another seed's epoch
            raise ValueError(f"data.seed={self.seed} must be below 2**32, e.g. data.seed=0")
        chunk = self.global_batch_size // self.streams
        if self.mixup_alpha > 0 and chunk < 2:
            raise ValueError(
                f"data.mixup_alpha={self.mixup_alpha} mixes samples within each stream's chunk of "
                f"data.global_batch_size / data.streams = {chunk}; it needs >= 2: set data.streams to at most "
                "data.global_batch_size / 2, or data.mixup_alpha=0"
            )
        if self.normalize_on not in ("auto", "loader", "device"):
            raise ValueError(f"data.normalize_on={self.normalize_on!r} must be one of auto, loader, device")
        if self.loader_start_method not in START_METHODS:
            raise ValueError(
                f"data.loader_start_method={self.loader_start_method!r} must be one of {', '.join(START_METHODS)}"
            )
        if self.builtin is not None:
            _check_builtin(self.builtin, self.builtin_options)
        if self.augment is not None:
            try:
                self.augment.validate()
            except ValueError as error:
                raise ValueError(f"data.{error}") from None


def _check_builtin(builtin: str, options: dict[str, Any]) -> None:
    name = ALIASES.get(builtin, builtin)
    if name not in BUILTIN_NAMES:
        raise ValueError(f"data.builtin={builtin!r} is unknown; use one of {', '.join(BUILTIN_NAMES)} or unset it")
    for key, value in options.items():
        low = option_minimum(key)
        if low is None:
            known = ", ".join(f.name for f in dataclasses.fields(BuiltinConfig))
            raise ValueError(f"data.builtin_options.{key} is unknown; valid options: {known}")
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"data.builtin_options.{key}={value!r} must be an integer >= {low}")
    unread = unread_options((name,), options)
    if unread:
        raise ValueError(
            f"data.builtin_options.{unread[0]}: {name} does not read it; the options it reads: "
            f"{', '.join(set_fields(name))}"
        )
    try:
        check_sizes(name, BuiltinConfig(**options))
    except ValueError as error:
        raise ValueError(f"data.builtin_options: {error}") from None
