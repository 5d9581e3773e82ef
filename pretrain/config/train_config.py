"""The training recipe, `TrainConfig`, loaded from YAML (docs/design.md, "One owner per concern", "Recipe paths")."""

from __future__ import annotations

import dataclasses
import os
import shutil
import zipfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from data_pipeline.cli import file_in_the_way, positive
from data_pipeline.manifest import (
    MANIFEST_FILE,
    check_class_count,
    check_shards_exist,
    is_shard_folder,
    read_dataset_info,
    read_dataset_json,
)
from data_pipeline.paths import RECIPE_DIR, is_remote, resolve_location
from data_pipeline.stream.config import DataConfig
from pretrain.checkpoint import run_folder
from pretrain.config import ds_config, optim, progressive, typed_yaml
from pretrain.config.ds_config import DeepSpeedConfig
from pretrain.config.optim import OptimConfig, ScheduleConfig
from pretrain.model import tasks
from pretrain.model.tasks import LossConfig, TaskConfig
from pretrain.model.vit import MODEL_NAMES, ViTConfig, model_config
from pretrain.weights import formats
from pretrain.weights import source as weights_source


@dataclass(frozen=True)
class ModelConfig:
    """Which ViT to build; ``None`` keeps the variant's default."""

    name: str = "vit_b16"  # a name in pretrain.model.vit.MODEL_NAMES
    num_classes: int | None = None  # None → the training set's (dataset.json)
    representation_size: int | None = None  # pre-logits Dense+tanh width
    head_bias_init: float | None = None  # −10 with sigmoid xent keeps the initial loss small
    dropout: float | None = None  # 0.1 for i21k pre-training of B and L
    attention_dropout: float | None = None  # on the attention weights
    pool: Literal["token", "gap"] | None = None  # class token, or the mean of all tokens
    gelu_approximate: Literal["tanh", "none"] | None = None  # tanh (JAX checkpoints) | none (erf)
    grad_checkpointing: bool = False  # recompute each block in backward
    compile: bool = False  # torch.compile each encoder block (docs/performance.md, "Compiled blocks")


@dataclass(frozen=True)
class CheckpointConfig:
    """The run folder, the save cadence, and where a run starts from."""

    dir: str = "runs/default"  # the run folder, a filesystem path
    every_steps: int = 1000  # save every K optimizer steps (and at the end)
    keep_last: int = 3  # complete checkpoints kept
    resume_from: str | None = None  # a checkpoint to resume (when <dir> has none)
    init_from: str | None = None  # weights only: .npz, weights/checkpoint/run folder, or a URL
    on_save_error: Literal["stop", "skip"] = "stop"  # skip: train on (never at the last step)


@dataclass(frozen=True)
class LoggingConfig:
    """MLflow and the console."""

    mlflow_tracking_uri: str | None = None  # None → the project's default store
    mlflow_run_id: str | None = None  # the driver's run; None → none unless mlflow_experiment
    mlflow_experiment: str | None = None  # without a run id: create (and end) a run here
    log_every: int = 10  # steps between logs
    peak_tflops: float | None = None  # per-device peak for MFU; None → pretrain.telemetry.peak
    progress_bar: bool = True  # tqdm on rank 0
    record_batch_digests: bool = False  # a hash of every batch in the summary, also in <run>/batch_digests/
    record_sample_keys: bool = False  # every step's sample keys, also in <run>/sample_keys/


@dataclass(frozen=True)
class SuiteCadence:
    """One more suite and its cadence."""

    suite: str  # an eval suite name or YAML path
    every: int = 1  # every N-th checkpoint (and the baseline and the last)


