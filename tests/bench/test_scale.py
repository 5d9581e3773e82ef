"""bench.scale.campaign at tiny sizes: every part runs end to end and writes the flat result keys (no timing
asserted)."""

from __future__ import annotations

import json
import tempfile

import pytest

from bench.scale import __main__ as scale
from bench.scale.tables import build_tables
from data_pipeline.manifest import iter_samples, read_dataset_info

KEYS = [
    "plan_s_64_ranks",
    "plan_s_512_ranks",
    "plan_peak_mb_per_rank",
    "samples_read_peak_mb",
    "samples_read_s",
    "manifest_read_s",
    "first_batch_s",
    "neardup_recall",
    "neardup_precision",
    "neardup_projected_hours_16_cores",
    "neardup_projected_hours_16_cores_inputs",
    "write_img_s_per_core",
    "write_projected_hours_96_cores",
    "write_projected_hours_96_cores_inputs",
    "write_projected_hours_8_nodes",
    "write_projected_hours_96_cores_with_serial",
    "write_serial_hours_i21k",
    "generate_img_s_per_core",
]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_tiny_bench_writes_every_key(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the bench's temp folder, to check that it is removed
    out = tmp_path / "scale.json"
    assert scale.main(["--tiny", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [k for k in KEYS if k not in result] == []
    assert result["tiny"] is True and result["samples"] == 60_000
    assert result["neardup_recall"] == 1.0 and result["neardup_precision"] == 1.0  # the index is exact
    assert result["neardup_bruteforce_sample"]["true_pairs"] > 0
    assert result["write_resume_identical"] is True and result["write_resume_killed"] is True
    assert result["first_batch_detail"]["batch_shape"] == [64, 3, 224, 224]
    assert result["plan_512_ranks_detail"]["shards_this_rank"] > 0
    assert "formula" in result["write_projected_hours_96_cores_inputs"]
    assert [p.name for p in tmp_path.iterdir()] == ["scale.json"]  # temp files cleaned up


def test_bad_output_path_is_one_error_line(tmp_path, capsys):
    assert scale.main(["--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("python -m bench.scale: error: --out")


def test_synthetic_tables_have_the_i21k_shape(tmp_path):
    build_tables(tmp_path / "t", samples=1001, shards=10, classes=7)
    info = read_dataset_info(tmp_path / "t")
    assert info.num_samples == 1001 and len(info.shards) == 10 and len(info.class_names) == 7
    assert sorted({s.samples for s in info.shards}) == [100, 101]
    rows = [r for b in iter_samples(tmp_path / "t") for r in b.to_pylist()]
    assert len(rows) == 1001 and len(rows[5]["sha256"]) == 64 and rows[5]["key"] == "000000005"
    assert rows[5]["source"].startswith("n") and rows[5]["source"].endswith("_000000005.JPEG")
