"""The run folder's layout: the one module that knows where a run keeps its checkpoints and what makes one usable.

Torch-free (no torch, deepspeed or numpy), so config checks, evals, the cluster driver and tracking read it cheaply.
The layout (docs/design.md "The run folder"; docs/interfaces.md "Checkpoints"):

    <run>/checkpoints/step_XXXXXXXX/     the step, zero-padded to 8 digits
      deepspeed/  model.safetensors  model.json  trainer_state.json  config.yaml  checksums.json  evals/  PINNED
      COMPLETE

A checkpoint is written into ``step_XXXXXXXX.tmp/``, renamed, and only then marked ``COMPLETE``; nothing reads a
folder without the marker. ``checksums.json`` (written last before the rename) records each file's size and CRC-32
(`pretrain.checkpoint.checksums`), checked before a resume or an eval reads the files. ``PINNED`` keeps a checkpoint
through ``checkpoint.keep_last`` pruning while evals need it.

API (paths are used as given: a loaded TrainConfig's ``checkpoint.dir`` is already absolute, `TrainConfig.resolved`)
  names      CHECKPOINTS, COMPLETE, PINNED, TRAINER_STATE, WEIGHTS_FILE, CONFIG_FILE, CONFIG_YAML, DEEPSPEED_DIR,
             CHECKSUMS
             step_name(step) -> "step_00000120"; parse_step(name) -> int | None (None for ".tmp" and other names)
             checkpoints_dir(run_dir); checkpoint_dir(run_dir, step)
  listing    complete_checkpoints(run_dir) -> [Path] oldest first; latest_checkpoint(run_dir) -> Path | None
  complete   is_complete(folder); require_complete(folder, setting=None) -> folder, else
             IncompleteCheckpointError (a ValueError: the one "not a finished checkpoint" error, naming folder and fix)
  writing    staging_dir(run_dir, step) -> the ".tmp" folder; start_staging(staging) creates it (stale ones go);
             publish(staging) -> the COMPLETE folder (renamed, then marked); write_durably(path, text)
  state      TrainerState (frozen): .read(folder) (refuses an incomplete one), .write(folder), to_json / from_json
  evals      looks_like_checkpoint(path) -> bool; open_checkpoint(folder) -> OpenCheckpoint(path, step | None)
             with .weights (its model.safetensors)
  pins       pin_checkpoint(folder, reason) -> bool; unpin_checkpoint; is_pinned; release_pins(run_dir) -> [Path]
  pruning    prune_checkpoints(run_dir, keep_last) -> [Path deleted] (pinned ones are skipped)
  resizes    record_world_size(run_dir, step, world_size, accumulation); world_size_history(run_dir) -> [dict];
             resize_events(history) -> [dict]
  precision  read_precision_record(run_dir) -> dict | None; write_precision_record(run_dir, precision, rule, reason)
             (``<run>/precision.json``: a `precision: probe` run's decision, repeated by every later start)
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
# A pin is a plain file in the checkpoint folder: training rank 0 sets it, the eval scheduler or the eval task
# (other processes, maybe other nodes on shared storage) clears it; nothing but the filesystem is involved.
PINNED = "PINNED"
TRAINER_STATE = "trainer_state.json"
WEIGHTS_FILE = "model.safetensors"  # also the file name of any save_pretrained folder (pretrain.weights.formats)
CONFIG_FILE = "model.json"  # the ViTConfig beside the weights
CONFIG_YAML = "config.yaml"  # the resolved TrainConfig of the step
DEEPSPEED_DIR = "deepspeed"
CHECKSUMS = "checksums.json"  # each file's size and CRC-32 as its save wrote them (pretrain.checkpoint.checksums)
STAGING_SUFFIX = ".tmp"
_STEP_NAME = re.compile(r"step_(\d+)")


# --------------------------------------------------------------------------------------------- names


def step_name(step: int) -> str:
    return f"step_{step:08d}"


def parse_step(name: str) -> int | None:
    """The step of a checkpoint folder name (``step_00000120`` → 120); None for anything else (``.tmp`` included)."""
    match = _STEP_NAME.fullmatch(name)
    return int(match.group(1)) if match else None


def checkpoints_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / CHECKPOINTS


def checkpoint_dir(run_dir: str | Path, step: int) -> Path:
    return checkpoints_dir(run_dir) / step_name(step)


# --------------------------------------------------------------------------------------------- listing


def is_complete(folder: str | Path) -> bool:
    return (Path(folder) / COMPLETE).is_file()


def _complete_in(root: Path) -> list[Path]:
    """COMPLETE ``step_N`` folders directly under ``root``, oldest first."""
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        step = parse_step(path.name)
        if step is not None and path.is_dir() and is_complete(path):
            found.append((step, path))
    return [path for _, path in sorted(found)]


def complete_checkpoints(run_dir: str | Path) -> list[Path]:
    """COMPLETE checkpoint folders of a run, oldest first; ``.tmp`` and unmarked folders are ignored."""
    return _complete_in(checkpoints_dir(run_dir))


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest COMPLETE checkpoint of a run (``<run_dir>/checkpoints/step_*``), or None."""
    found = complete_checkpoints(run_dir)
    return found[-1] if found else None


