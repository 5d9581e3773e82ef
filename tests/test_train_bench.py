"""bench.train runs end to end (tiny: batch 2, one round) and writes the documented keys; the numbers are the
lead's to measure on an idle machine."""

import json

import pytest


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bench_train_writes_the_documented_keys(tmp_path):
    from bench.train import main

    out = tmp_path / "train.json"
    args = ["--batch-size", "2", "--rounds", "1", "--repeats", "1", "--no-eager", "--out", str(out)]
    assert main(args) == 0
    result = json.loads(out.read_text())
    for key in ("vitscale_img_s", "hf_img_s", "speedup_vs_hf", "gemm_fraction"):
        assert result[key] > 0, key
    assert result["speedup_vs_hf"] == pytest.approx(result["vitscale_img_s"] / result["hf_img_s"])
    assert result["gemm_fraction"] == pytest.approx(result["achieved_tflops"] / result["gemm_tflops"])
    # ViT-S/16 at 224: 4.61 forward GMACs per image (docs/reference.md §5) → ~27.7 training GFLOPs
    assert result["train_gflops_per_image"] == pytest.approx(3 * 2 * 4.61, rel=0.01)
