"""The plan: a recipe joined with a profile — topology, batch split, model, compute, memory per device, data, evals.

Each number comes from its one owner; the plan shows exactly what the workers run.
"""

from __future__ import annotations

import importlib.util
import math
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from cluster.plan import comms, memory, mfu, storage
from cluster.plan.checkpoint_costs import baseline_eval, checkpoint_space_warning, pinned_beyond_kept
from cluster.plan.comms import CommPlan
from cluster.plan.compute import ComputePlan, compute_plan, gpu_bf16_of, profile_peak, step_time
from cluster.plan.data_wait import data_wait, loader_host_bytes
from cluster.plan.errors import PlanError
from cluster.plan.evals.cadence import EvalCadence
from cluster.plan.evals.cost import EvalsPlan, plan_evals
from cluster.plan.memory import MemoryPlan
from cluster.plan.startup import StartupAllowance, startup_allowance
from cluster.plan.storage import STORAGE_EXTRAS, StorageExtra
from cluster.profiles import SAFE_NAME, ClusterProfile
from data_pipeline.manifest import read_dataset_json
from data_pipeline.paths import is_remote, resolve_location
from data_pipeline.write.writer import WriteConfig
from evals.suites import SuiteConfig, load_suite
from pretrain.config.ds_config import BatchPlan, batch_plan, deepspeed_config, valid_world_sizes
from pretrain.config.precision import decide
from pretrain.config.train_config import TrainConfig, config_from_recipe, model_overrides, read_recipe, recipe_path
from pretrain.config.typed_yaml import parse_override
from pretrain.model import flops, tasks
from pretrain.model.vit import ViTConfig, model_config
from pretrain.weights.hf import hf_refusal

RECIPE_DATA_ROOT = "data"  # a profile relocates it to its storage
RELOCATED = ("data.train", "evals.data_root")  # the paths under it
RECIPE_RUNS_ROOT = "runs"  # the recipes' run folders' root: storage.checkpoints on several nodes
RELOCATED_RUNS = ("checkpoint.dir", "checkpoint.resume_from", "checkpoint.init_from")  # the paths under it
# Assumed where the training manifest is not readable here: i21k's bytes per image (docs/reference.md §6), and shards
# as this project's writer makes them by default.
ASSUMED_BYTES_PER_IMAGE = 92_000
ASSUMED_SAMPLES_PER_SHARD = WriteConfig.samples_per_shard
LOADER_MEMORY_SHARE = 0.5  # of a node's memory, for the data streams
MIN_SHARDS_PER_STREAM = 8  # below this, streams cycle over a few shards and become correlated (docs/reference.md §6)

# To log the final model as an HF ViT folder; = pyproject.toml's (tested).
HF_EXTRA = StorageExtra("hf", "transformers>=4.45,<6", "transformers")
EXTRAS = {**STORAGE_EXTRAS, HF_EXTRA.name: HF_EXTRA}


def runtime_pip(plan: dict) -> list[str]:
    """The runtime env's `pip` list for `Plan.to_dict()`."""
    return [EXTRAS[name].requirement for name in plan.get("runtime_extras", ())]


def _final_model(profile: ClusterProfile, vit: ViTConfig) -> tuple[bool, str]:
    if hf_refusal(vit) is not None:
        return False, "the final model is not logged to MLflow: HF's ViT has no pre-logits, gap pool or hybrid stem"
    if profile.is_local and importlib.util.find_spec(HF_EXTRA.module) is None:
        return False, f"the final model is not logged to MLflow: no {HF_EXTRA.module} here (pip install -e '.[hf]')"
    return True, "the final model is logged to MLflow at the job's end"


def _runtime_extras(profile: ClusterProfile, data: DataPlan, logs_model: bool) -> tuple[str, ...]:
    """A `local` job gets only a storage extra it lacks."""
    if profile.is_local:
        return tuple(n for n in data.storage_extras if importlib.util.find_spec(EXTRAS[n].module) is None)
    return (*data.storage_extras, *((HF_EXTRA.name,) if logs_model else ()))


def _relocate(path: str, root: str, under: str = RECIPE_DATA_ROOT) -> str:
    """`data/x/y` (``under``/x/y) → `<root>/x/y`; absolute paths and URLs stay."""
    if is_remote(path) or Path(path).is_absolute():
        return path
    parts = Path(path).parts
    if parts and parts[0] == under:
        return "/".join([root.rstrip("/"), *parts[1:]])
    return path