@dataclass(frozen=True)
class EvalsConfig:
    """Evals at checkpoints, run by the cluster driver (`cluster.plan.evals.cadence`)."""

    suite: str | None = None  # an eval suite name or YAML path; None → no evals
    every: int = 1  # `suite` evaluates every N-th checkpoint, and the baseline and the last
    extra_suites: tuple[SuiteCadence, ...] = ()  # more suites, run in this order
    data_root: str = "data"  # the suites' datasets
    baseline: bool = True  # also evaluate step_00000000
    timeout_s: float = 3600.0  # the job's end waits this long for pending evals
    budget_fraction: float = 0.10  # most eval cost as a share of the training FLOPs; the plan refuses more

    def schedule(self) -> tuple[tuple[str, int], ...]:
        """(suite, every) of each suite, `suite` first; () without `suite`."""
        if not self.suite:
            return ()
        return ((self.suite, self.every), *((s.suite, s.every) for s in self.extra_suites))

    def validate(self) -> None:
        positive(self.timeout_s, "evals.timeout_s")
        positive(self.every, "evals.every")
        for i, extra in enumerate(self.extra_suites):
            positive(extra.every, f"evals.extra_suites[{i}].every")
        positive(self.budget_fraction, "evals.budget_fraction")
        names = [suite for suite, _ in self.schedule()]
        if len(set(names)) < len(names):
            raise ValueError(
                f"evals: suite(s) {sorted({n for n in names if names.count(n) > 1})} named twice (evals.suite and "
                "evals.extra_suites); name each suite once, with the cadence it should have"
            )


SECTIONS = ("model", "data", "optim", "schedule", "loss", "task", "deepspeed", "checkpoint", "logging", "evals")


@dataclass(frozen=True)
class TrainConfig:
    recipe: str = ""  # the recipe's name (tags, run names); set by load_config
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
        """Build from a nested mapping; ValueError names a bad key."""
        return typed_yaml.build(cls, d)

    def replace(self, **sections: Any) -> TrainConfig:
        return dataclasses.replace(self, **sections)

    def resolved(self) -> TrainConfig:
        """This config with its local paths absolute; idempotent."""
        d, c, e = self.data, self.checkpoint, self.evals
        return dataclasses.replace(
            self,
            data=dataclasses.replace(d, train=_resolve(d.train)),
            checkpoint=dataclasses.replace(
                c,
                dir=_resolve(c.dir),
                resume_from=c.resume_from and _resolve(c.resume_from),
                init_from=c.init_from and _resolve(c.init_from),
            ),
            evals=dataclasses.replace(e, data_root=_resolve(e.data_root)),
        )

    def validate(self, world_size: int, *, check_paths: bool = True) -> None:
        """ValueError (field + fix) for anything that would fail later; ``check_paths=False`` skips local files."""
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be a positive int, got {world_size!r}")
        typed_yaml.build(TrainConfig, self.to_dict())  # a config made in code
        # numpy's SeedSequence (dropout) takes no negative, and reads a larger one as two 32-bit words: (2**32 + 5, 0)
        # is (5, 1), another seed's entropy
        if not 0 <= self.seed < 2**32:
            raise ValueError(f"seed={self.seed} must be an integer in [0, 2**32), e.g. seed=0")
        d, here = self.data, self.resolved()
        ds_config.batch_plan(d, world_size)
        vit = check_model(self)
        progressive.check_config(d.resolution_schedule, d.image_size, vit.stride, self.deepspeed.zero_stage)
        optim.check_config(self.optim, self.schedule, d.global_batch_size, _epoch_images(here.data, check_paths))
        tasks.check_config(self.loss, self.task, vit, d.resolution_schedule, self.model.name)
        ds_config.check_config(self.deepspeed)
        check_run_config(self.checkpoint, self.logging)
        self.evals.validate()
        if check_paths:
            check_paths_exist(here)
            check_compiler(self.model)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_yaml())

    def format(self) -> str:
        """One ``section.key: value`` per line."""
        lines = [f"{n}.{k}: {v}" for n in SECTIONS for k, v in dataclasses.asdict(getattr(self, n)).items()]
        return "\n".join([f"recipe: {self.recipe}", f"seed: {self.seed}", *lines])


