"""cluster.network + cluster.plan.comms + the DeepSpeed reduction keys: the interconnect in the plan, a step's bytes
and time by hand, the settings the arithmetic chooses, the workers' environment, and 2-rank CPU numbers unchanged."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from cluster.network import EFA_ENV, efa_missing, needs_efa, network_env
from cluster.plan import comms
from cluster.plan.planner import build_plan, resolve_config
from cluster.plan.text import format_plan
from cluster.profiles import load_profile
from pretrain.config.ds_config import BatchPlan, DeepSpeedConfig, deepspeed_config
from pretrain.config.optim import OptimConfig

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(120)
def test_a100x64_h14_plan_prints_the_interconnect_and_a_step_of_communication_by_hand():
    """ZeRO-2, bf16, 64 ranks, accumulation 1: reduce to owners 63/64 x P x 4 (fp32 gradients) + all-gather 63/64 x
    P x 2 (bf16 weights), at 400 Gb/s / 8 x 0.8 = 40 GB/s, + 30 us per collective."""
    profile = load_profile("a100x64")
    config = resolve_config(profile, "vit_h14_i21k", [], "h14-comms")
    plan = build_plan(profile, config)
    c, P, f = plan.comms, plan.model.num_params, 63 / 64
    assert config.deepspeed.communication_data_type == "fp32"  # 6% of the step over bf16: within the 10% budget
    assert (config.deepspeed.reduce_bucket_size, config.deepspeed.allgather_bucket_size) == (192_000_000, 200_000_000)
    assert [(x.what, x.bytes_per_gpu) for x in c.collectives] == [
        ("reduce to owners", pytest.approx(f * P * 4)),
        ("all-gather", pytest.approx(f * P * 2)),
    ]
    calls = 64 * math.ceil(P / 192e6) + math.ceil(P / 200e6)
    assert c.bandwidth_gb_per_s == pytest.approx(40.0)
    assert c.comm_s == pytest.approx(f * P * 6 / 40e9 + calls * 30e-6)
    assert c.compute_s == plan.compute.step_time_s and c.comm_s < c.compute_s
    text = format_plan(plan)
    line = next(x for x in text.splitlines() if x.startswith("  interconnect"))
    assert "EFA (libfabric, GPUDirect RDMA), 400 Gb/s per node between 8 node(s)" in line
    assert "FI_PROVIDER=efa, FI_EFA_USE_DEVICE_RDMA=1, NCCL_PROTO=simple, RDMAV_FORK_SAFE=1" in line
    line = next(x for x in text.splitlines() if x.startswith("  communication"))
    assert f"{c.comm_s * 1e3:.3g} ms at 40 GB/s (50 GB/s per node between nodes x efficiency 0.8)" in line
    assert f"{c.comm_s / c.compute_s:.0%} of the 0.515 s compute step: not communication-bound" in line
    assert "does not hide behind compute" in line  # the recipe's overlap_comm cannot overlap owner reduces
    line = next(x for x in text.splitlines() if x.startswith("  reduction"))
    assert "communication_data_type fp32 (+" in line and "use_multi_rank_bucket_allreduce false" in line


@pytest.mark.timeout(120)
def test_h100x8_b16_plan_uses_nvlink_and_counts_every_micro_batch_of_zero2():
    profile = load_profile("h100x8")
    plan = build_plan(profile, resolve_config(profile, "vit_b16_i21k", [], "b16-comms"))
    c, P, A = plan.comms, plan.model.num_params, plan.batch.grad_accum_steps
    assert A == 8 and c.bandwidth_gb_per_s == pytest.approx(450 * 0.8)
    assert c.collectives[0].bytes_per_gpu == pytest.approx(A * 7 / 8 * P * 4)  # ZeRO-2 reduces every micro-batch
    assert c.env == () and "one node: NCCL over NVLink 450 GB/s per GPU" in format_plan(plan)


def test_one_gpu_at_zero2_or_3_is_advised_zero1_and_nothing_else_is():
    """ZeRO-2 over one rank partitions nothing, yet its gradient hooks cost the step (measured on one H200)."""
    big = load_profile("h200x8")
    one = dataclasses.replace(
        big,
        hardware=dataclasses.replace(big.hardware, gpus_per_node=1),
        workers=dataclasses.replace(big.workers, num_workers=1),
    )
    no_evals = ["evals.suite=null", "evals.extra_suites=[]"]
    for profile, stage, advised in ((one, 2, True), (one, 3, True), (one, 1, False), (big, 2, False)):
        config = resolve_config(profile, "vit_h14_i21k", [*no_evals, f"deepspeed.zero_stage={stage}"], "one")
        verdict = build_plan(profile, config).comms.verdict
        advice = f"; ZeRO-{stage} partitions nothing at one rank and still costs its step"
        assert (advice in verdict) is advised, (profile.workers.num_workers, stage, verdict)
        assert verdict.endswith("--set deepspeed.zero_stage=1") is advised
    local = load_profile("local")
    cpu = dataclasses.replace(local, workers=dataclasses.replace(local.workers, num_workers=1))  # nothing measured
    config = resolve_config(cpu, "local_demo", ["deepspeed.zero_stage=2"], "r")
    assert build_plan(cpu, config).comms.verdict == "one rank: no collectives"


def test_step_collectives_by_hand_for_every_zero_stage():
    """4 ranks, 1000 parameters, 2 micro-batches, buckets of 300 / 400 elements: f = 3/4."""
    P, n, A, buckets = 1000, 4, 2, (300, 400)

    def moved(stage, precision, dtype):
        got = comms.step_collectives(stage, precision, dtype, n, A, P, buckets)
        return [(x.what, x.bytes_per_gpu, x.calls) for x in got]

    assert moved(0, "fp32", "fp32") == [("all-reduce", 2 * 0.75 * P * 4, 1)]
    assert moved(1, "bf16", "bf16") == [("all-reduce", 2 * 0.75 * P * 2, 1), ("all-gather", 0.75 * P * 2, 3)]
    assert moved(1, "fp32", "fp32") == [("reduce to owners", 0.75 * P * 4, 4 * 4), ("all-gather", 0.75 * P * 4, 3)]
    assert moved(2, "bf16", "fp32") == [("reduce to owners", A * 0.75 * P * 4, A * 4 * 4), ("all-gather", 1500, 3)]
    assert moved(3, "bf16", "bf16") == [("reduce-scatter", A * 0.75 * P * 2, A * 4), ("all-gather", 2 * A * 1500, 12)]
    assert comms.step_collectives(2, "bf16", "bf16", 1, A, P, buckets) == ()  # one rank sends nothing
    bw = comms.Bandwidth(gb_per_s=1e-6, latency_s=0.01, source="by hand")  # 1000 bytes/s
    owners, gather = comms.step_collectives(2, "bf16", "fp32", n, A, P, buckets)
    assert comms.seconds((owners, gather), bw) == pytest.approx((6000 + 1500) / 1000 + (32 + 3) * 0.01)


def test_buckets_and_the_gradient_dtype_follow_the_arithmetic():
    profile = load_profile("a100x64")
    bw = comms.bandwidth(profile)
    # per-rank share of a bucket >= 10 latencies: n x 30 us x 40 GB/s / (bytes x 0.1), within 5e7..2e8
    assert comms.bucket_elements(64, 4, bw) == 192_000_000 == math.ceil(64 * 30e-6 * 40e9 / 0.4 / 1e6) * 1_000_000
    assert comms.bucket_elements(64, 2, bw) == comms.MAX_BUCKET and comms.bucket_elements(2, 4, bw) == comms.MIN_BUCKET
    P, step = 660_000_000, 0.515
    assert comms.choose_reduction(profile, 2, "bf16", 64, 1, P, step).communication_data_type == "fp32"
    slow = dataclasses.replace(profile, network=dataclasses.replace(profile.network, gbps_per_node=100))
    chosen = comms.choose_reduction(slow, 2, "bf16", 64, 1, P, step)
    assert chosen.communication_data_type == "auto" and "over 10%" in chosen.dtype_reason  # bf16: the precision
    assert comms.choose_reduction(profile, 2, "fp32", 64, 1, P, step).communication_data_type == "auto"


@pytest.mark.timeout(60)
def test_the_plan_sets_reduction_settings_on_gpus_only_and_the_recipe_wins(tmp_path):
    local = load_profile("local")
    storage = dataclasses.replace(local.storage, shards=str(tmp_path / "data"), checkpoints=str(tmp_path / "runs"))
    cpu = resolve_config(dataclasses.replace(local, storage=storage), "local_demo", [], "demo").deepspeed
    defaults = DeepSpeedConfig()
    assert (cpu.communication_data_type, cpu.reduce_bucket_size, cpu.allgather_bucket_size) == (
        defaults.communication_data_type,
        defaults.reduce_bucket_size,
        defaults.allgather_bucket_size,
    )
    big = load_profile("a100x64")
    sets = ["deepspeed.reduce_bucket_size=60000000", "deepspeed.communication_data_type=auto"]
    ds = resolve_config(big, "vit_h14_i21k", sets, "h14").deepspeed
    assert (ds.reduce_bucket_size, ds.communication_data_type, ds.allgather_bucket_size) == (60e6, "auto", 200e6)


def test_the_deepspeed_json_makes_every_reduction_setting_explicit():
    plan, optim = BatchPlan(64, 4, 2, 8), OptimConfig()
    for precision in ("fp32", "bf16"):
        ds = deepspeed_config(DeepSpeedConfig(), optim, plan, precision)
        zero = ds["zero_optimization"]
        assert zero["use_multi_rank_bucket_allreduce"] is False
        assert {"overlap_comm", "contiguous_gradients", "reduce_bucket_size", "allgather_bucket_size"} <= set(zero)
        assert ds["communication_data_type"] == precision  # auto: DeepSpeed's own default, written out
    fp32 = DeepSpeedConfig(communication_data_type="fp32")
    assert deepspeed_config(fp32, optim, plan, "bf16")["communication_data_type"] == "fp32"
    with pytest.raises(ValueError, match="communication_data_type=bf16 with fp32 training"):
        deepspeed_config(DeepSpeedConfig(communication_data_type="bf16"), optim, plan, "fp32")


def test_network_env_gives_efa_its_documented_variables_and_nothing_elsewhere():
    docs = (ROOT / "docs" / "network.md").read_text()
    efa = network_env(load_profile("a100x64"))
    assert efa == {"FI_PROVIDER": "efa", "FI_EFA_USE_DEVICE_RDMA": "1", "NCCL_PROTO": "simple", "RDMAV_FORK_SAFE": "1"}
    for name, value, _ in EFA_ENV:
        assert f"`{name}={value}`" in docs, name  # each documented with its reason
    assert network_env(load_profile("local")) == {} and network_env(load_profile("h100x8")) == {}
    local = load_profile("local")
    pinned = dataclasses.replace(local, network=dataclasses.replace(local.network, socket_ifname="eth0"))
    assert network_env(pinned) == {"GLOO_SOCKET_IFNAME": "eth0"}  # gloo-only on a CPU profile
    big = load_profile("a100x64")
    pinned = dataclasses.replace(big, network=dataclasses.replace(big.network, socket_ifname="ens32"))
    assert network_env(pinned)["NCCL_SOCKET_IFNAME"] == "ens32"


@pytest.mark.timeout(60)
def test_a_worker_of_a_multi_node_efa_profile_finds_the_device_and_nccls_plugin(tmp_path):
    """Without either NCCL trains over TCP sockets, slowly and without an error: the worker refuses to start."""
    import torch

    assert needs_efa(load_profile("a100x64")) and not needs_efa(load_profile("h100x8"))
    assert not needs_efa(load_profile("local"))
    devices = tmp_path / "infiniband"
    devices.mkdir()
    assert "no EFA device in this container" in efa_missing(devices)
    (devices / "uverbs0").touch()
    lib = tmp_path / "lib"
    lib.mkdir()

    def in_a_new_process() -> str:  # the loader reads LD_LIBRARY_PATH when a process starts
        code = "import sys, pathlib, cluster.network as n; print(n.efa_missing(pathlib.Path(sys.argv[1])))"
        env = {**os.environ, "LD_LIBRARY_PATH": str(lib)}
        done = subprocess.run([sys.executable, "-c", code, str(devices)], env=env, capture_output=True, text=True)
        return done.stdout.strip()

    assert "NCCL's network plugin libnccl-net.so does not load" in in_a_new_process()
    (lib / "libnccl-net.so").symlink_to(Path(torch.__file__).parent / "lib" / "libc10.so")  # any shared library
    assert in_a_new_process() == "None"
    # The image holds the plugin and libfabric (AWS's installer, without the kernel module), on the loader's path.
    dockerfile = re.sub(r"\\\n\s*", " ", (ROOT / "Dockerfile").read_text())
    assert re.search(r"^RUN .*efa_installer\.sh -y --skip-kmod ", dockerfile, re.M)
    # one installer, checked, whenever the image is built (not "latest": a rebuild would change the plugin)
    assert re.search(r"^ARG EFA_INSTALLER_VERSION=\d+\.\d+\.\d+$", dockerfile, re.M)
    assert re.search(r"^ARG EFA_INSTALLER_SHA256=[0-9a-f]{64}$", dockerfile, re.M)
    assert re.search(r"^RUN .*\| sha256sum -c - .*&& tar xzf", dockerfile, re.M)
    assert re.search(r"^ENV LD_LIBRARY_PATH=/opt/amazon/ofi-nccl/lib:/opt/amazon/efa/lib:", dockerfile, re.M)


@pytest.mark.timeout(60)
def test_the_docs_plan_lines_are_the_plans_own():
    """docs/network.md quotes two plans' network lines; they stay what the planner prints (one had drifted)."""
    docs = (ROOT / "docs" / "network.md").read_text()
    quoted = re.findall(r"`make launch CLUSTER=(\S+) RECIPE=(\S+) DRY_RUN=1`:\n\n```\n(.*?)```", docs, re.S)
    assert [(cluster, recipe) for cluster, recipe, _ in quoted] == [
        ("a100x64", "vit_h14_i21k"),
        ("h100x8", "vit_b16_i21k"),
    ]
    for cluster, recipe, lines in quoted:
        profile = load_profile(cluster)
        printed = format_plan(build_plan(profile, resolve_config(profile, recipe, [], "docs"))).splitlines()
        for line in lines.splitlines():
            assert line in printed, (cluster, line)


