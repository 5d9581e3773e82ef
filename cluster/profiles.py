"""Cluster profiles (`cluster/profiles/<name>.yaml`): the hardware, storage, Ray address and defaults a recipe runs on.

Every field and default is declared here, once (docs/design.md, "Profiles and recipes"); `load_profile` reads and
validates one, expanding `{project}` to the project root.
"""

from __future__ import annotations

import math
import posixpath
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from data_pipeline.paths import PROJECT_ROOT
from pretrain.config import typed_yaml

# A profile's and a run's name: they name folders (run folders, `cluster.render`'s output) and Ray submission ids.
SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")

PROFILES_DIR = Path(__file__).resolve().parent / "profiles"
JOBS_API_SCHEMES = ("http://", "https://")  # a remote profile's ray.address: the Jobs API (dashboard) URL
# (vCPUs, GiB, GPUs) of each type evals.instance_type may name: a profile declares only its training nodes' shape.
EVAL_INSTANCES = {
    "g5.xlarge": (4, 16, 1),
    "g5.2xlarge": (8, 32, 1),
    "g5.4xlarge": (16, 64, 1),
    "g6.xlarge": (4, 16, 1),
    "g6.2xlarge": (8, 32, 1),
    "g6.4xlarge": (16, 64, 1),
}
# The Ray resource the eval node group's nodes declare (cluster.render) and eval tasks ask for: with GPUs free on the
# training nodes (a worker group restarting, an elastic group at its minimum), an eval must not take one there.
EVAL_NODE_RESOURCE = "vitscale_eval"
EVAL_NODE_UNITS = 1000  # on each eval node: a label more than a count (CPUs and GPUs bound the tasks there)
# Its Ray node label (cluster.render): the training workers' label selector keeps their ranks off an eval node
# big enough to hold one, and matches a node without the label (a lab's own cluster).
EVAL_NODE_LABELS = {"vitscale-node": "eval"}


@dataclass(frozen=True)
class HardwareSpec:
    nodes: int  # machines
    gpus_per_node: int  # 0: CPU workers
    gpu_type: str  # e.g. "A100-SXM4-80GB"; "none" on CPU
    gpu_memory_gb: float  # per GPU, GB of 1e9 bytes; 0 on CPU
    cpus_per_node: int
    memory_gb_per_node: float
    peak_tflops: float | None = None  # MFU denominator: the GPU's dense bf16 peak; None on CPU (measured there)
    instance_type: str = ""  # cloud machine type for cluster.render, e.g. "p4de.24xlarge"
    # Images/s one core decodes and augments at 224 px (local: measured); docs/benchmarks/2026-11-26-data-loader.md
    loader_img_s_per_core: float = 700.0


@dataclass(frozen=True)
class RaySpec:
    address: str  # Jobs API URL (http://head:8265), or "local": the embedded head
    head_num_cpus: int = 0  # embedded head: CPUs it advertises (workers + eval slot)
    head_object_store_mb: int = 256
    dashboard_port: int = 8265  # embedded head: preferred port; a free one when taken
    temp_dir: str = ""  # embedded head: Ray's temp folder, ours alone
    # Ray Train's actor that watches for nodes being drained (spot preemption): off where no node is ever drained
    preemption_watcher: bool = True


def path_under(path: str, root: str) -> bool:
    """``path`` is ``root`` or inside it (both absolute, normalized first)."""
    path, root = posixpath.normpath(path), posixpath.normpath(root)
    return path == root or path.startswith(root.rstrip("/") + "/")


