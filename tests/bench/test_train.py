"""bench.train runs end to end (tiny: ViT-Ti/16, batch 2 at fp32 and 1 at bf16, one round, eager and with compiled
blocks, 512-side GEMMs) and writes the documented keys; the numbers are the lead's to measure on an idle machine."""

import json

import pytest


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_bench_train_writes_the_documented_keys_at_both_precisions(tmp_path):
    from bench.train import main

    out = tmp_path / "train.json"
    args = [
        "--models",
        "vit_ti16",
        "--batch-size",
        "2",
        "--rounds",
        "1",
        "--repeats",
        "1",
        "--bf16-batch-size",
        "1",
        "--no-eager",
        "--gemm-size",
        "512",
        "--bf16-gemm-size",
        "512",
        "--out",
        str(out),
    ]
    assert main(args) == 0
    result = json.loads(out.read_text())
    for precision in ("fp32", "bf16"):
        tag = f"{precision}_ti16"
        for key in ("speedup_vs_hf", "gemm_fraction", "vitscale_img_s", "hf_img_s", "gemm_tflops", "achieved_tflops"):
            assert isinstance(result[f"{key}_{tag}"], float) and result[f"{key}_{tag}"] > 0, f"{key}_{tag}"
        ratio = result[f"vitscale_img_s_{tag}"] / result[f"hf_img_s_{tag}"]
        assert result[f"speedup_vs_hf_{tag}"] == pytest.approx(ratio)
        assert result[f"gemm_fraction_{tag}"] == pytest.approx(
            result[f"achieved_tflops_{tag}"] / result[f"gemm_tflops_{tag}"]
        )
        # the GEMM rate is the faster of the two operand layouts
        assert result[f"gemm_tflops_{tag}"] == max(result[f"gemm_tflops_nn_{tag}"], result[f"gemm_tflops_nt_{tag}"])
        # compiled blocks (model.compile), against HF as it runs and HF compiled the same way
        compiled, hf_compiled = result[f"vitscale_compiled_img_s_{tag}"], result[f"hf_compiled_img_s_{tag}"]
        assert compiled > 0 and hf_compiled > 0
        assert result[f"speedup_compiled_vs_hf_{tag}"] == pytest.approx(compiled / result[f"hf_img_s_{tag}"])
        assert result[f"speedup_compiled_vs_hf_compiled_{tag}"] == pytest.approx(compiled / hf_compiled)
        assert result[f"gemm_fraction_compiled_{tag}"] == pytest.approx(
            result[f"gemm_fraction_{tag}"] * compiled / result[f"vitscale_img_s_{tag}"]
        )
    assert isinstance(result["cpu_bf16_native"], bool) and isinstance(result["cpu_flags"], list)
    assert result["threads"] >= 1 and result["batch_size_bf16_ti16"] == 1
    shares = [share for _, share in result["bf16_profile_vitscale"]]
    assert shares == sorted(shares, reverse=True) and 0 < sum(shares) <= 1 + 1e-6
    assert 0 < result["bf16_profile_share_gemm"] <= 1
    # ViT-Ti/16 at 224: 1.254 forward GMACs per image (README) → ~7.5 training GFLOPs
    assert result["train_gflops_per_image_ti16"] == pytest.approx(3 * 2 * 1.254, rel=0.01)
    # the achieved rate counts what vitscale runs: its last block at the class token alone
    as_run = result["train_gflops_per_image_as_run_ti16"]
    assert 0.9 * result["train_gflops_per_image_ti16"] < as_run < result["train_gflops_per_image_ti16"]
    assert result["achieved_tflops_bf16_ti16"] == pytest.approx(result["vitscale_img_s_bf16_ti16"] * as_run / 1e3)


def test_bench_train_rejects_an_unknown_model():
    from bench.train import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--models", "vit_x99"])
    assert exit_info.value.code == 2
