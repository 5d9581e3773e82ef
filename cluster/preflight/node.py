"""What `cluster.preflight` measures on each node, inside a Ray actor pinned to it (`NodeProbe`): the GPUs, EFA, the
shards' read rate, the loader's decode rate per core, the checkpoint root's free space and the tracking store.

Each measurement returns a `Figure` (the number and what it was measured on, or the error that stopped it), so one
broken check never hides the others. Why each is measured: docs/preflight.md.
"""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from cluster.local_head import environ
from cluster.network import efa_missing
from data_pipeline.builtin import sets as builtin
from data_pipeline.paths import is_remote, resolve_location
from data_pipeline.stream.loader_rate import loader_rate
from pretrain.config.train_config import TrainConfig
from tracking.runs import get_or_create_experiment

EXPERIMENT = "vitscale-preflight"  # MLflow experiment of the probe runs (each deleted once written)
READ_CHUNK_BYTES = 4 * 2**20
READ_MAX_S = 60.0  # a read stops here: a slow store's rate is known by then
LOADER_TRIES = 2  # other work only slows a timing down: the fastest is the nearest to the node's rate
# One try, a short timeout (MLflow's client retries for minutes): a tracking server that is down fails in seconds.
TRACKING_ENV = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}


@dataclass(frozen=True)
class Figure:
    """One measured number (None when it could not be measured), what it was measured on, or the error."""

    value: float | None
    detail: str
    error: str = ""


@dataclass(frozen=True)
class GpuInventory:
    """The node's GPUs as the driver reports them; count 0 on a CPU node."""

    count: int
    names: tuple[str, ...] = ()
    memory_gb: tuple[float, ...] = ()  # each, GB of 1e9 bytes (the profile's unit)
    driver: str = ""
    source: str = "no nvidia-smi and no CUDA device"
    error: str = ""


@dataclass(frozen=True)
class ProbeRequest:
    """What one node measures: ``shard_urls`` (read up to ``read_budget_bytes`` by ``read_streams`` parallel readers),
    the run's config (its loader)."""

    shard_urls: tuple[str, ...]
    read_budget_bytes: int
    config: TrainConfig
    checkpoint_root: str
    tracking_uri: str
    label: str  # the node, for the probe run's name
    check_efa: bool = False  # a training node of a multi-node EFA profile (`cluster.network.needs_efa`)
    device_type: str = "cpu"  # the workers': on "cuda" the loader sends uint8 pixels (`DataConfig.pixels_for`)
    read_streams: int = 1  # the loader workers of the ranks the node holds, each reading a shard at a time


@dataclass(frozen=True)
class NodeFigures:
    gpus: GpuInventory
    read_mb_per_s: Figure
    loader_img_s_per_core: Figure
    free_gb: Figure  # at the checkpoint root, after a probe file was written and removed there
    tracking_s: Figure  # seconds to create, tag and delete a run
    efa_missing: str | None = None  # why NCCL would not reach EFA here; None: it would, or it was not asked


class NodeProbe:
    """The Ray actor (`ray.remote` is applied by the caller) that measures its node; ``now`` serves the clock check."""

    def identity(self) -> tuple[str, str]:
        import ray  # in the actor's process only

        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()

    def now(self) -> float:
        return time.time()

    def measure(self, request: ProbeRequest) -> NodeFigures:
        """Each figure in turn: the read first, so that it meets the shards cold."""
        return NodeFigures(
            gpus=gpu_inventory(),
            read_mb_per_s=_guarded(read_rate, request.shard_urls, request.read_budget_bytes, request.read_streams),
            loader_img_s_per_core=_guarded(loader_rate_now, request.config, request.device_type),
            free_gb=_guarded(free_space, request.checkpoint_root),
            tracking_s=_guarded(tracking_round_trip, request.tracking_uri, request.label),
            efa_missing=efa_missing() if request.check_efa else None,  # as a training worker checks it
        )


def _guarded(measure: Callable[..., Figure], *args) -> Figure:
    """``measure(*args)``, or a figure holding the error that stopped it."""
    try:
        return measure(*args)
    except Exception as exc:  # reported on the check's line, never raised out of the probe
        first = (str(exc).strip().splitlines() or [""])[0]
        return Figure(None, "", f"{type(exc).__name__}: {first}"[:300])


def gpu_inventory() -> GpuInventory:
    """nvidia-smi's view where it is installed, else torch.cuda's, else none."""
    if shutil.which("nvidia-smi"):
        return _nvidia_smi()
    try:
        import torch

        if not torch.cuda.is_available():
            return GpuInventory(0)
        props = [torch.cuda.get_device_properties(i) for i in range(torch.cuda.device_count())]
        return GpuInventory(
            len(props),
            tuple(p.name for p in props),
            tuple(p.total_memory / 1e9 for p in props),
            f"CUDA {torch.version.cuda} (torch)",
            "torch.cuda",
        )
    except Exception as exc:  # a broken driver: reported as such
        return GpuInventory(0, source="torch.cuda", error=f"{type(exc).__name__}: {exc}")