@dataclass(frozen=True)
class StorageSpec:
    shards: str  # root of the recipes' shard folders (path or fsspec URL)
    checkpoints: str  # run folders, on a filesystem every node mounts
    mlflow_tracking_uri: str
    read_mb_per_s: float = 100.0  # one rank's read rate from `shards` (the start allowance); assumed
    shared: str = ""  # a filesystem every node mounts, e.g. cluster.render's /fsx: paths under it are shared too

    def validate(self, where: str) -> None:
        """ValueError naming the key and the fix for an empty location or a URL with one slash (`s3:/bucket`)."""
        examples = {
            "shards": "the root of the shard folders, e.g. s3://vitscale-datasets or {project}/data",
            "checkpoints": "a folder every node mounts for the run folders, e.g. /fsx/vitscale/runs",
            "mlflow_tracking_uri": "the MLflow server, e.g. http://mlflow.example.com:5000",
        }
        for key, example in examples.items():
            value = getattr(self, key)
            if not value.strip():
                raise ValueError(f"{where}: storage.{key} is empty; give {example}")
            url = re.match(r"([A-Za-z][A-Za-z0-9+.-]*):(?!//)/*(.*)", value)
            if url and url.group(1).lower() not in ("file", "sqlite"):  # a path or `scheme:/x` read as one
                fixed = f"{url.group(1)}://{url.group(2)}"
                raise ValueError(f"{where}: storage.{key}={value!r} is no URL (a URL is SCHEME://...); write {fixed!r}")
        if self.shared and not self.shared.startswith("/"):
            raise ValueError(
                f"{where}: storage.shared={self.shared!r} must be the absolute path of the filesystem every node "
                "mounts, e.g. /fsx, or left out"
            )


@dataclass(frozen=True)
class WorkerSpec:
    """A fixed world size (`num_workers`) or an elastic one (`min` .. `max`, `num_workers` = `max`; docs/elastic.md)."""

    cpus_per_worker: int
    gpus_per_worker: int
    loader_workers: int  # DataLoader processes per rank
    num_workers: int | None = None  # fixed world size; None with min/max
    min: int | None = None  # elastic: fewest workers to go on with
    max: int | None = None  # elastic: most workers
    elastic_resize_monitor_interval_s: float = 60.0  # elastic: how often Ray looks for capacity
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"  # SPREAD: one per node
    # Custom Ray resources per worker, e.g. {trainer: 1}: an elastic group never grows onto the eval slot
    resources: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.num_workers is None and self.max is not None:
            object.__setattr__(self, "num_workers", self.max)  # frozen

    @property
    def elastic(self) -> bool:
        return self.min is not None or self.max is not None

    @property
    def min_workers(self) -> int:
        return self.min if self.min is not None else self.num_workers

    @property
    def max_workers(self) -> int:
        return self.max if self.max is not None else self.num_workers


@dataclass(frozen=True)
class TrainDefaults:
    """Hardware-dependent training settings for what the recipe and `--set` leave unset."""

    zero_stage: Literal[0, 1, 2, 3]
    micro_batch_size: int  # lowered to a divisor of global / world if needed
    precision: Literal["bf16", "fp32"]


@dataclass(frozen=True)
class EvalResources:
    """One eval task's Ray resources, beside the workers' share, and the device the plan prices evals on."""

    num_cpus: float = 1
    num_gpus: float = 0
    instance_type: str = ""  # cluster.render: an eval node group of this type
    gpu_type: str = ""  # the eval GPU's kind, e.g. "A10G": its peak comes from pretrain.telemetry.peak
    gpu_memory_gb: float = 0  # per eval GPU, GB of 1e9 bytes
    memory_gb: float = 0  # host memory an eval task reserves in Ray (its `memory=`); 0: none
    # Dense peak TFLOP/s where pretrain.telemetry.peak lacks it (remote CPU evals); None: from gpu_type, or measured
    peak_tflops: float | None = None
    assumed_mfu: float | None = None  # the evals' assumed MFU; None: the profile's assumed_mfu

    @property
    def node_resources(self) -> dict[str, float]:
        """The custom resources an eval task asks for: its node group's, where the profile has one."""
        return {EVAL_NODE_RESOURCE: 1} if self.instance_type else {}

    def validate(self, where: str) -> None:
        """ValueError naming the field and the fix."""
        if self.memory_gb < 0 or self.gpu_memory_gb < 0:
            raise ValueError(f"{where}: evals.memory_gb and evals.gpu_memory_gb must be >= 0 (0: not declared)")
        if self.peak_tflops is not None and not self.peak_tflops > 0:
            raise ValueError(f"{where}: evals.peak_tflops={self.peak_tflops} must be > 0 (or absent)")
        if self.assumed_mfu is not None and not 0 < self.assumed_mfu <= 1:
            raise ValueError(f"{where}: evals.assumed_mfu={self.assumed_mfu} must be in (0, 1] (or absent)")
        if self.num_gpus > 0 and not (self.gpu_memory_gb > 0 and (self.gpu_type or self.peak_tflops)):
            raise ValueError(
                f"{where}: evals on GPUs (evals.num_gpus={self.num_gpus:g}) need evals.gpu_memory_gb and "
                "evals.gpu_type (or evals.peak_tflops): the plan prices and sizes the evals on that device"
            )


