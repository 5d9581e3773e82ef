"""The typed training configuration: one frozen dataclass per concern, loaded from a YAML recipe.

A recipe (`configs/<name>.yaml`) is a nested mapping whose top-level keys are the sections below; a recipe may
start from another one with ``base: <recipe name>``. Command-line overrides are ``key=value`` strings with dotted
keys (``model.name=vit_s16``, ``optim.lr=3e-4``); values are parsed as YAML scalars. Every default lives in the
dataclass field that declares it, and every field is documented next to it.

``TrainConfig.validate(world_size)`` checks everything that can be checked before work starts and raises
``ValueError`` naming the field and the fix. Numbers derived from the config (accumulation steps, total steps)
are computed in one place each: :mod:`pretrain.ds_config` and :mod:`pretrain.optim`.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import types
import typing
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

import yaml

from data_pipeline.augment import AugmentConfig
from data_pipeline.cli import parse_yaml, read_yaml

PROJECT_ROOT = Path(__file__).resolve().parent.parent
RECIPE_DIR = PROJECT_ROOT / "configs"

# A duration: an int is a number of optimizer steps; a string carries a unit: "90ep" (epochs of
# `data.epoch_images`), "1.2e6img" (images), "500st" (steps). Converted by `pretrain.optim.duration_to_steps`.
Duration = int | str


@dataclass(frozen=True)
class ModelConfig:
    """Which ViT to build. ``None`` keeps the variant's default from `pretrain.model`."""

    name: str = "vit_b16"  # a name in pretrain.model.MODEL_NAMES
    num_classes: int | None = None  # None → the training set's num_classes (dataset.json)
    representation_size: int | None = None  # pre-logits Dense+tanh width (768 for i21k pre-training)
    head_bias_init: float | None = None  # −10 with sigmoid xent so the initial loss is small
    dropout: float | None = None  # 0.1 for i21k pre-training of B and L
    attention_dropout: float | None = None
    pool: str | None = None  # "token" | "gap"
    gelu_approximate: str | None = None  # "tanh" | "none"
    grad_checkpointing: bool = False  # activation checkpointing: recompute each block in backward


@dataclass(frozen=True)
class DataConfig:
    """The training stream and the batch sizes (the one source of truth for both)."""

    train: str = "data/imagenet21k/train"  # shard folder (local path relative to the project, or an fsspec URL)
    builtin: str | None = None  # a data_pipeline.builtin name; when set and `train` is absent it is generated
    builtin_options: dict[str, Any] = field(default_factory=dict)  # BuiltinConfig sizes (resolution, num_classes…)
    image_size: int = 224  # training resolution; also the model's position-embedding grid
    # Progressive resolution: [[step, size], ...] from step 0, ending at image_size (pretrain.progressive); () = off
    resolution_schedule: tuple[tuple[int, int], ...] = ()
    global_batch_size: int = 4096  # images per optimizer step, summed over ranks and accumulation steps
    micro_batch_size: int = 32  # images per rank per forward/backward
    epoch_images: int | None = None  # images per epoch for "ep" durations; None → dataset.json num_samples
    num_workers: int = 0  # DataLoader worker processes per rank decoding images
    loader_start_method: str = "fork"  # how those workers start: fork | forkserver | spawn (forkserver in Ray actors)
    shuffle_buffer: int = 1000  # sample shuffle buffer per rank (shards are also shuffled per epoch)
    seed: int = 0  # stream seed: shard order per epoch, shuffle, augmentation
    mixup_alpha: float = 0.0  # mixup Beta(α, α); 0 disables (AugReg B/16: 0.2)
    # Training augmentation (inception crop, flip, RandAugment; data_pipeline.augment). null → resize only.
    augment: AugmentConfig | None = field(default_factory=AugmentConfig)


@dataclass(frozen=True)
class OptimConfig:
    """AdamW applied to weight matrices only (biases, norms, cls and position embeddings are not decayed)."""

    lr: float = 1e-3  # peak learning rate, reached at the end of warmup
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.1  # decoupled (torch AdamW: multiplied by the current lr)
    grad_clip: float = 1.0  # clip the global gradient norm to this; 0 disables


@dataclass(frozen=True)
class ScheduleConfig:
    """Learning-rate schedule: linear warmup from 0 to `optim.lr`, then decay to `end_lr`."""

    total: Duration = "90ep"  # training length
    warmup: Duration = 10_000  # linear warmup length
    decay: str = "linear"  # "linear" | "cosine" | "constant"
    end_lr: float = 1e-5  # lr at the last step (linear/cosine)
    stop_at_step: int | None = None  # stop early (e.g. a time-boxed job); the schedule still spans `total`