def _nvidia_smi() -> GpuInventory:
    query = ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader,nounits"]
    try:
        out = subprocess.run(query, capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        return GpuInventory(0, source="nvidia-smi", error=f"{type(exc).__name__}: {exc}"[:300])
    return parse_nvidia_smi(out)


def parse_nvidia_smi(text: str) -> GpuInventory:
    """The inventory from `_nvidia_smi`'s query (memory.total in MiB); an error where a row is unreadable (a failing
    GPU's fields read `[Unknown Error]`, and nvidia-smi still exits 0)."""
    rows = [[field.strip() for field in line.split(",")] for line in text.splitlines() if line.strip()]
    for row in rows:
        if len(row) != 3 or not _is_number(row[1]):
            return GpuInventory(len(rows), source="nvidia-smi", error=f"unreadable row {', '.join(row)!r}"[:300])
    names = tuple(row[0] for row in rows)
    memory = tuple(float(row[1]) * 2**20 / 1e9 for row in rows)
    drivers = sorted({row[2] for row in rows})
    return GpuInventory(len(rows), names, memory, ", ".join(drivers), "nvidia-smi")


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def read_rate(urls: tuple[str, ...], budget_bytes: int, streams: int = 1) -> Figure:
    """MB/s of ``streams`` parallel readers, as many loader workers (an object store serves each stream at a fraction
    of a node's rate), each reading its share of ``urls`` whole, in turn, until ``budget_bytes`` are read in all or
    `READ_MAX_S` passed; opening each file is timed too."""
    if not urls:
        raise ValueError("no shard to read: the training manifest lists none")
    import fsspec  # the storage's filesystem (s3fs, gcsfs) where the runtime env installed it

    streams = max(1, min(streams, len(urls)))
    read, files = [0] * streams, [0] * streams
    start = time.perf_counter()

    def more() -> bool:
        return sum(read) < budget_bytes and time.perf_counter() - start < READ_MAX_S

    def reader(k: int) -> None:
        for url in urls[k::streams]:
            _drop_page_cache(url)
            with fsspec.open(url, "rb") as stream:
                while more() and (chunk := stream.read(READ_CHUNK_BYTES)):
                    read[k] += len(chunk)
            files[k] += 1
            if not more():
                return

    with ThreadPoolExecutor(streams) as pool:
        list(pool.map(reader, range(streams)))  # the first reader's error is the figure's
    seconds, total = max(time.perf_counter() - start, 1e-9), sum(read)
    shards = f"{sum(files)} shard(s), {total / 1e6:.3g} MB in {seconds:.2g} s"
    return Figure(total / 1e6 / seconds, f"{streams} parallel stream(s), {shards}")


def _drop_page_cache(url: str) -> None:
    """Ask the kernel to forget a local shard's cached pages: a run reads most shards cold, not from memory."""
    if is_remote(url) or not hasattr(os, "posix_fadvise"):
        return
    try:
        fd = os.open(resolve_location(url), os.O_RDONLY)
    except OSError:
        return  # the read reports it
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def loader_rate_now(config: TrainConfig, device_type: str = "cpu") -> Figure:
    """Images/s one core loads for ``config`` here, now (own cache: no earlier figure), the best of `LOADER_TRIES`,
    in the pixels the workers of ``device_type`` get."""
    d, pixels = config.data, config.data.pixels_for(device_type)
    side = builtin.config(d.builtin, **d.builtin_options).resolution if d.builtin else None
    rates = []
    for _ in range(LOADER_TRIES):
        with tempfile.TemporaryDirectory(prefix="vitscale-preflight-") as cache, environ({"VITSCALE_CACHE": cache}):
            rates.append(loader_rate(resolve_location(d.train), d.image_size, d.augment, d.cache_mb, side, pixels))
    if "synthetic" in rates[0].source:  # loader_rate's fallback: the shards are not readable on this node
        raise RuntimeError(f"{d.train} is not readable on this node (timed on synthetic JPEGs instead)")
    where = "from its decoded cache" if "decoded cache" in rates[0].source else "from the shards"
    best = max(r.img_s_per_core for r in rates)
    return Figure(best, f"one core, {d.image_size}px {where}, best of {LOADER_TRIES}")


def free_space(root: str) -> Figure:
    """GB free at the checkpoint root (made if absent) after writing and removing a probe file; inf on object stores."""
    name = f".vitscale-preflight-{uuid.uuid4().hex[:8]}"
    if is_remote(root):
        import fsspec

        fs, path = fsspec.core.url_to_fs(root)
        fs.pipe_file(f"{path.rstrip('/')}/{name}", b"preflight")
        fs.rm_file(f"{path.rstrip('/')}/{name}")
        return Figure(math.inf, "object store: wrote and removed a probe object")
    folder = Path(resolve_location(root))
    folder.mkdir(parents=True, exist_ok=True)
    probe = folder / name
    probe.write_bytes(b"preflight")
    probe.unlink()
    return Figure(shutil.disk_usage(folder).free / 1e9, f"{folder}, writable")


def tracking_round_trip(uri: str, label: str) -> Figure:
    """Seconds to create, tag and delete a run at ``uri``."""
    with environ(TRACKING_ENV):
        from mlflow import MlflowClient

        start = time.perf_counter()
        client = MlflowClient(tracking_uri=uri)
        experiment = get_or_create_experiment(client, uri, EXPERIMENT)
        run = client.create_run(experiment, run_name=f"preflight {label}")
        client.set_tag(run.info.run_id, "vitscale.preflight", label)
        client.delete_run(run.info.run_id)
        seconds = time.perf_counter() - start
    return Figure(seconds, f"created, tagged and deleted a run in experiment {EXPERIMENT}")
