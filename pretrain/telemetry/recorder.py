"""What a rank trained on and got: `Recorder` keeps per-step losses and, if asked, digests and sample keys.

Digests hash each micro-batch's pixels and labels in order. Both also go, a line per step, to
``<run>/batch_digests/rank<r>.jsonl`` and ``<run>/sample_keys/rank<r>.jsonl``: under Ray no summary is returned.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, SupportsFloat, TextIO

import torch

from pretrain.checkpoint.run_folder import BATCH_DIGESTS_DIR, SAMPLE_KEYS_DIR


@dataclass
class TrainSummary:
    """What `pretrain.loop.train_worker` returns on every rank (``--summary`` writes it as JSON)."""

    rank: int
    world_size: int
    start: str  # "run" | "resume_from" | "init_from" | "scratch"
    start_step: int
    steps: int  # the last step
    images_seen: int
    checkpoints: list[str] = field(default_factory=list)  # COMPLETE checkpoints saved
    losses: list[list[float]] = field(default_factory=list)  # [step, loss averaged over ranks]
    digests: list[list[Any]] = field(default_factory=list)  # [step, sha256 hex]: record_batch_digests
    sample_keys: list[dict[str, Any]] = field(default_factory=list)  # {step, epoch, keys}: record_sample_keys

    @property
    def final_loss(self) -> float | None:
        return self.losses[-1][1] if self.losses else None

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "final_loss": self.final_loss}


class Recorder:
    def __init__(
        self, digests: bool, sample_keys: bool, logs: dict[str, Path] | None = None, where: dict | None = None
    ):
        """``logs``: where each step's ``"digest"`` and ``"keys"`` lines go (appended), for what is recorded."""
        self.want_digests, self.want_keys = digests, sample_keys
        self.losses: list[list[Any]] = []  # [step, loss]: a float once read
        self.digests: list[list[Any]] = []
        self.sample_keys: list[dict[str, Any]] = []
        self._digest = hashlib.sha256()
        self._keys: list[str] = []
        self._where = where or {}  # attempt, rank, world size
        self._logs: dict[str, TextIO] = {}
        for name, path in (logs or {}).items():
            if {"digest": digests, "keys": sample_keys}[name]:
                path.parent.mkdir(parents=True, exist_ok=True)
                self._logs[name] = open(path, "a")  # noqa: SIM115 (`close` ends it)

    @classmethod
    def for_run(cls, run_dir: Path, logging, rank: int, world_size: int, attempt: int) -> Recorder:
        """The recorder ``logging`` (a `LoggingConfig`) asks for."""
        logs = {"digest": run_dir / BATCH_DIGESTS_DIR, "keys": run_dir / SAMPLE_KEYS_DIR}
        logs = {name: folder / f"rank{rank}.jsonl" for name, folder in logs.items()}
        where = {"attempt": attempt, "rank": rank, "world_size": world_size}
        return cls(logging.record_batch_digests, logging.record_sample_keys, logs, where)

    @property
    def wants_batches(self) -> bool:
        return self.want_digests or self.want_keys

    def batch(self, images: torch.Tensor, labels: torch.Tensor, keys: list[str]) -> None:
        """A micro-batch of the current step, as the model received it."""
        if self.want_digests:
            self._digest.update(images.float().cpu().numpy().tobytes() + labels.cpu().numpy().tobytes())
        if self.want_keys:
            self._keys.extend(keys)

    def end_step(self, step: int, loss: SupportsFloat, epoch: int) -> None:
        """Step ``step`` (1-based) is done; ``epoch``: its batches' stream epoch. ``loss`` is read only in `summary`."""
        self.losses.append([step, loss])
        if self.want_digests:
            self.digests.append([step, self._digest.hexdigest()])
            self._write("digest", {"step": step, "digest": self.digests[-1][1]})
            self._digest = hashlib.sha256()
        if self.want_keys:
            entry = {"step": step, "epoch": epoch, "keys": self._keys}
            self.sample_keys.append(entry)
            self._write("keys", entry)
            self._keys = []

    def _write(self, name: str, entry: dict[str, Any]) -> None:
        if log := self._logs.get(name):
            log.write(json.dumps({**entry, **self._where}) + "\n")
            log.flush()  # kept by a killed attempt

    def close(self) -> None:
        for log in self._logs.values():
            log.close()
        self._logs = {}

    def summary(self, **fields: Any) -> TrainSummary:
        losses = [[step, float(loss)] for step, loss in self.losses]
        return TrainSummary(**fields, losses=losses, digests=self.digests, sample_keys=self.sample_keys)
