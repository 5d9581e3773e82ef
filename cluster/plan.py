"""The plan: a recipe joined with a profile — topology, batch split, memory per GPU, time, compute and data rate.

`resolve_config` applies the profile's hardware defaults (ZeRO stage, micro-batch, precision, loader workers,
storage locations) to the recipe, then the user's `--set` overrides, so what the plan shows is exactly what the
workers will run. `build_plan` does the arithmetic and raises `PlanError` (a ValueError) when the run cannot fit
in memory, with the settings that would make it fit. Every number is derived here from one source:
FLOPs and parameter counts from `pretrain.flops`, the batch split from `pretrain.ds_config.batch_plan`, steps from
`pretrain.optim.duration_to_steps`, memory from `cluster.memory`.

The plan also says what the run needs that this machine may lack (the fsspec filesystem of remote storage, an
optional extra of vitscale: `STORAGE_EXTRAS`) and whether activation checkpointing is worth its recompute.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from cluster import memory
from cluster.profiles import ClusterProfile
from data_pipeline.manifest import read_dataset_info
from data_pipeline.paths import is_remote, resolve_location, resolve_path
from data_pipeline.stream import decoded_bytes
from pretrain import flops, optim
from pretrain.config import (
    TrainConfig,
    config_from_recipe,
    model_overrides,
    read_recipe,
    recipe_path,
)
from pretrain.ds_config import batch_plan, valid_world_sizes
from pretrain.model import ViTConfig, model_config
from pretrain.mpp import MPPConfig
from pretrain.peak import Peak, cpu_peak, gpu_peak
from pretrain.precision import StepShape, cpu_bf16_units, decide
from pretrain.typed_yaml import parse_override

# Recipes name shard folders under this root (e.g. data/fractal/train); a profile relocates it to its storage.
RECIPE_DATA_ROOT = "data"
# Memory no formula above accounts for: CUDA context, NCCL buffers, DeepSpeed buckets, allocator fragmentation
# (GPU); Python + torch + DeepSpeed resident size (CPU).
GPU_OVERHEAD_GB = 3.0
CPU_OVERHEAD_GB = 1.5
# Assumptions used only when the training manifest cannot be read from here (e.g. s3:// on a laptop).
ASSUMED_BYTES_PER_IMAGE = 92_000  # ImageNet-21k originals average ~92 KB (docs/reference.md §6)
ASSUMED_SAMPLES_PER_SHARD = 3_300  # timm's i21k release: 4096 shards of ~3.3k samples
# The data streams may fill this share of a node's memory; the rest holds the processes and the page cache.
LOADER_MEMORY_SHARE = 0.5
MIN_SHARDS_PER_LOADER = 8  # below this, streams of different ranks/workers become correlated (docs/reference.md §6)
# Share of device memory a plan may fill before the plan calls it tight: the estimate leaves out allocator peaks
# in backward (e.g. a block's recomputation beside its gradients), so a setting "fits" only below this.
COMFORTABLE_FRACTION = 0.85
# Smallest micro-batch the checkpointing advice trades recomputation for: below it the GEMMs of a ViT shrink
# enough (≈ 16 x 197 tokens at 224 px) that the GPU loses more than recomputing costs.
MIN_EFFICIENT_MICRO_BATCH = 16


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


class PlanError(ValueError):
    """The plan cannot run as configured; the message names the problem and settings that would fix it."""


def _scheme(url: str) -> str | None:
    return url.split("://", 1)[0].lower() if is_remote(url) else None


def storage_urls(config: TrainConfig) -> list[str]:
    """Where the run reads data from (training shards, eval shard folders): what its filesystems must reach."""
    return [config.data.train, config.evals.data_root]


def storage_extras(urls: list[str]) -> list[StorageExtra]:
    """The vitscale extras the remote schemes among `urls` need (`s3://` → vitscale[s3], `gs://` → vitscale[gcs])."""
    names = [SCHEME_EXTRAS[s] for s in map(_scheme, urls) if s in SCHEME_EXTRAS]
    return [STORAGE_EXTRAS[n] for n in dict.fromkeys(names)]


def storage_pip(plan: dict) -> list[str]:
    """pip requirements of the extras a plan's storage needs (`Plan.to_dict()`): a Ray runtime env's `pip`."""
    return [STORAGE_EXTRAS[name].requirement for name in plan.get("storage_extras", ())]


def missing_storage(urls: list[str]) -> list[str]:
    """One sentence per remote scheme among `urls` whose fsspec filesystem cannot be imported on this machine."""
    import fsspec

    missing = []
    for scheme in dict.fromkeys(filter(None, map(_scheme, urls))):
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


def _relocate(path: str, root: str) -> str:
    """`data/x/y` → `<root>/x/y`; absolute paths and URLs are the recipe's own choice and stay."""
    if is_remote(path) or Path(path).is_absolute():
        return path
    parts = Path(path).parts
    if parts and parts[0] == RECIPE_DATA_ROOT:
        return "/".join([root.rstrip("/"), *parts[1:]])
    return path


