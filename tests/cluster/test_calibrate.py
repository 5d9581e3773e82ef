"""cluster.calibrate: a GPU campaign's JSON (the shape `bench.gpu.campaign` writes) becomes cluster/mfu.yaml entries,
and the plan then uses them: the measured MFU for that model on that GPU kind (and says so), the measured activation
scale where the memory model was off by more than 15%; everything else stays assumed. Tests write a copy of the table
(``--mfu-file``, ``$VITSCALE_MFU_FILE``), never the repository's."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from cluster.calibrate import HEADER, entries_from, main
from cluster.plan import mfu
from cluster.plan.mfu import MFU_FILE, gpu_kind
from cluster.plan.planner import build_plan, resolve_config
from cluster.plan.text import format_plan
from cluster.profiles import load_profile
from data_pipeline.paths import PROJECT_ROOT


def campaign(**changes) -> dict:
    """What `python -m bench.gpu` writes on an H100 (the keys calibrate reads, and a few it does not)."""
    result = {
        "device": "NVIDIA H100 80GB HBM3",
        "device_kind": "H100",
        "date": "2026-11-28T10:00:00+00:00",
        "torch": "2.11.0+cu130",
        "cuda": "13.0",
        "deepspeed": "0.19.8",
        "driver": "580.65",
        "smoke": False,
        "train_path_mfu_vit_h14": 0.42,
        "train_path_micro_batch": 64,
        "mfu_eager_vit_h14": 0.47,
        "mfu_eager_vit_b16": 0.33,
        "eager_batch_vit_b16": 1024,
        "mfu_vit_l16": 0.44,
        "plan_memory_gb_vit_h14": 39.0,
        "plan_activations_gb_vit_h14": 23.0,
        "measured_memory_gb_vit_h14": 30.0,
        "plan_memory_error_vit_h14": (39.0 - 30.0) / 30.0,
        "loader_cores_needed_vit_b16": 7.5,
    }
    return {**result, **changes}


@pytest.fixture
def table(tmp_path, monkeypatch) -> Path:
    """An empty table, which the plan reads through $VITSCALE_MFU_FILE."""
    path = tmp_path / "mfu.yaml"
    path.write_text(HEADER + "{}\n")
    monkeypatch.setenv(mfu.MFU_FILE_ENV, str(path))
    return path


def write(tmp_path: Path, result) -> Path:
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps(result))
    return path


def h14_plan(profile_name: str = "h100x8"):
    profile = load_profile(profile_name)
    return build_plan(profile, resolve_config(profile, "vit_h14_i21k", [], "calibrate-test"))


def test_the_shipped_table_is_the_committed_campaigns_and_the_kinds_are_the_datasheet_names():
    record = json.loads((PROJECT_ROOT / "bench-results" / "gpu.json").read_text())  # docs/benchmarks/gpu.md
    shipped = mfu.read_table(MFU_FILE)
    assert {model: kinds["H200"] for model, kinds in shipped.items()} == entries_from(record)
    assert all(set(kinds) == {"H200"} for kinds in shipped.values())
    assert [gpu_kind(n) for n in ("NVIDIA H200", "H100-SXM5-80GB", "A100-SXM4-80GB")] == ["H200", "H100", "A100"]
    assert gpu_kind(" Some New GPU ") == "Some New GPU"
    assert gpu_kind("NVIDIA L40S") == "NVIDIA L40S"  # not the L4's measurements
    assert mfu.same_peak_kinds("H100") == ["H200"] and mfu.same_peak_kinds("A100") == []


@pytest.mark.timeout(120)
def test_an_h200_measurement_calibrates_h200_and_marked_so_h100_but_not_a100(tmp_path, table):
    on_h200 = campaign(device="NVIDIA H200", device_kind="H200", date="2026-12-04T10:41:22+00:00")
    assert main([str(write(tmp_path, on_h200))]) == 0
    assert set(yaml.safe_load(table.read_text())["vit_h14"]) == {"H200"}  # filed under the kind that ran it
    h200, h100 = h14_plan("h200x8").compute, h14_plan("h100x8").compute
    assert h200.assumed_mfu == h100.assumed_mfu == 0.42
    assert h200.mfu_source == "measured on H200 2026-12-04 (pretrain.train)"
    assert h100.mfu_source == "measured on H200 2026-12-04 (pretrain.train), applied to H100 (same dense peak)"
    assert "MFU 42% measured on H200 2026-12-04 (pretrain.train), applied to H100" in format_plan(h14_plan("h100x8"))
    assert h14_plan("a100x64").compute.mfu_source == "assumed"
    # a measurement of the plan's own kind wins over one of a kind with the same peaks
    assert main([str(write(tmp_path, campaign(train_path_mfu_vit_h14=0.40)))]) == 0
    assert h14_plan("h100x8").compute.mfu_source == "measured on H100 2026-11-28 (pretrain.train)"
    assert h14_plan("h200x8").compute.assumed_mfu == 0.42


@pytest.mark.timeout(120)
def test_calibrated_plan_uses_the_measured_mfu_and_memory(tmp_path, table, capsys):
    before = h14_plan()
    assert before.compute.mfu_source == "assumed" and "assumed MFU 35%" in format_plan(before)
    assert main([str(write(tmp_path, campaign())), "--mfu-file", str(table)]) == 0
    assert "vit_h14 on H100: MFU 42.0% (pretrain.train), memory off by +30%" in capsys.readouterr().out
    entry = yaml.safe_load(table.read_text())["vit_h14"]["H100"]
    # The real path's MFU wins over the step benchmark's; memory off by 30% > 15%: the activations take the blame.
    assert (entry["mfu"], entry["mfu_from"], entry["date"]) == (0.42, "pretrain.train", "2026-11-28")
    assert entry["activation_scale"] == pytest.approx((30.0 - (39.0 - 23.0)) / 23.0, abs=1e-4)
    after = h14_plan()
    assert after.compute.assumed_mfu == 0.42
    assert after.compute.mfu_source == "measured on H100 2026-11-28 (pretrain.train)"
    assert after.compute.step_time_s == pytest.approx(before.compute.step_time_s * 0.35 / 0.42)
    assert after.memory.activations_gb == pytest.approx(before.memory.activations_gb * entry["activation_scale"])
    text = format_plan(after)
    assert "MFU 42% measured on H100 2026-11-28 (pretrain.train) of 989 TFLOP/s" in text
    assert "activations x 0.61: the model was +30% off what H100 measured on 2026-11-28" in text
    # B/16 has no real-path number: the step benchmark's eager MFU; another GPU kind stays assumed.
    b16 = yaml.safe_load(table.read_text())["vit_b16"]["H100"]
    assert (b16["mfu"], b16["mfu_from"], b16["micro_batch_size"]) == (0.33, "step benchmark (eager)", 1024)
    assert h14_plan("a100x64").compute.mfu_source == "assumed"


@pytest.mark.timeout(120)
def test_memory_within_15_percent_is_not_corrected_and_a_rerun_replaces_the_entry(tmp_path, table):
    close = campaign(measured_memory_gb_vit_h14=36.0, plan_memory_error_vit_h14=(39.0 - 36.0) / 36.0)
    assert main([str(write(tmp_path, close))]) == 0  # the table from $VITSCALE_MFU_FILE
    assert main([str(write(tmp_path, close | {"train_path_mfu_vit_h14": 0.45}))]) == 0
    entry = mfu.measured("vit_h14", "H100-SXM5-80GB")
    assert entry is not None and entry.mfu == 0.45 and entry.activation_scale == 1.0 and not entry.memory_corrected
    plan = h14_plan()
    assert plan.memory.memory_source == "" and plan.compute.assumed_mfu == 0.45


@pytest.mark.parametrize(
    "content, says",
    [
        (None, "cannot read it"),
        ("{not json", "not JSON"),
        (json.dumps(campaign(smoke=True)), "--smoke run"),
        (json.dumps({k: v for k, v in campaign().items() if k != "device"}), "no 'device'"),
        (json.dumps(campaign(train_path_mfu_vit_h14=None, mfu_eager_vit_h14=2.0, mfu_eager_vit_b16=None)), "no MFU"),
        (json.dumps([1, 2]), "must be an object"),
    ],
)
def test_bad_input_exits_2_with_one_message(tmp_path, table, capsys, content, says):
    path = tmp_path / "gpu.json"
    if content is not None:
        path.write_text(content)
    assert main([str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("python -m cluster.calibrate: error: ") and says in err and len(err.strip().splitlines()) == 1
    assert mfu.read_table(table) == {}  # nothing written


def test_a_damaged_table_is_a_clear_error(tmp_path, table, capsys):
    table.write_text("- a list\n")
    assert main([str(write(tmp_path, campaign()))]) == 2
    assert "must map model -> GPU kind" in capsys.readouterr().err


@pytest.mark.parametrize("where", ["missing/mfu.yaml", ".", "env:."])
def test_an_mfu_file_that_cannot_be_written_is_refused_before_any_work(tmp_path, table, monkeypatch, capsys, where):
    """A folder, or a file in a missing folder: one line naming it, exit 2, even before the GPU JSON is read."""
    target = tmp_path / where.removeprefix("env:")
    args = [str(tmp_path / "absent.json")]
    if where.startswith("env:"):
        monkeypatch.setenv(mfu.MFU_FILE_ENV, str(target))
    else:
        args += ["--mfu-file", str(target)]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and str(target) in err and "absent.json" not in err
    assert ("--mfu-file" if "env" not in where else "$VITSCALE_MFU_FILE") in err
    assert main([str(write(tmp_path, campaign())), *args[1:]]) == 2  # and with a campaign to write: no traceback
    assert mfu.read_table(table) == {} and not (tmp_path / "missing").exists()


BROKEN_TABLES = [
    ("vit_h14: [1\n", r"line 2, column 1: invalid YAML"),
    ("vit_h14:\n  H100: {mfu: fast}\n", r"vit_h14 -> H100: mfu is 'fast'"),
    ("vit_h14:\n  H100: {mfu: 0.4, memory_error: big}\n", r"vit_h14 -> H100: memory_error is 'big'"),
    ("vit_h14:\n  H100: {mfu: 0.4, activation_scale: [2]}\n", r"vit_h14 -> H100: activation_scale is \[2\]"),
]


@pytest.mark.parametrize("text, says", BROKEN_TABLES)
def test_a_broken_table_is_one_line_naming_it_in_calibrate_and_in_the_plan(tmp_path, table, capsys, text, says):
    table.write_text(text)
    assert main([str(write(tmp_path, campaign()))]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and re.search(f"MFU table {re.escape(str(table))}.*{says}", err)
    assert table.read_text() == text  # nothing written over it
    with pytest.raises(ValueError) as info:  # `cluster.launch` prints it as its one error line
        h14_plan()
    assert len(str(info.value).splitlines()) == 1 and re.search(says, str(info.value))


def test_vitscale_mfu_file_naming_no_file_is_refused_not_ignored(tmp_path, monkeypatch):
    monkeypatch.setenv(mfu.MFU_FILE_ENV, str(tmp_path / "typo.yaml"))
    with pytest.raises(ValueError, match=rf"VITSCALE_MFU_FILE={tmp_path}/typo\.yaml is not a file; unset it"):
        h14_plan()
    monkeypatch.delenv(mfu.MFU_FILE_ENV)
    assert h14_plan().compute.mfu_source.startswith("measured on H200")  # unset: the shipped table


def test_a_campaign_planned_with_a_correction_keeps_it_rather_than_undoing_it(tmp_path, table, capsys):
    """The campaign's plan reads the table: once it holds a correction, the next campaign's plan includes it, so its
    error was ~0 and calibrate wrote scale 1.0, undoing the correction (the next plan off by 30% again). The error
    and the scale are now the model's, the applied scale taken out."""
    assert main([str(write(tmp_path, campaign())), "--mfu-file", str(table)]) == 0
    first = mfu.measured("vit_h14", "NVIDIA H100 80GB HBM3")
    assert first.memory_corrected and first.activation_scale == pytest.approx((30.0 - 16.0) / 23.0, abs=1e-4)
    activations = 23.0 * first.activation_scale  # what the next campaign's plan holds: 16 GB + these = 30 GB
    again = campaign(
        plan_memory_gb_vit_h14=16.0 + activations,
        plan_activations_gb_vit_h14=activations,
        plan_memory_error_vit_h14=(16.0 + activations - 30.0) / 30.0,
        plan_memory_source_vit_h14=first.memory_source,
    )
    assert main([str(write(tmp_path, again)), "--mfu-file", str(table)]) == 0
    entry = mfu.read_table(table)["vit_h14"]["H100"]
    assert entry["memory_error"] == pytest.approx(0.3, abs=1e-3) and entry["memory_gb_planned"] == 39.0
    assert mfu.measured("vit_h14", "NVIDIA H100 80GB HBM3").activation_scale == pytest.approx(first.activation_scale)
    capsys.readouterr()
    stranger = campaign(plan_memory_source_vit_h14="activations x 0.50: the model was +45% off what H200 measured")
    assert main([str(write(tmp_path, stranger)), "--mfu-file", str(table)]) == 2
    assert "which this table does not hold" in capsys.readouterr().err