def _relocate_sets(sets: list[str], profile: ClusterProfile) -> list[str]:
    """The user's `data.train` and `evals.data_root` relocated as the recipe's: they come last, so they would stay;
    on a remote profile `runs/...` checkpoint paths too, under storage.checkpoints as the recipe's run folder goes."""
    roots = {key: (profile.storage.shards, RECIPE_DATA_ROOT) for key in RELOCATED}
    if not profile.is_local:
        roots |= {key: (profile.storage.checkpoints, RECIPE_RUNS_ROOT) for key in RELOCATED_RUNS}
    out = []
    for text in sets:
        keys, value = parse_override(text)
        key = ".".join(keys)
        out.append(f"{key}={_relocate(value, *roots[key])}" if key in roots and isinstance(value, str) else text)
    return out


def _given(written: dict, sets: list[str]) -> set[str]:
    def walk(d: dict, at: str) -> set[str]:
        return set().union(*(walk(v, f"{at}{k}.") if isinstance(v, dict) else {f"{at}{k}"} for k, v in d.items()))

    return walk(written, "") | {".".join(parse_override(s)[0]) for s in sets}


def _profile_defaults(profile: ClusterProfile) -> dict[str, Any]:
    d = profile.defaults
    return {
        "deepspeed.zero_stage": d.zero_stage,
        "deepspeed.precision": d.precision,
        "data.micro_batch_size": d.micro_batch_size,
        "data.num_workers": profile.workers.loader_workers,
    }


def _recipe_over_profile(
    profile: ClusterProfile, path: Path, written: dict, sets: list[str], run_name: str, config: TrainConfig
) -> list[str]:
    """A line per profile default the recipe as written replaces: the value the plan uses, and the profile's as this
    run would use it (the recipe silent there), or why the profile's cannot apply."""
    from_recipe, from_user = _given(written, []), _given({}, sets)
    lines = []
    for key, default in _profile_defaults(profile).items():
        section, field = key.split(".")
        value = getattr(getattr(config, section), field)
        if key not in from_recipe or key in from_user or value == "auto":
            continue
        try:
            silent = _resolve(profile, path, _without(written, key), sets, run_name)
        except ValueError as error:  # PlanError too
            named = f"the recipe's {key}={value} replaces profile {profile.name}'s {default}"
            lines.append(f"{named}, which cannot apply here: {error}")
            continue
        theirs = getattr(getattr(silent, section), field)
        if str(theirs) != str(value):
            lowered = "" if str(theirs) == str(default) else f" (lowered to {theirs} here)"
            lines.append(
                f"the recipe's {key}={value} replaces profile {profile.name}'s {default}{lowered}; "
                f"--set {key}={theirs} takes the profile's"
            )
    return lines


def _without(written: dict, key: str) -> dict:
    """``written`` without the dotted ``key``."""
    section, field = key.split(".")
    return {**written, section: {k: v for k, v in written[section].items() if k != field}}


def profile_overrides(profile: ClusterProfile, path: Path, written: dict, sets: list[str], run_name: str) -> list[str]:
    """`key=value` overrides that put a recipe on this profile; its `defaults` only where the recipe is silent."""
    base, given = config_from_recipe(path, written, sets), _given(written, sets)
    d, shards = profile.defaults, profile.storage.shards
    out = [
        f"deepspeed.dist_backend={profile.comm_backend}",
        f"data.train={_relocate(base.data.train, shards)}",
        f"logging.mlflow_tracking_uri={profile.storage.mlflow_tracking_uri}",
        f"checkpoint.dir={profile.storage.checkpoints.rstrip('/')}/{run_name}",
        f"evals.data_root={_relocate(base.evals.data_root, shards)}",
        # forking Ray Train's threaded actors is unsafe (docs/reference.md §6)
        "data.loader_start_method=forkserver",
        "logging.progress_bar=false",
    ]
    out += [f"{k}={v}" for k, v in _profile_defaults(profile).items() if k not in given]
    # the workers' own rule (`decide`): on CUDA auto and probe are bf16, but fp32 at ZeRO-0 or without bf16 tensor cores
    requested = base.deepspeed.precision if "deepspeed.precision" in given else d.precision
    zero_stage = base.deepspeed.zero_stage if "deepspeed.zero_stage" in given else d.zero_stage
    gpu_precision = (
        decide(requested, profile.device_type, zero_stage=zero_stage, cuda_bf16=gpu_bf16_of(profile)).precision
        if profile.uses_gpus
        else ""
    )
    peak = profile_peak(profile, gpu_precision or "fp32")
    if peak is not None:
        out.append(f"logging.peak_tflops={peak.tflops}")
    micro = base.data.micro_batch_size if "data.micro_batch_size" in given else d.micro_batch_size
    span = _span(profile)
    per_rank = base.data.global_batch_size // span
    user_micro = any(parse_override(s)[0] == ["data", "micro_batch_size"] for s in sets)
    if not user_micro and per_rank and base.data.global_batch_size % span == 0 and per_rank % micro:
        fitting = max(d for d in range(1, min(per_rank, micro) + 1) if per_rank % d == 0)
        out.append(f"data.micro_batch_size={fitting}")
    return out