def _largest_divisor_at_most(n: int, cap: int) -> int:
    return max(d for d in range(1, min(n, cap) + 1) if n % d == 0)


def _given(written: dict, sets: list[str]) -> set[str]:
    """Dotted keys the recipe as written (with its `base:` chain) or the user's `--set` gives a value."""

    def walk(d: dict, prefix: str) -> set[str]:
        keys = set()
        for k, v in d.items():
            keys |= walk(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}"}
        return keys

    return walk(written, "") | {".".join(parse_override(s)[0]) for s in sets}


def profile_overrides(profile: ClusterProfile, path: Path, written: dict, sets: list[str], run_name: str) -> list[str]:
    """`key=value` overrides that put a recipe (``written``, as read from ``path``) on this profile's hardware.

    Storage, tracking, communication backend and the hardware peak (where the profile declares one) always come from
    the profile. The profile's
    `defaults` (ZeRO stage, micro-batch, precision, loader workers) fill only what the recipe leaves unset. The
    micro-batch is then lowered, if needed, to the largest value that splits the global batch over the world.
    """
    base = config_from_recipe(path, written, sets)
    given = _given(written, sets)
    d = profile.defaults
    shards = profile.storage.shards
    out = [
        f"deepspeed.dist_backend={profile.comm_backend}",
        f"data.train={_relocate(base.data.train, shards)}",
        f"logging.mlflow_tracking_uri={profile.storage.mlflow_tracking_uri}",
        f"checkpoint.dir={profile.storage.checkpoints.rstrip('/')}/{run_name}",
        f"evals.data_root={_relocate(base.evals.data_root, shards)}",
        # Ray Train workers are actors with threads: forking them for loader workers is unsafe (docs/reference.md §6).
        "data.loader_start_method=forkserver",
        # Job logs are not a terminal: one line per log_every steps instead of a redrawn progress bar.
        "logging.progress_bar=false",
    ]
    defaults = {
        "deepspeed.zero_stage": d.zero_stage,
        "deepspeed.precision": d.precision,
        "data.micro_batch_size": d.micro_batch_size,
        "data.num_workers": profile.workers.loader_workers,
    }
    out += [f"{k}={v}" for k, v in defaults.items() if k not in given]
    # The MFU denominator at the run's precision (CUDA: auto and probe are bf16), where the profile knows it; a local
    # CPU run measures it, as the plan does (pretrain.peak).
    requested = base.deepspeed.precision if "deepspeed.precision" in given else d.precision
    peak = profile_peak(profile, "fp32" if requested == "fp32" or not profile.uses_gpus else "bf16")
    if peak is not None:
        out.append(f"logging.peak_tflops={peak.tflops}")
    micro = base.data.micro_batch_size if "data.micro_batch_size" in given else d.micro_batch_size
    # Elastic: one micro-batch for every world size Ray may pick, so the global batch never changes on a resize.
    span = math.lcm(*range(profile.workers.min_workers, profile.workers.max_workers + 1))
    per_rank = base.data.global_batch_size // span
    user_micro = any(parse_override(s)[0] == ["data", "micro_batch_size"] for s in sets)
    if not user_micro and per_rank and base.data.global_batch_size % span == 0 and per_rank % micro:
        out.append(f"data.micro_batch_size={_largest_divisor_at_most(per_rank, micro)}")
    return out