def recipe_path(name_or_path: str | Path) -> Path:
    """A YAML file path, or `configs/<name>.yaml`; ValueError listing the recipes if neither."""
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


def read_recipe(path: Path) -> dict[str, Any]:
    """The recipe file, its ``base:`` chain merged in; ``recipe`` defaults to the file's stem."""
    fix = "see configs/local_demo.yaml (sections model:, data:, optim: ...) and local_mpp.yaml (base: local_demo)"
    data = typed_yaml.read_with_base(path, "recipe", fix, recipe_path)
    data.setdefault("recipe", path.stem)
    return data


def load_config(path_or_recipe_name: str | Path, overrides: Iterable[str] = ()) -> TrainConfig:
    """Load a recipe (path or name) with ``key=value`` overrides, typed and resolved."""
    path = recipe_path(path_or_recipe_name)
    return config_from_recipe(path, read_recipe(path), overrides).resolved()


def config_from_recipe(path: Path, written: dict[str, Any], overrides: Iterable[str] = ()) -> TrainConfig:
    """`load_config` on a recipe already read, its paths as written."""
    merged = typed_yaml.apply_overrides(written, list(overrides))
    try:
        return TrainConfig.from_dict(merged)
    except ValueError as error:
        try:
            TrainConfig.from_dict(written)
        except ValueError:
            raise ValueError(f"recipe {path}: {error}") from None
        raise ValueError(f"--set override: {error}") from None


def model_overrides(config: TrainConfig, num_classes: int) -> dict[str, Any]:
    """The ViTConfig overrides the training config implies."""
    m = config.model
    out: dict[str, Any] = {"image_size": config.data.image_size, "num_classes": num_classes}
    for name in ("representation_size", "head_bias_init", "dropout", "attention_dropout", "pool", "gelu_approximate"):
        if getattr(m, name) is not None:
            out[name] = getattr(m, name)
    out["grad_checkpointing"] = m.grad_checkpointing
    return out


def check_model(config: TrainConfig) -> ViTConfig:
    """The ViTConfig the model and data sections make."""
    m = config.model
    if m.name not in MODEL_NAMES:
        raise ValueError(f"model.name={m.name!r} is unknown; set model.name to one of: {', '.join(MODEL_NAMES)}")
    if m.num_classes is not None and m.num_classes < 1:  # ViTConfig's 0 (no head) trains nothing
        raise ValueError(
            f"model.num_classes={m.num_classes}: pre-training needs a head of at least one class; set it to the "
            "training set's class count, or null to take it from the dataset"
        )
    overrides = model_overrides(config, num_classes=m.num_classes or 1)
    try:
        return model_config(m.name, **overrides)
    except ValueError as error:
        text = str(error)
        for name in overrides:  # the recipe's keys, not the ViTConfig fields they set
            key = "data.image_size" if name == "image_size" else f"model.{name}"
            text = text.replace(f"ViTConfig.{name}", key).replace(f"e.g. {name}=", f"e.g. {key}=")
        raise ValueError(f"model/data settings do not make a valid {m.name}: {text}") from None


def check_compiler(m: ModelConfig) -> None:
    compiler = os.environ.get("CXX") or "g++"
    if m.compile and shutil.which(compiler) is None:
        raise ValueError(
            f"model.compile=true needs a C++ compiler, and {compiler!r} is not on PATH; install g++ (or set CXX to "
            "one), or set model.compile=false"
        )


