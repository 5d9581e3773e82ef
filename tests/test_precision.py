"""`deepspeed.precision: auto` (pretrain.precision): bf16 on CUDA; on a CPU only with native bf16 units and a probe
step that is faster in bf16; fp32 otherwise, with one line saying why. The same decision on every rank."""

import pytest
import torch

from pretrain.config import load_config, model_overrides
from pretrain.ds_config import batch_plan, deepspeed_config, resolve_precision
from pretrain.model import build_model
from pretrain.precision import cpu_bf16_units, cpu_flags, decide, decide_on_rank0, probe_bf16_speedup
from pretrain.tasks import build_task

AVX2_ONLY = {"fpu", "sse2", "avx", "avx2", "fma"}
SAPPHIRE_RAPIDS = AVX2_ONLY | {"avx512f", "avx512_bf16", "amx_tile", "amx_bf16"}


def test_flags_are_read_from_cpuinfo(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: X\nflags\t\t: fpu avx2 avx512_bf16 amx_bf16\n\nprocessor\t: 1\n")
    assert cpu_flags(info) == {"fpu", "avx2", "avx512_bf16", "amx_bf16"}
    assert cpu_flags(tmp_path / "absent") is None
    assert cpu_bf16_units(cpu_flags(info)) == ("amx_bf16", "avx512_bf16")
    assert cpu_bf16_units(AVX2_ONLY) == ()


def test_cpu_without_bf16_units_falls_back_to_fp32_without_probing():
    def probe():
        raise AssertionError("no probe on a CPU that would emulate bf16")

    choice = decide("auto", "cpu", probe, flags=AVX2_ONLY)
    assert choice.precision == "fp32"
    assert choice.line("auto").startswith("precision auto -> fp32: this CPU")
    assert "no AMX/AVX512-BF16; bf16 matmul would be emulated" in choice.reason


def test_cpu_with_bf16_units_follows_the_probe():
    faster = decide("auto", "cpu", lambda: (0.30, 0.15), flags=SAPPHIRE_RAPIDS)
    assert faster.precision == "bf16" and "amx_bf16+avx512_bf16" in faster.reason and "2.00x" in faster.reason
    slower = decide("auto", "cpu", lambda: (0.10, 0.20), flags=SAPPHIRE_RAPIDS)  # a tiny model: casts dominate
    assert slower.precision == "fp32" and "0.50x" in slower.reason
    even = decide("auto", "cpu", lambda: (0.100, 0.098), flags=SAPPHIRE_RAPIDS)  # within noise: fp32, exact
    assert even.precision == "fp32"
    # Without a probe (the plan has no model to time) the answer is fp32 and says what the run will do.
    assert "probe step" in decide("auto", "cpu", None, flags=SAPPHIRE_RAPIDS).reason


def test_a_resumed_auto_run_keeps_its_checkpoints_precision_without_probing():
    def probe():
        raise AssertionError("a resumed run does not probe again")

    for kept in ("fp32", "bf16"):
        choice = decide("auto", "cpu", probe, flags=SAPPHIRE_RAPIDS, resumed=(kept, "step_00000300"))
        assert choice.precision == kept
        assert choice.line("auto") == (f"precision auto -> {kept}: kept from step_00000300, which trained in {kept} "
                                       "(auto decides once per run, when it begins)")  # fmt: skip
    # An explicit setting is the recipe's (a change of it is warned about as a changed setting); CUDA auto keeps too.
    assert decide("fp32", "cpu", resumed=("bf16", "step_00000300")).precision == "fp32"
    assert decide("auto", "cuda", resumed=("fp32", "step_00000300")).precision == "fp32"


def test_cuda_and_explicit_settings():
    assert decide("auto", "cuda").precision == "bf16"
    assert decide("fp32", "cuda").precision == "fp32" and decide("bf16", "cpu").precision == "bf16"
    assert decide("bf16", "cpu").reason == "set in the recipe"


def test_this_machine_decides_from_its_own_flags():
    """What `make launch` prints here: the line names this CPU's kernel level when it has no bf16 units."""
    choice = decide("auto", "cpu", lambda: (1.0, 0.5))
    if cpu_bf16_units():
        assert choice.precision == "bf16"
    else:
        assert choice.precision == "fp32"
        assert f"this CPU ({torch.backends.cpu.get_cpu_capability()}) has no AMX/AVX512-BF16" in choice.reason
    assert decide_on_rank0(lambda: choice) == choice  # no process group: decided here


def test_deepspeed_config_takes_the_decided_precision():
    config = load_config("local_demo")
    plan = batch_plan(config.data, 2)
    assert resolve_precision(config.deepspeed, "cuda") == "bf16"
    assert resolve_precision(config.deepspeed, "cpu") == "fp32"  # without a probe
    probed = deepspeed_config(config.deepspeed, config.optim, plan, "cpu", precision="bf16")
    assert probed["bf16"]["enabled"] is True and probed["data_types"]["grad_accum_dtype"] == "fp32"


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