@pytest.mark.timeout(60)
def test_a_network_that_cannot_carry_the_workers_is_a_clear_error(tmp_path):
    data = yaml.safe_load((ROOT / "cluster" / "profiles" / "a100x64.yaml").read_text())
    cases = {
        "nvlink joins the GPUs of one node only": dict(kind="nvlink", nvlink_gb_per_s=300),
        "on 8 nodes needs network.gbps_per_node": dict(kind="efa", gbps_per_node=0),
        r"network.efficiency=1.5 must be in \(0, 1\]": dict(kind="efa", gbps_per_node=400, efficiency=1.5),
    }
    for message, network in cases.items():
        (tmp_path / "bad.yaml").write_text(yaml.safe_dump(dict(data, network=network)))
        with pytest.raises(ValueError, match=message):
            load_profile(tmp_path / "bad.yaml")
    local = yaml.safe_load((ROOT / "cluster" / "profiles" / "local.yaml").read_text())
    (tmp_path / "cpu.yaml").write_text(yaml.safe_dump(dict(local, network=dict(kind="efa", gbps_per_node=400))))
    with pytest.raises(ValueError, match="CPU workers"):
        load_profile(tmp_path / "cpu.yaml")


RANK_SCRIPT = """
import hashlib, json, sys
import torch, deepspeed
from pretrain.config.ds_config import BatchPlan, DeepSpeedConfig, deepspeed_config
from pretrain.config.optim import OptimConfig

deepspeed.init_distributed("gloo")
rank, out = torch.distributed.get_rank(), {}
for stage in (1, 2, 3):
    for precision in ("fp32", "bf16"):
        for keys in ("before", "now"):
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(64, 300), torch.nn.GELU(), torch.nn.Linear(300, 10))
            ds = DeepSpeedConfig(zero_stage=stage, reduce_bucket_size=5000, allgather_bucket_size=5000)
            config = deepspeed_config(ds, OptimConfig(), BatchPlan(16, 4, 2, 2), precision)
            if keys == "before":  # the JSON without the keys this change writes out
                del config["zero_optimization"]["use_multi_rank_bucket_allreduce"], config["communication_data_type"]
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)
            g = torch.Generator().manual_seed(100 + rank)
            dtype = torch.bfloat16 if precision == "bf16" else torch.float32
            for _ in range(6):
                x, y = torch.randn(4, 64, generator=g).to(dtype), torch.randn(4, 10, generator=g).to(dtype)
                engine.backward(((engine(x) - y) ** 2).float().mean())
                engine.step()
            params = list(engine.module.parameters())
            with deepspeed.zero.GatheredParameters(params, enabled=stage == 3):
                digest = hashlib.sha256(b"".join(p.detach().float().numpy().tobytes() for p in params)).hexdigest()
            out[f"{stage}-{precision}-{keys}"] = digest
json.dump(out, open(sys.argv[1].format(rank=rank), "w"))
"""


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_cpu_ranks_train_bit_identically_with_the_explicit_reduction_keys(tmp_path):
    """Owner reduces and the written-out communication_data_type leave 2-rank gloo numbers as they were, ZeRO-1/2/3
    in fp32 and bf16 (two ranks sum a + b whichever collective does it)."""
    from tests.pretrain.test_train_distributed import _env
    from tests.support import warm_ranks

    script, log = tmp_path / "ranks.py", tmp_path / "ranks.log"
    script.write_text(RANK_SCRIPT)
    status = warm_ranks.launch(str(script), [str(tmp_path / "out_{rank}.json")], 2, _env(), log, 540, module=False)
    assert status == 0, log.read_text()[-4000:]
    for rank in range(2):
        out = json.loads((tmp_path / f"out_{rank}.json").read_text())
        for key in (k for k in out if k.endswith("-now")):
            assert out[key] == out[re.sub("-now$", "-before", key)], key


def test_the_workers_environment_carries_the_network_allocator_and_compile_pool():
    """What reaches every training worker (`cluster.driver.job.worker_env`): the network's variables, the CUDA
    allocator's expandable segments on GPUs, and Inductor's compile pool sized to the worker's CPUs."""
    from cluster.driver.job import worker_env

    gpu = worker_env(load_profile("a100x64"))
    assert {name: gpu[name] for name, _, _ in EFA_ENV} == network_env(load_profile("a100x64"))
    assert gpu["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True" and "DS_ACCELERATOR" not in gpu
    assert gpu["TORCHINDUCTOR_COMPILE_THREADS"] == "10"  # cpus_per_worker of a100x64
    cpu = worker_env(load_profile("local"))
    assert cpu["DS_ACCELERATOR"] == "cpu" and cpu["TORCHINDUCTOR_COMPILE_THREADS"] == "1"
    assert not any(name.startswith(("FI_", "NCCL_", "PYTORCH_CUDA")) for name in cpu)