@dataclass(frozen=True)
class LossConfig:
    type: str = "sigmoid_xent"  # "softmax_xent" (+ label smoothing) | "sigmoid_xent" (summed over classes)
    label_smoothing: float = 0.0  # softmax_xent only


@dataclass(frozen=True)
class TaskConfig:
    """What the model is trained to do; a name in `pretrain.tasks.TASKS` with its own options."""

    name: str = "classification"  # "classification" | "mpp" (masked patch prediction, §4.6)
    options: dict[str, Any] = field(default_factory=dict)  # passed to the task builder, which validates them


@dataclass(frozen=True)
class DeepSpeedConfig:
    """The ZeRO engine; the DeepSpeed JSON is generated from this by `pretrain.ds_config`."""

    zero_stage: int = 2  # 0 (plain DDP) … 3 (parameters partitioned too)
    precision: str = "auto"  # "auto" (bf16 on CUDA, fp32 on CPU) | "fp32" | "bf16"
    reduce_bucket_size: int = 50_000_000  # elements; the 5e8 default allocates two ~1 GB buffers
    allgather_bucket_size: int = 50_000_000
    overlap_comm: bool = False  # overlap gradient reduction with backward (worth it on GPUs)
    dist_backend: str = "auto"  # "auto" (nccl on CUDA, gloo on CPU) | "nccl" | "gloo"
    timeout_minutes: int = 30  # collective timeout when this worker creates the process group


@dataclass(frozen=True)
class CheckpointConfig:
    dir: str = "runs/default"  # the run folder; checkpoints go to <dir>/checkpoints/step_XXXXXXXX/
    every_steps: int = 1000  # save every K optimizer steps (and at the end)
    keep_last: int = 3  # keep the newest k complete checkpoints
    resume_from: str | None = None  # a checkpoint folder to resume fully (used when <dir> has none)
    init_from: str | None = None  # weights only: a model.safetensors folder or an official .npz


@dataclass(frozen=True)
class LoggingConfig:
    mlflow_tracking_uri: str | None = None  # None → pretrain.tracking.default_tracking_uri()
    mlflow_run_id: str | None = None  # the run created by the driver; None → no MLflow unless experiment is set
    mlflow_experiment: str | None = None  # standalone runs: create a run in this experiment when no run id
    log_every: int = 10  # steps between metric logs (and console updates)
    peak_tflops: float | None = None  # hardware peak per device for MFU; None → known GPU table / measured CPU GEMM
    progress_bar: bool = True  # tqdm on rank 0
    record_batch_digests: bool = False  # keep a hash of every batch in the summary (exact-resume checks)


@dataclass(frozen=True)
class EvalsConfig:
    """Carried for the cluster driver, which runs `configs/evals/<suite>.yaml` after each checkpoint."""

    suite: str | None = None
    data_root: str = "data"


SECTIONS = ("model", "data", "optim", "schedule", "loss", "task", "deepspeed", "checkpoint", "logging", "evals")


@dataclass(frozen=True)
class TrainConfig:
    recipe: str = ""  # the recipe's name (tags and run names); set by load_config
    seed: int = 0  # model initialisation and dropout
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    evals: EvalsConfig = field(default_factory=EvalsConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainConfig:
        """Build from a nested mapping; unknown keys and wrongly typed values raise ValueError naming the key."""
        return _build(cls, d, "")

    def replace(self, **sections: Any) -> TrainConfig:
        return dataclasses.replace(self, **sections)

    def validate(self, world_size: int, *, check_paths: bool = True) -> None:
        """Raise ValueError (field + fix) for anything that would fail later; see :func:`validate_config`."""
        validate_config(self, world_size, check_paths=check_paths)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=False)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_yaml())

    def format(self) -> str:
        """The resolved config as printed at start: one ``section.key: value`` per line."""
        lines = [f"recipe: {self.recipe}", f"seed: {self.seed}"]
        for name in SECTIONS:
            for key, value in dataclasses.asdict(getattr(self, name)).items():
                lines.append(f"{name}.{key}: {value}")
        return "\n".join(lines)


# --------------------------------------------------------------------------------------------- loading


