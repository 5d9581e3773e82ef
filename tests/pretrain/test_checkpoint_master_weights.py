"""A bf16 run's consolidated ``model.safetensors`` holds the fp32 master weights the optimizer trains, not the bf16
compute copy: at ZeRO 1, 2 and 3 (2 processes) every tensor is fp32 and equals DeepSpeed's own consolidation of the
same checkpoint's engine state, and the checkpoint loads as a model. The bf16 runs (`bf16_run`) are trained once per
pytest run: tests/pretrain/test_deepspeed_interop.py reads the same checkpoints with DeepSpeed's own tools."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pretrain.checkpoint.run_folder import DEEPSPEED_DIR, WEIGHTS_FILE, TrainerState
from pretrain.checkpointer import _to_universal
from pretrain.weights.formats import load_checkpoint_model
from tests.pretrain.test_train_distributed import shared_torchrun

pytestmark = [pytest.mark.slow]

# The engine wraps the bare ViT in a task module (pretrain.model.tasks): its names gain this prefix.
TASK_PREFIX = "model."


def bf16_run(shared_folder, shards: Path, stage: int) -> tuple[Path, list[dict]]:
    """A 2-process bf16 run at ZeRO ``stage`` stopped after step 2 (its checkpoint), accumulation 1: its run folder
    and rank summaries, shared with tests/pretrain/test_deepspeed_interop.py (read only)."""
    overrides = (
        f"deepspeed.zero_stage={stage}",
        "deepspeed.precision=bf16",
        "data.global_batch_size=8",
        "schedule.stop_at_step=2",
    )
    return shared_torchrun(shared_folder, shards, *overrides)


def deepspeed_fp32_weights(checkpoint: Path, stage: int, scratch: Path) -> dict[str, torch.Tensor]:
    """DeepSpeed's consolidation of the checkpoint's fp32 master weights, by the bare model's names: ``zero_to_fp32``;
    at ZeRO-1 in bf16 (DeepSpeed's BF16_Optimizer, whose files zero_to_fp32 refuses as "not a zero checkpoint") its
    universal checkpoint converter, which writes each parameter's fp32 weights to ``zero/<name>/fp32.pt``."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    tag = TrainerState.read(checkpoint).deepspeed_tag
    if stage == 1:
        _to_universal(checkpoint / DEEPSPEED_DIR / tag, scratch)
        files = (scratch / "zero").glob("*/fp32.pt")
        weights = {f.parent.name: torch.load(f, map_location="cpu", weights_only=True)["param"] for f in files}
    else:
        weights = get_fp32_state_dict_from_zero_checkpoint(str(checkpoint / DEEPSPEED_DIR), tag=tag)
    return {k.removeprefix(TASK_PREFIX): v for k, v in weights.items() if k.startswith(TASK_PREFIX)}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_bf16_checkpoint_holds_the_fp32_master_weights(
    stage, tiny_fractal_shards, tmp_path, one_torch_thread, shared_folder
):
    checkpoint = Path(bf16_run(shared_folder, tiny_fractal_shards, stage)[1][0]["checkpoints"][-1])
    assert checkpoint.name == "step_00000002" and TrainerState.read(checkpoint).precision == "bf16"
    saved = load_file(str(checkpoint / WEIGHTS_FILE))
    expected = deepspeed_fp32_weights(checkpoint, stage, tmp_path / "universal")
    assert saved.keys() == expected.keys()
    for name, tensor in saved.items():
        assert tensor.dtype == torch.float32, (name, tensor.dtype)
        assert torch.equal(tensor, expected[name]), (name, (tensor - expected[name]).abs().max())
    # The masters hold bits a bf16 copy cannot: the file is not the compute copy cast up.
    assert any(not torch.equal(t, t.bfloat16().float()) for t in saved.values())
    model = load_checkpoint_model(checkpoint)  # what evals and init_from read
    assert model(torch.zeros(1, 3, 32, 32)).shape == (1, 4)
