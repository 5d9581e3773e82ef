"""DeepSpeed's own tools read vitscale checkpoints: real 2-process runs at ZeRO 1, 2 and 3, in fp32 and bf16.

`deepspeed.utils.zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(<checkpoint>/deepspeed)` — the plain call,
the tag read from the ``latest`` file vitscale writes — and the ``zero_to_fp32.py`` script DeepSpeed copies into
``deepspeed/`` (that module's copy, run on its own at ZeRO-3 in each precision) give exactly the tensors of the
checkpoint's ``model.safetensors`` (under the names of the task module the engine wraps: ``model.`` + the ViT's). The
one exception is DeepSpeed's: at ZeRO-1 in bf16, vitscale's fp32 gradient accumulation makes DeepSpeed train with its
BF16_Optimizer, whose state zero_to_fp32 does not read ("not a zero checkpoint"); DeepSpeed's universal-checkpoint
converter does, and gives the same tensors (docs/contracts.md, "Checkpoints"). The same runs' folders export to
transformers with vitscale's logits.

The runs are the ones other tests train (once per pytest run, read only here): fp32 the 8-step reference runs of
tests/pretrain/test_train_distributed.py (accumulation 2, checkpoint at step 8), bf16 the runs of
tests/pretrain/test_checkpoint_master_weights.py (accumulation 1, stopped after the step-2 checkpoint).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from data_pipeline.manifest import read_dataset_info
from pretrain.checkpoint.run_folder import DEEPSPEED_DIR, WEIGHTS_FILE, TrainerState
from pretrain.weights.__main__ import main
from pretrain.weights.formats import load_checkpoint_model
from tests.pretrain.test_checkpoint_master_weights import bf16_run
from tests.pretrain.test_train_distributed import reference_run

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

TASK_PREFIX = "model."  # the engine wraps the ViT in a task module (pretrain.model.tasks): DeepSpeed's names carry this
# What the recipe's task (classification_mpp) trains and keeps beside the ViT: the [mask] embedding, the colour head,
# the count of its calls. Not the ViT's: model.safetensors leaves them out.
TASK_OWN = {"mask_token", "head.weight", "head.bias", "draws"}


def _bare(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    own = {k for k in weights if not k.startswith(TASK_PREFIX)}
    assert TASK_OWN - {"draws"} <= own <= TASK_OWN, sorted(own)  # the universal converter writes parameters only
    return {k.removeprefix(TASK_PREFIX): v for k, v in weights.items() if k.startswith(TASK_PREFIX)}


def _assert_same(theirs: dict[str, torch.Tensor], saved: dict[str, torch.Tensor]) -> None:
    assert theirs.keys() == saved.keys()
    for name, tensor in saved.items():
        assert theirs[name].dtype == torch.float32 == tensor.dtype, name
        assert torch.equal(theirs[name], tensor), (name, (theirs[name] - tensor).abs().max())


def _run(*cmd: str, cwd: Path, home: Path) -> None:
    """A command of DeepSpeed's in its own process, as a user runs it (nothing of vitscale on the path)."""
    env = {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "HOME": str(home)}
    proc = subprocess.run([sys.executable, *cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def _universal_fp32(engine_dir: Path, tag: str, out: Path) -> dict[str, torch.Tensor]:
    """DeepSpeed's universal-checkpoint converter, as its command line runs it: ``zero/<name>/fp32.pt`` per param."""
    _run(
        "-m",
        "deepspeed.checkpoint.ds_to_universal",
        "--input_folder",
        str(engine_dir / tag),
        "--output_folder",
        str(out),
        "--num_extract_workers",
        "1",
        "--num_merge_workers",
        "1",
        "--inject_missing_state",
        cwd=out.parent,
        home=out.parent,
    )
    files = sorted((out / "zero").glob("*/fp32.pt"))
    return {f.parent.name: torch.load(f, map_location="cpu", weights_only=True)["param"] for f in files}


def _hf_logits_match(run_dir: Path, checkpoint: Path, out: Path, shards: Path) -> None:
    """The run folder exports (its newest checkpoint) to a folder transformers loads with our logits, its classes
    named as the training data names them."""
    transformers = pytest.importorskip("transformers")
    assert main(["export", str(run_dir), str(out), "--format", "hf"]) == 0
    labels = json.loads((out / "config.json").read_text())["id2label"]
    assert [labels[str(i)] for i in range(len(labels))] == list(read_dataset_info(shards).class_names)
    hf = transformers.ViTForImageClassification.from_pretrained(out).eval()
    ours = load_checkpoint_model(checkpoint).eval()
    side = ours.config.image_size
    images = torch.rand(3, 3, side, side, generator=torch.Generator().manual_seed(0)) * 2 - 1
    with torch.no_grad():
        expected, got = ours(images), hf(pixel_values=images).logits
    assert (got - expected).abs().max() <= 1e-4 * expected.abs().max()


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_deepspeeds_zero_to_fp32_gives_the_checkpoints_weights(
    stage, precision, tiny_fractal_shards, tmp_path, one_torch_thread, shared_folder
):
    from deepspeed.utils import zero_to_fp32
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    shared_run = reference_run if precision == "fp32" else bf16_run
    run, summaries = shared_run(shared_folder, tiny_fractal_shards, stage)
    checkpoint = Path(summaries[0]["checkpoints"][-1])
    state = TrainerState.read(checkpoint)
    assert checkpoint.name == {"fp32": "step_00000008", "bf16": "step_00000002"}[precision]
    assert state.precision == precision
    engine_dir = checkpoint / DEEPSPEED_DIR
    # What DeepSpeed's tools look for: the tag in `latest`, its folder beside it, and the recovery script.
    assert (engine_dir / "latest").read_text().strip() == state.deepspeed_tag
    assert (engine_dir / state.deepspeed_tag).is_dir() and (engine_dir / "zero_to_fp32.py").is_file()
    saved = load_file(str(checkpoint / WEIGHTS_FILE))
    if stage == 1 and precision == "bf16":
        with pytest.raises(ValueError, match="is not a zero checkpoint"):  # DeepSpeed's BF16_Optimizer state
            get_fp32_state_dict_from_zero_checkpoint(str(engine_dir))
        _assert_same(_bare(_universal_fp32(engine_dir, state.deepspeed_tag, tmp_path / "universal")), saved)
    else:
        _assert_same(_bare(get_fp32_state_dict_from_zero_checkpoint(str(engine_dir))), saved)
    assert (engine_dir / "zero_to_fp32.py").read_bytes() == Path(zero_to_fp32.__file__).read_bytes()
    if stage == 3:  # the module above, as a script: once per precision shows that it runs on its own
        # The script DeepSpeed wrote into the checkpoint, run as its header says, from inside the folder.
        _run("zero_to_fp32.py", ".", str(tmp_path / "fp32"), "--safe_serialization", cwd=engine_dir, home=tmp_path)
        _assert_same(_bare(load_file(str(tmp_path / "fp32" / WEIGHTS_FILE))), saved)
    _hf_logits_match(run, checkpoint, tmp_path / "hf", tiny_fractal_shards)