def resolve_config(profile: ClusterProfile, recipe: str, sets: list[str], run_name: str) -> TrainConfig:
    """Recipe → profile defaults → the user's `--set` overrides (last wins), validated at the profile's world size.

    The recipe file (and its `base:` chain) is read here, once, for the whole launch. Paths are checked only where
    they are local: a cluster's shards or checkpoints are not visible from a laptop.
    """
    path = recipe_path(recipe)
    written = read_recipe(path)
    config = config_from_recipe(path, written, [*profile_overrides(profile, path, written, sets, run_name), *sets])
    if profile.workers.elastic:
        elastic_world_sizes(profile, config)  # every size Ray may pick must keep the global batch
    config.validate(profile.workers.num_workers, check_paths=profile.is_local)
    return config


def elastic_world_sizes(profile: ClusterProfile, config: TrainConfig) -> list[int]:
    """The world sizes an elastic job may run at: Ray Train picks ANY worker count in workers.min..max that the
    cluster holds, so each must keep the global batch (`pretrain.ds_config.valid_world_sizes`); PlanError naming
    the sizes that work otherwise."""
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
class Plan:
    profile: str
    recipe: str
    model: str
    run_name: str
    nodes: int
    world_size: int
    device: str  # "8 x A100-SXM4-80GB per node" or "CPU"
    global_batch_size: int
    micro_batch_size: int
    grad_accum_steps: int
    zero_stage: int
    precision: str
    precision_reason: str  # why: what `deepspeed.precision: auto` picks on the profile's hardware
    activation_checkpointing: bool
    image_size: int
    num_params: int
    num_params_1k_head: int  # the paper's convention (Table 1 counts a 1000-class head)
    forward_gflops_per_image: float
    train_gflops_per_image: float
    params_gb: float
    grads_gb: float
    optimizer_gb: float
    activation_mb_per_image: float
    activations_gb: float
    overhead_gb: float
    total_gb: float
    capacity_gb: float
    # Both settings of activation checkpointing at this micro-batch, whichever the run uses (the fields above).
    activations_gb_checkpointed: float
    activations_gb_not_checkpointed: float
    total_gb_not_checkpointed: float
    recompute_factor: float  # step time with checkpointing / without: one more forward per step, (3 + 1) / 3
    checkpointing_advice: str
    total_steps: int
    step_time_s: float
    days: float
    total_exaflops: float
    images_per_s: float
    assumed_mfu: float
    peak_tflops: float  # per device at the plan's precision: the MFU denominator of the run too
    peak_source: str
    num_shards: int
    shards_per_loader: float
    bytes_per_image: float
    read_mb_per_s: float
    data_note: str
    loader_gb_per_node: float  # host memory of the data streams on the fullest node (docs/elastic.md "Memory")
    loader_detail: str  # what it is made of
    storage: str  # the training shards' location
    storage_extras: tuple[str, ...]  # vitscale extras the run's storage needs (installed by the job's runtime env)
    storage_missing_here: tuple[str, ...]  # what this machine lacks to read that storage (the dry run goes on)
    baseline_eval: str = ""  # the step-0 baseline eval: what it costs, or why there is none
    # Elastic profiles: the same numbers at the smallest and the largest world size Ray may pick, each a dict of
    # world_size, grad_accum_steps, step_time_s, images_per_s, days, total_gb, capacity_gb; () when fixed.
    elastic_ends: tuple[dict, ...] = ()
    warnings: tuple[str, ...] = field(default_factory=tuple)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _data_stats(config: TrainConfig) -> tuple[int | None, int | None, float | None, str]:
    """(num_shards, num_samples, bytes per image, note) from the manifest when it is readable here."""
    if missing_storage([config.data.train]):  # the storage line says what to install; no raw fsspec message here
        return None, None, None, f"manifest not readable here: no {_scheme(config.data.train)}:// filesystem"
    try:
        info = read_dataset_info(resolve_location(config.data.train))
    except Exception as exc:  # any unreadable manifest (absent, remote, offline) → documented assumptions
        return None, None, None, f"manifest not readable here: {type(exc).__name__}: {str(exc)[:80]}"
    total_bytes = sum(s.bytes for s in info.shards)
    return len(info.shards), info.num_samples, total_bytes / max(info.num_samples, 1), "from manifest.parquet"