def _span(profile: ClusterProfile) -> int:
    """What the global batch is split by: one micro-batch for every world size Ray may pick."""
    return math.lcm(*range(profile.workers.min_workers, profile.workers.max_workers + 1))


def resolve_config(profile: ClusterProfile, recipe: str, sets: list[str], run_name: str) -> TrainConfig:
    """Recipe → profile defaults → the user's `--set` (last wins), validated at the profile's world size."""
    return resolve_with_notes(profile, recipe, sets, run_name)[0]


def resolve_run(
    profile: ClusterProfile, recipe: str, sets: list[str], run_name: str | None
) -> tuple[TrainConfig, list[str], SuiteConfig | None]:
    """What `cluster.launch` and `cluster.driver --cluster` run: `resolve_with_notes` of the run (named
    ``<recipe>-<time>`` by default) and its eval suite, read now rather than at the first eval."""
    run_name = run_name or f"{Path(recipe).stem}-{time.strftime('%Y%m%d-%H%M%S')}"
    config, notes = resolve_with_notes(profile, recipe, sets, run_name)
    return config, notes, load_suite(config.evals.suite) if config.evals.suite else None


def resolve_with_notes(
    profile: ClusterProfile, recipe: str, sets: list[str], run_name: str
) -> tuple[TrainConfig, list[str]]:
    """`resolve_config`, and `_recipe_over_profile`'s lines."""
    if not SAFE_NAME.fullmatch(run_name):  # it names the run folder under the profile's checkpoints
        raise ValueError(
            f"run name {run_name!r}: use letters, digits, '.', '_' and '-' only (--run-name, e.g. vit-b16-try2)"
        )
    path = recipe_path(recipe)
    written = read_recipe(path)
    config = _resolve(profile, path, written, sets, run_name)
    return config, _recipe_over_profile(profile, path, written, sets, run_name, config) + _remote_builtin(config)


def _resolve(profile: ClusterProfile, path: Path, written: dict, sets: list[str], run_name: str) -> TrainConfig:
    """The recipe as read, on this profile, with the user's `--set`; validated at its world size(s)."""
    sets = _relocate_sets(sets, profile)
    overrides = profile_overrides(profile, path, written, sets, run_name)
    config = config_from_recipe(path, written, [*overrides, *sets])
    if profile.uses_gpus:  # CPU runs keep their settings
        chosen = reduction_overrides(profile, config, _given(written, sets))
        config = config_from_recipe(path, written, [*overrides, *chosen, *sets])
    storage.node_local_setting(profile, config)
    if profile.workers.elastic:
        elastic_world_sizes(profile, config)
    config.validate(profile.workers.num_workers, check_paths=profile.is_local)
    return config


def _remote_builtin(config: TrainConfig) -> list[str]:
    """The line for a built-in training set in object storage, which nothing generates."""
    d = config.data
    if not d.builtin or not is_remote(d.train):
        return []
    sets = "".join(f" --set {key}={value}" for key, value in d.builtin_options.items())
    return [
        f"data.builtin={d.builtin} is generated only for a local data.train; {d.train} must hold it already "
        f"(`python -m data_pipeline.builtin {d.builtin} --out DIR{sets}`, then copy DIR/{d.builtin}/train there)"
    ]


