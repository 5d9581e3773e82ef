"""cluster.profiles + cluster.plan.memory + cluster.plan.planner: hand arithmetic, profile/recipe errors, the launcher's
dry run."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from cluster import launch
from cluster.plan.memory import (
    GB,
    activation_bytes_per_image,
    model_state_bytes,
    stem_activation_bytes,
    vit_activation_bytes,
)
from cluster.plan.planner import PlanError, _model_size, build_plan, resolve_config, resolve_with_notes
from cluster.plan.text import format_plan
from cluster.profiles import load_profile, profile_names
from data_pipeline.paths import PROJECT_ROOT
from pretrain.config.precision import StepShape, cpu_bf16_units, decide
from pretrain.config.train_config import recipe_path
from pretrain.model.resnet import ResNetStem
from pretrain.model.vit import model_config
from pretrain.telemetry.peak import cpu_peak
from tests.support.saved_bytes import saved_bytes_per_image

H14_PARAMS_1K = 632_050_000  # paper Table 1 / docs/reference.md §1, with a 1000-class head


@pytest.mark.timeout(60)
def test_every_shipped_profile_loads_and_validates():
    assert {"local", "a100x8", "a100x64", "h100x8", "h200x8"} <= set(profile_names())
    for name in profile_names():
        profile = load_profile(name)
        assert profile.name == name
    local = load_profile("local")
    assert local.is_local and not local.uses_gpus
    assert (local.comm_backend, local.workers.num_workers, local.defaults.zero_stage) == ("gloo", 2, 2)
    assert local.storage.mlflow_tracking_uri.startswith("sqlite:///") and local.storage.mlflow_tracking_uri.endswith(
        "/mlflow.db"
    )
    big = load_profile("a100x64")
    assert big.hardware.nodes * big.hardware.gpus_per_node == big.workers.num_workers == 64
    assert big.comm_backend == "nccl" and big.hardware.gpu_memory_gb == 80


@pytest.mark.timeout(60)
def test_zero_memory_matches_reference_h14_at_64_gpus():
    """docs/reference.md §7: ViT-H/14 at 64 GPUs, bf16 + fp32 master + Adam: 10.1 / 5.17 / 1.44 / ~0.2 GB (ZeRO-1: the
    paper's 2.65 and DeepSpeed's full fp32 gradient buffer)."""
    expected = {0: 10.1, 1: 5.17, 2: 1.44, 3: 0.20}
    for stage, gb in expected.items():
        got = model_state_bytes(H14_PARAMS_1K, stage, 64, "bf16").total / 1e9
        assert round(got, 1 if gb >= 10 else 2) == gb, (stage, got)  # equal at the reference's precision
    # The same by hand, stage by stage (bytes per parameter over P).
    P, N = H14_PARAMS_1K, 64
    assert model_state_bytes(P, 0, N, "bf16").total == pytest.approx(16 * P)
    assert model_state_bytes(P, 1, N, "bf16").total == pytest.approx(2 * P + (2 + 4) * P + 12 * P / N)
    assert model_state_bytes(P, 2, N, "bf16").total == pytest.approx(2 * P + (2 + 4 + 12) * P / N)
    assert model_state_bytes(P, 3, N, "bf16").total == pytest.approx((2 + 2 + 4 + 12) * P / N)
    with pytest.raises(ValueError, match="zero_stage"):
        model_state_bytes(P, 4, N, "bf16")


@pytest.mark.timeout(60)
def test_activation_formula_matches_measured_h14():
    """docs/reference.md §7: ~337 MB per image at 224 with SDPA, 405 MB with eager attention (no recomputation)."""
    N = (224 // 14) ** 2 + 1  # patches + the class token
    kw = dict(tokens=N, width=1280, mlp_dim=5120, depth=32, num_heads=16, precision="bf16")
    assert activation_bytes_per_image(**kw) / 1e6 == pytest.approx(337, abs=1)
    assert activation_bytes_per_image(**kw, sdpa=False) / 1e6 == pytest.approx(405, abs=1)
    # Per-block checkpointing keeps block inputs + one block: far less.
    assert activation_bytes_per_image(**kw, activation_checkpointing=True) / 1e6 < 40


@pytest.mark.timeout(120)
def test_h14_plan_on_a100x64_matches_hand_arithmetic():
    profile = load_profile("a100x64")
    config = resolve_config(profile, "vit_h14_i21k", ["model.grad_checkpointing=false"], "h14-test")
    plan = build_plan(profile, config)
    assert plan.topology.world_size == 64 and plan.topology.nodes == 8
    assert (
        plan.batch.global_batch_size
        == plan.batch.micro_batch_size * plan.batch.grad_accum_steps * plan.topology.world_size
        == 4096
    )
    assert plan.model.num_params_1k_head / 1e6 == pytest.approx(632.05, abs=0.01)
    # Forward FLOPs per image at 224 (docs/reference.md §5: 167.4 GMACs; the per-layer formula gives 334.6 GFLOPs).
    D, L, M, Ntok = 1280, 32, 5120, 257
    macs = L * (Ntok * D * 3 * D + 2 * Ntok**2 * D + Ntok * D * D + 2 * Ntok * D * M) + 256 * 14 * 14 * 3 * D
    assert plan.compute.forward_gflops_per_image == pytest.approx(2 * macs / 1e9, rel=2e-3)
    assert plan.compute.forward_gflops_per_image == pytest.approx(334.6, abs=0.5)
    # ZeRO-2 model states for this run's parameter count, by hand.
    P = plan.model.num_params
    assert plan.memory.params_gb == pytest.approx(2 * P / 1e9)
    assert plan.memory.grads_gb + plan.memory.optimizer_gb == pytest.approx((2 + 4 + 12) * P / 64 / 1e9)
    # Activations: (16 D + 4 M) bytes per token per layer at bf16, + one-byte dropout masks (2 D) since dropout 0.1.
    per_image = (16 * D + 4 * M + 2 * D) * Ntok * L
    assert plan.memory.activation_mb_per_image == pytest.approx(per_image / 1e6)
    assert plan.memory.activations_gb == pytest.approx(per_image * plan.batch.micro_batch_size / 1e9)
    # Time: 3 x forward FLOPs per image x global batch / (world x 312 TFLOP/s x MFU).
    step = plan.compute.train_gflops_per_image * 1e9 * 4096 / (64 * 312e12 * profile.assumed_mfu)
    assert plan.compute.step_time_s == pytest.approx(step)
    steps = math.ceil(90 * 12_400_000 / 4096)
    assert plan.compute.total_steps == steps
    assert plan.compute.days == pytest.approx(steps * step / 86400)
    assert plan.compute.total_exaflops == pytest.approx(plan.compute.train_gflops_per_image * 1e9 * 4096 * steps / 1e18)
    text = format_plan(plan)
    for needle in (
        "world size 64",
        "global 4096 = micro 64 x accumulation 1 x world 64",
        "632.05M",
        "334.6",
        "ZeRO-2",
        "exaFLOPs",
        "shards",
        "MB/s",
        "precision     bf16 (cuda: CUDA: bf16 tensor cores)",
        # the MFU denominator of a bf16 run on A100s: their dense bf16 peak
        "assumed MFU 40% of 312 TFLOP/s per device: profile a100x64: A100-SXM4-80GB dense bf16 peak",
        # H/14's step-0 baseline costs one more checkpoint: the plan says how large.
        "baseline eval the step-0 weights are saved before the first update (a checkpoint of ~13 GB)",
    ):
        assert needle in text, needle


@pytest.mark.timeout(120)
def test_plan_that_does_not_fit_names_the_fixes():
    profile = load_profile("a100x64")
    sets = ["model.grad_checkpointing=false", "data.global_batch_size=16384", "data.micro_batch_size=256"]
    config = resolve_config(profile, "vit_h14_i21k", sets, "too-big")
    with pytest.raises(PlanError) as info:
        build_plan(profile, config)
    msg = str(info.value)
    assert "does not fit" in msg and "80.0 GB" in msg
    assert "data.micro_batch_size=" in msg and "model.grad_checkpointing=true" in msg
    # ~92 GB of activations alone: no ZeRO stage makes it fit, so none is offered (it was: ZeRO-3, still over 80 GB)
    assert "zero_stage" not in msg
    with pytest.raises(PlanError, match="does not fit"):
        build_plan(profile, resolve_config(profile, "vit_h14_i21k", [*sets, "deepspeed.zero_stage=3"], "too-big"))
    # ... and the launcher stops there, before contacting any cluster.
    assert (
        launch.main(["--cluster", "a100x64", "--recipe", "vit_h14_i21k", *sum((["--set", s] for s in sets), [])]) == 2
    )


@pytest.mark.timeout(120)
def test_a_plan_that_does_not_fit_offers_the_zero_stage_that_makes_it_fit():
    """A higher ZeRO stage is offered only where its model states, the activations and the overhead fit; the stage
    offered, or the settings offered together where no one fits, then plan."""
    a100x8 = load_profile("a100x8")
    sets = ["data.global_batch_size=1600", "data.streams=8", "deepspeed.zero_stage=1", "model.grad_checkpointing=false"]
    # ZeRO-1: 6.27 GB of model states + 71.6 GB of activations + 3 GB over 80 GB; ZeRO-2's 2.81 GB fit
    with pytest.raises(PlanError) as info:
        build_plan(a100x8, resolve_config(a100x8, "vit_h14_i21k", [*sets, "data.micro_batch_size=200"], "r"))
    assert "partition more model state: --set deepspeed.zero_stage=2 (model states and overhead then leave 74.2 GB" in (
        str(info.value)
    )
    taken = [*sets, "data.micro_batch_size=200", "deepspeed.zero_stage=2"]
    assert build_plan(a100x8, resolve_config(a100x8, "vit_h14_i21k", taken, "r")).memory.total_gb <= 80
    # On 9 GB devices: the lowest stage that fits; else, no one setting fitting, the stage, recompute and micro-batch
    small = dataclasses.replace(a100x8, hardware=dataclasses.replace(a100x8.hardware, gpu_memory_gb=9))
    sets = ["deepspeed.zero_stage=1"]  # the recipe's 4096 images: 512 per rank
    for micro, checkpointing, fix in (
        (64, "true", ["deepspeed.zero_stage=2"]),
        (128, "true", ["deepspeed.zero_stage=3"]),
        (256, "false", ["deepspeed.zero_stage=3", "model.grad_checkpointing=true", "data.micro_batch_size=128"]),
    ):
        given = [*sets, f"data.micro_batch_size={micro}", f"model.grad_checkpointing={checkpointing}"]
        with pytest.raises(PlanError) as info:
            build_plan(small, resolve_config(small, "vit_h14_i21k", given, "r"))
        msg = str(info.value)
        assert " ".join(f"--set {s}" for s in fix) in msg and msg.count("--set") == len(fix), msg
        assert build_plan(small, resolve_config(small, "vit_h14_i21k", [*given, *fix], "r")).memory.total_gb <= 9
    # a resolution schedule needs ZeRO <= 2: ZeRO-3 is not offered
    given = [
        *sets,
        "data.micro_batch_size=128",
        "model.grad_checkpointing=true",
        "data.resolution_schedule=[[0, 112], [10, 224]]",
    ]
    with pytest.raises(PlanError) as info:
        build_plan(small, resolve_config(small, "vit_h14_i21k", given, "r"))
    assert str(info.value).endswith("together: --set deepspeed.zero_stage=2 --set data.micro_batch_size=64")
    # where nothing fits, nothing is offered as if it did
    tiny = dataclasses.replace(a100x8, hardware=dataclasses.replace(a100x8.hardware, gpu_memory_gb=4))
    with pytest.raises(PlanError) as info:
        build_plan(tiny, resolve_config(tiny, "vit_h14_i21k", ["model.grad_checkpointing=true"], "r"))
    assert "Fix: none: even at ZeRO-3, model states and overhead leave 0.0 GB per device" in str(info.value)
    assert str(info.value).endswith("use devices with more memory") and "--set" not in str(info.value)


@pytest.mark.timeout(120)
def test_a_users_relative_data_paths_move_to_the_profiles_storage_like_the_recipes():
    """`--set data.train=data/...` came after the profile's relocation, so a cluster job read a path in its working
    folder; it is relocated as the recipe's is, and on `local` it stays under the checkout's data/."""
    for name, recipe, train, root in (
        ("a100x64", "vit_h14_i21k", "imagenet21k/train", "s3://vitscale-datasets"),
        ("local", "local_demo", "rcdb/train", f"{PROJECT_ROOT}/data"),
    ):
        profile = load_profile(name)
        given = resolve_config(profile, recipe, [f"data.train=data/{train}", "evals.data_root=data"], "r")
        assert (given.data.train, given.evals.data_root) == (f"{root}/{train}", root)
        as_written = resolve_config(profile, recipe, [], "r")
        assert (given.data.train, given.evals.data_root) == (as_written.data.train, as_written.evals.data_root)
    config = resolve_config(load_profile("a100x64"), "vit_h14_i21k", ["data.train=/fsx/i21k/train"], "r")
    assert config.data.train == "/fsx/i21k/train"  # absolute paths and URLs stay


@pytest.mark.timeout(120)
def test_a_declared_peak_is_the_plans_mfu_denominator_as_it_is_the_runs(tmp_path, monkeypatch):
    """`--set logging.peak_tflops=500` is the run's MFU denominator; the plan printed the datasheet's 312 and its step
    time divided by it. An assumed MFU is a share of the declared peak; a measured one a rate, rescaled to it."""
    monkeypatch.setenv("VITSCALE_MFU_FILE", str(tmp_path / "mfu.yaml"))
    (tmp_path / "mfu.yaml").write_text(yaml.safe_dump({"vit_b16": {"A100": {"mfu": 0.5}}}))
    profile = load_profile("a100x64")
    config = resolve_config(profile, "vit_h14_i21k", ["logging.peak_tflops=500"], "r")
    plan = build_plan(profile, config)
    assert config.logging.peak_tflops == plan.compute.peak_tflops == 500
    step = plan.compute.train_gflops_per_image * 1e9 * 4096 / (64 * 500e12 * profile.assumed_mfu)
    assert plan.compute.step_time_s == pytest.approx(step)
    assert (
        "assumed MFU 40% of 500 TFLOP/s per device: logging.peak_tflops (declared; profile a100x64: A100-SXM4-80GB "
        "dense bf16 peak: 312)"
    ) in format_plan(plan)
    sets = ["data.global_batch_size=1024", "data.streams=64"]
    datasheet = build_plan(profile, resolve_config(profile, "vit_b16_i21k", sets, "r")).compute
    declared = build_plan(profile, resolve_config(profile, "vit_b16_i21k", [*sets, "logging.peak_tflops=500"], "r"))
    assert (datasheet.peak_tflops, datasheet.assumed_mfu) == (312, 0.5)
    assert declared.compute.assumed_mfu == pytest.approx(0.5 * 312 / 500)
    assert declared.compute.step_time_s == pytest.approx(datasheet.step_time_s)
    assert declared.compute.mfu_source.startswith("rescaled from 50.0% of 312 TFLOP/s measured on A100")


@pytest.mark.timeout(120)
def test_profile_defaults_fill_only_what_the_recipe_leaves_unset(tmp_path):
    profile = load_profile("a100x8")
    recipe = tmp_path / "r.yaml"
    # 96 images in 8 streams (the i21k recipes' 512 streams do not divide 96)
    recipe.write_text(yaml.safe_dump({"base": "vit_b16_i21k", "data": {"global_batch_size": 96, "streams": 8}}))
    config = resolve_config(profile, str(recipe), [], "r")
    # recipe's micro-batch 64 does not split 96 / 8 = 12 per rank → largest divisor <= 64 is 12
    assert config.data.micro_batch_size == 12
    assert config.deepspeed.dist_backend == "nccl"
    assert config.checkpoint.dir == "/fsx/vitscale/runs/r"
    assert config.data.train.startswith("s3://vitscale-datasets/")
    # the user's --set wins
    config = resolve_config(profile, "vit_b16_i21k", ["deepspeed.zero_stage=3", "data.micro_batch_size=32"], "r")
    assert (config.deepspeed.zero_stage, config.data.micro_batch_size) == (3, 32)


@pytest.mark.timeout(60)
def test_the_plan_names_each_profile_default_the_recipe_replaces(capsys):
    h100 = load_profile("h100x8")
    lines = resolve_with_notes(h100, "vit_b16_i21k", [], "r")[1]
    # the recipe's ZeRO-2, micro 64 and 8 loaders win over h100x8's ZeRO-1, 128 and 12; precision auto is not listed
    assert [line.split("=")[0].split()[-1] for line in lines] == [
        "deepspeed.zero_stage",
        "data.micro_batch_size",
        "data.num_workers",
    ]
    assert "--set deepspeed.zero_stage=1 takes the profile's" in lines[0]
    # the user's own --set is a choice, not a surprise; and taking the profile's value silences its line
    sets = ["deepspeed.zero_stage=3", "data.num_workers=12"]
    assert [line.split("=")[0].split()[-1] for line in resolve_with_notes(h100, "vit_b16_i21k", sets, "r")[1]] == [
        "data.micro_batch_size"
    ]
    assert resolve_with_notes(load_profile("a100x64"), "vit_h14_i21k", [], "r")[1] == []
    assert launch.main(["--cluster", "a100x8", "--recipe", "vit_b16_i21k", "--dry-run"]) == 0
    notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note: ")]
    assert notes == [
        "note: the recipe's deepspeed.zero_stage=2 replaces profile a100x8's 1; "
        "--set deepspeed.zero_stage=1 takes the profile's"
    ]


@pytest.mark.timeout(60)
def test_bad_profiles_and_recipes_are_clear_errors(tmp_path, capsys):
    with pytest.raises(ValueError, match="valid profiles: a100x64, a100x8, h100x8, h200x8, local"):
        load_profile("a100x65")
    data = yaml.safe_load(open(load_profile.__globals__["PROFILES_DIR"] / "local.yaml"))
    bad = dict(data, comm_backend="nccl")
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(bad))
    with pytest.raises(ValueError, match="comm_backend: gloo"):
        load_profile(tmp_path / "bad.yaml")
    typo = dict(data, workers=dict(data["workers"], num_wokers=3))
    (tmp_path / "typo.yaml").write_text(yaml.safe_dump(typo))
    with pytest.raises(ValueError, match="num_wokers"):
        load_profile(tmp_path / "typo.yaml")
    assert launch.main(["--cluster", "nope", "--dry-run"]) == 2
    assert "unknown cluster profile 'nope'" in capsys.readouterr().err
    assert launch.main(["--cluster", "local", "--recipe", "no_such_recipe", "--dry-run"]) == 2
    assert "no recipe 'no_such_recipe'" in capsys.readouterr().err
    assert launch.main(["--cluster", "local", "--set", "deepspeed.zero_stage=4", "--dry-run"]) == 2
    assert "deepspeed.zero_stage" in capsys.readouterr().err


@pytest.mark.timeout(60)
def test_dry_run_prints_plan_and_submits_nothing(capsys):
    assert launch.main(["--cluster", "a100x64", "--recipe", "vit_h14_i21k", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("plan: recipe vit_h14_i21k on profile a100x64")
    assert "dry run: nothing submitted" in out
    # No manifest here: shards as this project's writer makes them, 12.4M images / 3000 = 4134 over 512 streams.
    assert "data          4134 shards, 8.1 per stream;" in out and "WARNING" not in out
    # Half the images, half the shards: 2067 over the same 512 streams.
    assert launch.main(["--cluster", "a100x64", "--dry-run", "--set", "data.epoch_images=6200000"]) == 0
    assert (
        "  WARNING       only 4.0 shards per stream (2067 shards / data.streams=512); use >= 8: re-shard into "
        "more, smaller tar files (--samples-per-shard) or lower data.streams (a new data order)"
    ) in capsys.readouterr().out.splitlines()


@pytest.mark.timeout(60)
def test_a_profile_runs_its_own_recipe_when_none_is_named(tmp_path, capsys):
    """`make launch CLUSTER=a100x64` plans the profile's recipe (before: the CPU demo's, refused at world size 64 for
    its 8 data streams); a profile that names none asks for one, in one line."""
    for name in profile_names():
        assert recipe_path(load_profile(name).recipe).is_file()
    assert launch.main(["--cluster", "a100x64", "--dry-run"]) == 0
    assert capsys.readouterr().out.startswith("plan: recipe vit_h14_i21k on profile a100x64")
    data = yaml.safe_load(open(load_profile.__globals__["PROFILES_DIR"] / "a100x8.yaml"))
    del data["recipe"]
    (tmp_path / "mine.yaml").write_text(yaml.safe_dump(data))
    assert launch.main(["--cluster", str(tmp_path / "mine.yaml"), "--dry-run"]) == 2
    assert capsys.readouterr().err == (
        "python -m cluster.launch: error: "
        "profile a100x8 names no recipe to run: name one, RECIPE=NAME (make) or --recipe NAME "
        "(configs/<name>.yaml or a YAML path), or add `recipe: NAME` to the profile\n"
    )
    assert launch.main(["--cluster", str(tmp_path / "mine.yaml"), "--recipe", "vit_b16_i21k", "--dry-run"]) == 0


@pytest.mark.timeout(300)
def test_a_stale_builtin_folder_stops_the_dry_run_with_one_line(tmp_path, local_demo_data, capsys):
    """A built-in folder generated with other settings (an older `make shards`) stops `make launch DRY_RUN=1` as bad
    input, before the plan, generating nothing; an absent one is named as what the launch will generate."""
    import re
    import subprocess

    from data_pipeline.builtin import sets as builtin

    data = tmp_path / "data"
    builtin.ensure("rcdb", data, num_classes=4, images_per_class=4, val_per_class=1, samples_per_shard=4)
    sets = ["--set", f"data.train={data}/rcdb/train", "--set", f"evals.data_root={data}"]
    command = [sys.executable, "-m", "cluster.launch", "--cluster", "local", "--recipe", "local_demo", *sets]
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS")}
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([*command, "--dry-run"], cwd=root, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 2 and "Traceback" not in done.stdout + done.stderr, done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    folder = re.escape(str(data / "rcdb"))
    assert len(lines) == 1 and re.fullmatch(
        r"python -m cluster\.launch: error: "
        rf"{folder}/train was generated with num_classes=4 \(wanted 64\), images_per_class=4 \(wanted 60\), "
        rf"val_per_class=1 \(wanted 10\), samples_per_shard=4 \(wanted 128\); to train on it as it is, set "
        "data.builtin_options.num_classes=4 data.builtin_options.images_per_class=4 "
        "data.builtin_options.val_per_class=1 data.builtin_options.samples_per_shard=4; to generate it at the "
        rf"recipe's settings, delete it \(rm -r {folder}\) or use another data.train",
        lines[0],
    ), lines
    assert "plan:" not in done.stdout  # stopped before the plan
    assert sorted(p.name for p in data.iterdir()) == ["rcdb"]  # the suite's eval sets were not generated
    # The settings the recipe wants (the session's local_demo set): the dry run goes on, naming what is absent.
    sets = ["--set", f"data.train={local_demo_data}/rcdb/train", "--set", f"evals.data_root={local_demo_data}"]
    assert launch.main(["--cluster", "local", "--recipe", "local_demo", *sets, "--dry-run"]) == 0
    out = capsys.readouterr().out
    absent = next(line for line in out.splitlines() if line.startswith("data: "))
    assert f"{local_demo_data}/digits" in absent and "absent: the launch generates them" in absent
    assert f"{local_demo_data}/rcdb," not in absent and not (local_demo_data / "digits").exists()


@pytest.mark.timeout(60)
def test_the_dry_run_refuses_one_builtin_folder_wanted_at_two_settings(tmp_path, capsys):
    """inspect_rcdb reads <evals.data_root>/rcdb at rcdb's defaults: training on other sizes in the same folder
    would make the eval refuse it later; the dry run says so first."""
    sets = [f"data.train={tmp_path}/rcdb/train", f"evals.data_root={tmp_path}", "evals.suite=inspect_rcdb"]
    sets.append("data.builtin_options.num_classes=32")
    argv = ["--cluster", "local", "--recipe", "local_demo", *sum((["--set", s] for s in sets), []), "--dry-run"]
    assert launch.main(argv) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path}/rcdb is read at two settings (num_classes=32 / 64)" in err and "evals.data_root" in err
    assert not any(tmp_path.iterdir())


@pytest.mark.timeout(60)
def test_launch_reads_the_recipe_file_once(capsys):
    """Every open of the recipe and of its `base:` by `make launch`'s path (as a dry run) is counted: one each."""
    configs = Path(__file__).resolve().parents[2] / "configs"
    opened: list[str] = []
    counting = [True]  # an audit hook cannot be removed: this one stops counting when the test ends

    def count_opens(event: str, args: tuple) -> None:
        if counting[0] and event == "open" and isinstance(args[0], str | os.PathLike):
            opened.append(os.fspath(args[0]))

    sys.addaudithook(count_opens)
    try:
        sets = ["--set", "schedule.total=50", "--set", "data.micro_batch_size=4"]
        assert launch.main(["--cluster", "local", "--recipe", "local_mpp", *sets, "--dry-run"]) == 0
    finally:
        counting[0] = False
    assert "plan: recipe local_mpp on profile local" in capsys.readouterr().out
    reads = [Path(p).resolve() for p in opened if p.endswith(".yaml")]
    assert reads.count(configs / "local_mpp.yaml") == 1 and reads.count(configs / "local_demo.yaml") == 1, reads


