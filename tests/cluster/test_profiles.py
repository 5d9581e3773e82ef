"""cluster.profiles: a lab's own cluster file, written from a shipped one, fails at load with the field at fault and
the fix; no edit reaches the plan or Ray with a value the planner divides by or Ray would refuse."""

from __future__ import annotations

import pytest
import yaml

from cluster.profiles import PROFILES_DIR, load_profile

# (shipped profile, {dotted key: new value, or None to delete it}, the message's expected text)
BAD_EDITS = [
    ("a100x64", {"name": "my lab"}, "name 'my lab': use letters, digits, '.', '_' and '-' only"),
    ("a100x64", {"workers.num_workers": 80}, "= 80 GPUs, but hardware.nodes=8 x gpus_per_node=8 = 64: the workers do"),
    ("a100x64", {"hardware.peak_tflops": None}, "GPU workers need hardware.peak_tflops (their dense bf16 peak)"),
    ("a100x64", {"hardware.peak_tflops": 0}, "hardware.peak_tflops=0.0 must be > 0 (or absent on CPU)"),
    ("a100x64", {"comm_backend": "gloo"}, "GPU workers need comm_backend: nccl"),
    ("a100x64", {"hardware.gpu_memory_gb": 0}, "hardware.gpu_memory_gb must be > 0 for GPU workers"),
    ("a100x64", {"hardware.nodes": 0}, "hardware.nodes=0 must be >= 1"),
    ("a100x64", {"hardware.memory_gb_per_node": 0}, "hardware.memory_gb_per_node=0.0 must be > 0"),
    ("a100x64", {"hardware.loader_img_s_per_core": 0}, "`make bench-data` measures it"),
    ("a100x64", {"storage.read_mb_per_s": 0}, "storage.read_mb_per_s=0.0 must be > 0"),
    ("a100x64", {"defaults.micro_batch_size": 0}, "defaults.micro_batch_size=0 must be >= 1"),
    ("a100x64", {"assumed_mfu": 1.5}, "assumed_mfu=1.5 must be in (0, 1]"),
    ("a100x64", {"max_failures": -1}, "max_failures must be >= 0 (-1 is not supported: be explicit)"),
    ("a100x64", {"workers.num_workers": 0}, "workers.num_workers must be >= 1 (a fixed world size), or give"),
    ("a100x64", {"workers.min": 4}, "an elastic worker group needs both workers.min and workers.max; add workers.max"),
    (
        "a100x64",
        {"workers.num_workers": None, "workers.min": 8, "workers.max": 4},
        "workers.min=8, workers.max=4: need 1 <= min <= max",
    ),
    ("a100x64", {"workers.resources": {"GPU": 1}}, "CPUs and GPUs are cpus_per_worker and gpus_per_worker"),
    ("a100x64", {"workers.elastic_resize_monitor_interval_s": 0}, "must be > 0 (Ray's default is 60)"),
    ("a100x64", {"evals.num_gpus": 1, "evals.gpu_memory_gb": 0}, "evals on GPUs (evals.num_gpus=1) need"),
    ("a100x64", {"evals.memory_gb": -1}, "evals.memory_gb and evals.gpu_memory_gb must be >= 0"),
    ("a100x64", {"evals.peak_tflops": 0}, "evals.peak_tflops=0.0 must be > 0 (or absent)"),
    ("a100x64", {"evals.assumed_mfu": 2}, "evals.assumed_mfu=2.0 must be in (0, 1] (or absent)"),
    ("a100x64", {"hang.straggler_polls": 0}, "hang.straggler_polls=0 must be >= 1"),
    ("a100x64", {"hang.floor_s": 0}, "hang.floor_s=0.0 must be > 0"),
    ("a100x64", {"network.efficiency": -1}, "network.efficiency=-1.0 must be in (0, 1]"),
    ("h100x8", {"network.nvlink_gb_per_s": None}, "network.kind=nvlink needs network.nvlink_gb_per_s"),
    ("local", {"ray.head_num_cpus": 1}, "ray.head_num_cpus=1 cannot hold 2 workers x 1 CPUs; raise head_num_cpus"),
]


