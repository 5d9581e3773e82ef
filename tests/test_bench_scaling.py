"""bench.scaling runs the real training loop at world size 1 and 2 (tiny: ViT-Ti/16 at 32 px, 4 steps), one core per
rank plus world 1 on both cores, and writes the documented keys; the ratio itself is the lead's to measure on an idle
machine."""

import json

import pytest


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_bench_scaling_writes_the_documented_keys(tmp_path):
    from bench.scaling import main

    out = tmp_path / "scaling.json"
    args = ["--model", "vit_ti16", "--image-size", "32", "--global-batch", "16", "--steps", "4", "--log-every", "2",
            "--rounds", "1", "--threads", "2", "--out", str(out)]  # fmt: skip
    assert main(args) == 0
    result = json.loads(out.read_text())
    for key in ("scaling_2_over_1", "img_s_world1", "img_s_world2", "step_s_world1", "step_s_world2",
                "exchange_s_world2", "compute_s_world2", "scaling_2_over_1_same_cores",
                "img_s_world1_all_cores"):  # fmt: skip
        assert isinstance(result[key], float) and result[key] >= 0, key
    assert result["scaling_2_over_1"] == pytest.approx(result["img_s_world2"] / result["img_s_world1"])
    assert result["step_s_world1"] == pytest.approx(16 / result["img_s_world1"])
    assert result["scaling_2_over_1_same_cores"] == pytest.approx(
        result["img_s_world2"] / result["img_s_world1_all_cores"]
    )
    threads = ("threads_per_rank_world1", "threads_per_rank_world2", "threads_world1_all_cores")
    assert [result[key] for key in threads] == [1, 1, 2]
    assert (result["cores_world1"], result["cores_world2"]) == (1, 2)
    assert 0 <= result["data_wait_world2"] <= 1 and "gloo" in result["notes"]


@pytest.mark.parametrize("args", [["--global-batch", "15"], ["--steps", "3", "--log-every", "2"], ["--threads", "1"]])
def test_bench_scaling_rejects_bad_sizes_before_training(args, capsys):
    from bench.scaling import main

    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 2 and "error:" in capsys.readouterr().err