def build_plan(profile: ClusterProfile, config: TrainConfig) -> Plan:
    """All the numbers `cluster.launch` prints; PlanError when the memory per device exceeds its capacity."""
    world = profile.workers.num_workers
    batch = batch_plan(config.data, world)
    shards, samples, bytes_per_image, data_note = _data_stats(config)
    num_classes = config.model.num_classes or _dataset_classes(config)
    vit = model_config(config.model.name, **model_overrides(config, num_classes=num_classes or 1000))
    vit, task_params = _task_model(config, vit)
    if num_classes is None and vit.num_classes:  # the task keeps a classifier whose size only the data knows
        data_note += "; head size unknown here, 1000 classes assumed (set model.num_classes)"
    vit_1k = model_config(config.model.name, image_size=vit.image_size, num_classes=1000)
    num_params = flops.param_count(vit) + task_params
    fwd = flops.forward_flops(vit)
    train = flops.train_flops(vit)

    epoch_images = config.data.epoch_images or samples
    total_steps = optim.duration_to_steps(
        config.schedule.total, batch.global_batch_size, epoch_images, field="schedule.total"
    )
    if config.schedule.stop_at_step:
        total_steps = min(total_steps, config.schedule.stop_at_step)

    precision, precision_reason = _precision(profile, config, vit)
    peak = _peak(profile, precision)
    states = memory.model_state_bytes(num_params, config.deepspeed.zero_stage, world, precision)
    per_image = functools.partial(
        memory.activation_bytes_per_image,
        tokens=vit.num_patches + (vit.pool == "token"),
        width=vit.width,
        mlp_dim=vit.mlp_dim,
        depth=vit.depth,
        num_heads=vit.num_heads,
        precision=precision,
        dropout=vit.dropout,
    )
    # Both settings, for the checkpointing advice; the plan's own numbers follow the configured one.
    act_on, act_off = per_image(activation_checkpointing=True), per_image(activation_checkpointing=False)
    act_per_image = act_on if vit.grad_checkpointing else act_off
    activations = act_per_image * batch.micro_batch_size
    if profile.uses_gpus:
        capacity, overhead = profile.hardware.gpu_memory_gb * memory.GB, GPU_OVERHEAD_GB * memory.GB
    else:
        per_node = math.ceil(world / profile.hardware.nodes)
        capacity, overhead = profile.hardware.memory_gb_per_node * memory.GB / per_node, CPU_OVERHEAD_GB * memory.GB
    total = states.total + activations + overhead

    # MFU counts model FLOPs (3 x forward); recomputing activations runs one more forward per step on top.
    recompute_factor = (train + fwd) / train
    plain_step_time = train * batch.global_batch_size / (world * peak.tflops * 1e12 * profile.assumed_mfu)
    step_time = plain_step_time * (recompute_factor if vit.grad_checkpointing else 1.0)
    images_per_s = batch.global_batch_size / step_time
    if shards is not None and shards < config.data.streams:  # each stream reads shards of its own (docs/elastic.md)
        raise PlanError(
            f"{config.data.train} has {shards} shards but data.streams={config.data.streams} needs at least one per "
            "stream; lower data.streams (a divisor of the global batch) or re-shard with a smaller --samples-per-shard"
        )
    if shards is None:
        shards = math.ceil((epoch_images or 0) / ASSUMED_SAMPLES_PER_SHARD) or 0
        data_note += f"; assumed ~{ASSUMED_SAMPLES_PER_SHARD} samples/shard, {ASSUMED_BYTES_PER_IMAGE // 1000} KB/image"
        bytes_per_image = float(ASSUMED_BYTES_PER_IMAGE)
    loaders = world * max(1, config.data.num_workers)
    shards_per_loader = shards / loaders if shards else 0.0
    ranks_per_node = math.ceil(world / profile.hardware.nodes)
    loader_bytes, loader_detail = _loader_host_bytes(config, world, bytes_per_image, vit.image_size, samples)
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
    if shards and shards_per_loader < MIN_SHARDS_PER_LOADER:
        warnings.append(
            f"only {shards_per_loader:.1f} shards per (rank x loader worker) ({shards} shards / {loaders}); "
            f"use >= {MIN_SHARDS_PER_LOADER}: re-shard into more, smaller tar files or lower data.num_workers"
        )
    plan = Plan(
        profile=profile.name,
        recipe=config.recipe,
        model=config.model.name,
        run_name=Path(config.checkpoint.dir).name,
        nodes=profile.hardware.nodes,
        world_size=world,
        device=(
            f"{profile.hardware.gpus_per_node} x {profile.hardware.gpu_type} per node"
            if profile.uses_gpus
            else f"CPU ({profile.workers.cpus_per_worker} core per worker)"
        ),
        global_batch_size=batch.global_batch_size,
        micro_batch_size=batch.micro_batch_size,
        grad_accum_steps=batch.grad_accum_steps,
        zero_stage=config.deepspeed.zero_stage,
        precision=precision,
        precision_reason=precision_reason,
        activation_checkpointing=vit.grad_checkpointing,
        image_size=vit.image_size,
        num_params=num_params,
        num_params_1k_head=flops.param_count(vit_1k),
        forward_gflops_per_image=fwd / 1e9,
        train_gflops_per_image=train / 1e9,
        params_gb=states.params / memory.GB,
        grads_gb=states.grads / memory.GB,
        optimizer_gb=states.optimizer / memory.GB,
        activation_mb_per_image=act_per_image / 1e6,
        activations_gb=activations / memory.GB,
        overhead_gb=overhead / memory.GB,
        total_gb=total / memory.GB,
        capacity_gb=capacity / memory.GB,
        activations_gb_checkpointed=act_on * batch.micro_batch_size / memory.GB,
        activations_gb_not_checkpointed=act_off * batch.micro_batch_size / memory.GB,
        total_gb_not_checkpointed=(states.total + overhead + act_off * batch.micro_batch_size) / memory.GB,
        recompute_factor=recompute_factor,
        checkpointing_advice="",
        total_steps=total_steps,
        step_time_s=step_time,
        days=total_steps * step_time / 86400,
        total_exaflops=train * batch.global_batch_size * total_steps / 1e18,
        images_per_s=images_per_s,
        assumed_mfu=profile.assumed_mfu,
        peak_tflops=peak.tflops,
        peak_source=peak.source,
        num_shards=shards,
        shards_per_loader=shards_per_loader,
        bytes_per_image=bytes_per_image or 0.0,
        read_mb_per_s=images_per_s * (bytes_per_image or 0.0) / 1e6,
        data_note=data_note,
        loader_gb_per_node=loader_node / memory.GB,
        loader_detail=f"{ranks_per_node} rank(s) x ({loader_detail})",
        storage=config.data.train,
        storage_extras=tuple(e.name for e in storage_extras(storage_urls(config))),
        storage_missing_here=tuple(missing_storage(storage_urls(config))),
        baseline_eval=_baseline_eval(config, num_params),
        warnings=tuple(warnings),
    )
    fixed = states.total + overhead
    if not memory.fits(total, capacity):
        at = f" (at world size {world}, the elastic group's largest)" if profile.workers.elastic else ""
        raise PlanError(_does_not_fit(plan, act_per_image, fixed, capacity) + at)
    plan = dataclasses.replace(plan, checkpointing_advice=_checkpointing_advice(plan, act_off, fixed, capacity))
    if profile.workers.elastic:
        plan = dataclasses.replace(plan, elastic_ends=_elastic_ends(profile, config, plan))
    return plan