@dataclass(frozen=True)
class HangSpec:
    """The hung-rank watchdog's allowances (`cluster.driver.watchdog`; docs/elastic.md, "Faults")."""

    enabled: bool = True
    floor_s: float = 30.0  # training: never sooner
    factor: float = 10.0  # ... nor than this many median steps (in a save: longest saves)
    startup_s: float = 600.0  # floor of the plan's start allowance
    checkpoint_s: float = 300.0  # floor of the plan's first-save allowance
    save_floor_s: float = 60.0  # a save once one was measured: never sooner
    write_mb_per_s: float = 100.0  # storage write rate the allowances assume; too high kills a healthy group
    poll_s: float = 2.0  # how often the watchdog reads the heartbeats
    # Straggler (reported, not restarted): data wait above the median rank's by this share of the median step ...
    straggler_fraction: float = 0.2
    straggler_polls: int = 3  # ... in this many polls in a row

    def validate(self, where: str) -> None:
        positive = "floor_s factor startup_s checkpoint_s save_floor_s write_mb_per_s poll_s straggler_fraction"
        for key in positive.split():
            if not getattr(self, key) > 0:
                raise ValueError(f"{where}: hang.{key}={getattr(self, key)} must be > 0")
        if self.straggler_polls < 1:
            raise ValueError(f"{where}: hang.straggler_polls={self.straggler_polls} must be >= 1")


@dataclass(frozen=True)
class NetworkSpec:
    """How the workers' collectives travel: the fabric between nodes, NVLink within one (docs/network.md)."""

    kind: Literal["efa", "infiniband", "nvlink", "sockets"] = "sockets"  # nvlink: one node, no network in the way
    gbps_per_node: float = 0.0  # line rate of all of a node's NICs, Gb/s; 0: unknown or one node
    nvlink_gb_per_s: float = 0.0  # per GPU and direction, GB/s; 0: none (CPU) or unknown
    efficiency: float = 0.8  # share of the line rate NCCL reaches (nccl-tests' busbw / line rate); assumed
    latency_us: float = 20.0  # start-up time of one collective, microseconds; assumed
    socket_ifname: str = ""  # NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME, only where the default interface is wrong

    def validate(self, where: str, nodes: int, gpus: bool) -> None:
        """ValueError naming the field and the fix."""
        if not 0 < self.efficiency <= 1:
            raise ValueError(f"{where}: network.efficiency={self.efficiency} must be in (0, 1]")
        for key in ("gbps_per_node", "nvlink_gb_per_s", "latency_us"):
            if getattr(self, key) < 0:
                raise ValueError(f"{where}: network.{key}={getattr(self, key)} must be >= 0")
        if self.kind == "nvlink" and (nodes > 1 or not gpus):
            raise ValueError(
                f"{where}: network.kind=nvlink joins the GPUs of one node only; with {nodes} node(s) and "
                f"{'GPU' if gpus else 'CPU'} workers use efa, infiniband or sockets"
            )
        if self.kind in ("efa", "infiniband") and not gpus:
            raise ValueError(f"{where}: network.kind={self.kind} carries NCCL; CPU workers (gloo) use sockets")
        if self.kind == "nvlink" and not self.nvlink_gb_per_s > 0:
            raise ValueError(f"{where}: network.kind=nvlink needs network.nvlink_gb_per_s (per GPU and direction)")
        if self.kind in ("efa", "infiniband") and nodes > 1 and not self.gbps_per_node > 0:
            raise ValueError(f"{where}: network.kind={self.kind} on {nodes} nodes needs network.gbps_per_node")