def recipe_path(name_or_path: str | Path) -> Path:
    """A YAML file path, or the recipe name `configs/<name>.yaml`; ValueError listing the recipes if neither."""
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") and path.is_file():
        return path
    candidate = RECIPE_DIR / f"{name_or_path}.yaml"
    if candidate.exists():
        return candidate
    known = sorted(p.stem for p in RECIPE_DIR.glob("*.yaml"))
    if path.suffix in (".yaml", ".yml"):
        raise ValueError(f"recipe file {path} does not exist or is not a file; give a YAML path or a recipe: {known}")
    raise ValueError(f"no recipe {str(name_or_path)!r}: not a YAML file and not one of configs/*.yaml: {known}")


def _load_yaml(path: Path, seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    if path in seen:
        raise ValueError(f"recipe {path} inherits from itself via 'base:' ({' -> '.join(map(str, seen))})")
    data = read_yaml(path, "recipe")
    if data is None:  # an empty file: every default
        data = {}
    if not isinstance(data, dict):
        raise ValueError(
            f"recipe {path} must be a YAML mapping of sections (model:, data:, optim: ...), "
            f"got a {type(data).__name__}; see configs/local_demo.yaml"
        )
    base = data.pop("base", None)
    if base is None:
        return data
    if not isinstance(base, str) or not base:
        raise ValueError(f"recipe {path}: base={base!r} must be a recipe name or YAML path, e.g. base: vit_b16_i21k")
    return _deep_merge(_load_yaml(recipe_path(base), seen + (path,)), data)


def _deep_merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict) and key != "options":
            merged[key] = _deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def parse_override(text: str) -> tuple[list[str], Any]:
    """``"optim.lr=3e-4"`` → (["optim", "lr"], 0.0003); the value is a YAML scalar (null, true, 1e-3, [1, 2])."""
    key, sep, raw = text.partition("=")
    keys = key.strip().split(".")
    if not sep or not all(k.strip() for k in keys):
        raise ValueError(f"override {text!r} is not key=value; write e.g. optim.lr=3e-4 or model.name=vit_s16")
    value = parse_yaml(raw, f"override {text!r}: the value") if raw.strip() else ""
    return [k.strip() for k in keys], value


def apply_overrides(d: dict[str, Any], overrides: typing.Iterable[str]) -> dict[str, Any]:
    out = copy.deepcopy(d)  # ``d`` stays as the recipe wrote it (load_config checks it on its own)
    for text in overrides:
        keys, value = parse_override(text)
        node = out
        for key in keys[:-1]:
            child = node.get(key)
            if not isinstance(child, dict):
                child = {}
                node[key] = child
            node = child
        node[keys[-1]] = value
    return out


def load_config(path_or_recipe_name: str | Path, overrides: typing.Iterable[str] = ()) -> TrainConfig:
    """Load a recipe (path or name under configs/), apply ``key=value`` overrides and type-check every field.

    Unknown keys raise ValueError listing the valid ones. ``recipe`` defaults to the file's stem.
    """
    path = recipe_path(path_or_recipe_name)
    data = _load_yaml(path)
    data.setdefault("recipe", path.stem)
    merged = apply_overrides(data, list(overrides))  # a malformed override raises here, naming itself
    try:
        return TrainConfig.from_dict(merged)
    except ValueError as error:
        # Say where the bad key or value came from: the file (or its base chain), or an override.
        try:
            TrainConfig.from_dict(data)
        except ValueError:
            raise ValueError(f"recipe {path}: {error}") from None
        raise ValueError(f"--set override: {error}") from None


# --------------------------------------------------------------------------------------------- typing