def _loader_host_bytes(
    config: TrainConfig, world: int, bytes_per_image: float, image_size: int, samples: int | None
) -> tuple[float, str]:
    """(bytes, what they are) of host memory one rank's TrainStream holds: the shuffle buffers of its P/R streams
    (encoded samples; a buffer never holds more than its stream's samples) and its decoded images
    (``data_pipeline.stream.decoded_bytes``: its pool of float step buffers, each worker's uint8 planes of an image)."""
    d = config.data
    streams, share = d.streams // world, d.global_batch_size // world  # streams and images per step of a rank
    held = min(d.shuffle_buffer, math.ceil(samples / d.streams)) if samples else d.shuffle_buffer
    buffers = streams * held * bytes_per_image
    decoded = decoded_bytes(share, image_size, d.num_workers)
    detail = (
        f"{streams} streams x {held} buffered samples x {bytes_per_image / 1e3:.0f} KB = "
        f"{buffers / memory.GB:.3g} GB + decoded steps {decoded / memory.GB:.3g} GB"
    )
    return buffers + decoded, detail


def _elastic_ends(profile: ClusterProfile, config: TrainConfig, at_max: Plan) -> tuple[dict, ...]:
    """The plan's throughput, time and memory per worker at workers.min and workers.max: the same estimators, run
    at a fixed world size of each (fewer workers: more accumulation, more ZeRO state each, longer steps)."""
    w = profile.workers
    fixed = dataclasses.replace(w, num_workers=w.min_workers, min=None, max=None)
    try:
        at_min = (
            at_max
            if w.min_workers == w.max_workers
            else build_plan(dataclasses.replace(profile, workers=fixed), config)
        )
    except PlanError as error:
        raise PlanError(f"at workers.min={w.min_workers} (an elastic job may shrink to it): {error}") from None
    keys = ("world_size", "grad_accum_steps", "step_time_s", "images_per_s", "days", "total_gb", "capacity_gb")
    return tuple({k: getattr(p, k) for k in keys} for p in (at_min, at_max))


