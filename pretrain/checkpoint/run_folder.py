"""Where a run keeps its checkpoints and what makes one usable. Torch-free.

    <run>/checkpoints/step_XXXXXXXX/     the step, zero-padded to 8 digits
      deepspeed/  model.safetensors  model.json  trainer_state.json  config.yaml  checksums.json  evals/  PINNED
      COMPLETE

A save writes ``step_XXXXXXXX.tmp/``, renames it, then marks it ``COMPLETE`` (`publish`); nothing reads a folder
without the marker. ``PINNED`` keeps it from pruning; a save that evals wait on writes it before the rename. Also:
`TrainerState`, the world-size history, the `probe` precision record (docs/contracts.md, "Checkpoints").
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CHECKPOINTS = "checkpoints"
COMPLETE = "COMPLETE"
PINNED = "PINNED"  # written by the save before COMPLETE, cleared by the eval scheduler or task (maybe on another node)
TRAINER_STATE = "trainer_state.json"
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "model.json"  # the ViTConfig
CONFIG_YAML = "config.yaml"  # the resolved TrainConfig
DEEPSPEED_DIR = "deepspeed"
CHECKSUMS = "checksums.json"  # pretrain.checkpoint.checksums
STAGING_SUFFIX = ".tmp"
_STEP_NAME = re.compile(r"step_(\d+)")


def step_name(step: int) -> str:
    return f"step_{step:08d}"


def parse_step(name: str) -> int | None:
    """``step_00000120`` → 120; None for any other name (``.tmp`` included)."""
    match = _STEP_NAME.fullmatch(name)
    return int(match.group(1)) if match else None


def checkpoints_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / CHECKPOINTS


def checkpoint_dir(run_dir: str | Path, step: int) -> Path:
    return checkpoints_dir(run_dir) / step_name(step)


def is_complete(folder: str | Path) -> bool:
    return (Path(folder) / COMPLETE).is_file()


def _complete_in(root: Path) -> list[Path]:
    """Oldest first."""
    if not root.is_dir():
        return []
    found = [(s, p) for p in root.iterdir() if (s := parse_step(p.name)) is not None and p.is_dir() and is_complete(p)]
    return [path for _, path in sorted(found)]


def complete_checkpoints(run_dir: str | Path) -> list[Path]:
    """Oldest first."""
    return _complete_in(checkpoints_dir(run_dir))


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest COMPLETE checkpoint, or None."""
    found = complete_checkpoints(run_dir)
    return found[-1] if found else None


class IncompleteCheckpointError(ValueError):
    """A checkpoint folder without COMPLETE: its files may be half written."""

    def __init__(self, folder: str | Path, setting: str | None = None):
        folder = Path(folder)
        newest = _complete_in(folder.parent)
        fix = f"the newest complete one beside it is {newest[-1]}" if newest else "none beside it is complete"
        missing = not folder.exists()
        super().__init__(
            f"{f'{setting}={folder}' if setting else f'checkpoint folder {folder}'} has no {COMPLETE} marker"
            + (" (the folder does not exist)" if missing else ": its save was interrupted or is still running")
            + f"; use a finished checkpoint, a <run>/{CHECKPOINTS}/step_XXXXXXXX folder that holds {COMPLETE} ({fix})"
        )


def require_complete(folder: str | Path, setting: str | None = None) -> Path:
    """``folder`` if COMPLETE, else IncompleteCheckpointError (``setting``: the recipe field that named it)."""
    if not is_complete(folder):
        raise IncompleteCheckpointError(folder, setting)
    return Path(folder)


def write_durably(path: Path, text: str) -> None:
    """Write and fsync."""
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def staging_dir(run_dir: str | Path, step: int) -> Path:
    """``step_XXXXXXXX.tmp``, where a save writes before `publish`."""
    return checkpoints_dir(run_dir) / f"{step_name(step)}{STAGING_SUFFIX}"


def start_staging(staging: Path) -> None:
    """Create the staging folder, removing crashed saves' ones and the unmarked folders that a kill during `publish`
    or `prune_checkpoints` left (a save of their step would replace them, but an old step's is never saved again)."""
    if staging.parent.is_dir():
        for stale in staging.parent.iterdir():
            unmarked = parse_step(stale.name) is not None and stale.is_dir() and not is_complete(stale)
            if unmarked or (stale.name.endswith(STAGING_SUFFIX) and stale.name.startswith("step_")):
                shutil.rmtree(stale, ignore_errors=True)
    staging.mkdir(parents=True)