def _build(cls: type, d: Any, prefix: str) -> Any:
    if not isinstance(d, dict):
        raise ValueError(f"{prefix.rstrip('.') or 'config'} must be a mapping, got {d!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(str(key) for key in set(d) - set(names))  # YAML keys may be numbers or null
    if unknown:
        where = prefix.rstrip(".") or "the top level"
        raise ValueError(f"unknown config key(s) {[prefix + u for u in unknown]} in {where}; valid keys: {names}")
    kwargs = {name: _coerce(d[name], hints[name], prefix + name) for name in names if name in d}
    return cls(**kwargs)


def coerce_value(value: Any, hint: Any, path: str) -> Any:
    """``value`` checked (and converted: list → tuple, "1e-3" → 0.001) against a dataclass field's type ``hint``.

    ValueError naming ``path`` and the expected type; the same rules as recipe fields (eval-suite options use it).
    """
    return _coerce(value, hint, path)


def _coerce(value: Any, hint: Any, path: str) -> Any:
    if dataclasses.is_dataclass(hint):
        return _build(hint, value, path + ".")
    origin = typing.get_origin(hint)
    if origin in (Union, types.UnionType):
        options = typing.get_args(hint)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _coerce(value, option, path)
            except ValueError as error:
                errors.append(str(error))
        raise ValueError(f"{path}={value!r} has the wrong type; expected {_type_name(hint)}")
    if origin is dict or hint is dict:
        if not isinstance(value, dict):
            raise ValueError(f"{path} must be a mapping, got {value!r}")
        return dict(value)
    if origin is tuple:
        args = typing.get_args(hint)
        variadic = args[-1] is Ellipsis
        if not isinstance(value, (list, tuple)) or (not variadic and len(value) != len(args)):
            raise ValueError(f"{path} must be a list{'' if variadic else f' of {len(args)} items'}, got {value!r}")
        items = args[:1] * len(value) if variadic else args
        return tuple(_coerce(v, a, f"{path}[{i}]") for i, (v, a) in enumerate(zip(value, items)))
    if hint is Any:
        return value
    if hint is bool:
        if not isinstance(value, bool):
            raise ValueError(f"{path} must be true or false, got {value!r}")
        return value
    if hint in (int, float) and isinstance(value, str):
        # YAML 1.1 reads "1e-3" (no dot) as a string
        value = _number(value, path, "an integer" if hint is int else "a number")
    if hint is int:
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not number or not math.isfinite(value) or int(value) != value:
            raise ValueError(f"{path} must be an integer, got {value!r}")
        return int(value)
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"{path} must be a finite number, got {value!r}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ValueError(f"{path} must be a string, got {value!r}")
        return value
    raise TypeError(f"internal: no coercion for {hint} at {path}")


def _number(text: str, path: str, kind: str) -> float | int:
    try:
        number = float(text)
    except ValueError:
        raise ValueError(f"{path} must be {kind}, got {text!r}") from None
    return int(number) if number.is_integer() and "e" not in text.lower() and "." not in text else number


def _type_name(hint: Any) -> str:
    args = typing.get_args(hint)
    if not args:
        return getattr(hint, "__name__", str(hint))
    return " or ".join("null" if a is type(None) else _type_name(a) for a in args)


# --------------------------------------------------------------------------------------------- validation


def resolve_path(path: str | Path) -> Path:
    """Local paths in a recipe are relative to the project root, whatever the working directory."""
    p = Path(str(path)[len("file://") :] if str(path).startswith("file://") else path).expanduser()
    return p if p.is_absolute() else PROJECT_ROOT / p


def is_remote(url: str) -> bool:
    return "://" in url and not url.startswith("file://")


def validate_config(config: TrainConfig, world_size: int, *, check_paths: bool = True) -> None:
    """Every check that can run before work starts; the first failure raises ValueError naming field and fix.

    ``check_paths=False`` skips what depends on files existing here (data, resume_from, init_from), e.g. to
    check a cluster recipe on a laptop. Remote (``s3://``…) data is checked when the stream opens it.
    """
    from pretrain import optim, tasks
    from pretrain.ds_config import batch_plan
    from pretrain.model import MODEL_NAMES, model_config

    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    m, d, o, s = config.model, config.data, config.optim, config.schedule
    if m.name not in MODEL_NAMES:
        raise ValueError(f"model.name={m.name!r} is unknown; set model.name to one of: {', '.join(MODEL_NAMES)}")
    _positive(d.image_size, "data.image_size")
    try:
        vit = model_config(m.name, **model_overrides(config, num_classes=m.num_classes or 1))
    except ValueError as error:
        raise ValueError(f"model/data settings do not make a valid {m.name}: {error}") from None
    if d.resolution_schedule:
        from pretrain.progressive import check_schedule

        check_schedule(d.resolution_schedule, d.image_size, vit.stride)
        if config.deepspeed.zero_stage > 2:
            raise ValueError(
                "data.resolution_schedule needs deepspeed.zero_stage ≤ 2 (the engine switch moves Adam state "
                "through ZeRO-1/2 fragments); set deepspeed.zero_stage=2 or drop the schedule"
            )
    _positive(d.global_batch_size, "data.global_batch_size")
    _positive(d.micro_batch_size, "data.micro_batch_size")
    batch_plan(d, world_size)  # raises when global batch is not divisible by world × micro
    if d.epoch_images is not None:
        _positive(d.epoch_images, "data.epoch_images")
    _at_least(d.num_workers, 0, "data.num_workers")
    if d.loader_start_method not in ("fork", "forkserver", "spawn"):
        raise ValueError(f"data.loader_start_method={d.loader_start_method!r}; use fork, forkserver or spawn")
    _at_least(d.shuffle_buffer, 0, "data.shuffle_buffer")
    if d.builtin is not None:
        _check_builtin(d.builtin, d.builtin_options)
    _at_least(d.mixup_alpha, 0.0, "data.mixup_alpha")
    if d.augment is not None:
        try:
            d.augment.validate()
        except ValueError as error:
            raise ValueError(f"data.{error}") from None

    if not o.lr > 0:
        raise ValueError(f"optim.lr={o.lr} must be > 0; the paper's i21k runs use optim.lr=1e-3")
    _at_least(o.weight_decay, 0.0, "optim.weight_decay")
    for name in ("beta1", "beta2"):
        if not 0.0 <= getattr(o, name) < 1.0:
            raise ValueError(f"optim.{name}={getattr(o, name)} must be in [0, 1); the paper uses 0.9 / 0.999")
    _positive(o.eps, "optim.eps")
    _at_least(o.grad_clip, 0.0, "optim.grad_clip")

    if s.decay not in optim.DECAYS:
        raise ValueError(f"schedule.decay={s.decay!r} is unknown; use one of {list(optim.DECAYS)}")
    if not 0.0 <= s.end_lr <= o.lr:
        raise ValueError(f"schedule.end_lr={s.end_lr} must be in [0, optim.lr={o.lr}]")
    epoch_images = d.epoch_images
    local_info = not is_remote(d.train) and (resolve_path(d.train) / "dataset.json").exists()
    if epoch_images is None and check_paths and local_info:
        epoch_images = _dataset_num_samples(d.train)
    total = optim.duration_to_steps(s.total, d.global_batch_size, epoch_images, field="schedule.total")
    warmup = optim.duration_to_steps(s.warmup, d.global_batch_size, epoch_images, field="schedule.warmup", zero_ok=True)
    if warmup >= total:
        raise ValueError(f"schedule.warmup ({warmup} steps) must be shorter than schedule.total ({total} steps)")
    if s.stop_at_step is not None:
        _positive(s.stop_at_step, "schedule.stop_at_step")

    if config.loss.type not in tasks.LOSSES:
        raise ValueError(f"loss.type={config.loss.type!r} is unknown; use one of {list(tasks.LOSSES)}")
    if not 0.0 <= config.loss.label_smoothing < 1.0:
        raise ValueError(f"loss.label_smoothing={config.loss.label_smoothing} must be in [0, 1)")
    if config.loss.label_smoothing and config.loss.type != "softmax_xent":
        raise ValueError("loss.label_smoothing applies to softmax_xent only; set it to 0 or loss.type=softmax_xent")
    if config.task.name not in tasks.registered_tasks():
        raise ValueError(f"task.name={config.task.name!r} is not registered; use one of {sorted(tasks.TASKS)}")

    ds = config.deepspeed
    if isinstance(ds.zero_stage, bool) or ds.zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"deepspeed.zero_stage={ds.zero_stage} is not a ZeRO stage; use 0, 1, 2 or 3 (2 is usual)")
    if ds.precision not in ("auto", "fp32", "bf16"):
        hint = " (fp16 loss scaling is not supported; use bf16)" if ds.precision == "fp16" else ""
        raise ValueError(f"deepspeed.precision={ds.precision!r} is unknown{hint}; use auto, fp32 or bf16")
    if ds.dist_backend not in ("auto", "nccl", "gloo"):
        raise ValueError(f"deepspeed.dist_backend={ds.dist_backend!r} is unknown; use auto, nccl or gloo")
    _positive(ds.reduce_bucket_size, "deepspeed.reduce_bucket_size")
    _positive(ds.allgather_bucket_size, "deepspeed.allgather_bucket_size")
    _positive(ds.timeout_minutes, "deepspeed.timeout_minutes")

    c = config.checkpoint
    _positive(c.every_steps, "checkpoint.every_steps")
    _positive(c.keep_last, "checkpoint.keep_last")
    if not c.dir:
        raise ValueError("checkpoint.dir is empty; set it to the run folder, e.g. checkpoint.dir=runs/my_run")
    _positive(config.logging.log_every, "logging.log_every")
    if config.logging.peak_tflops is not None:
        _positive(config.logging.peak_tflops, "logging.peak_tflops")
    if check_paths:
        _check_paths(config)