def _precision(profile: ClusterProfile, config: TrainConfig, vit: ViTConfig) -> tuple[str, str]:
    """(precision the plan's memory and step time assume, why): `pretrain.precision.decide` on the profile's
    hardware, the same rule the workers apply. This machine's CPU answers for a local profile; the CPUs of a remote CPU
    cluster are unknown here, so the plan assumes fp32 and the workers decide at start."""
    requested = config.deepspeed.precision
    if profile.uses_gpus or profile.is_local or requested in ("fp32", "bf16"):
        device = "cuda" if profile.uses_gpus else "cpu"
        shape = StepShape.of(vit, config.data.micro_batch_size)
        choice = decide(requested, device, shape, zero_stage=config.deepspeed.zero_stage)
        reason = f"{choice.rule}: {choice.reason}"
        if choice.precision == "bf16" and not profile.uses_gpus and not cpu_bf16_units():
            reason += "; this CPU has no AMX/AVX512-BF16: bf16 is emulated, many times slower"
        return choice.precision, reason
    return "fp32", f"decided by the workers at start ({requested} on CPUs unknown here); the memory below assumes fp32"


def profile_peak(profile: ClusterProfile, precision: str) -> Peak | None:
    """The per-device peak a run on ``profile`` in ``precision`` divides by, where the profile knows it: its GPUs'
    datasheet (``hardware.peak_tflops`` is their dense bf16 peak; fp32 from `pretrain.peak.GPU_PEAK_TFLOPS`) or a
    declared CPU peak. None: measured on the machine (`pretrain.peak.cpu_peak`)."""
    hw = profile.hardware
    if hw.peak_tflops is None:
        return None
    if not profile.uses_gpus:
        return Peak(hw.peak_tflops, f"profile {profile.name}: hardware.peak_tflops")
    if precision == "bf16":
        return Peak(hw.peak_tflops, f"profile {profile.name}: {hw.gpu_type} dense bf16 peak")
    known = gpu_peak(hw.gpu_type, "fp32")
    if known is None:
        raise PlanError(
            f"profile {profile.name}: no fp32 peak is known for gpu_type {hw.gpu_type!r} (pretrain.peak); train in "
            "bf16 (--set deepspeed.precision=auto) or name a GPU the table lists"
        )
    return known


def _peak(profile: ClusterProfile, precision: str) -> Peak:
    peak = profile_peak(profile, precision)
    if peak is not None:
        return peak
    if not profile.is_local:
        raise PlanError(
            f"profile {profile.name}: CPU workers without hardware.peak_tflops; only this machine's CPU can be "
            "measured here: declare the workers' peak TFLOP/s in the profile"
        )
    return cpu_peak(precision, threads=profile.workers.cpus_per_worker)


# Bytes per parameter of one checkpoint: fp32 master weights + Adam's two moments in the engine state (12), the
# engine's working copy (4 at most) and the consolidated model.safetensors (4).
CHECKPOINT_BYTES_PER_PARAM = 20


def _baseline_eval(config: TrainConfig, num_params: int) -> str:
    if not config.evals.suite:
        return "none (no evals.suite)"
    if not config.evals.baseline:
        return "off (evals.baseline=false): transfer curves have no step-0 point"
    size = num_params * CHECKPOINT_BYTES_PER_PARAM / 1e9
    return (
        f"the step-0 weights are saved before the first update (a checkpoint of ~{size:.2g} GB) and evaluated with "
        f"{config.evals.suite} like every checkpoint; evals.baseline=false skips both"
    )


