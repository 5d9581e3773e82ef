"""cluster.plan.startup: the watchdog's start allowance from the plan's parts (manifest, model, checkpoint at the
profile's storage rates), with the profile's hang.startup_s as its floor."""

from __future__ import annotations

import dataclasses

import pytest

from cluster.plan.planner import build_plan, resolve_config
from cluster.plan.startup import ALLOWANCE_MARGIN, manifest_seconds, startup_allowance
from cluster.plan.text import format_plan
from cluster.profiles import load_profile


def test_the_manifest_term_by_hand():
    # 4,700 shards x 128 bytes at 100 MB/s, + 0.10 s to deal them to the streams (the i21k-scale benchmark)
    assert manifest_seconds(4_700, 100.0) == pytest.approx(4_700 * 128 / 100e6 + 0.10)
    assert manifest_seconds(0, 100.0) == 0


def test_the_start_allowance_grows_with_the_checkpoint_and_never_falls_below_the_floor():
    profile = load_profile("a100x64")
    floor = profile.hang.startup_s
    sizes = [1e6, 1e8, 632e6, 2e9, 10e9]
    allowances = [startup_allowance(profile, params, 4_700) for params in sizes]
    assert all(a.startup_s >= floor for a in allowances)
    assert [a.startup_s for a in allowances] == sorted(a.startup_s for a in allowances)
    big = allowances[-1]  # 10e9 parameters: 200 GB at 100 MB/s, far above the floor
    assert big.startup_s == pytest.approx(ALLOWANCE_MARGIN * big.estimate_s) and big.startup_s > floor
    assert dict(big.terms)["checkpoint"] == pytest.approx(10e9 * 20 / 100e6)
    assert allowances[0].startup_s == floor  # a small model: the profile's floor applies


def test_slower_shard_storage_lengthens_the_manifest_term():
    profile = load_profile("a100x64")
    slow = dataclasses.replace(profile, storage=dataclasses.replace(profile.storage, read_mb_per_s=0.01))
    fast, slowed = startup_allowance(profile, 632e6, 4_700), startup_allowance(slow, 632e6, 4_700)
    assert dict(slowed.terms)["manifest"] == pytest.approx(4_700 * 128 / 0.01e6 + 0.10)
    assert slowed.estimate_s - fast.estimate_s == pytest.approx(4_700 * 128 * (1 / 0.01e6 - 1 / 100e6))


@pytest.mark.timeout(120)
def test_the_plan_prints_the_start_allowance_with_its_parts():
    profile = load_profile("a100x64")
    plan = build_plan(profile, resolve_config(profile, "vit_h14_i21k", [], "h14-start"))
    a = plan.startup
    assert a.num_shards == plan.data.num_shards and [name for name, _ in a.terms] == [
        "process start",
        "manifest",
        "model and engine",
        "checkpoint",
    ]
    line = next(x for x in format_plan(plan).splitlines() if x.startswith("  hang watchdog"))
    manifest = manifest_seconds(plan.data.num_shards, 100.0)
    assert f"+ manifest {manifest:.3g} +" in line
    assert plan.data.num_shards == 4134  # no manifest readable here: 12.4M images at the writer's 3000 a shard
    assert "a manifest of 4134 shards, 0.53 MB at 100 MB/s (storage.read_mb_per_s)" in line