@pytest.mark.timeout(60)
def test_local_plan_uses_cpu_memory_and_profile_storage(tmp_path):
    profile = load_profile("local")
    profile = dataclasses.replace(
        profile,
        storage=dataclasses.replace(profile.storage, shards=str(tmp_path / "data"), checkpoints=str(tmp_path / "runs")),
    )
    config = resolve_config(profile, "local_demo", [], "demo")
    assert config.data.train == f"{tmp_path}/data/rcdb/train"
    assert config.checkpoint.dir == f"{tmp_path}/runs/demo"
    plan = build_plan(profile, config)
    assert plan.memory.capacity_gb == pytest.approx(12.0)  # 24 GB / 2 workers on the node
    assert plan.compute.precision == "fp32" and plan.memory.zero_stage == 2 and plan.topology.world_size == 2
    # auto on this CPU: what the workers will pick, by the same rule on this machine's flags and the model's shapes.
    choice = decide("auto", "cpu", StepShape.of(model_config("vit_tiny_debug"), 32))
    assert plan.compute.precision_reason == f"{choice.rule}: {choice.reason}"
    if not cpu_bf16_units():
        assert "has no AMX/AVX512-BF16" in format_plan(plan)
    # MFU and the step time divide by this CPU's GEMM rate at the plan's precision, measured once and cached.
    assert plan.compute.peak_tflops == cpu_peak("fp32", threads=1).tflops
    assert "fp32 2048x2048 GEMM on this CPU, 1 thread(s)" in plan.compute.peak_source
    assert "evaluated with local_fewshot" in plan.baseline_eval
    off = build_plan(profile, resolve_config(profile, "local_demo", ["evals.baseline=false"], "demo"))
    assert off.baseline_eval.startswith("off (evals.baseline=false)")
    forced = build_plan(profile, resolve_config(profile, "local_demo", ["deepspeed.precision=bf16"], "demo"))
    assert forced.compute.precision == "bf16" and (
        cpu_bf16_units() or "bf16 is emulated" in forced.compute.precision_reason
    )
    assert forced.compute.peak_tflops == cpu_peak("bf16", threads=1).tflops and "bf16" in forced.compute.peak_source