def _task_model(config: TrainConfig, vit):
    """(the ViTConfig the task trains, parameters the task adds): what `pretrain.tasks.build_task` will build.

    Classification trains the model as configured. Masked patch prediction drops the classifier and its
    pre-logits (`pretrain.mpp.build_mpp_task`) and adds a [mask] embedding (D) and a linear colour head
    (D x colours + colours), so `model.num_classes` sizes nothing there.
    """
    if config.task.name != "mpp":
        return vit, 0
    colours = MPPConfig.from_options(dict(config.task.options)).num_colors
    encoder = dataclasses.replace(vit, num_classes=0, representation_size=None)
    return encoder, vit.width + vit.width * colours + colours


def _checkpointing_advice(plan: Plan, act_off: float, fixed: float, capacity: float) -> str:
    """Whether activation checkpointing pays for its recompute here, and the faster setting that fits."""
    p, comfortable = plan, COMFORTABLE_FRACTION * capacity
    slower = f"one more forward per step: step time x {p.recompute_factor:.2f}"
    if not p.activation_checkpointing:
        if p.total_gb * memory.GB <= comfortable:
            return (
                f"not needed: {p.total_gb:.1f} GB of {p.capacity_gb:.0f} GB per device without it; keep "
                f"model.grad_checkpointing=false (it would cut activations to {p.activations_gb_checkpointed:.2f} GB "
                f"at {slower})"
            )
        return (
            f"tight: {p.total_gb:.1f} GB is over {COMFORTABLE_FRACTION:.0%} of {p.capacity_gb:.0f} GB; if it runs out "
            f"of memory, --set model.grad_checkpointing=true cuts activations to {p.activations_gb_checkpointed:.2f} "
            f"GB at {slower}"
        )
    per_rank = p.global_batch_size // p.world_size
    without = p.step_time_s / p.recompute_factor
    faster = (
        f"{without:.3g} s/step instead of {p.step_time_s:.3g}, {p.days / p.recompute_factor:.3g} days instead of "
        f"{p.days:.3g}"
    )
    if fixed + act_off * p.micro_batch_size <= comfortable:
        return (
            f"not needed: without it activations take {p.activations_gb_not_checkpointed:.1f} GB and the device "
            f"{p.total_gb_not_checkpointed:.1f} GB of {p.capacity_gb:.0f} GB; recomputing costs {slower}. Faster: "
            f"--set model.grad_checkpointing=false: {faster}"
        )
    fitting = [m for m in range(1, p.micro_batch_size) if per_rank % m == 0 and fixed + act_off * m <= comfortable]
    if fitting and max(fitting) >= MIN_EFFICIENT_MICRO_BATCH:
        m = max(fitting)
        return (
            f"needed at micro-batch {p.micro_batch_size} (without it {p.total_gb_not_checkpointed:.1f} GB of "
            f"{p.capacity_gb:.0f} GB), but micro-batch {m} x accumulation {per_rank // m} fits without it "
            f"({(fixed + act_off * m) / memory.GB:.1f} GB) and skips the recompute ({slower}). Faster: "
            f"--set model.grad_checkpointing=false --set data.micro_batch_size={m}: {faster}"
        )
    return (
        f"needed: without it {p.total_gb_not_checkpointed:.1f} GB of {p.capacity_gb:.0f} GB per device at "
        f"micro-batch {p.micro_batch_size}; it costs {slower}"
    )


def _dataset_classes(config: TrainConfig) -> int | None:
    path = resolve_path(config.data.train) / "dataset.json"
    if is_remote(config.data.train) or not path.exists():
        return None
    return int(json.loads(path.read_text())["num_classes"])