def _check_builtin(name: str, options: dict[str, Any]) -> None:
    """data.builtin and its size options, checked here rather than when rank 0 generates the set mid-start."""
    from data_pipeline.builtin import ALIASES, BUILTIN_NAMES, BuiltinConfig

    if ALIASES.get(name, name) not in BUILTIN_NAMES:
        raise ValueError(f"data.builtin={name!r} is unknown; use one of {', '.join(BUILTIN_NAMES)} or unset it")
    known = [f.name for f in dataclasses.fields(BuiltinConfig)]
    for key, value in options.items():
        if key not in known:
            raise ValueError(f"data.builtin_options.{key} is unknown; valid options: {', '.join(known)}")
        low = 0 if key == "seed" else 1
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"data.builtin_options.{key}={value!r} must be an integer >= {low}")


def model_overrides(config: TrainConfig, num_classes: int) -> dict[str, Any]:
    """The ViTConfig overrides the training config implies (None fields keep the variant's default)."""
    m = config.model
    out: dict[str, Any] = {"image_size": config.data.image_size, "num_classes": num_classes}
    for name in ("representation_size", "head_bias_init", "dropout", "attention_dropout", "pool", "gelu_approximate"):
        if getattr(m, name) is not None:
            out[name] = getattr(m, name)
    out["grad_checkpointing"] = m.grad_checkpointing
    return out