def test_a_dataset_with_fewer_shards_than_streams_is_refused_at_plan_time(tiny_fractal_shards):
    profile = load_profile("local")
    sets = [f"data.train={tiny_fractal_shards}", "data.builtin=null"]
    with pytest.raises(PlanError, match=r"has 4 shards but data.streams=8 needs at least one per stream"):
        build_plan(profile, resolve_config(profile, "local_demo", sets, "x"))
    assert (
        build_plan(profile, resolve_config(profile, "local_demo", [*sets, "data.streams=4"], "x")).data.num_shards == 4
    )


I21K_RECIPES = ("vit_b16_i21k", "vit_b16_i21k_augreg", "vit_l16_i21k", "vit_h14_i21k", "r50_vit_b16_i21k")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("profile_name", ["a100x64", "h100x8"])
def test_i21k_plans_count_the_21843_class_head_without_the_data(profile_name):
    from pretrain.config.train_config import model_overrides
    from pretrain.model import flops
    from pretrain.model.vit import model_config

    profile = load_profile(profile_name)
    for recipe in I21K_RECIPES:
        config = resolve_config(profile, recipe, [], "r")
        assert config.model.num_classes == 21843, recipe
        plan = build_plan(profile, config)
        assert not plan.model.head_classes_assumed
        vit = model_config(config.model.name, **model_overrides(config, num_classes=21843))
        assert plan.model.num_params == flops.param_count(vit), recipe
        head_in = config.model.representation_size or vit.width
        assert (
            plan.model.num_params - flops.param_count(dataclasses.replace(vit, num_classes=0))
            == head_in * 21843 + 21843
        )


