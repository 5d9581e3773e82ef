"""Whether the engine a recipe builds can load a checkpoint: the settings a resume must keep, checked before any rank
starts DeepSpeed, which would fail mid-load (docs/contracts.md, "Checkpoints")."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import yaml

from pretrain.checkpoint import run_folder
from pretrain.checkpoint.run_folder import CONFIG_YAML
from pretrain.config.train_config import TrainConfig, check_model
from pretrain.model.vit import ViTConfig
from pretrain.weights.formats import architecture_differences, recorded_config

NEW_RUN = "set another checkpoint.dir to train a new run"
DROP_RESUME_FROM = "drop checkpoint.resume_from"


def saved_setting(folder: Path, section: str, key: str) -> Any:
    """The checkpoint's recipe setting ``section.key``, or None if unreadable."""
    try:
        return yaml.safe_load((folder / CONFIG_YAML).read_text())[section][key]
    except (OSError, yaml.YAMLError, KeyError, TypeError):
        return None


def check_resumable(config: TrainConfig, folder: Path, named: str, fix: str) -> None:
    """ValueError if the engine the recipe builds cannot load the checkpoint a resume would load: another model, a
    ZeRO stage whose files another stage cannot read, another precision. DeepSpeed would fail mid-load."""
    _check_same_model(config, folder, named, fix)
    _check_zero_stage(config, folder, named, fix)
    _check_precision(config, folder, named, fix)


def _check_same_model(config: TrainConfig, folder: Path, named: str, fix: str) -> None:
    """ValueError if the checkpoint a resume would load holds another architecture than the recipe's model: its
    engine state cannot load (DeepSpeed's size mismatches). An unreadable ``model.json`` is left to the start."""
    saved = recorded_config(folder)
    if saved is None:
        return
    differ = architecture_differences(saved, check_model(config))
    if differ:
        raise ValueError(
            f"{named} holds another model than model.name={config.model.name} builds ({'; '.join(differ)}): a "
            f"resume cannot load it; set the model back to the checkpoint's ({_model_settings(config, folder, saved)}"
            f"), or {fix}"
        )


def _model_settings(config: TrainConfig, folder: Path, saved: ViTConfig) -> str:
    """The recipe settings that build the checkpoint's ``saved`` architecture again (``model.pool=token``), else
    "its architecture"."""
    sets: dict[str, Any] = {}
    name = saved_setting(folder, "model", "name")
    if isinstance(name, str) and name != config.model.name:
        sets["model.name"] = name
    model = dataclasses.replace(config.model, name=sets.get("model.name", config.model.name))
    try:
        want = check_model(dataclasses.replace(config, model=model))
    except ValueError:  # a saved model.name this version lacks
        return f"model.name={sets['model.name']}" if sets else "its architecture"
    if want.pool != saved.pool:
        sets["model.pool"] = saved.pool
        want = dataclasses.replace(want, pool=saved.pool)
    if not sets or architecture_differences(saved, want):
        return "its architecture"
    return ", ".join(f"{key}={value}" for key, value in sets.items())


# ZeRO stages whose engine files each other's engine loads: 1 and 2 write the same partitioned optimizer state
_STAGES_THAT_LOAD_EACH_OTHER = ({1, 2},)


def _check_zero_stage(config: TrainConfig, folder: Path, named: str, fix: str) -> None:
    """ValueError if the checkpoint was saved at a ZeRO stage whose engine files the recipe's stage cannot read
    (0 or 3 on either side: DeepSpeed fails mid-load); 1 <-> 2 loads."""
    saved, now = saved_setting(folder, "deepspeed", "zero_stage"), config.deepspeed.zero_stage
    if not isinstance(saved, int) or saved == now or any({saved, now} <= s for s in _STAGES_THAT_LOAD_EACH_OTHER):
        return
    raise ValueError(
        f"{named} was saved at deepspeed.zero_stage={saved}, whose engine state ZeRO-{now} cannot load; set "
        f"deepspeed.zero_stage={saved} to resume it, or {fix}"
    )


def _check_precision(config: TrainConfig, folder: Path, named: str, fix: str) -> None:
    """ValueError if the recipe asks for another precision than the checkpoint trained in: DeepSpeed's fp32 and bf16
    engines write different files (``auto`` and ``probe`` keep the checkpoint's)."""
    requested, kept = config.deepspeed.precision, _saved_precision(folder)
    if requested not in ("fp32", "bf16") or kept not in ("fp32", "bf16") or requested == kept:
        return
    raise ValueError(
        f"{named} was trained in {kept}, and a {requested} engine cannot load its state; set "
        f"deepspeed.precision={kept} (or auto) to resume it, or {fix}"
    )


def _saved_precision(folder: Path) -> Any:
    """The precision the checkpoint trained in: its trainer state's, else its recipe's fp32 or bf16 (a checkpoint
    written before trainer states recorded it); None if unknown."""
    try:
        kept = json.loads((folder / run_folder.TRAINER_STATE).read_text()).get("precision")
    except (OSError, ValueError, AttributeError):
        kept = None
    return kept if kept is not None else saved_setting(folder, "deepspeed", "precision")