class IncompleteCheckpointError(ValueError):
    """A folder used as a training checkpoint that has no COMPLETE marker: its save was interrupted, is still
    running, or it is no checkpoint at all. Its files may be half written, so nothing reads them."""

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
    """``folder`` if it holds COMPLETE, else IncompleteCheckpointError (``setting``: the recipe field that named it)."""
    if not is_complete(folder):
        raise IncompleteCheckpointError(folder, setting)
    return Path(folder)


# --------------------------------------------------------------------------------------------- writing


def write_durably(path: Path, text: str) -> None:
    """Write and fsync: a marker or state file must be on disk before anything that depends on it."""
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def staging_dir(run_dir: str | Path, step: int) -> Path:
    """Where step ``step`` is written before `publish`: ``step_XXXXXXXX.tmp`` beside the checkpoints."""
    return checkpoints_dir(run_dir) / f"{step_name(step)}{STAGING_SUFFIX}"


def start_staging(staging: Path) -> None:
    """Create the empty staging folder; partial writes of crashed runs (other ``.tmp`` folders) are removed."""
    for stale in staging.parent.glob(f"step_*{STAGING_SUFFIX}"):
        shutil.rmtree(stale, ignore_errors=True)
    staging.mkdir(parents=True)


def publish(staging: Path) -> Path:
    """Rename a fully written staging folder to its final name, then mark it COMPLETE; returns the final folder."""
    final = staging.with_name(staging.name.removesuffix(STAGING_SUFFIX))
    step = parse_step(final.name)
    if step is None or final == staging:
        raise ValueError(f"{staging} is not a staging folder (step_XXXXXXXX{STAGING_SUFFIX})")
    if final.exists():  # the same step saved again (e.g. an unmarked folder of a crash): replace it whole
        shutil.rmtree(final)
    os.replace(staging, final)
    # The marker goes in after the rename, so no ".tmp" folder ever looks complete to any reader.
    write_durably(final / COMPLETE, f"{step}\n")
    return final


# --------------------------------------------------------------------------------------------- trainer state


@dataclass(frozen=True)
class TrainerState:
    """``trainer_state.json``: where training stood at a checkpoint. Field order is the file's key order.

    ``stream_state`` is the data stream's global position (every rank's ``TrainStream.state_dict`` joined by
    ``merge_stream_states``: the same at any world size, docs/elastic.md); ``rng_states[r]`` are rank r's global RNG
    states (``pretrain.checkpointer.rng_state``); ``world_size`` is the world size that wrote it; ``deepspeed_tag``
    names the engine state under ``deepspeed/``; ``metrics`` are the training metrics at the step; ``saved_at`` is a
    Unix time; ``precision`` is the precision the engine trained in ("fp32" | "bf16"; None in checkpoints written
    before it was recorded): a resumed ``precision: auto`` run keeps it (`pretrain.config.precision.decide`).
    """

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
        # Not dataclasses.asdict: it deep-copies every rank's state only to serialise it.
        return json.dumps({f.name: getattr(self, f.name) for f in dataclasses.fields(self)})

    @classmethod
    def from_json(cls, text: str, source: str | Path = TRAINER_STATE) -> TrainerState:
        try:
            data = json.loads(text)
            if not isinstance(data, dict):
                raise ValueError(f"it holds a JSON {type(data).__name__}, not an object")
            old = "stream_states" in data  # per-rank positions: before the streams were world-size-invariant
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
        """The state of a COMPLETE checkpoint; IncompleteCheckpointError for an unfinished folder."""
        path = require_complete(folder) / TRAINER_STATE
        return cls.from_json(path.read_text(), path)

    def write(self, folder: Path) -> None:
        write_durably(folder / TRAINER_STATE, self.to_json())


# --------------------------------------------------------------------------------------------- opening for evals


def looks_like_checkpoint(path: str | Path) -> bool:
    """Whether ``path`` is (meant to be) a training checkpoint folder rather than exported weights: it holds what only
    the trainer writes (COMPLETE, its state), or it is a ``step_N`` folder whose save has not reached the weights."""
    path = Path(path)
    if not path.is_dir():
        return False
    if (path / COMPLETE).exists() or (path / TRAINER_STATE).exists():
        return True
    return parse_step(path.name) is not None and not (path / WEIGHTS_FILE).exists()


@dataclass(frozen=True)
class OpenCheckpoint:
    """A COMPLETE training checkpoint opened for reading (what evals need)."""

    path: Path
    step: int | None  # from trainer_state.json; None when the folder has no trainer state

    @property
    def weights(self) -> Path:
        return self.path / WEIGHTS_FILE