@pytest.mark.timeout(120)
def test_mpp_plans_count_the_colour_head_not_a_classifier():
    from pretrain.config.train_config import model_overrides
    from pretrain.model import flops
    from pretrain.model.tasks import build_task
    from pretrain.model.vit import build_model, model_config

    # vit_b16_mpp leaves num_classes unset: MPP drops the classifier, so nothing needs the dataset's classes.
    profile = load_profile("a100x64")
    plan = build_plan(profile, resolve_config(profile, "vit_b16_mpp", [], "mpp"))
    encoder = flops.param_count(model_config("vit_b16", num_classes=0))
    assert plan.model.num_params == encoder + 768 + 768 * 512 + 512  # [mask] embedding + 512-way colour head
    assert not plan.model.head_classes_assumed
    # The same count as the module DeepSpeed trains, built for real (tiny model of local_mpp).
    local = load_profile("local")
    config = resolve_config(local, "local_mpp", [], "mpp")
    task = build_task(config, build_model(config.model.name, **model_overrides(config, num_classes=10)))
    assert build_plan(local, config).model.num_params == sum(p.numel() for p in task.parameters())
    # local_demo's classification_mpp keeps the classifier and adds the same [mask] embedding and colour head.
    config = resolve_config(local, "local_demo", ["model.num_classes=64"], "demo")
    task = build_task(config, build_model(config.model.name, **model_overrides(config, num_classes=64)))
    assert build_plan(local, config).model.num_params == sum(p.numel() for p in task.parameters())


@pytest.mark.timeout(120)
def test_checkpointing_advice_and_numbers_follow_the_setting():
    profile = load_profile("a100x64")
    on = build_plan(profile, resolve_config(profile, "vit_h14_i21k", ["model.grad_checkpointing=true"], "h"))
    off = build_plan(profile, resolve_config(profile, "vit_h14_i21k", ["model.grad_checkpointing=false"], "h"))
    D, M, N, L = 1280, 5120, 257, 32
    plain = (16 * D + 4 * M + 2 * D) * N * L  # bytes/image kept for backward (bf16, dropout masks)
    kept = 2 * D * N * L + (16 * D + 4 * M + 2 * D) * N  # block inputs + one block being recomputed
    for plan in (on, off):  # both settings are reported, whichever is used
        assert plan.memory.activations_gb_not_checkpointed == pytest.approx(plain * 64 / 1e9)
        assert plan.memory.activations_gb_checkpointed == pytest.approx(kept * 64 / 1e9)
        assert plan.compute.recompute_factor == pytest.approx(4 / 3)  # one more forward on top of 3 x forward
    # The plan's own numbers are those of the setting the user picked.
    assert (on.memory.activations_gb, off.memory.activations_gb) == (
        on.memory.activations_gb_checkpointed,
        off.memory.activations_gb,
    )
    assert off.memory.activations_gb == pytest.approx(off.memory.activations_gb_not_checkpointed)
    assert on.memory.total_gb == pytest.approx(on.memory.total_gb_not_checkpointed - (plain - kept) * 64 / 1e9)
    assert on.compute.step_time_s == pytest.approx(
        off.compute.step_time_s * 4 / 3
    ) and on.compute.days == pytest.approx(off.compute.days * 4 / 3)
    assert (
        on.memory.total_gb < 7 and 20 < off.memory.total_gb < 0.85 * 80
    )  # the 6.5 GB of 80, and ~27 GB without
    text = format_plan(on)
    assert "not needed" in text and "--set model.grad_checkpointing=false" in text
    assert f"{off.compute.step_time_s:.3g} s/step instead of {on.compute.step_time_s:.3g}" in text
    assert "+ recompute x 1.33" in text
    assert "not needed" in format_plan(off) and "+ recompute" not in format_plan(off)
    # The recipe itself now runs the faster setting.
    assert (
        build_plan(profile, resolve_config(profile, "vit_h14_i21k", [], "h")).memory.activation_checkpointing is False
    )


@pytest.mark.timeout(120)
def test_checkpointing_advice_trades_micro_batch_or_says_needed():
    # 8 GPUs, micro-batch 256: without checkpointing 256 x 358 MB does not fit, 128 x 4 accumulation does.
    a100x8 = load_profile("a100x8")
    sets = ["model.grad_checkpointing=true", "data.micro_batch_size=256"]
    plan = build_plan(a100x8, resolve_config(a100x8, "vit_h14_i21k", sets, "h"))
    assert plan.memory.total_gb_not_checkpointed > 80
    assert "micro-batch 128 x accumulation 4 fits without it" in plan.memory.checkpointing_advice
    assert "--set model.grad_checkpointing=false --set data.micro_batch_size=128" in plan.memory.checkpointing_advice
    # 896 px (4097 tokens): even micro-batch 8 without recomputation is too large for an efficient split.
    a100x64 = load_profile("a100x64")
    sets = ["model.grad_checkpointing=true", "data.image_size=896", "data.global_batch_size=1024"]
    plan = build_plan(a100x64, resolve_config(a100x64, "vit_h14_i21k", [*sets, "data.micro_batch_size=16"], "h"))
    assert plan.memory.checkpointing_advice.startswith("needed: without it") and plan.memory.total_gb < 80
    # ... and switching it off there is refused with the numbers and the fix.
    with pytest.raises(PlanError, match=r"model.grad_checkpointing=true \(activations \d+\.\d GB; step time x 1.33\)"):
        build_plan(a100x64, resolve_config(a100x64, "vit_h14_i21k", [*sets, "model.grad_checkpointing=false"], "h"))


def _profile_with_shards(tmp_path, base: str, shards: str):
    data = yaml.safe_load(open(load_profile.__globals__["PROFILES_DIR"] / f"{base}.yaml"))
    data["storage"]["shards"] = shards
    path = tmp_path / f"{base}_{shards.split(':')[0]}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _unanswering_stores(monkeypatch) -> None:
    """S3 and GCS clients pointed at a closed loopback port, with dummy credentials; the plan waits 3 s for a
    manifest."""
    from cluster.local_head import free_port
    from cluster.plan import storage

    closed = f"http://127.0.0.1:{free_port()}"
    for name, value in [("AWS_ENDPOINT_URL", closed), ("STORAGE_EMULATOR_HOST", closed), ("NO_GCE_CHECK", "true")]:
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setattr(storage, "MANIFEST_WAIT_S", 3.0)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("scheme", "extra", "module"), [("s3", "s3", "s3fs"), ("gs", "gcs", "gcsfs")])
def test_remote_storage_names_its_extra_and_the_job_installs_it(tmp_path, capsys, monkeypatch, scheme, extra, module):
    import importlib.util

    from cluster.driver.job import JobSpec
    from cluster.plan.storage import STORAGE_EXTRAS

    # Stores that do not answer (a closed loopback port, dummy credentials): the plan waits for the manifest only
    # MANIFEST_WAIT_S (their clients would retry for minutes), then goes on with its assumptions.
    _unanswering_stores(monkeypatch)
    path = _profile_with_shards(tmp_path, "h100x8", f"{scheme}://bucket/shards")
    assert launch.main(["--cluster", str(path), "--recipe", "vit_l16_i21k", "--dry-run"]) == 0  # never fails for it
    out = capsys.readouterr().out
    storage = next(line for line in out.splitlines() if line.startswith("  storage"))
    assert f"{scheme}://bucket/shards/imagenet21k/train" in storage and f"vitscale[{extra}] ({module})" in storage
    if importlib.util.find_spec(module) is None:  # this machine lacks it: the plan says what to install
        assert f"pip install 'vitscale[{extra}]'" in storage and "manifest not readable here" in out
        assert "Install s3fs" not in out and "Please install gcsfs" not in out  # fsspec's raw message
    else:
        assert "pip install" not in storage and "manifest not readable here" in out
    # The job's runtime env installs the extra on the cluster; a local run needs none.
    profile = load_profile(path)
    config = resolve_config(profile, "vit_l16_i21k", [], "r")
    spec = JobSpec.create(profile, config, build_plan(profile, config))
    assert JobSpec.from_json(spec.to_json()).config == config  # the config travels as one dict, rebuilt as it was
    assert launch.runtime_env(profile, spec)["pip"] == [STORAGE_EXTRAS[extra].requirement]
    local = load_profile("local")
    local_config = resolve_config(local, "local_demo", [], "r")
    local_spec = JobSpec.create(local, local_config, build_plan(local, local_config))
    assert "pip" not in launch.runtime_env(local, local_spec)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("scheme", ["s3", "gs"])
