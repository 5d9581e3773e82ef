"""pretrain.checkpoint.safe_load: a damaged engine file is one clear ValueError from both guarded loads."""

from __future__ import annotations

import pytest
import torch

from pretrain.checkpoint.safe_load import check_weights_only, load_weights_only


def _cut(tmp_path, name: str, elements: int):
    """An engine file cut in half, as a copy or save interrupted leaves it."""
    whole = tmp_path / f"whole_{name}"
    torch.save({"module": {"w": torch.arange(elements, dtype=torch.float32)}}, whole)
    cut = tmp_path / "deepspeed" / name
    cut.parent.mkdir(exist_ok=True)
    cut.write_bytes(whole.read_bytes()[: whole.stat().st_size // 2])
    return cut


# torch's zip reader fails a cut file over 64 KiB with RuntimeError, a smaller one (a ZeRO-3 model-states file
# holds no weights) with OSError [Errno 22]
@pytest.mark.parametrize("elements", [10_000, 100_000])
def test_a_cut_engine_file_is_one_clear_error_from_both_loads(tmp_path, elements):
    import types

    cut = _cut(tmp_path, "mp_rank_00_model_states.pt", elements)
    engine = types.SimpleNamespace()
    load_weights_only(engine)
    with pytest.raises(ValueError, match=r"mp_rank_00_model_states.pt cannot be loaded \(.*\): resume from another"):
        engine.load(str(cut))
    with pytest.raises(ValueError, match=r"mp_rank_00_model_states.pt cannot be loaded \(.*\): resume from another"):
        check_weights_only(cut.parent)  # before the universal-checkpoint converter reads the files