def open_checkpoint(folder: str | Path) -> OpenCheckpoint:
    """A COMPLETE checkpoint and its step. IncompleteCheckpointError without COMPLETE; ValueError (naming the file)
    when ``trainer_state.json`` is there but records no step."""
    folder = require_complete(folder)
    path = folder / TRAINER_STATE
    if not path.is_file():
        return OpenCheckpoint(folder, None)
    try:
        # Only the step: evals must not depend on the resume-only fields (older or hand-made states lack them).
        step = json.loads(path.read_text())["step"]
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step={step!r} is not an integer >= 0")
    except (ValueError, KeyError, TypeError) as error:  # JSONDecodeError included
        raise ValueError(f"{path} does not record the checkpoint's step ({error}); pass the step explicitly") from None
    return OpenCheckpoint(folder, step)


# --------------------------------------------------------------------------------------------- pins and pruning


def pin_checkpoint(folder: str | Path, reason: str) -> bool:
    """Keep ``folder`` through `checkpoint.keep_last` pruning until `unpin_checkpoint`; False if it is gone."""
    try:
        (Path(folder) / PINNED).write_text(f"{reason}\n")
    except FileNotFoundError:  # already pruned (or never written): nothing to keep
        return False
    return True


def unpin_checkpoint(folder: str | Path) -> None:
    (Path(folder) / PINNED).unlink(missing_ok=True)


def is_pinned(folder: str | Path) -> bool:
    return (Path(folder) / PINNED).is_file()


def release_pins(run_dir: str | Path) -> list[Path]:
    """Clear every pin of a run (left by a job that died before its evals finished); returns the unpinned folders."""
    root = checkpoints_dir(run_dir)
    pinned = sorted(p.parent for p in root.glob(f"step_*/{PINNED}")) if root.is_dir() else []
    for folder in pinned:
        unpin_checkpoint(folder)
    return pinned


WORLD_SIZES = "world_sizes.jsonl"  # one line per (re)start of training: the world size it ran at (elastic jobs)


def record_world_size(run_dir: str | Path, step: int, world_size: int, accumulation: int) -> None:
    """Append this (re)start of training to ``<run_dir>/world_sizes.jsonl``: time, the step it starts from, world
    size and accumulation steps. Rank 0 calls it; the cluster driver turns changes into resize events."""
    record = {"time": time.time(), "step": step, "world_size": world_size, "accumulation": accumulation}
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    with open(Path(run_dir) / WORLD_SIZES, "a") as f:
        f.write(json.dumps(record) + "\n")


def world_size_history(run_dir: str | Path) -> list[dict[str, Any]]:
    """The records of `record_world_size`, oldest first ([] when training never started); a line cut short by a
    crash mid-write is skipped."""
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
    """The world-size changes of a run, from its (re)start records in order (`world_sizes.jsonl`: time, step,
    world_size, ...): one event per record whose world size differs from the one before it."""
    events = []
    for before, after in zip(history, history[1:]):
        if after.get("world_size") != before.get("world_size"):
            events.append(
                {
                    "step": after.get("step"),
                    "from": before["world_size"],
                    "to": after["world_size"],
                    "time": after.get("time"),
                }
            )
    return events


def prune_checkpoints(run_dir: str | Path, keep_last: int) -> list[Path]:
    """Delete the COMPLETE checkpoints older than the newest ``keep_last``, except pinned ones; returns those deleted.

    A pinned checkpoint (evals scheduled on it) stays until it is unpinned and goes at a later prune: the next
    save's, or the driver's after its evals finished.
    """
    deleted = []
    for old in complete_checkpoints(run_dir)[:-keep_last]:
        if is_pinned(old):
            continue
        # Unmark first: a prune interrupted half-way leaves a folder nothing reads, never a "complete" fragment.
        (old / COMPLETE).unlink(missing_ok=True)
        shutil.rmtree(old, ignore_errors=True)
        deleted.append(old)
    return deleted


# --------------------------------------------------------------------------------------------- precision record

PRECISION_RECORD = "precision.json"  # a `precision: probe` run's timed decision, repeated by every later start


def read_precision_record(run_dir: str | Path) -> dict[str, str] | None:
    """``{"precision", "rule", "reason"}`` that the run's first start decided by timing; None when it has none."""
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
    """Rank 0, once, at the run's first start (before its first checkpoint)."""
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    record = {"precision": precision, "rule": rule, "reason": reason, "decided_at": time.time()}
    write_durably(Path(run_dir) / PRECISION_RECORD, json.dumps(record) + "\n")


# <run>/sample_keys/rank<r>.jsonl with logging.record_sample_keys (pretrain.telemetry.recorder)
SAMPLE_KEYS_DIR = "sample_keys"