@dataclass(frozen=True)
class ClusterProfile:
    name: str
    description: str
    hardware: HardwareSpec
    ray: RaySpec
    storage: StorageSpec
    comm_backend: Literal["nccl", "gloo"]  # nccl on GPUs, gloo on CPUs
    workers: WorkerSpec
    defaults: TrainDefaults
    evals: EvalResources = EvalResources()
    max_failures: int = 1  # worker-group restarts before the job fails
    assumed_mfu: float = 0.4  # the plan's MFU where none was measured (cluster.calibrate)
    hang: HangSpec = HangSpec()  # hung-rank watchdog
    network: NetworkSpec = NetworkSpec()  # the collectives' fabric (docs/network.md)
    recipe: str = ""  # what launch, preflight, render and the driver run when no recipe is named

    def pick_recipe(self, named: str | None) -> str:
        """``named``, else the profile's recipe; ValueError with the fix when neither is given."""
        recipe = named or self.recipe
        if not recipe:
            raise ValueError(
                f"profile {self.name} names no recipe to run: name one, RECIPE=NAME (make) or --recipe NAME "
                "(configs/<name>.yaml or a YAML path), or add `recipe: NAME` to the profile"
            )
        return recipe

    @property
    def training_label_selector(self) -> dict[str, str] | None:
        """Ray's label selector for a training worker: any node but an eval node; None without an eval node group."""
        return {key: f"!{value}" for key, value in EVAL_NODE_LABELS.items()} if self.evals.instance_type else None

    @property
    def is_local(self) -> bool:
        return self.ray.address == "local"

    @property
    def uses_gpus(self) -> bool:
        return self.workers.gpus_per_worker > 0

    @property
    def device_type(self) -> str:
        """The workers' torch device type: "cuda" or "cpu"."""
        return "cuda" if self.uses_gpus else "cpu"

    def validate(self) -> None:
        """Raise ValueError naming the field and the fix when the profile contradicts itself."""
        hw, wk, where = self.hardware, self.workers, f"profile {self.name}"
        if not SAFE_NAME.fullmatch(self.name):  # a run folder `<recipe>-<name>` (cluster.render), a folder of its own
            raise ValueError(f"{where}: name {self.name!r}: use letters, digits, '.', '_' and '-' only")
        counts = (
            ("hardware.nodes", hw.nodes, 1),
            ("hardware.gpus_per_node", hw.gpus_per_node, 0),
            ("hardware.cpus_per_node", hw.cpus_per_node, 1),
            ("hardware.gpu_memory_gb", hw.gpu_memory_gb, 0),
            ("workers.cpus_per_worker", wk.cpus_per_worker, 1),
            ("workers.gpus_per_worker", wk.gpus_per_worker, 0),
            ("workers.loader_workers", wk.loader_workers, 0),
            ("defaults.micro_batch_size", self.defaults.micro_batch_size, 1),
            ("evals.num_cpus", self.evals.num_cpus, 0),
            ("evals.num_gpus", self.evals.num_gpus, 0),
        )
        for key, value, low in counts:
            if value < low:
                raise ValueError(f"{where}: {key}={value} must be >= {low}")
        if not hw.loader_img_s_per_core > 0:  # the data-wait prediction divides by it
            raise ValueError(
                f"{where}: hardware.loader_img_s_per_core={hw.loader_img_s_per_core} must be > 0 "
                "(images/s one core decodes; `make bench-data` measures it)"
            )
        if not hw.memory_gb_per_node > 0:  # the plan divides by it
            raise ValueError(f"{where}: hardware.memory_gb_per_node={hw.memory_gb_per_node} must be > 0")
        if not self.storage.read_mb_per_s > 0:  # the start allowance divides by it
            raise ValueError(f"{where}: storage.read_mb_per_s={self.storage.read_mb_per_s} must be > 0")
        if hw.peak_tflops is not None and not hw.peak_tflops > 0:
            raise ValueError(f"{where}: hardware.peak_tflops={hw.peak_tflops} must be > 0 (or absent on CPU)")
        if wk.gpus_per_worker > 0 and hw.peak_tflops is None:
            raise ValueError(f"{where}: GPU workers need hardware.peak_tflops (their dense bf16 peak)")
        self._validate_worker_counts()
        if wk.gpus_per_worker > 0:
            if self.comm_backend != "nccl":
                raise ValueError(f"{where}: GPU workers need comm_backend: nccl")
            self._validate_gpu_count()
            if hw.gpu_memory_gb <= 0:
                raise ValueError(f"{where}: hardware.gpu_memory_gb must be > 0 for GPU workers")
        elif self.comm_backend == "nccl":
            raise ValueError(f"{where}: CPU workers (gpus_per_worker: 0) need comm_backend: gloo")
        self.storage.validate(where)
        if not self.is_local and not self.ray.address.startswith(JOBS_API_SCHEMES):
            given = self.ray.address
            fix = f"http://{given}" if given and "://" not in given else "http://HEAD:8265 (the head's dashboard port)"
            raise ValueError(
                f"{where}: ray.address={given!r} is not the Jobs API's URL (http:// or https://); write {fix}, "
                "or `local` for the embedded head"
            )
        if not self.is_local:  # `local` runs on this machine: ray.head_num_cpus holds its workers
            check_fits(self)
        self.hang.validate(where)
        self.evals.validate(where)
        self.network.validate(where, hw.nodes, wk.gpus_per_worker > 0)
        if not 0 < self.assumed_mfu <= 1:
            raise ValueError(f"{where}: assumed_mfu={self.assumed_mfu} must be in (0, 1]")
        if self.max_failures < 0:
            raise ValueError(f"{where}: max_failures must be >= 0 (-1 is not supported: be explicit)")
        if self.is_local and self.ray.head_num_cpus < wk.max_workers * wk.cpus_per_worker:
            raise ValueError(
                f"{where}: ray.head_num_cpus={self.ray.head_num_cpus} cannot hold "
                f"{wk.max_workers} workers x {wk.cpus_per_worker} CPUs; raise head_num_cpus"
            )

    def _validate_gpu_count(self) -> None:
        """One worker per GPU of every node: the plan's topology is the profile's (evals have a node group)."""
        hw, wk, where = self.hardware, self.workers, f"profile {self.name}"
        per, key = wk.gpus_per_worker, "workers.max" if wk.elastic else "workers.num_workers"
        if hw.gpus_per_node == 0:
            raise ValueError(
                f"{where}: workers.gpus_per_worker={per} but hardware.gpus_per_node=0; set hardware.gpus_per_node to "
                "the GPUs a node has, or run CPU workers (workers.gpus_per_worker: 0, comm_backend: gloo)"
            )
        used, gpus = wk.max_workers * per, hw.nodes * hw.gpus_per_node
        if per != 1:
            raise ValueError(f"{where}: {self._one_gpu_per_worker(gpus)}")
        if used != gpus:
            fit = gpus // per
            fixes = [f"{key}: {fit}" + (f" (and workers.min <= {fit})" if wk.elastic and wk.min_workers > fit else "")]
            if used % hw.gpus_per_node == 0:
                fixes.append(f"hardware.nodes: {used // hw.gpus_per_node}")
            raise ValueError(
                f"{where}: {key}={wk.max_workers} x workers.gpus_per_worker={per} = {used} GPUs, but hardware.nodes="
                f"{hw.nodes} x gpus_per_node={hw.gpus_per_node} = {gpus}: "
                f"{f'{gpus - used} GPU(s) would sit idle' if used < gpus else 'the workers do not fit'}; "
                f"set {' or '.join(fixes)}"
            )

    def _one_gpu_per_worker(self, gpus: int) -> str:
        """Why a worker takes one GPU; the fix: a worker per GPU, each with its share of the CPUs the node holds."""
        hw, wk, per = self.hardware, self.workers, self.workers.gpus_per_worker
        if self.is_local:  # the embedded head holds every worker
            share = self.ray.head_num_cpus // gpus
        else:  # the node's pod, as check_fits counts it
            shared = 0 if self.evals.instance_type else self.evals.num_cpus
            share = int(allocatable(hw.cpus_per_node, 0)[0] - shared) // hw.gpus_per_node
        cpus = max(1, min(wk.cpus_per_worker // per, share))
        counts = f"workers.max: {gpus}, workers.min: {min(wk.min_workers * per, gpus)}" if wk.elastic else ""
        return (
            f"workers.gpus_per_worker={per}, but a worker trains on one GPU (cuda:LOCAL_RANK) and the plan prices one "
            f"per worker: {per - 1} of each worker's {per} would sit idle; run one worker per GPU: set "
            f"workers.gpus_per_worker: 1, {counts or f'workers.num_workers: {gpus}'} (hardware.nodes={hw.nodes} x "
            f"gpus_per_node={hw.gpus_per_node}) and workers.cpus_per_worker: {cpus}"
        )

    def _validate_worker_counts(self) -> None:
        wk, where = self.workers, f"profile {self.name}"
        if not wk.elastic:
            if wk.num_workers is None or wk.num_workers < 1:
                raise ValueError(
                    f"{where}: workers.num_workers must be >= 1 (a fixed world size), or give "
                    "workers.min and workers.max (an elastic one)"
                )
        elif wk.min is None or wk.max is None:
            missing = "workers.min" if wk.min is None else "workers.max"
            raise ValueError(f"{where}: an elastic worker group needs both workers.min and workers.max; add {missing}")
        elif wk.min < 1 or wk.max < wk.min:
            raise ValueError(f"{where}: workers.min={wk.min}, workers.max={wk.max}: need 1 <= min <= max")
        elif wk.num_workers != wk.max:
            raise ValueError(
                f"{where}: workers.num_workers={wk.num_workers} beside workers.min/max: give either "
                "num_workers (a fixed world size) or min and max (elastic), not both"
            )
        if not wk.elastic_resize_monitor_interval_s > 0:
            raise ValueError(
                f"{where}: workers.elastic_resize_monitor_interval_s="
                f"{wk.elastic_resize_monitor_interval_s} must be > 0 (Ray's default is 60)"
            )
        bad = {k: v for k, v in wk.resources.items() if not (isinstance(v, (int, float)) and v > 0)}
        if bad or {"CPU", "GPU"} & set(wk.resources):
            raise ValueError(
                f"{where}: workers.resources={wk.resources}: custom Ray resources with amounts > 0 only "
                "(CPUs and GPUs are cpus_per_worker and gpus_per_worker)"
            )


def allocatable(vcpus: int, memory_gb: float) -> tuple[int, float]:
    """(CPUs, GiB) a pod may ask of a node: the kubelet, the OS and the daemonsets keep more than EKS reserves."""
    return vcpus - max(1, round(vcpus * 0.02)), memory_gb * 0.9


def check_fits(profile: ClusterProfile) -> None:
    """A training node's pod holds its workers (and evals sharing it); the eval pod holds an eval (cluster.render's
    pods; a remote profile is checked at load, so the plan, launch, preflight, driver and render agree)."""
    hw, wk, ev, where = profile.hardware, profile.workers, profile.evals, f"profile {profile.name}"
    cpus, _ = allocatable(hw.cpus_per_node, hw.memory_gb_per_node)
    workers, shared = math.ceil(wk.max_workers / hw.nodes), 0 if ev.instance_type else ev.num_cpus
    per_node = workers * wk.cpus_per_worker + shared
    if per_node > cpus:
        fixes = [f"workers.cpus_per_worker to {int(cpus - shared) // workers}"] if cpus - shared >= workers else []
        if shared and cpus > workers * wk.cpus_per_worker:
            fixes.append(f"evals.num_cpus to {cpus - workers * wk.cpus_per_worker}")
        raise ValueError(
            f"{where}: a node's workers (and evals) need {per_node:g} CPUs, its pod has {cpus} of "
            f"hardware.cpus_per_node={hw.cpus_per_node}; "
            + (f"lower {' or '.join(fixes)} (or less)" if fixes else "use nodes with more CPUs")
        )
    if not ev.instance_type:
        return
    if ev.instance_type not in EVAL_INSTANCES:
        raise ValueError(
            f"{where}: evals.instance_type={ev.instance_type!r} is not one cluster.render knows "
            f"({', '.join(EVAL_INSTANCES)}); pick one or add its vCPUs, GiB and GPUs to cluster.profiles.EVAL_INSTANCES"
        )
    vcpus, memory_gb, gpus = EVAL_INSTANCES[ev.instance_type]
    pod_cpus, _ = allocatable(vcpus, memory_gb)
    if ev.num_cpus > pod_cpus or ev.num_gpus > gpus:
        holds = {t: allocatable(c, m)[0] >= ev.num_cpus and g >= ev.num_gpus for t, (c, m, g) in EVAL_INSTANCES.items()}
        bigger = [t for t, fits in holds.items() if fits]
        lowered = (("num_cpus", pod_cpus, ev.num_cpus > pod_cpus), ("num_gpus", gpus, ev.num_gpus > gpus))
        raise ValueError(
            f"{where}: an eval (evals.num_cpus={ev.num_cpus:g}, num_gpus={ev.num_gpus:g}) does not fit the "
            f"{ev.instance_type} pod ({pod_cpus} of its {vcpus} vCPUs, {gpus} GPU); lower "
            + " and ".join(f"evals.{k} to {n:g}" for k, n, over in lowered if over)
            + (f", or use {' or '.join(bigger)}" if bigger else "")
        )


def profile_names() -> list[str]:
    return sorted(p.stem for p in PROFILES_DIR.glob("*.yaml"))


def _expand(value: Any, project: Path) -> Any:
    if isinstance(value, str):
        return value.replace("{project}", str(project))
    if isinstance(value, dict):
        return {k: _expand(v, project) for k, v in value.items()}
    return value


def load_profile(name_or_path: str | Path, project: Path = PROJECT_ROOT) -> ClusterProfile:
    """Load and validate a profile by name or YAML path; ValueError lists the valid names."""
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") and not path.is_file():
        raise ValueError(
            f"cluster profile file {path} does not exist or is not a file; give a YAML path or a profile name: "
            f"{', '.join(profile_names())}"
        )
    if path.suffix not in (".yaml", ".yml"):
        path = PROFILES_DIR / f"{name_or_path}.yaml"
    if not path.is_file():
        raise ValueError(
            f"unknown cluster profile {str(name_or_path)!r}; valid profiles: {', '.join(profile_names())} "
            f"(files in {PROFILES_DIR})"
        )
    hint = f"start from a copy of {PROFILES_DIR / 'local.yaml'}"
    data = typed_yaml.read_mapping(path, "cluster profile", hint)
    where = f"profile {path.stem}" if path.parent == PROFILES_DIR else f"cluster profile {path}"
    if not data:
        raise ValueError(f"{where} is empty; {hint}")
    profile = typed_yaml.build(ClusterProfile, _expand(data, project), where)
    try:
        profile.validate()
    except ValueError as error:
        if path.parent == PROFILES_DIR:
            raise
        raise ValueError(f"cluster profile {path}: {error}") from None  # the file, not only its `name:`
    return profile


def profile_to_dict(profile: ClusterProfile) -> dict:
    return asdict(profile)


def profile_from_dict(data: dict) -> ClusterProfile:
    """Inverse of `profile_to_dict`."""
    return typed_yaml.build(ClusterProfile, data, f"profile {data.get('name', '?')}")