def check_run_config(c: CheckpointConfig, log: LoggingConfig) -> None:
    positive(c.every_steps, "checkpoint.every_steps")
    positive(c.keep_last, "checkpoint.keep_last")
    if not c.dir:
        raise ValueError("checkpoint.dir is empty; set it to the run folder, e.g. checkpoint.dir=runs/my_run")
    if is_remote(c.dir):  # DeepSpeed renames files in it
        raise ValueError(
            f"checkpoint.dir={c.dir!r} is object storage; ranks write checkpoints to a filesystem path (a shared one "
            "on a cluster, e.g. /fsx/runs/my_run); copy finished checkpoints to the bucket afterwards"
        )
    if c.resume_from is not None and is_remote(c.resume_from):
        raise ValueError(
            f"checkpoint.resume_from={c.resume_from!r} is object storage; a resume reads the whole engine state from "
            "a filesystem path: copy the checkpoint folder there, or set checkpoint.init_from to the URL for its "
            "weights only"
        )
    positive(log.log_every, "logging.log_every")
    if log.peak_tflops is not None:
        positive(log.peak_tflops, "logging.peak_tflops")


def check_paths_exist(config: TrainConfig) -> None:
    """The local files a resolved config points at."""
    d, c = config.data, config.checkpoint
    if not is_remote(d.train):
        shard_dir = Path(d.train)
        if not is_shard_folder(shard_dir):
            if d.builtin is None:
                raise ValueError(
                    f"data.train={d.train!r}: no shard folder there (no {MANIFEST_FILE}); write shards there "
                    "(e.g. `python -m data_pipeline.builtin fractal --out data`) or set data.builtin=<name> to "
                    "generate a built-in dataset on demand"
                )
            if not d.generates_builtin:  # the one rule for where the set is generated (DataConfig)
                raise ValueError(
                    f"data.train={d.train!r}: no shard folder there (no {MANIFEST_FILE}), and it cannot hold built-in "
                    f"dataset {d.builtin!r}, generated as <root>/{d.builtin}/<split>; write your shards there "
                    f"(`python -m data_pipeline.write`) or set data.train=data/{d.builtin}/train"
                )
        else:  # a folder that contradicts itself, found now (--dry-run, the plan) rather than at the ranks' start
            info = read_dataset_info(shard_dir)
            check_class_count(info)
            check_shards_exist(info)
    if file := file_in_the_way(Path(c.dir)):
        raise ValueError(f"checkpoint.dir={c.dir!r}: {file} is a file; set checkpoint.dir to a folder (new or a run's)")
    if c.resume_from is not None:
        run_folder.require_complete(Path(c.resume_from), "checkpoint.resume_from")
    if c.init_from is not None and not is_remote(c.init_from):  # a URL is checked when fetched
        src = weights_source.locate_setting(c.init_from, "checkpoint.init_from")
        npz = src.suffix == ".npz" and src.is_file()
        if not npz and not (src / "model.safetensors").exists():
            raise ValueError(
                f"checkpoint.init_from={c.init_from!r} is neither an .npz file nor a folder with model.safetensors; "
                "point it at an official ViT .npz or a checkpoint folder"
            )
        # a zip's directory is at its end: a truncated download fails here
        if npz and not zipfile.is_zipfile(src):
            raise ValueError(
                f"checkpoint.init_from={c.init_from!r} is not an .npz archive (truncated, damaged or another format); "
                "download the official checkpoint again or point at a model.safetensors folder"
            )
        _check_init_architecture(src, npz, config)  # refused here, not in every rank


def _check_init_architecture(src: Path, npz: bool, config: TrainConfig) -> None:
    """ValueError if the ``init_from`` weights are of another architecture than the recipe's model, as a folder's
    ``model.json`` or an .npz's array shapes say; unreadable ones are left to the ranks, which load the weights."""
    saved = formats.npz_architecture(src) if npz else formats.recorded_config(src)
    if saved is not None:
        formats.check_init_architecture(saved, check_model(config), str(src))


def _epoch_images(d: DataConfig, check_paths: bool) -> int | None:
    """Images per epoch: the recipe's, else the local dataset.json's."""
    if d.epoch_images is None and check_paths and not is_remote(d.train):
        meta = read_dataset_json(d.train)
        if meta is not None and "num_samples" in meta:
            return int(meta["num_samples"])
    return d.epoch_images


def _resolve(path: str) -> str:
    return resolve_location(path) if path else path