def publish(staging: Path) -> Path:
    """Rename a written staging folder to its final name and mark it COMPLETE."""
    final = staging.with_name(staging.name.removesuffix(STAGING_SUFFIX))
    step = parse_step(final.name)
    if step is None or final == staging:
        raise ValueError(f"{staging} is not a staging folder (step_XXXXXXXX{STAGING_SUFFIX})")
    if final.exists():  # the same step saved again (e.g. after a crash)
        _delete(final)
    os.replace(staging, final)
    write_durably(final / COMPLETE, f"{step}\n")
    return final


def _delete(folder: Path, ignore_errors: bool = False) -> None:
    """Unmarked first: an interrupted delete leaves a folder nothing reads."""
    (folder / COMPLETE).unlink(missing_ok=True)
    shutil.rmtree(folder, ignore_errors=ignore_errors)


@dataclass(frozen=True)
class TrainerState:
    """``trainer_state.json``, keys in field order. ``stream_state``: the stream's global position (any world size);
    ``rng_states[r]``: rank r's RNG states; ``deepspeed_tag``: the engine state under ``deepspeed/``; ``saved_at``:
    Unix time; ``precision``: "fp32" | "bf16" | None (unrecorded), kept on resume."""

    step: int
    images_seen: int
    world_size: int
    deepspeed_tag: str
    stream_state: dict[str, Any]
    rng_states: tuple[dict[str, Any], ...]
    metrics: dict[str, float] = field(default_factory=dict)
    saved_at: float | None = None
    precision: str | None = None

    def to_json(self) -> str:
        # not dataclasses.asdict: it deep-copies every rank's state
        return json.dumps({f.name: getattr(self, f.name) for f in dataclasses.fields(self)})

    @classmethod
    def from_json(cls, text: str, source: str | Path = TRAINER_STATE) -> TrainerState:
        try:
            data = json.loads(text)
            if not isinstance(data, dict):
                raise ValueError(f"it holds a JSON {type(data).__name__}, not an object")
            old = "stream_states" in data  # per-rank positions
            if not old:
                data["rng_states"] = tuple(data["rng_states"])
                return cls(**data)
        except (ValueError, KeyError, TypeError) as error:  # JSONDecodeError included
            raise ValueError(
                f"{source} is not a trainer state written by pretrain.checkpointer ({type(error).__name__}: {error}); "
                "the checkpoint is damaged: resume from another one"
            ) from None
        raise ValueError(
            f"{source} holds per-rank stream positions: the checkpoint was written before the world-size-invariant "
            "data order (docs/elastic.md); resume it with the vitscale version that wrote it, or start a new run"
        )

    @classmethod
    def read(cls, folder: str | Path) -> TrainerState:
        """IncompleteCheckpointError unless COMPLETE."""
        path = require_complete(folder) / TRAINER_STATE
        return cls.from_json(path.read_text(), path)

    def write(self, folder: Path) -> None:
        write_durably(folder / TRAINER_STATE, self.to_json())


def looks_like_checkpoint(path: str | Path) -> bool:
    """Whether ``path`` is a training checkpoint, not exported weights: it holds COMPLETE or a trainer state, or is
    a ``step_N`` folder without weights."""
    path = Path(path)
    if not path.is_dir():
        return False
    if (path / COMPLETE).exists() or (path / TRAINER_STATE).exists():
        return True
    return parse_step(path.name) is not None and not (path / WEIGHTS_FILE).exists()


@dataclass(frozen=True)
class OpenCheckpoint:
    """A COMPLETE training checkpoint opened for evals."""

    path: Path
    step: int | None  # from trainer_state.json, if any

    @property
    def weights(self) -> Path:
        return self.path / WEIGHTS_FILE