def _does_not_fit(plan: Plan, act_per_image: float, fixed: float, capacity: float) -> str:
    room = capacity - fixed
    max_micro = int(room // act_per_image) if room > 0 else 0
    fixes = []
    if max_micro >= 1:
        fixes.append(
            f"lower the micro-batch: --set data.micro_batch_size={max_micro} or less (a divisor of "
            f"{plan.global_batch_size // plan.world_size})"
        )
    if not plan.activation_checkpointing:
        fixes.append(
            f"recompute activations: --set model.grad_checkpointing=true (activations "
            f"{plan.activations_gb_checkpointed:.1f} GB; step time x {plan.recompute_factor:.2f})"
        )
    if plan.zero_stage < 3:
        fixes.append(f"partition more model state: --set deepspeed.zero_stage={plan.zero_stage + 1}")
    return (
        f"plan does not fit: {plan.total_gb:.1f} GB per device needed, {plan.capacity_gb:.1f} GB available "
        f"(model states {plan.params_gb + plan.grads_gb + plan.optimizer_gb:.2f} GB, activations "
        f"{plan.activations_gb:.1f} GB = {plan.micro_batch_size} x {plan.activation_mb_per_image:.0f} MB/image, "
        f"overhead {plan.overhead_gb:.1f} GB). Fix: " + "; or ".join(fixes)
    )


def format_plan(plan: Plan) -> str:
    p = plan
    lines = [
        f"plan: recipe {p.recipe} on profile {p.profile} (run {p.run_name})",
        f"  topology      {p.nodes} node(s), {p.device}; world size {p.world_size}",
        f"  batch         global {p.global_batch_size} = micro {p.micro_batch_size} x accumulation "
        f"{p.grad_accum_steps} x world {p.world_size}",
        f"  model         {p.model} @ {p.image_size}px: {p.num_params / 1e6:.2f}M params "
        f"({p.num_params_1k_head / 1e6:.2f}M with a 1000-class head); forward {p.forward_gflops_per_image:.4g} "
        f"GFLOPs/image, training {p.train_gflops_per_image:.4g}",
        f"  precision     {p.precision} ({p.precision_reason}), ZeRO-{p.zero_stage}, activation checkpointing "
        f"{'on' if p.activation_checkpointing else 'off'}",
        f"  memory/device params {p.params_gb:.2f} GB + grads {p.grads_gb:.2f} GB + optimizer "
        f"{p.optimizer_gb:.2f} GB + activations {p.activations_gb:.2f} GB ({p.activation_mb_per_image:.0f} MB/image "
        f"x {p.micro_batch_size}) + overhead {p.overhead_gb:.1f} GB = {p.total_gb:.2f} GB of {p.capacity_gb:.0f} GB",
        f"  checkpointing activations {p.activations_gb_checkpointed:.2f} GB with it, "
        f"{p.activations_gb_not_checkpointed:.2f} GB without (micro-batch {p.micro_batch_size}); "
        f"{p.checkpointing_advice}",
        f"  compute       {p.total_steps} steps x {p.step_time_s:.3g} s/step (assumed MFU {p.assumed_mfu:.0%} of "
        f"{p.peak_tflops:.4g} TFLOP/s per device: {p.peak_source}"
        f"{f', + recompute x {p.recompute_factor:.2f}' if p.activation_checkpointing else ''}) = "
        f"{p.days:.3g} days; {p.images_per_s:,.0f} images/s; {p.total_exaflops:.4g} exaFLOPs total",
        f"  data          {p.num_shards or 'unknown number of'} shards, {p.shards_per_loader:.1f} per (rank x loader "
        "worker); "
        f"{p.bytes_per_image / 1e3:.0f} KB/image -> read {p.read_mb_per_s:,.1f} MB/s ({p.data_note})",
        f"  loader memory {p.loader_gb_per_node:.3g} GB per node: {p.loader_detail}",
        f"  storage       {p.storage}" + _storage_needs(p),
        f"  baseline eval {p.baseline_eval}",
    ]
    if p.elastic_ends:
        lo, hi = p.elastic_ends
        lines.append(
            f"  elastic       workers {lo['world_size']}..{hi['world_size']} (Ray Train may run at any of "
            f"{', '.join(map(str, range(lo['world_size'], hi['world_size'] + 1)))}; global batch "
            f"{p.global_batch_size} kept, accumulation recomputed)"
        )
        for end, e in (("min", lo), ("max", hi)):
            lines.append(
                f"    at {end} {e['world_size']:>3}  accumulation {e['grad_accum_steps']}, "
                f"{e['step_time_s']:.3g} s/step, "
                f"{e['images_per_s']:,.0f} images/s, {e['days']:.3g} days if it stayed there, "
                f"{e['total_gb']:.2f} GB of {e['capacity_gb']:.0f} GB per worker"
            )
    lines += [f"  WARNING       {w}" for w in p.warnings]
    return "\n".join(lines)


def _storage_needs(p: Plan) -> str:
    needs = ""
    if p.storage_extras:
        extras = ", ".join(f"vitscale[{n}] ({STORAGE_EXTRAS[n].module})" for n in p.storage_extras)
        needs = f"; needs {extras}, which the job's runtime env installs on the cluster"
    if p.storage_missing_here:
        needs += "; " + "; ".join(p.storage_missing_here) + " (only to read the manifest from this machine)"
    return needs
