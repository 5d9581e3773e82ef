"""`deepspeed.precision` (pretrain.config.precision): auto is bf16 on CUDA and, on a CPU, a fixed rule on its bf16 units
and the model's GEMM shapes (never a timing); probe is an opt-in timing recorded in the run folder and repeated by every
later start; a resumed run keeps its checkpoint's precision. The same decision on every rank."""

import json

import pytest
import torch

from pretrain.checkpoint.run_folder import PRECISION_RECORD, read_precision_record
from pretrain.checkpointer import StartPoint
from pretrain.config.ds_config import batch_plan, deepspeed_config
from pretrain.config.precision import (
    PrecisionChoice,
    StepShape,
    cpu_bf16_units,
    cpu_flags,
    decide,
    decide_on_rank0,
    probe_bf16_speedup,
)
from pretrain.config.train_config import load_config, model_overrides
from pretrain.model.tasks import build_task
from pretrain.model.vit import build_model, model_config

AVX2_ONLY = {"fpu", "sse2", "avx", "avx2", "fma"}
SAPPHIRE_RAPIDS = AVX2_ONLY | {"avx512f", "avx512_bf16", "amx_tile", "amx_bf16"}
ZEN4 = AVX2_ONLY | {"avx512f", "avx512_bf16"}


def test_flags_are_read_from_cpuinfo(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: X\nflags\t\t: fpu avx2 avx512_bf16 amx_bf16\n\nprocessor\t: 1\n")
    assert cpu_flags(info) == {"fpu", "avx2", "avx512_bf16", "amx_bf16"}
    assert cpu_flags(tmp_path / "absent") is None
    assert cpu_bf16_units(cpu_flags(info)) == ("amx_bf16", "avx512_bf16")
    assert cpu_bf16_units(AVX2_ONLY) == ()


def _shape(name: str, micro_batch: int, **overrides) -> StepShape:
    return StepShape.of(model_config(name, **overrides), micro_batch)


def test_cpu_without_bf16_units_falls_back_to_fp32():
    choice = decide("auto", "cpu", _shape("vit_b16", 32), flags=AVX2_ONLY)
    assert (choice.precision, choice.rule) == ("fp32", "cpu:none")
    assert choice.line("auto").startswith("precision auto -> fp32 (cpu:none): this CPU")
    assert "no AMX/AVX512-BF16; bf16 matmul would be emulated" in choice.reason


@pytest.mark.parametrize(
    "name, micro_batch, overrides, amx, avx512",
    [
        # (the measured fwd+bwd speedups on AMX, docs/performance.md "Precision": tiny 1.03-1.51x, the rest >= 1.53x)
        ("vit_tiny_debug", 32, {}, "fp32", "fp32"),  # local_demo: width 64, 1.35x on AMX
        ("vit_tiny_debug", 64, {}, "fp32", "fp32"),  # 1.51x: still under the margin
        ("vit_ti16", 2, {}, "fp32", "fp32"),  # 394 tokens x 192² = 14.5M < 16M
        ("vit_ti16", 8, {}, "bf16", "fp32"),  # 2.16x on AMX; width 192 < 384 for AVX512-BF16
        ("vit_s16", 16, {}, "bf16", "bf16"),  # 2.6-3.5x on AMX, 1.7x on Zen 4
        ("vit_s16", 1, {}, "bf16", "fp32"),  # 27.7M: enough for AMX, under AVX512-BF16's 64M
        ("vit_b32", 32, {}, "bf16", "bf16"),
        ("vit_s32", 8, {"depth": 2}, "fp32", "fp32"),  # a 2-layer /32: the patch convolution is 24% of the FLOPs
        ("r26_vit_s32", 4, {}, "bf16", "fp32"),  # 1.53x on AMX; stems were not measured on Zen 4
        ("vit_h14", 64, {}, "bf16", "bf16"),
    ],
)
def test_cpu_auto_is_a_rule_on_the_units_and_the_gemm_shapes(name, micro_batch, overrides, amx, avx512):
    shape = _shape(name, micro_batch, **overrides)
    on_amx = decide("auto", "cpu", shape, flags=SAPPHIRE_RAPIDS)
    on_zen4 = decide("auto", "cpu", shape, flags=ZEN4)
    assert (on_amx.precision, on_amx.rule) == (amx, "cpu:amx_bf16"), on_amx.reason
    assert (on_zen4.precision, on_zen4.rule) == (avx512, "cpu:avx512_bf16"), on_zen4.reason
    assert "rule: bf16 iff width >= 128" in on_amx.reason and "rule: bf16 iff width >= 384" in on_zen4.reason


def test_the_rule_never_times_anything_and_repeats_itself():
    def probe():
        raise AssertionError("auto decides by its rule: no timing")

    shape = _shape("vit_tiny_debug", 32)
    choices = {decide("auto", "cpu", shape, flags=SAPPHIRE_RAPIDS, probe=probe) for _ in range(3)}
    assert len(choices) == 1
    with pytest.raises(ValueError, match="needs the model's step shape"):
        decide("auto", "cpu", None, flags=SAPPHIRE_RAPIDS)


def test_probe_is_an_explicit_opt_in_that_a_record_repeats():
    faster = decide("probe", "cpu", flags=SAPPHIRE_RAPIDS, probe=lambda: (0.30, 0.15))
    assert (faster.precision, faster.rule) == ("bf16", "probe") and "2.00x" in faster.reason
    slower = decide("probe", "cpu", flags=SAPPHIRE_RAPIDS, probe=lambda: (0.10, 0.20))
    assert slower.precision == "fp32" and "0.50x" in slower.reason
    even = decide("probe", "cpu", flags=SAPPHIRE_RAPIDS, probe=lambda: (0.100, 0.098))  # within noise: fp32, exact
    assert even.precision == "fp32"

    def probe():
        raise AssertionError("a recorded decision is not timed again")

    recorded = PrecisionChoice("bf16", "run-record", "runs/x/precision.json: probe step ...")
    assert decide("probe", "cpu", flags=SAPPHIRE_RAPIDS, recorded=recorded, probe=probe) == recorded
    assert decide("probe", "cpu", flags=AVX2_ONLY, probe=probe).rule == "cpu:none"  # nothing to time
    assert decide("probe", "cuda", probe=probe).precision == "bf16"


def test_a_resumed_run_keeps_its_checkpoints_precision():
    def probe():
        raise AssertionError("a resumed run does not probe again")

    shape = _shape("vit_b16", 32)
    for requested in ("auto", "probe"):
        for kept in ("fp32", "bf16"):
            choice = decide(
                requested, "cpu", shape, flags=SAPPHIRE_RAPIDS, resumed=(kept, "step_00000300"), probe=probe
            )
            assert choice.precision == kept
            assert choice.line(requested) == (
                f"precision {requested} -> {kept} (checkpoint): kept from step_00000300, which trained in {kept}"
            )
    # An explicit setting is the recipe's (a change of it is warned about as a changed setting); CUDA auto keeps too.
    assert decide("fp32", "cpu", resumed=("bf16", "step_00000300")).precision == "fp32"
    assert decide("auto", "cuda", resumed=("fp32", "step_00000300")).precision == "fp32"


def test_cuda_and_explicit_settings():
    assert decide("auto", "cuda").precision == "bf16"
    assert decide("fp32", "cuda").precision == "fp32" and decide("bf16", "cpu").precision == "bf16"
    assert decide("bf16", "cpu").reason == "deepspeed.precision=bf16, in the recipe or --set"
    assert decide("bf16", "cpu").rule == "recipe"


def test_this_machine_decides_from_its_own_flags():
    """What `make launch` prints here: the local_demo model is fp32 on every CPU; ViT-B/16 is bf16 where there are
    bf16 units."""
    assert decide("auto", "cpu", _shape("vit_tiny_debug", 32)).precision == "fp32"
    big = decide("auto", "cpu", _shape("vit_b16", 32))
    if cpu_bf16_units():
        assert big.precision == "bf16" and big.rule == f"cpu:{cpu_bf16_units()[0]}"
    else:
        assert big.precision == "fp32"
        assert f"this CPU ({torch.backends.cpu.get_cpu_capability()}) has no AMX/AVX512-BF16" in big.reason
    assert decide_on_rank0(lambda: big) == big  # no process group: decided here


def test_deepspeed_config_takes_the_decided_precision():
    config = load_config("local_demo")
    plan = batch_plan(config.data, 2)
    probed = deepspeed_config(config.deepspeed, config.optim, plan, "bf16")
    assert probed["bf16"]["enabled"] is True and probed["data_types"]["grad_accum_dtype"] == "fp32"
    with pytest.raises(ValueError, match="pass the decided precision"):
        deepspeed_config(config.deepspeed, config.optim, plan, "auto")


def test_probe_in_a_run_is_timed_once_and_recorded_in_the_run_folder(tmp_path, monkeypatch):
    """`precision: probe` times on the first start, writes ``<run>/precision.json``, and every later start of the run
    (a resume, or a re-run with the same run folder) repeats it without timing."""
    import pretrain.config.precision as precision_module
    import pretrain.engine as train
    from pretrain.distributed import Placement

    monkeypatch.setattr(precision_module, "cpu_flags", lambda cpuinfo=None: SAPPHIRE_RAPIDS)  # so there is a probe
    config = load_config(
        "local_demo", [f"checkpoint.dir={tmp_path / 'run'}", "deepspeed.precision=probe", "data.micro_batch_size=2"]
    )
    place = Placement(0, 1, 0, torch.device("cpu"))
    first = train.decide_precision(config, place, 4, StartPoint("scratch", None))
    assert first.rule == "probe" and "probe step fp32" in first.reason
    record = read_precision_record(tmp_path / "run")
    assert record == {"precision": first.precision, "rule": "probe", "reason": first.reason}

    def no_timing(*args, **kwargs):
        raise AssertionError("the run folder's record is repeated, not timed again")

    monkeypatch.setattr(train, "probe_bf16_speedup", no_timing)
    again = train.decide_precision(config, place, 4, StartPoint("scratch", None))
    assert (again.precision, again.rule) == (first.precision, "run-record")
    assert str(tmp_path / "run" / PRECISION_RECORD) in again.reason
    (tmp_path / "run" / PRECISION_RECORD).write_text("{not json")
    with pytest.raises(ValueError, match="precision.json is damaged.*delete it"):
        train.decide_precision(config, place, 4, StartPoint("scratch", None))


def test_probe_times_both_precisions_and_draws_no_random_numbers():
    config = load_config("local_demo", ["data.micro_batch_size=2"])
    before = torch.get_rng_state()

    def build():
        return build_task(config, build_model(config.model.name, **model_overrides(config, 4)))

    fp32, bf16 = probe_bf16_speedup(build, batch=2, image_size=config.data.image_size, repeats=1)
    assert fp32 > 0 and bf16 > 0
    assert torch.equal(torch.get_rng_state(), before)  # the run's initialisation and data are untouched


@pytest.mark.parametrize("value", ["fp16", "half"])
def test_unknown_precision_is_rejected_at_load(value):
    with pytest.raises(ValueError, match="deepspeed.precision"):
        load_config("local_demo", [f"deepspeed.precision={value}"])


def test_bench_precision_times_shapes_and_checks_the_rule(tmp_path):
    from bench.precision import main

    out = tmp_path / "precision.json"
    assert main(["--shapes", "quick", "--trials", "1", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["rule_vit_tiny_debug_32px_b32"] == "fp32" and result["speedup_vit_tiny_debug_32px_b32"] > 0
    assert result["bf16_units"] == ("+".join(cpu_bf16_units()) or "none")
    with pytest.raises(SystemExit) as bad:  # argparse's error: usage, one line, exit 2
        main(["--trials", "0", "--out", str(out)])
    assert bad.value.code == 2


def test_zero_stage_0_has_no_bf16_with_master_weights():
    """DeepSpeed 0.19 refuses bf16 with fp32 gradient accumulation without ZeRO: a recipe asking for it is refused at
    load, and auto picks fp32 there, saying why."""
    with pytest.raises(ValueError, match="bf16 needs deepspeed.zero_stage >= 1"):
        load_config("local_demo", ["deepspeed.precision=bf16", "deepspeed.zero_stage=0"]).validate(2)
    choice = decide("auto", "cuda", zero_stage=0)
    assert choice.precision == "fp32" and "ZeRO-0" in choice.reason
    assert decide("auto", "cuda", zero_stage=1).precision == "bf16"