def _check_paths(config: TrainConfig) -> None:
    d, c = config.data, config.checkpoint
    if not is_remote(d.train):
        shard_dir = resolve_path(d.train)
        if not (shard_dir / "manifest.parquet").exists():
            if d.builtin is None:
                raise ValueError(
                    f"data.train={d.train!r}: no shard folder at {shard_dir} (manifest.parquet missing); write shards "
                    "there (e.g. `python -m data_pipeline.builtin fractal --out data`) or set data.builtin=<name> to "
                    "generate a built-in dataset on demand"
                )
            if shard_dir.parent.name != d.builtin:
                raise ValueError(
                    f"data.train={d.train!r} cannot hold built-in dataset {d.builtin!r}: it is generated as "
                    f"<root>/{d.builtin}/<split>; set data.train=data/{d.builtin}/train"
                )
    if c.resume_from is not None and not (resolve_path(c.resume_from) / "COMPLETE").exists():
        raise ValueError(
            f"checkpoint.resume_from={c.resume_from!r} is not a complete checkpoint (no COMPLETE marker); point it "
            "at a <run>/checkpoints/step_XXXXXXXX folder or unset it"
        )
    if c.init_from is not None:
        src = resolve_path(c.init_from)
        if not (src.suffix == ".npz" and src.is_file()) and not (src / "model.safetensors").exists():
            raise ValueError(
                f"checkpoint.init_from={c.init_from!r} is neither an .npz file nor a folder with model.safetensors; "
                "point it at an official ViT .npz or a checkpoint folder"
            )
        # An .npz is a zip whose directory is at its end: a truncated download or a pickle fails here, in seconds,
        # rather than after the workers have started.
        if src.suffix == ".npz" and src.is_file() and not zipfile.is_zipfile(src):
            raise ValueError(
                f"checkpoint.init_from={c.init_from!r} is not an .npz archive (truncated, damaged or another format); "
                "download the official checkpoint again or point at a model.safetensors folder"
            )


def _dataset_num_samples(train: str) -> int:
    path = resolve_path(train) / "dataset.json"
    try:
        info = json.loads(path.read_text())
        return int(info["num_samples"])
    except (OSError, ValueError, KeyError, TypeError) as error:  # reading one small user file: all mean "damaged"
        raise ValueError(
            f"data.train={train!r}: {path} is unreadable or damaged ({type(error).__name__}: {error}); rewrite the "
            "shard folder, or check it with `python -m data_pipeline.validate`"
        ) from None


def _positive(value: float, name: str) -> None:
    if not value > 0:
        raise ValueError(f"{name}={value} must be > 0")


def _at_least(value: float, low: float, name: str) -> None:
    if value < low:
        raise ValueError(f"{name}={value} must be >= {low}")
