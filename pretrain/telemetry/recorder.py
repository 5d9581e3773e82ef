"""What a rank trained on and got: `Recorder` keeps per-step losses and, if asked, digests and sample keys.

Digests hash each micro-batch's pixels and labels in order; sample keys also go to ``<run>/sample_keys/rank<r>.jsonl``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, SupportsFloat, TextIO

import torch

from pretrain.checkpoint.run_folder import SAMPLE_KEYS_DIR


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
    def __init__(self, digests: bool, sample_keys: bool, keys_log: Path | None = None, where: dict | None = None):
        self.want_digests, self.want_keys = digests, sample_keys
        self.losses: list[list[Any]] = []  # [step, loss]: a float once read
        self.digests: list[list[Any]] = []
        self.sample_keys: list[dict[str, Any]] = []
        self._digest = hashlib.sha256()
        self._keys: list[str] = []
        self._where = where or {}  # attempt, rank, world size
        self._log: TextIO | None = None
        if sample_keys and keys_log is not None:
            keys_log.parent.mkdir(parents=True, exist_ok=True)
            self._log = open(keys_log, "a")  # noqa: SIM115 (`close` ends it)

    @classmethod
    def for_run(cls, run_dir: Path, logging, rank: int, world_size: int, attempt: int) -> Recorder:
        """The recorder ``logging`` (a `LoggingConfig`) asks for."""
        log = run_dir / SAMPLE_KEYS_DIR / f"rank{rank}.jsonl"
        where = {"attempt": attempt, "rank": rank, "world_size": world_size}
        return cls(logging.record_batch_digests, logging.record_sample_keys, log, where)

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
            self._digest = hashlib.sha256()
        if self.want_keys:
            entry = {"step": step, "epoch": epoch, "keys": self._keys}
            self.sample_keys.append(entry)
            if self._log is not None:
                self._log.write(json.dumps({**entry, **self._where}) + "\n")
                self._log.flush()  # kept by a killed attempt
            self._keys = []

    def close(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None

    def summary(self, **fields: Any) -> TrainSummary:
        losses = [[step, float(loss)] for step, loss in self.losses]
        return TrainSummary(**fields, losses=losses, digests=self.digests, sample_keys=self.sample_keys)
