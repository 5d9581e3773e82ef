"""What a weights source is: the one rule that loading, export and evals share (no torch here).

A source is an official `.npz`, a checkpoint, a run folder or its `checkpoints/` (the newest COMPLETE checkpoint),
a `save_pretrained` or HF folder, or one file of such a folder. A checkpoint is used only COMPLETE and intact.
"""

from __future__ import annotations

from pathlib import Path

from pretrain.checkpoint import checksums, run_folder
from pretrain.checkpoint.run_folder import CHECKPOINTS, CONFIG_FILE, WEIGHTS_FILE

HF_CONFIG = "config.json"  # transformers' config file, beside its model.safetensors
FOLDER_FILES = (WEIGHTS_FILE, CONFIG_FILE, HF_CONFIG)  # a path to one of these stands for its folder


class DamagedCheckpointError(ValueError):
    """A COMPLETE checkpoint whose weights no longer match the checksums written at save."""


def resolve(source: str | Path) -> Path:
    """The file or folder whose weights ``source`` names; FileNotFoundError for a run without a COMPLETE
    checkpoint, DamagedCheckpointError for failed checksums. Anything else is for the loader to judge."""
    path = Path(source)
    if path.is_file() and path.name in FOLDER_FILES:
        path = path.parent
    run = path.parent if path.name == CHECKPOINTS else path
    if path.is_dir() and not run_folder.looks_like_checkpoint(path) and (run / CHECKPOINTS).is_dir():
        latest = run_folder.latest_checkpoint(run)
        if latest is None:
            raise FileNotFoundError(
                f"{source} is a run folder without a COMPLETE checkpoint; wait for its first save, or pass a "
                "checkpoint folder (<run>/checkpoints/step_XXXXXXXX)"
            )
        path = latest
    if run_folder.is_complete(path):
        verdict = checksums.verify(path, only=checksums.WEIGHT_FILES)
        if not verdict.ok:
            raise DamagedCheckpointError(
                f"checkpoint {path} is damaged: {verdict.problem}; use an intact one (`python -m pretrain.checkpoint "
                "verify <run folder>` lists them)"
            )
    return path