def test_the_demo_on_object_storage_plans_within_the_manifest_wait_and_generates_nothing(
    tmp_path, capsys, monkeypatch, scheme
):
    """`make launch` of the demo with data.train in a bucket that does not answer, on `local` and on a cloud profile.
    The loader-rate measurement read the manifest itself, past the plan's bounded wait: 65 s and a gcsfs traceback
    for gs:// without network. The built-in set (data.builtin) was then to be generated at a mangled local path
    (`<project>/gs:/rcdb`), here by the launch and on a cloud profile by the job's driver; now the plan says the
    bucket must hold it."""
    from data_pipeline.paths import PROJECT_ROOT

    _unanswering_stores(monkeypatch)
    train = f"{scheme}://bucket-{tmp_path.name}/rcdb/train"  # a location of its own: reads are cached per process
    started = time.monotonic()
    assert launch.main(["--dry-run", "--set", f"data.train={train}"]) == 0
    assert time.monotonic() - started < 30
    out, err = capsys.readouterr()
    absent = "".join(line for line in out.splitlines() if "absent: the launch generates" in line)  # eval sets, maybe
    assert "Traceback" not in err and f"{scheme}:" not in absent and "rcdb" not in absent
    assert f"note: data.builtin=rcdb is generated only for a local data.train; {train} must hold it already" in out
    cloud = resolve_config(load_profile("a100x8"), "local_demo", [], "r")
    cloud.data.ensure_builtin()  # what the job's driver calls: nothing to generate for a bucket
    assert not (PROJECT_ROOT / f"{scheme}:").exists() and not (Path.cwd() / f"{scheme}:").exists()