def _edited(base: str, edits: dict[str, object]) -> dict:
    data = yaml.safe_load((PROFILES_DIR / f"{base}.yaml").read_text())
    for key, value in edits.items():
        *parents, leaf = key.split(".")
        node = data
        for part in parents:
            node = node.setdefault(part, {})
        if value is None:
            node.pop(leaf, None)
        else:
            node[leaf] = value
    return data


@pytest.mark.parametrize("base,edits,message", BAD_EDITS, ids=[",".join(e) for _, e, _ in BAD_EDITS])
def test_a_bad_edit_of_a_shipped_profile_names_its_field_and_the_fix(tmp_path, base, edits, message):
    path = tmp_path / f"{base}_edited.yaml"
    path.write_text(yaml.safe_dump(_edited(base, edits)))
    with pytest.raises(ValueError) as raised:
        load_profile(path)
    text = str(raised.value)
    assert text.startswith(f"cluster profile {path}: ") and message in text and "\n" not in text, text


# (shipped profile, a bad edit, the message's expected text, the edit that message names as the fix)
BAD_EDITS_AND_FIXES = [
    # cluster.render's pods, checked at load: the launch, preflight and driver refuse what render refuses
    (
        "a100x64",
        {"workers.cpus_per_worker": 20},
        "need 160 CPUs, its pod has 94 of hardware.cpus_per_node=96; lower workers.cpus_per_worker to 11 (or less)",
        {"workers.cpus_per_worker": 11},
    ),
    (
        "a100x64",
        {"evals.num_gpus": 2},
        "an eval (evals.num_cpus=7, num_gpus=2) does not fit the g5.2xlarge pod (7 of its 8 vCPUs, 1 GPU); lower "
        "evals.num_gpus to 1",
        {"evals.num_gpus": 1},
    ),
    (
        "a100x8",
        {"evals.num_cpus": 20},
        "need 100 CPUs, its pod has 94 of hardware.cpus_per_node=96; lower workers.cpus_per_worker to 9 or "
        "evals.num_cpus to 14 (or less)",
        {"evals.num_cpus": 14},
    ),
    # every GPU runs a worker
    (
        "a100x64",
        {"hardware.nodes": 16},
        "workers.num_workers=64 x workers.gpus_per_worker=1 = 64 GPUs, but hardware.nodes=16 x gpus_per_node=8 = 128: "
        "64 GPU(s) would sit idle; set workers.num_workers: 128 or hardware.nodes: 8",
        {"hardware.nodes": 8},
    ),
    (
        "a100x64",
        {"workers.num_workers": 63},
        "= 63 GPUs, but hardware.nodes=8 x gpus_per_node=8 = 64: 1 GPU(s) would sit idle; set workers.num_workers: 64",
        {"workers.num_workers": 64},
    ),
    (
        "a100x64",
        {"workers.num_workers": None, "workers.min": 56, "workers.max": 72},
        "workers.max=72 x workers.gpus_per_worker=1 = 72 GPUs, but hardware.nodes=8 x gpus_per_node=8 = 64: the "
        "workers do not fit; set workers.max: 64 or hardware.nodes: 9",
        {"hardware.nodes": 9},
    ),
    (
        "a100x64",
        {"hardware.gpus_per_node": 0},
        "workers.gpus_per_worker=1 but hardware.gpus_per_node=0; set hardware.gpus_per_node to the GPUs a node has",
        {"hardware.gpus_per_node": 8},
    ),
    # a rank trains on one GPU (cuda:LOCAL_RANK): a second one per worker sat idle, and the plan priced one per rank
    (
        "h100x8",
        {"workers.gpus_per_worker": 2, "workers.num_workers": 4, "workers.cpus_per_worker": 40},
        "workers.gpus_per_worker=2, but a worker trains on one GPU (cuda:LOCAL_RANK) and the plan prices one per "
        "worker: 1 of each worker's 2 would sit idle; run one worker per GPU: set workers.gpus_per_worker: 1, "
        "workers.num_workers: 8 (hardware.nodes=1 x gpus_per_node=8) and workers.cpus_per_worker: 20",
        {"workers.gpus_per_worker": 1, "workers.num_workers": 8, "workers.cpus_per_worker": 20},
    ),
    (
        "a100x64",
        {"workers.gpus_per_worker": 8, "workers.num_workers": 8, "workers.cpus_per_worker": 88},
        "workers.gpus_per_worker=8, but a worker trains on one GPU (cuda:LOCAL_RANK) and the plan prices one per "
        "worker: 7 of each worker's 8 would sit idle; run one worker per GPU: set workers.gpus_per_worker: 1, "
        "workers.num_workers: 64 (hardware.nodes=8 x gpus_per_node=8) and workers.cpus_per_worker: 11",
        {"workers.gpus_per_worker": 1, "workers.num_workers": 64, "workers.cpus_per_worker": 11},
    ),
    (
        "a100x64",
        {"workers.num_workers": None, "workers.min": 16, "workers.max": 32, "workers.gpus_per_worker": 2},
        "run one worker per GPU: set workers.gpus_per_worker: 1, workers.max: 64, workers.min: 32 (hardware.nodes=8 "
        "x gpus_per_node=8) and workers.cpus_per_worker: 5",
        {"workers.gpus_per_worker": 1, "workers.max": 64, "workers.min": 32, "workers.cpus_per_worker": 5},
    ),
    # storage: no empty location, no URL with one slash
    (
        "a100x64",
        {"storage.checkpoints": ""},
        "storage.checkpoints is empty; give a folder",
        {"storage.checkpoints": "/fsx/r"},
    ),
    (
        "a100x64",
        {"storage.shards": " "},
        "storage.shards is empty; give the root of the shard folders",
        {"storage.shards": "s3://b"},
    ),
    (
        "a100x64",
        {"storage.shards": "s3:/vitscale-datasets"},
        "storage.shards='s3:/vitscale-datasets' is no URL (a URL is SCHEME://...); write 's3://vitscale-datasets'",
        {"storage.shards": "s3://vitscale-datasets"},
    ),
    (  # paths a multi-node run's nodes share go under it
        "a100x64",
        {"storage.shared": "fsx"},
        "storage.shared='fsx' must be the absolute path of the filesystem every node mounts, e.g. /fsx, or left out",
        {"storage.shared": "/fsx"},
    ),
    (
        "local",
        {"storage.mlflow_tracking_uri": ""},
        "storage.mlflow_tracking_uri is empty; give the MLflow server",
        {"storage.mlflow_tracking_uri": "http://mlflow.example.com:5000"},
    ),
    # a remote profile's Ray address is the Jobs API's URL (without http:// Ray takes it for a GCS address)
    (
        "a100x64",
        {"ray.address": "127.0.0.1:8265"},
        "ray.address='127.0.0.1:8265' is not the Jobs API's URL (http:// or https://); write http://127.0.0.1:8265",
        {"ray.address": "http://127.0.0.1:8265"},
    ),
]


@pytest.mark.parametrize(
    "base,edits,message,fix", BAD_EDITS_AND_FIXES, ids=[",".join(e) for _, e, _, _ in BAD_EDITS_AND_FIXES]
)
def test_a_bad_edit_is_refused_in_one_line_and_the_fix_it_names_loads(tmp_path, base, edits, message, fix):
    test_a_bad_edit_of_a_shipped_profile_names_its_field_and_the_fix(tmp_path, base, edits, message)
    fixed = tmp_path / f"{base}_fixed.yaml"
    fixed.write_text(yaml.safe_dump(_edited(base, {**edits, **fix})))
    load_profile(fixed)