def reduction_overrides(profile: ClusterProfile, config: TrainConfig, given: set[str]) -> list[str]:
    """`comms.choose_reduction`'s, for the keys the recipe and `--set` leave unset (docs/network.md)."""
    vit, model = _model_size(config)
    batch = batch_plan(config.data, profile.workers.num_workers)
    measured = mfu.measured(config.model.name, profile.hardware.gpu_type)
    precision, step_s = step_time(profile, config, vit, batch, measured)
    ds = config.deepspeed
    r = comms.choose_reduction(
        profile, ds.zero_stage, precision, batch.world_size, batch.grad_accum_steps, model.num_params, step_s
    )
    # the buckets fit the dtype in force, which may be the recipe's
    dtype = ds.communication_data_type if "deepspeed.communication_data_type" in given else r.communication_data_type
    reduce, gather = comms.buckets(profile, batch.world_size, precision if dtype == "auto" else dtype, precision)
    chosen = {
        "deepspeed.communication_data_type": r.communication_data_type,
        "deepspeed.reduce_bucket_size": reduce,
        "deepspeed.allgather_bucket_size": gather,
    }
    return [f"{k}={v}" for k, v in chosen.items() if k not in given]


def elastic_world_sizes(profile: ClusterProfile, config: TrainConfig) -> list[int]:
    """workers.min..max; PlanError unless each keeps the global batch."""
    w = profile.workers
    sizes = list(range(w.min_workers, w.max_workers + 1))
    valid = valid_world_sizes(config.data, max(w.max_workers, config.data.streams))
    bad = [n for n in sizes if n not in valid]
    if bad:
        d = config.data
        ranges = [f"{a}..{b}" for a in valid for b in valid if a <= b and all(n in valid for n in range(a, b + 1))]
        raise PlanError(
            f"profile {profile.name}: workers.min={w.min_workers}..max={w.max_workers} includes world size(s) "
            f"{bad} that cannot keep the global batch {d.global_batch_size} (data.streams={d.streams}, "
            f"data.micro_batch_size={d.micro_batch_size}); Ray may pick any count in the range. Valid world sizes: "
            f"{valid}; set workers.min/max to a range of valid sizes ({', '.join(ranges[-4:])}) or change "
            "data.streams / data.micro_batch_size"
        )
    return sizes


@dataclass(frozen=True)
class Topology:
    profile: str
    nodes: int
    world_size: int
    device: str


@dataclass(frozen=True)
class ModelSize:
    name: str
    image_size: int
    num_params: int  # with what the task adds (MPP: a [mask] embedding and a colour head)
    num_params_1k_head: int  # the paper's Table 1 convention
    head_classes_assumed: bool


@dataclass(frozen=True)
class DataPlan:
    num_shards: int
    shards_per_stream: float  # the order deals the shards to data.streams streams, whatever the loader workers
    bytes_per_image: float
    read_mb_per_s: float
    note: str
    loader_gb_per_node: float  # on the fullest node (docs/elastic.md, "Costs")
    loader_detail: str
    storage: str
    storage_extras: tuple[str, ...]
    storage_missing_here: tuple[str, ...]
    warnings: tuple[str, ...]
    # `cluster.plan.data_wait.DataWait`'s fields:
    loader_img_s_per_core: float
    loader_rate_source: str
    loader_workers: int
    loader_cores_per_rank: float
    load_s_per_step: float
    predicted_step_time_s: float
    predicted_data_wait: float
    input_bound: bool
    loader_workers_needed: int | None
    loader_cores_needed: float


@dataclass(frozen=True)
class ElasticEnd:
    world_size: int
    grad_accum_steps: int
    step_time_s: float
    images_per_s: float
    days: float
    total_gb: float
    capacity_gb: float  # per worker

    @classmethod
    def of(cls, plan: Plan) -> ElasticEnd:
        c, m = plan.compute, plan.memory
        return cls(
            plan.topology.world_size,
            plan.batch.grad_accum_steps,
            c.step_time_s,
            c.images_per_s,
            c.days,
            m.total_gb,
            m.capacity_gb,
        )


