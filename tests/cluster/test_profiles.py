"""cluster.profiles: a lab's own cluster file, written from a shipped one, fails at load with the field at fault and
the fix; no edit reaches the plan or Ray with a value the planner divides by or Ray would refuse."""

from __future__ import annotations

import pytest
import yaml

from cluster.profiles import PROFILES_DIR, load_profile

# (shipped profile, {dotted key: new value, or None to delete it}, the message's expected text)
BAD_EDITS = [
    ("a100x64", {"name": "my lab"}, "name 'my lab': use letters, digits, '.', '_' and '-' only"),
    ("a100x64", {"workers.num_workers": 80}, "workers.num_workers=80 exceeds nodes x gpus_per_node / gpus_per_worker"),
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
