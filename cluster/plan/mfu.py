"""The planner's measured MFU and memory table, cluster/mfu.yaml (``python -m cluster.calibrate`` writes it): model ->
GPU kind -> entry, taken instead of a profile's assumed MFU; ``$VITSCALE_MFU_FILE`` selects another table.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pretrain.config.typed_yaml import read_yaml
from pretrain.telemetry.peak import GPU_PEAK_TFLOPS, known_gpu

MFU_FILE = Path(__file__).resolve().parents[1] / "mfu.yaml"
MFU_FILE_ENV = "VITSCALE_MFU_FILE"
MEMORY_TOLERANCE = 0.15  # beyond this relative memory error the plan scales the activations


def mfu_file() -> Path:
    return Path(os.environ.get(MFU_FILE_ENV) or MFU_FILE)


def gpu_kind(name: str) -> str:
    """ "NVIDIA H200" -> "H200" (a `GPU_PEAK_TFLOPS` key), else the name itself."""
    return known_gpu(name) or name.strip()


def same_peak_kinds(kind: str) -> list[str]:
    """The other GPU kinds with ``kind``'s datasheet peaks (H100 and H200: the same Hopper die, only the memory
    differs), whose measurements stand in for ``kind``'s."""
    peaks = GPU_PEAK_TFLOPS.get(kind)
    if peaks is None:
        return []
    return [other for other, p in GPU_PEAK_TFLOPS.items() if other != kind and p == peaks]


@dataclass(frozen=True)
class Measured:
    model: str
    gpu_kind: str  # the plan's
    mfu: float
    mfu_from: str
    device: str
    date: str
    memory_error: float | None = None
    activation_scale: float = 1.0
    measured_on: str = ""  # the kind that ran it, where another kind with the same peaks did; "" = gpu_kind

    @property
    def _where(self) -> str:
        return self.measured_on or self.gpu_kind

    @property
    def mfu_source(self) -> str:
        applied = f", applied to {self.gpu_kind} (same dense peak)" if self.measured_on else ""
        return f"measured on {self._where} {self.date} ({self.mfu_from}){applied}"

    @property
    def memory_corrected(self) -> bool:
        return self.memory_error is not None and abs(self.memory_error) > MEMORY_TOLERANCE

    @property
    def memory_source(self) -> str:
        return (
            f"activations x {self.activation_scale:.2f}: the model was {self.memory_error:+.0%} off what "
            f"{self._where} measured on {self.date}"
        )


def read_table(path: Path | None = None) -> dict[str, dict[str, dict[str, Any]]]:
    """The table at ``path`` (default: `mfu_file`); {} when that file is absent or empty, except one that
    ``$VITSCALE_MFU_FILE`` names: set, it must be used. ValueError, in one line, when it is not such a table."""
    if path is None and os.environ.get(MFU_FILE_ENV) and not mfu_file().is_file():
        raise ValueError(
            f"{MFU_FILE_ENV}={os.environ[MFU_FILE_ENV]} is not a file; unset it (the plan then reads {MFU_FILE}) "
            "or point it at a table python -m cluster.calibrate wrote"
        )
    path = path or mfu_file()
    if not path.is_file():
        return {}
    table = read_yaml(path, "MFU table") or {}
    fix = f"fix it, or write another: python -m cluster.calibrate GPU_JSON --mfu-file NEW.yaml, {MFU_FILE_ENV}=NEW.yaml"
    if not isinstance(table, dict) or not all(isinstance(v, dict) for v in table.values()):
        raise ValueError(f"MFU table {path} must map model -> GPU kind -> entry; {fix}")
    for model, row in table.items():
        for kind, entry in row.items():
            if problem := _entry_problem(entry):
                raise ValueError(f"MFU table {path}: {model} -> {kind}: {problem}; {fix}")
    return table


def _entry_problem(entry: Any) -> str | None:
    if not isinstance(entry, dict):
        return f"{entry!r} is not a mapping with an mfu"
    if not _is_fraction(entry.get("mfu")):
        return f"mfu is {entry.get('mfu')!r}, not a number in (0, 1]"
    for key in ("memory_error", "activation_scale"):
        if key in entry and not (_is_number(entry[key]) and (key == "memory_error" or entry[key] > 0)):
            return f"{key} is {entry[key]!r}, not a{' positive' if key == 'activation_scale' else ''} number"
    return None


def measured(model: str, gpu_type: str, path: Path | None = None) -> Measured | None:
    """The table's entry for ``model`` on ``gpu_type``'s kind, else on a kind with the same peaks (marked so)."""
    kind = gpu_kind(gpu_type)
    row = read_table(path).get(model, {})
    on = next((k for k in (kind, *same_peak_kinds(kind)) if k in row), None)
    if on is None:
        return None
    entry = row[on]
    return Measured(
        model=model,
        gpu_kind=kind,
        mfu=float(entry["mfu"]),
        mfu_from=str(entry.get("mfu_from", "bench.gpu")),
        device=str(entry.get("device", kind)),
        date=str(entry.get("date", "?")),
        memory_error=entry.get("memory_error"),
        activation_scale=float(entry.get("activation_scale", 1.0)),
        measured_on="" if on == kind else on,
    )


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_fraction(value: Any) -> bool:
    return _is_number(value) and 0 < value <= 1