@dataclass(frozen=True)
class Plan:
    """Everything `cluster.launch` prints; `to_dict()` is the job's `plan.json`."""

    recipe: str
    run_name: str
    topology: Topology
    batch: BatchPlan  # global = micro x accumulation x world
    model: ModelSize
    compute: ComputePlan
    memory: MemoryPlan
    data: DataPlan
    baseline_eval: str
    startup: StartupAllowance
    comms: CommPlan
    evals: EvalsPlan
    elastic_ends: tuple[ElasticEnd, ...] = ()  # (at workers.min, at workers.max); () when not elastic
    runtime_extras: tuple[str, ...] = ()
    final_model: str = ""
    checkpoints_pinned: int = 0  # the most older than checkpoint.keep_last that pins for pending evals keep (estimated)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def build_plan(profile: ClusterProfile, config: TrainConfig, span: int | None = None) -> Plan:
    """PlanError when the run cannot fit; ``span``: `_span` of the elastic profile a fixed one stands for."""
    batch = batch_plan(config.data, profile.workers.num_workers)
    stats = _data_stats(config)
    vit, model = _model_size(config)
    measured = mfu.measured(config.model.name, profile.hardware.gpu_type) if profile.uses_gpus else None
    compute = compute_plan(profile, config, vit, batch, stats.num_samples, measured)
    data = _data_plan(profile, config, batch, stats, model, compute.images_per_s)
    correction = (measured.activation_scale, measured.memory_source) if measured and measured.memory_corrected else None
    mem, does_not_fit = memory.plan_memory(
        profile,
        batch,
        vit,
        compute,
        config.deepspeed.zero_stage,
        model.num_params,
        correction,
        config.data.global_batch_size // (span or _span(profile)),
        # a resolution schedule needs ZeRO <= 2 (pretrain.config.progressive)
        max_stage=2 if config.data.resolution_schedule else 3,
    )
    if does_not_fit:
        raise PlanError(does_not_fit)
    logs_model, final_model = _final_model(profile, vit)
    plan = Plan(
        recipe=config.recipe,
        run_name=Path(config.checkpoint.dir).name,
        topology=_topology(profile),
        batch=batch,
        model=model,
        compute=compute,
        memory=mem,
        data=data,
        baseline_eval=baseline_eval(config, model.num_params),
        startup=startup_allowance(profile, model.num_params, data.num_shards),
        comms=comms.comm_plan(
            profile,
            deepspeed_config(config.deepspeed, config.optim, batch, compute.precision),
            batch,
            model.num_params,
            compute.step_time_s,
        ),
        evals=plan_evals(profile, config, vit, compute),
        runtime_extras=_runtime_extras(profile, data, logs_model),
        final_model=final_model,
    )
    # The disk holds what the evals keep pinned too: known once they are priced.
    cadence = EvalCadence(config.evals.schedule(), config.checkpoint.every_steps, compute.total_steps)
    pinned = pinned_beyond_kept(plan.evals, cadence, compute.step_time_s, config.checkpoint.keep_last)
    space = checkpoint_space_warning(config, model.num_params, pinned, runs_here=profile.is_local)
    plan = replace(plan, data=replace(data, warnings=(*data.warnings, *space)), checkpoints_pinned=pinned)
    if profile.workers.elastic:
        plan = replace(plan, elastic_ends=_elastic_ends(profile, config, plan))
    return plan


def _topology(profile: ClusterProfile) -> Topology:
    hw = profile.hardware
    if profile.uses_gpus:
        device = f"{hw.gpus_per_node} x {hw.gpu_type} per node"
    else:
        cores = profile.workers.cpus_per_worker
        device = f"CPU ({cores} core{'s' if cores != 1 else ''} per worker)"
    return Topology(profile.name, hw.nodes, profile.workers.num_workers, device)


def _model_size(config: TrainConfig) -> tuple[ViTConfig, ModelSize]:
    """The head has `model.num_classes`, else the dataset's, else 1000."""
    num_classes = config.model.num_classes or _dataset_classes(config)
    configured = model_config(config.model.name, **model_overrides(config, num_classes=num_classes or 1000))
    vit, task_params = tasks.planned_model(config, configured)
    vit_1k = model_config(config.model.name, image_size=vit.image_size, num_classes=1000)
    return vit, ModelSize(
        name=config.model.name,
        image_size=vit.image_size,
        num_params=flops.param_count(vit) + task_params,
        num_params_1k_head=flops.param_count(vit_1k),
        head_classes_assumed=num_classes is None and vit.num_classes > 0,
    )


@dataclass(frozen=True)
class DataStats:
    num_shards: int | None
    num_samples: int | None
    bytes_per_image: float | None
    note: str


def _data_stats(config: TrainConfig) -> DataStats:
    if storage.missing_storage([config.data.train]):
        scheme = storage.url_scheme(config.data.train)
        return DataStats(None, None, None, f"manifest not readable here: no {scheme}:// filesystem")
    try:
        info = storage.read_manifest(resolve_location(config.data.train))
    except Exception as exc:
        return DataStats(None, None, None, f"manifest not readable here: {type(exc).__name__}: {str(exc)[:80]}")
    per_image = sum(s.bytes for s in info.shards) / max(info.num_samples, 1)
    return DataStats(len(info.shards), info.num_samples, per_image, "from manifest.parquet")