def open_checkpoint(folder: str | Path) -> OpenCheckpoint:
    """ValueError naming the file when its trainer state records no step."""
    folder = require_complete(folder)
    path = folder / TRAINER_STATE
    if not path.is_file():
        return OpenCheckpoint(folder, None)
    try:
        # only the step: evals must not depend on resume-only fields
        step = json.loads(path.read_text())["step"]
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step={step!r} is not an integer >= 0")
    except (ValueError, KeyError, TypeError) as error:  # JSONDecodeError included
        raise ValueError(f"{path} does not record the checkpoint's step ({error}); pass the step explicitly") from None
    return OpenCheckpoint(folder, step)


def pin_checkpoint(folder: str | Path, reason: str) -> bool:
    """Keep ``folder`` from pruning until `unpin_checkpoint`; False if it is gone."""
    try:
        (Path(folder) / PINNED).write_text(f"{reason}\n")
    except FileNotFoundError:  # already pruned
        return False
    return True


def unpin_checkpoint(folder: str | Path) -> None:
    (Path(folder) / PINNED).unlink(missing_ok=True)


def is_pinned(folder: str | Path) -> bool:
    return (Path(folder) / PINNED).is_file()


def pinned_checkpoints(run_dir: str | Path) -> list[Path]:
    """The run's pinned checkpoints, oldest first: a pin a job left behind marks evals that never ended."""
    root = checkpoints_dir(run_dir)
    return sorted(p.parent for p in root.glob(f"step_*/{PINNED}")) if root.is_dir() else []


WORLD_SIZES = "world_sizes.jsonl"  # one line per (re)start of training


def record_world_size(run_dir: str | Path, step: int, world_size: int, accumulation: int) -> None:
    """Append this (re)start to ``world_sizes.jsonl``."""
    record = {"time": time.time(), "step": step, "world_size": world_size, "accumulation": accumulation}
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    with open(Path(run_dir) / WORLD_SIZES, "a") as f:
        f.write(json.dumps(record) + "\n")


def world_size_history(run_dir: str | Path) -> list[dict[str, Any]]:
    """`record_world_size`'s records, oldest first; a line cut short by a crash is skipped."""
    path = Path(run_dir) / WORLD_SIZES
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    return records


def resize_events(history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One per `world_size_history` record whose world size differs from the one before."""
    return [
        {"step": after.get("step"), "from": before["world_size"], "to": after["world_size"], "time": after.get("time")}
        for before, after in zip(history, history[1:])
        if after.get("world_size") != before.get("world_size")
    ]


def prune_checkpoints(run_dir: str | Path, keep_last: int, upto: int | None = None) -> list[Path]:
    """Delete unpinned COMPLETE checkpoints older than the newest ``keep_last``; returns them. ``upto``: the step a
    save just published; later ones (a damaged checkpoint the resume skipped) neither count nor go."""
    found = complete_checkpoints(run_dir)
    if upto is not None:
        found = [p for p in found if (parse_step(p.name) or 0) <= upto]
    deleted = []
    for old in found[:-keep_last]:
        if is_pinned(old):
            continue
        _delete(old, ignore_errors=True)
        deleted.append(old)
    return deleted


PRECISION_RECORD = "precision.json"  # a `precision: probe` run's decision, kept by later starts


def read_precision_record(run_dir: str | Path) -> dict[str, str] | None:
    """``{"precision", "rule", "reason"}`` of the run's first start, or None."""
    path = Path(run_dir) / PRECISION_RECORD
    if not path.exists():
        return None
    try:
        record = json.loads(path.read_text())
        return {key: str(record[key]) for key in ("precision", "rule", "reason")}
    except (ValueError, KeyError, TypeError) as error:
        raise ValueError(
            f"{path} is damaged ({type(error).__name__}: {error}); delete it to time the precision probe again, or "
            "set deepspeed.precision to fp32 or bf16"
        ) from None


def write_precision_record(run_dir: str | Path, precision: str, rule: str, reason: str) -> None:
    """Rank 0, at the run's first start."""
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    record = {"precision": precision, "rule": rule, "reason": reason, "decided_at": time.time()}
    write_durably(Path(run_dir) / PRECISION_RECORD, json.dumps(record) + "\n")


SAMPLE_KEYS_DIR = "sample_keys"  # <run>/sample_keys/rank<r>.jsonl (pretrain.telemetry.recorder)
BATCH_DIGESTS_DIR = "batch_digests"  # <run>/batch_digests/rank<r>.jsonl (pretrain.telemetry.recorder)