@pytest.mark.timeout(60)
def test_storage_extras_are_the_pyproject_extras():
    import tomllib

    from cluster.plan.planner import EXTRAS, HF_EXTRA
    from cluster.plan.storage import SCHEME_EXTRAS, STORAGE_EXTRAS
    from cluster.profiles import PROJECT_ROOT

    extras = tomllib.loads((PROJECT_ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for name, extra in EXTRAS.items():
        assert extras[name] == [extra.requirement], name
        assert extra.requirement.startswith(extra.module)
    assert set(SCHEME_EXTRAS.values()) == set(STORAGE_EXTRAS)
    # dev installs hf (the venv logs models, the tests export them), by the extra rather than a second version bound
    assert f"vitscale[{HF_EXTRA.name}]" in extras["dev"]
    assert not any(r.startswith(HF_EXTRA.module) for r in extras["dev"])


@pytest.mark.timeout(120)
def test_the_job_installs_transformers_on_a_cluster_where_it_logs_the_final_model():
    """`cluster.driver.record.log_final_model` needs transformers on the cluster; the job's runtime env installs
    vitscale[hf] there when the job logs a model (one HF's ViT holds), and a local job installs nothing it has."""
    import importlib.util

    from cluster.driver.job import JobSpec
    from cluster.plan.planner import HF_EXTRA, STORAGE_EXTRAS

    def job(profile_name: str, recipe: str, sets: tuple[str, ...] = ()):
        profile = load_profile(profile_name)
        config = resolve_config(profile, recipe, list(sets), "r")
        plan = build_plan(profile, config)
        spec = JobSpec.from_json(JobSpec.create(profile, config, plan).to_json())  # as it travels to the job
        return plan, launch.runtime_env(profile, spec)

    s3fs = STORAGE_EXTRAS["s3"].requirement
    # class token, no pre-logits layer: the final model is logged, so the cluster gets transformers
    mpp, env = job("a100x64", "vit_b16_mpp")
    assert mpp.runtime_extras == ("s3", "hf") and env["pip"] == [s3fs, HF_EXTRA.requirement]
    runtime = next(line for line in format_plan(mpp).splitlines() if line.startswith("  runtime env"))
    assert "pip installs vitscale[s3] (s3fs), vitscale[hf] (transformers) on the cluster" in runtime
    assert "the final model is logged to MLflow" in runtime
    # a pre-logits layer (the i21k recipes): HF's ViT cannot hold it, nothing is logged, transformers is not needed
    prelogits, env = job("h100x8", "vit_b16_i21k")
    assert prelogits.runtime_extras == ("s3",) and env["pip"] == [s3fs]
    assert "the final model is not logged to MLflow: HF's ViT has no pre-logits" in format_plan(prelogits)
    # the same recipe without it logs its model again: the model decides, not the recipe's name
    _, env = job("h100x8", "vit_b16_i21k", ("model.representation_size=null",))
    assert env["pip"] == [s3fs, HF_EXTRA.requirement]
    # local: the job runs in this environment, which has transformers (dev): nothing to install, the model logged
    local, env = job("local", "local_demo")
    assert local.runtime_extras == () and "pip" not in env
    if importlib.util.find_spec("transformers") is not None:
        assert "installs no extras; the final model is logged to MLflow" in format_plan(local)


@pytest.mark.timeout(60)
def test_elastic_workers_validate_round_trip_and_name_the_fix(tmp_path):
    from cluster.profiles import profile_from_dict, profile_to_dict

    elastic = load_profile("local_elastic")
    w = elastic.workers
    assert w.elastic and (w.min_workers, w.max_workers, w.num_workers) == (1, 2, 2)
    assert profile_from_dict(profile_to_dict(elastic)) == elastic  # the plan file carries it to the driver
    fixed = load_profile("local").workers
    assert not fixed.elastic and (fixed.min_workers, fixed.max_workers) == (2, 2)
    data = yaml.safe_load(open(load_profile.__globals__["PROFILES_DIR"] / "local_elastic.yaml"))
    cases = {
        "need 1 <= min <= max": {"min": 2, "max": 1},
        "add workers.max": {"min": 1, "max": None},
        "give either num_workers": {"num_workers": 1},
        "must be > 0": {"elastic_resize_monitor_interval_s": 0},
        "custom Ray resources": {"resources": {"CPU": 1}},
        "cannot hold 4 workers": {"max": 4},  # the embedded head's CPUs
    }
    for message, change in cases.items():
        (tmp_path / "p.yaml").write_text(yaml.safe_dump(dict(data, workers=dict(data["workers"], **change))))
        with pytest.raises(ValueError, match=message):
            load_profile(tmp_path / "p.yaml")


@pytest.mark.timeout(60)
def test_elastic_plan_prints_both_ends_and_refuses_sizes_that_break_the_global_batch(capsys):
    profile = load_profile("local_elastic")
    config = resolve_config(profile, "local_demo", [], "r")
    plan = build_plan(profile, config)
    lo, hi = plan.elastic_ends
    assert (lo.world_size, hi.world_size) == (1, 2) and plan.topology.world_size == 2
    assert (lo.grad_accum_steps, hi.grad_accum_steps) == (2, 1)  # global batch 64 kept at both ends
    assert lo.images_per_s == pytest.approx(hi.images_per_s / 2) and lo.days == pytest.approx(2 * hi.days)
    assert lo.capacity_gb == pytest.approx(2 * hi.capacity_gb)  # one worker has the node's memory
    text = format_plan(plan)
    assert "elastic       workers 1..2" in text and "at min   1" in text and "at max   2" in text
    assert not build_plan(
        load_profile("local"), resolve_config(load_profile("local"), "local_demo", [], "r")
    ).elastic_ends
    # Ray may pick any count in min..max: 3 workers cannot split 8 streams (nor 4 x micro 32 the batch of 64), so
    # 1..3 and 2..4 are refused with the sizes that work.
    for low, high, bad in ((1, 3, r"\[3\]"), (2, 4, r"\[3, 4\]")):
        wide = dataclasses.replace(
            profile,
            workers=dataclasses.replace(profile.workers, min=low, max=high, num_workers=high),
            ray=dataclasses.replace(profile.ray, head_num_cpus=high + 1),
        )
        with pytest.raises(PlanError, match=rf"includes world size\(s\) {bad}.*Valid world sizes: \[1, 2\]"):
            resolve_config(wide, "local_demo", [], "r")
    # The launcher's dry run of an elastic profile prints both ends.
    assert launch.main(["--cluster", "local_elastic", "--recipe", "local_demo", "--dry-run"]) == 0
    assert "at min   1" in capsys.readouterr().out


@pytest.mark.timeout(120)
def test_plan_counts_the_loader_memory_per_node_and_refuses_what_a_node_cannot_hold(local_demo_data):
    profile = load_profile("local")
    profile = dataclasses.replace(profile, storage=dataclasses.replace(profile.storage, shards=str(local_demo_data)))
    config = resolve_config(profile, "local_demo", [], "r")
    plan = build_plan(profile, config)
    per_rank = 4 * 256 * plan.data.bytes_per_image + 3 * 32 * 3 * 32**2 * 4  # 4 streams x 256 samples + 3 float steps
    per_rank += 3840 * 32 * 32 * 4  # + the set decoded (data.cache_mb): 3,840 RGBX images of 32 px
    assert plan.data.loader_gb_per_node * GB == pytest.approx(2 * per_rank, rel=1e-6)
    assert "2 rank(s) x (4 streams x 256 buffered samples" in format_plan(plan)
    # a buffer larger than its stream holds only the stream's samples (3840 / 8 streams)
    big = build_plan(profile, resolve_config(profile, "local_demo", ["data.shuffle_buffer=100000"], "r"))
    assert "4 streams x 480 buffered samples" in big.data.loader_detail
    small = dataclasses.replace(profile, hardware=dataclasses.replace(profile.hardware, memory_gb_per_node=0.01))
    with pytest.raises(PlanError, match=r"data streams would hold 0\.0\d+ GB per node at world size 2 .* over 50% of "):
        build_plan(small, config)
    # 8 workers per rank: 5 step buffers (prefetch 2 + 3) in shared memory + each worker's uint8 image planes; the
    # buffers hold uint8 where the GPU normalizes (data.normalize_on: auto), float32 where the loader does
    a100x64 = load_profile("a100x64")
    for normalize_on, value_bytes in (("auto", 1), ("loader", 4)):
        config = resolve_config(a100x64, "vit_b16_i21k", [f"data.normalize_on={normalize_on}"], "r")
        per_rank = 8 * 1000 * 92_000 + (5 * 64 * value_bytes + 8) * 3 * 224**2
        assert build_plan(a100x64, config).data.loader_gb_per_node == pytest.approx(8 * per_rank / GB), normalize_on


# ------------------------------------------------------------------------------------- data wait
# (cluster.plan.data_wait)


def test_the_data_wait_model_by_hand():
    from cluster.plan.data_wait import step_with_data

    # no loader workers: the rank loads, then computes
    assert step_with_data(0.1, 0.02, 0, cores=1, threads=1) == pytest.approx((0.12, 0.02))
    # a core for every process: the slower of compute and the workers' share of the loading
    assert step_with_data(0.1, 0.3, 2, cores=12, threads=1) == pytest.approx((0.15, 0.05))
    assert step_with_data(0.1, 0.1, 2, cores=12, threads=1) == pytest.approx((0.1, 0.0))
    # 1 core shared with 2 workers: computing takes 3 x 0.1 s, meanwhile the workers load 0.2 core-s: no wait, and no
    # step shorter than all the work on the one core
    assert step_with_data(0.1, 0.05, 2, cores=1, threads=1) == pytest.approx((0.15, 0.0))
    # 1 worker on the shared core: 0.1 core-s loaded while the rank computes (0.2 s), the other 0.2 core-s waited
    assert step_with_data(0.1, 0.3, 1, cores=1, threads=1) == pytest.approx((0.4, 0.2))


def test_the_prediction_says_input_bound_and_the_workers_needed():
    from cluster.plan.data_wait import INPUT_BOUND_WAIT, data_wait_line, predict
    from data_pipeline.stream.loader_rate import LoaderRate

    rate = LoaderRate(1000.0, "declared: a test")
    fast = predict(0.1, 32, rate, workers=0, max_workers=8, cores=12, threads=1)  # 0.032 s of loading a step
    assert fast.predicted_data_wait == pytest.approx(0.032 / 0.132) and fast.input_bound
    assert fast.loader_workers_needed == 1 and fast.loader_cores_needed == pytest.approx(0.32)
    line = data_wait_line(fast, 32)
    assert line.startswith("predicted 24% of each step (input-bound): 32 images/rank take 0.032 core-s at 1,000")
    assert "needs data.num_workers=1 (has 0)" in line and "(declared: a test)" in line
    heavy = predict(0.1, 320, rate, workers=2, max_workers=8, cores=12, threads=1)  # 0.32 core-s a step
    assert heavy.predicted_data_wait == pytest.approx(0.06 / 0.16) and heavy.loader_workers_needed == 4
    shared = predict(0.1, 320, rate, workers=1, max_workers=8, cores=1, threads=1)  # the cores are the limit
    assert shared.loader_workers_needed == 3 and shared.predicted_step_time_s == pytest.approx(0.1 + 0.32)
    none = predict(0.1, 32, rate, workers=0, max_workers=0, cores=1, threads=1)
    assert none.loader_workers_needed is None and "no worker count gets it under 5%" in data_wait_line(none, 32)
    idle = predict(10.0, 32, rate, workers=0, max_workers=4, cores=1, threads=1)
    assert idle.predicted_data_wait < INPUT_BOUND_WAIT and not idle.input_bound and idle.loader_workers_needed == 0


@pytest.mark.timeout(120)
def test_the_local_plan_predicts_the_data_wait_from_this_cpu_and_a_remote_one_from_its_profile(local_demo_data):
    from cluster.plan.data_wait import step_with_data

    profile = load_profile("local")
    profile = dataclasses.replace(profile, storage=dataclasses.replace(profile.storage, shards=str(local_demo_data)))
    plan = build_plan(profile, resolve_config(profile, "local_demo", [], "r"))
    data = plan.to_dict()["data"]  # what plan.json holds: the run's end compares predicted_data_wait with its own
    assert 0 <= data["predicted_data_wait"] <= 1 and data["loader_img_s_per_core"] > 0
    assert data["loader_rate_source"].startswith("this CPU, one core, 32px from its decoded cache (measured")
    assert (data["loader_workers"], data["loader_cores_per_rank"]) == (0, 1.0)  # 2 ranks on 2 cores, no workers
    d = 32 / data["loader_img_s_per_core"]
    step, wait = step_with_data(plan.compute.step_time_s, d, 0, cores=1, threads=1)
    assert data["predicted_data_wait"] == pytest.approx(wait / step) and data["load_s_per_step"] == pytest.approx(d)
    text = format_plan(plan)
    assert "\n  data wait     predicted " in text and " of each step (" in text
    off = build_plan(profile, resolve_config(profile, "local_demo", ["data.cache_mb=0"], "r"))
    assert "32px from its shards" in off.data.loader_rate_source
    big = load_profile("a100x64")
    remote = build_plan(big, resolve_config(big, "vit_b16_i21k", [], "r"))
    assert remote.data.loader_rate_source == "declared: profile a100x64 hardware.loader_img_s_per_core"
    assert remote.data.loader_img_s_per_core == big.hardware.loader_img_s_per_core == 700.0
    assert remote.data.loader_workers == 8 and remote.data.loader_cores_per_rank == 12.0  # 96 cores / 8 ranks


@pytest.mark.timeout(120)
def test_recipe_over_profile_notes_give_the_plans_numbers_and_a_set_that_validates(tmp_path):
    """A note names the value the plan uses and the profile's as this run would use it; its --set resolves, and a
    profile value that cannot apply says why instead."""
    # local_mpp's micro-batch 16 and a100x8's 64 (local's 32) are both cut to what the ranks' share allows: no note
    for name in ("a100x8", "local"):
        notes = resolve_with_notes(load_profile(name), "local_mpp", [], "r")[1]
        assert not [n for n in notes if "micro_batch_size" in n], notes
    profile, recipe = load_profile("a100x8"), tmp_path / "r.yaml"
    written = {"global_batch_size": 96, "streams": 8, "micro_batch_size": 4}  # 12 images per rank at world size 8
    recipe.write_text(
        yaml.safe_dump({"base": "vit_b16_i21k", "data": written, "deepspeed": {"precision": "fp32", "zero_stage": 0}})
    )
    config, notes = resolve_with_notes(profile, str(recipe), [], "r")
    assert config.data.micro_batch_size == 4
    assert [n for n in notes if n.startswith("the recipe's")] == [
        "the recipe's deepspeed.zero_stage=0 replaces profile a100x8's 1; --set deepspeed.zero_stage=1 takes the "
        "profile's",
        "the recipe's deepspeed.precision=fp32 replaces profile a100x8's bf16, which cannot apply here: "
        + notes[1].split("which cannot apply here: ")[1],
        "the recipe's data.micro_batch_size=4 replaces profile a100x8's 64 (lowered to 12 here); "
        "--set data.micro_batch_size=12 takes the profile's",
    ]
    assert "deepspeed.precision=bf16 needs deepspeed.zero_stage >= 1" in notes[1]
    for note in (notes[0], notes[2]):
        key, value = note.split("--set ")[1].split()[0].split("=")
        taken = resolve_config(profile, str(recipe), [f"{key}={value}"], "r")
        section, field = key.split(".")
        assert str(getattr(getattr(taken, section), field)) == value


@pytest.mark.timeout(120)
def test_a_plan_that_does_not_fit_suggests_a_micro_batch_that_divides_and_fits():
    profile = load_profile("a100x64")
    sets = ["model.grad_checkpointing=false", "data.global_batch_size=16384", "data.micro_batch_size=256"]
    with pytest.raises(PlanError) as info:
        build_plan(profile, resolve_config(profile, "vit_h14_i21k", sets, "too-big"))
    micro = int(str(info.value).split("--set data.micro_batch_size=")[1].split()[0])
    assert 16384 // 64 % micro == 0 and micro >= 64
    build_plan(profile, resolve_config(profile, "vit_h14_i21k", [*sets, f"data.micro_batch_size={micro}"], "fits"))


@pytest.mark.timeout(120)
def test_launch_refuses_a_worker_failure_the_run_never_reaches(capsys):
    """--inject-worker-failure RANK:STEP: a rank beyond the world size or a step past the last never strikes."""
    run = ["--cluster", "local", "--recipe", "local_demo", "--dry-run", "--run-name", "fault"]
    for flag, message in (
        ("99:50", "--inject-worker-failure: rank 99 is not in this run (world size 2); give a rank 0..1"),
        ("1:5000000", "--inject-worker-failure: step 5000000 is not in this run (steps 0.."),
        ("1:5:-1", "--inject-worker-failure: DELAY_S -1.0 must be >= 0 seconds"),
    ):
        assert launch.main([*run, "--inject-worker-failure", flag]) == 2
        captured = capsys.readouterr()
        assert message in captured.err and captured.err.count("\n") == 1 and "plan:" not in captured.out, captured
    assert launch.main([*run, "--inject-worker-failure", "1:50:2"]) == 0


GRAD_BUFFERS_SCRIPT = """
import json, sys
import torch, deepspeed
from pretrain.config.ds_config import BatchPlan, DeepSpeedConfig, deepspeed_config
from pretrain.config.optim import OptimConfig

deepspeed.init_distributed("gloo")
out = {}
for stage in (1, 2):
    model = torch.nn.Sequential(torch.nn.Linear(64, 300), torch.nn.GELU(), torch.nn.Linear(300, 10))
    config = deepspeed_config(DeepSpeedConfig(zero_stage=stage), OptimConfig(), BatchPlan(4, 4, 1, 1), "bf16")
    adam = torch.optim.AdamW(model.parameters())
    engine, optimizer, *_ = deepspeed.initialize(model=model, optimizer=adam, config=config)
    engine.backward(engine(torch.randn(4, 64).bfloat16()).float().square().mean())
    fp32 = getattr(optimizer, "fp32_groups_gradients_flat", [])  # BF16_Optimizer's; ZeRO-2 has a partition instead
    out[stage] = {
        "optimizer": type(optimizer).__name__,
        "params": sum(p.numel() for p in model.parameters()),
        "fp32_grad_bytes": sum(t.numel() * t.element_size() for t in fp32 if t.dtype == torch.float32),
    }
json.dump(out, open(sys.argv[1], "w"))
"""


@pytest.mark.timeout(180)
def test_zero_1_in_bf16_holds_the_fp32_gradients_the_plan_counts(tmp_path):
    """Not the paper's ZeRO-1: with our `grad_accum_dtype: fp32`, DeepSpeed's BF16_Optimizer sums the gradients into
    a full-size fp32 buffer on every rank, 4 bytes per parameter that the plan left out (2.5 GB for H/14)."""
    from tests.pretrain.test_train_distributed import _env
    from tests.support import warm_ranks

    script, log = tmp_path / "rank.py", tmp_path / "rank.log"
    script.write_text(GRAD_BUFFERS_SCRIPT)
    status = warm_ranks.launch(str(script), [str(tmp_path / "out.json")], 1, _env(), log, 150, module=False)
    assert status == 0, log.read_text()[-4000:]
    held = json.loads((tmp_path / "out.json").read_text())["1"]
    assert held["optimizer"] == "BF16_Optimizer" and held["fp32_grad_bytes"] == 4 * held["params"]  # whole
    P = held["params"]
    assert model_state_bytes(P, 1, 64, "bf16").grads == (2 + 4) * P  # at one rank or 64


@pytest.mark.timeout(120)
def test_loader_workers_beyond_a_ranks_streams_are_not_counted():
    """A rank runs min(data.num_workers, its streams) loader workers (a worker reads whole streams): at a100x64's 8
    streams per rank, 16 asked for are 8."""
    profile = load_profile("a100x64")
    at8, at16 = (
        build_plan(profile, resolve_config(profile, "vit_h14_i21k", [f"data.num_workers={n}"], "r")) for n in (8, 16)
    )
    assert at16.data.shards_per_stream == at8.data.shards_per_stream == pytest.approx(4134 / 512)
    assert at16.data.warnings == () and at16.data.loader_workers == 8
    assert at16.data.loader_gb_per_node == at8.data.loader_gb_per_node  # 8 workers' planes, not 16


@pytest.mark.timeout(120)
def test_the_runs_mfu_denominator_is_the_plans_at_zero_0():
    """`auto` trains fp32 at ZeRO-0 (DeepSpeed's bf16 needs stage >= 1): the run's logging.peak_tflops is then the
    fp32 peak the plan divides by, not the bf16 one (the logged MFU would be 16x too low on A100s)."""
    profile = load_profile("a100x64")
    for sets, precision, peak in (([], "bf16", 312.0), (["deepspeed.zero_stage=0"], "fp32", 19.5)):
        config = resolve_config(profile, "vit_h14_i21k", sets, "r")
        plan = build_plan(profile, config)
        assert plan.compute.precision == precision and config.logging.peak_tflops == plan.compute.peak_tflops == peak


FP32_MASTER_SCRIPT = """
import json, sys
import torch, deepspeed
from pretrain.config.ds_config import BatchPlan, DeepSpeedConfig, deepspeed_config
from pretrain.config.optim import OptimConfig

deepspeed.init_distributed("gloo")
out = {}
for stage in (1, 2, 3):
    model = torch.nn.Sequential(torch.nn.Linear(64, 300), torch.nn.GELU(), torch.nn.Linear(300, 10))
    config = deepspeed_config(DeepSpeedConfig(zero_stage=stage), OptimConfig(), BatchPlan(4, 4, 1, 1), "fp32")
    engine, optimizer, *_ = deepspeed.initialize(
        model=model, optimizer=torch.optim.AdamW(model.parameters()), config=config
    )
    engine.backward(engine(torch.randn(4, 64)).square().mean())
    engine.step()
    masters = getattr(optimizer, "single_partition_of_fp32_groups", None) or optimizer.fp32_partitioned_groups_flat
    weights = {t.untyped_storage().data_ptr() for p in model.parameters() for t in (p, getattr(p, "ds_tensor", p))}
    moments = [t for s in optimizer.optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.dim()]
    out[stage] = {
        "params": sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters()),
        "master_bytes": sum(t.nbytes for t in masters if t.untyped_storage().data_ptr() not in weights),
        "moment_bytes": sum(t.nbytes for t in moments),
    }
json.dump(out, open(sys.argv[1], "w"))
"""


@pytest.mark.timeout(180)
def test_zero_in_fp32_keeps_a_master_copy_the_plan_counts(tmp_path):
    """DeepSpeed's ZeRO-1/2/3 clone their partition of the weights as the fp32 master even when the weights are fp32:
    12 bytes per parameter of optimizer state as in bf16, not Adam's m and v alone (8); ZeRO-0 has no wrapper."""
    from tests.pretrain.test_train_distributed import _env
    from tests.support import warm_ranks

    script, log = tmp_path / "rank.py", tmp_path / "rank.log"
    script.write_text(FP32_MASTER_SCRIPT)
    status = warm_ranks.launch(str(script), [str(tmp_path / "out.json")], 1, _env(), log, 150, module=False)
    assert status == 0, log.read_text()[-4000:]
    for stage, held in json.loads((tmp_path / "out.json").read_text()).items():
        P = held["params"]
        assert (held["master_bytes"], held["moment_bytes"]) == (4 * P, 8 * P), stage
        assert model_state_bytes(P, int(stage), 1, "fp32").optimizer == 12 * P, stage
    assert model_state_bytes(1000, 0, 1, "fp32").optimizer == 8 * 1000  # plain AdamW: m and v


@pytest.mark.timeout(120)
def test_a_pre_ampere_gpu_is_planned_in_the_fp32_its_workers_pick():
    """`auto` trains fp32 on a GPU without bf16 tensor cores (V100, T4: compute capability < 8.0), by the workers'
    own rule; the plan, in a process without CUDA, took bf16: half the activation bytes a V100 holds, and the MFU over
    a bf16 peak it does not have."""
    base = load_profile("a100x8")
    v100 = dataclasses.replace(base.hardware, gpu_type="Tesla V100-SXM2-32GB", gpu_memory_gb=32, peak_tflops=125)
    profile = dataclasses.replace(base, hardware=v100)
    config = resolve_config(profile, "vit_b16_i21k", [], "v100")
    assert config.deepspeed.precision == "auto"
    workers = decide("auto", "cuda", zero_stage=config.deepspeed.zero_stage, cuda_bf16=False)
    plan = build_plan(profile, config)
    assert plan.compute.precision == workers.precision == "fp32"
    assert "compute capability < 8.0" in plan.compute.precision_reason
    assert config.logging.peak_tflops == plan.compute.peak_tflops == 15.7  # V100 SXM2's dense fp32
    vit, _ = _model_size(config)
    fp32 = vit_activation_bytes(vit, "fp32", dropout=vit.dropout)
    assert plan.memory.activation_mb_per_image == pytest.approx(fp32 / 1e6)
    assert plan.memory.params_gb == pytest.approx(4 * plan.model.num_params / 1e9)  # fp32 weights
    a100 = build_plan(base, resolve_config(base, "vit_b16_i21k", [], "a100"))  # an Ampere GPU keeps bf16
    assert a100.compute.precision == "bf16" and a100.compute.peak_tflops == 312.0


@pytest.mark.timeout(120)
def test_a_hybrid_plan_counts_its_resnet_stems_activations():
    """R50+ViT-B/16's stem keeps ~51 MB per image for backward in bf16 (measured here with a real forward and
    backward), as much as its 12 encoder blocks, and no checkpointing recomputes it; the plan counted the encoder
    alone, so a hybrid that does not fit planned as fitting."""
    vit = model_config("r50_vit_b16")
    stem = ResNetStem(vit.hybrid_stages, vit.hybrid_width, vit.in_chans).to(torch.bfloat16)
    measured = saved_bytes_per_image(stem, vit.image_size, torch.bfloat16)
    assert measured / 1e6 == pytest.approx(51.0, rel=0.02)
    assert stem_activation_bytes(vit, "bf16") == pytest.approx(measured, rel=0.001)
    assert stem_activation_bytes(model_config("vit_b16"), "bf16") == 0.0
    base = load_profile("a100x8")
    config = resolve_config(base, "r50_vit_b16_i21k", [], "r50")
    plan, (hybrid, _), micro = build_plan(base, config), _model_size(config), config.data.micro_batch_size
    encoder = functools.partial(vit_activation_bytes, hybrid, "bf16", dropout=hybrid.dropout)
    assert plan.memory.activation_mb_per_image == pytest.approx((encoder() + measured) / 1e6, rel=0.001)
    with_it = (encoder(activation_checkpointing=True) + measured) * micro / 1e9  # checkpointing keeps the stem's
    assert plan.memory.activations_gb_checkpointed == pytest.approx(with_it, rel=0.001)
    # On 40 GB A100s at micro-batch 512 the encoder alone left room (35 GB); with the stem it needs 62 GB
    a40 = dataclasses.replace(base, hardware=dataclasses.replace(base.hardware, gpu_memory_gb=40))
    with pytest.raises(PlanError, match="does not fit"):
        build_plan(a40, resolve_config(a40, "r50_vit_b16_i21k", ["data.micro_batch_size=512"], "r50"))


@pytest.mark.timeout(120)
def test_too_few_shards_per_stream_is_not_fixed_by_fewer_loader_workers():
    """The order deals the shards to data.streams streams whatever the loader workers (docs/elastic.md, "Data order"):
    2067 shards over 512 streams are 4 per stream at any data.num_workers. Before, the plan counted shards per
    (rank x worker) and advised lowering data.num_workers, which silenced the warning and changed no stream."""
    profile = load_profile("a100x64")
    for workers in (8, 4, 1):
        sets = ["data.epoch_images=6200000", f"data.num_workers={workers}"]
        plan = build_plan(profile, resolve_config(profile, "vit_h14_i21k", sets, "r"))
        assert plan.data.shards_per_stream == pytest.approx(2067 / 512)
        (warning,) = [w for w in plan.data.warnings if "shards per stream" in w]
        assert "data.num_workers" not in warning and "data.streams" in warning and "re-shard" in warning
    more_streams = build_plan(profile, resolve_config(profile, "vit_h14_i21k", ["data.streams=256"], "r"))
    assert more_streams.data.shards_per_stream == pytest.approx(4134 / 256) and more_streams.data.warnings == ()


def test_a_recipes_own_built_in_set_is_not_warned_of_for_its_few_shards_per_stream(local_demo_data):
    """local_demo's built-in set is 30 shards for 8 streams. Its first launch warned to re-shard or lower data.streams,
    settings the user did not choose, against a correlation that shards cut from one global shuffle do not have.
    The same shards as a set of the user's own (data.builtin=null) are still warned of."""
    profile = load_profile("local")
    profile = dataclasses.replace(profile, storage=dataclasses.replace(profile.storage, shards=str(local_demo_data)))
    own = build_plan(profile, resolve_config(profile, "local_demo", [], "demo"))
    assert own.data.shards_per_stream == pytest.approx(30 / 8) and own.data.warnings == ()
    assert "under 8 per stream is fine here: a built-in set is written in one global shuffle" in own.data.note
    train = f"data.train={local_demo_data}/rcdb/train"
    users = build_plan(profile, resolve_config(profile, "local_demo", [train, "data.builtin=null"], "demo"))
    (warning,) = users.data.warnings
    assert warning.startswith("only 3.8 shards per stream (30 shards / data.streams=8); use >= 8: re-shard")
    assert "fine here" not in users.data.note


@pytest.mark.timeout(120)
def test_the_checkpointing_advice_names_a_micro_batch_every_elastic_world_size_keeps():
    """An elastic group of 7..8 A100s: the advice to drop checkpointing at a smaller micro-batch picked 112, a divisor
    of 896 images per rank at world size 8 but not of 1024 at 7, and the plan then refused its own advice."""
    base = load_profile("a100x8")
    profile = dataclasses.replace(
        base,
        workers=dataclasses.replace(base.workers, num_workers=None, min=7, max=8),
        hardware=dataclasses.replace(base.hardware, gpu_memory_gb=60),
    )
    sets = ["data.global_batch_size=7168", "data.streams=56", "data.micro_batch_size=128"]
    sets += ["model.grad_checkpointing=true"]
    advice = build_plan(profile, resolve_config(profile, "vit_h14_i21k", sets, "r")).memory.checkpointing_advice
    assert "--set model.grad_checkpointing=false --set data.micro_batch_size=64:" in advice
    assert "micro-batch 64 x accumulation 14 fits without it" in advice  # at world size 8
    taken = sets + ["model.grad_checkpointing=false", "data.micro_batch_size=64"]
    assert build_plan(profile, resolve_config(profile, "vit_h14_i21k", taken, "r")).memory.total_gb < 60


@pytest.mark.timeout(120)
def test_the_disk_warning_counts_the_checkpoints_pinned_for_pending_evals(tmp_path, monkeypatch):
    """Before, the plan sized the run folder for keep_last + 1 checkpoints, but a checkpoint pinned for its pending
    evals survives pruning: evals that fall behind keep up to MAX_PINNED more, and a slow suite every N-th checkpoint
    holds the others' evals queued behind it (H/14 on a100x64: its VTAB probe every 20th takes ~10 checkpoints'
    time, so the few-shot evals due meanwhile keep 5 more checkpoints of 13 GB, though the evals keep pace)."""
    import shutil

    from cluster.plan import checkpoint_costs
    from cluster.plan.checkpoint_costs import CHECKPOINT_BYTES_PER_PARAM, pinned_beyond_kept
    from cluster.plan.evals.cadence import MAX_PINNED, EvalCadence

    def pins(profile, config, plan) -> int:
        cadence = EvalCadence(config.evals.schedule(), config.checkpoint.every_steps, plan.compute.total_steps)
        return pinned_beyond_kept(plan.evals, cadence, plan.compute.step_time_s, config.checkpoint.keep_last)

    a100 = load_profile("a100x64")
    h14 = resolve_config(a100, "vit_h14_i21k", [], "h14")
    plan = build_plan(a100, h14)
    assert not plan.evals.warnings and pins(a100, h14, plan) == 5
    profile = load_profile("local")
    storage = dataclasses.replace(profile.storage, shards=str(tmp_path / "data"), checkpoints=str(tmp_path / "runs"))
    profile = dataclasses.replace(profile, storage=storage)
    config = resolve_config(profile, "local_demo", [], "demo")
    assert pins(profile, config, build_plan(profile, config)) == 0  # the demo's evals keep up
    config = resolve_config(profile, "local_demo", ["checkpoint.every_steps=10"], "demo")  # the evals fall behind
    plan = build_plan(profile, config)
    assert any("keep up with training" in w for w in plan.evals.warnings) and pins(profile, config, plan) == MAX_PINNED
    size, keep = plan.model.num_params * CHECKPOINT_BYTES_PER_PARAM, config.checkpoint.keep_last
    free = (keep + 1 + MAX_PINNED // 2) * size  # keep_last + 1 fit, not the pinned ones too
    monkeypatch.setattr(checkpoint_costs.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(free, 0, free))
    (warning,) = [w for w in build_plan(profile, config).data.warnings if "checkpoint.keep_last" in w]
    assert f"keep_last + 1 = {keep + 1} + {MAX_PINNED} pinned for pending evals" in warning
    assert f"= {keep + 1 + MAX_PINNED} checkpoints of" in warning


@pytest.mark.timeout(120)
def test_a_clusters_checkpoint_folder_not_mounted_here_is_not_measured_on_this_hosts_disk(tmp_path, monkeypatch):
    """Before, a cluster plan made where storage.checkpoints (/fsx/...) is not mounted measured the nearest folder that
    exists (this host's /) and printed its free space as the run folder's, warning or not by the launching host's disk.
    Now a cluster's run folder is measured only where the folder of run folders is here."""
    import shutil

    from cluster.plan import checkpoint_costs

    monkeypatch.setattr(checkpoint_costs.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(1e9, 0, 1e9))
    profile = load_profile("a100x64")
    runs = tmp_path / "fsx" / "runs"  # the cluster's shared file system, not mounted on this host
    profile = dataclasses.replace(profile, storage=dataclasses.replace(profile.storage, checkpoints=str(runs)))

    def space_warnings() -> list[str]:
        plan = build_plan(profile, resolve_config(profile, "vit_b16_i21k", [], "b16"))
        return [w for w in plan.data.warnings if "checkpoint.keep_last" in w]

    assert space_warnings() == []
    runs.mkdir(parents=True)  # mounted here: its space is the run's
    (warning,) = space_warnings()
    assert warning.startswith(f"{runs / 'b16'} has 1 GB free but needs")