def _data_plan(
    profile: ClusterProfile,
    config: TrainConfig,
    batch: BatchPlan,
    stats: DataStats,
    model: ModelSize,
    images_per_s: float,
) -> DataPlan:
    """PlanError when a stream has no shard of its own or the streams fill over LOADER_MEMORY_SHARE of a node."""
    d, world = config.data, batch.world_size
    shards, bytes_per_image, note = stats.num_shards, stats.bytes_per_image, stats.note
    if model.head_classes_assumed:
        note += "; head size unknown here, 1000 classes assumed (set model.num_classes)"
    if shards is not None and shards < d.streams:
        raise PlanError(
            f"{d.train} has {shards} shards but data.streams={d.streams} needs at least one per "
            "stream; lower data.streams (a divisor of the global batch) or re-shard with a smaller --samples-per-shard"
        )
    if shards is None or bytes_per_image is None:
        shards = math.ceil((d.epoch_images or stats.num_samples or 0) / ASSUMED_SAMPLES_PER_SHARD) or 0
        per_image = f"{ASSUMED_BYTES_PER_IMAGE // 1000} KB/image"
        note += f"; assumed {ASSUMED_SAMPLES_PER_SHARD} samples/shard (the writer's default), {per_image}"
        bytes_per_image = float(ASSUMED_BYTES_PER_IMAGE)
    shards_per_stream = shards / d.streams if shards else 0.0
    ranks_per_node = math.ceil(world / profile.hardware.nodes)
    loader_bytes, loader_detail = loader_host_bytes(
        config, world, bytes_per_image, model.image_size, stats.num_samples, profile.device_type
    )
    loader_node = loader_bytes * ranks_per_node
    node_memory = profile.hardware.memory_gb_per_node * memory.GB
    if loader_node > LOADER_MEMORY_SHARE * node_memory:
        raise PlanError(
            f"the data streams would hold {loader_node / memory.GB:.3g} GB per node at world size {world} "
            f"({ranks_per_node} rank(s) x ({loader_detail})), over {LOADER_MEMORY_SHARE:.0%} of the node's "
            f"{profile.hardware.memory_gb_per_node} GB; lower data.shuffle_buffer (a new data order) or "
            "data.streams, or run at a world size that spreads the streams over more nodes (docs/elastic.md)"
        )
    warnings = []
    if shards and shards_per_stream < MIN_SHARDS_PER_STREAM and d.generates_builtin:
        # Few shards per stream correlate streams whose shards differ (class-sorted ones); a built-in set's shards are
        # cut from one global permutation, alike. Its recipe's first launch then warns of nothing the user chose.
        note += (
            f"; under {MIN_SHARDS_PER_STREAM} per stream is fine here: a built-in set is written in one global shuffle"
        )
    elif shards and shards_per_stream < MIN_SHARDS_PER_STREAM:
        warnings.append(
            f"only {shards_per_stream:.1f} shards per stream ({shards} shards / data.streams={d.streams}); use >= "
            f"{MIN_SHARDS_PER_STREAM}: re-shard into more, smaller tar files (--samples-per-shard) or lower "
            "data.streams (a new data order)"
        )
    urls = storage.storage_urls(config)
    return DataPlan(
        num_shards=shards,
        shards_per_stream=shards_per_stream,
        bytes_per_image=bytes_per_image,
        read_mb_per_s=images_per_s * bytes_per_image / 1e6,
        note=note,
        loader_gb_per_node=loader_node / memory.GB,
        loader_detail=f"{ranks_per_node} rank(s) x ({loader_detail})",
        storage=d.train,
        storage_extras=tuple(e.name for e in storage.storage_extras(urls)),
        storage_missing_here=tuple(storage.missing_storage(urls)),
        warnings=tuple(warnings),
        **asdict(data_wait(profile, config, batch, images_per_s)),
    )


def _elastic_ends(profile: ClusterProfile, config: TrainConfig, at_max: Plan) -> tuple[ElasticEnd, ElasticEnd]:
    w = profile.workers
    fixed = replace(profile, workers=replace(w, num_workers=w.min_workers, min=None, max=None))
    try:
        at_min = at_max if w.min_workers == w.max_workers else build_plan(fixed, config, _span(profile))
    except PlanError as error:
        raise PlanError(f"at workers.min={w.min_workers} (an elastic job may shrink to it): {error}") from None
    return ElasticEnd.of(at_min), ElasticEnd.of(at_max)


def _dataset_classes(config: TrainConfig) -> int | None:
    if is_remote(config.data.train):
        return None
    info = read_dataset_json(config.resolved().data.train)
    return None if info is None else info["num_classes"]
