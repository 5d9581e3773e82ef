"""Write the planner's measured MFU and memory table from a GPU campaign's JSON (``python -m bench.gpu``).

    python -m cluster.calibrate bench-results/gpu.json [--mfu-file cluster/mfu.yaml]

`cluster/mfu.yaml` maps model -> GPU kind (`gpu_kind`) -> entry (`entries_from`); `cluster.plan.planner` reads it
through `measured`. ``$VITSCALE_MFU_FILE`` or ``--mfu-file`` selects another table.
See docs/benchmarks/gpu.md, "The device call".
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from pretrain.telemetry.peak import GPU_PEAK_TFLOPS

MFU_FILE = Path(__file__).resolve().parent / "mfu.yaml"
MFU_FILE_ENV = "VITSCALE_MFU_FILE"
MEMORY_TOLERANCE = 0.15  # beyond this relative memory error the plan takes the activation scale
MODELS = ("vit_b16", "vit_l16", "vit_h14")
ACTIVATION_SCALE_RANGE = (0.1, 10.0)  # beyond it the model is wrong, not its activations
HEADER = (
    "# Measured MFU and memory per model and GPU kind, written by `python -m cluster.calibrate GPU_JSON` from\n"
    "# `python -m bench.gpu` (docs/benchmarks/gpu.md); cluster.plan.planner uses them instead of a profile's\n"
    "# assumed_mfu.\n"
)


def mfu_file() -> Path:
    return Path(os.environ.get(MFU_FILE_ENV) or MFU_FILE)


def gpu_kind(name: str) -> str:
    """The `GPU_PEAK_TFLOPS` fragment in ``name`` ("NVIDIA H200" -> "H200"), else the name itself."""
    return next((fragment for fragment in GPU_PEAK_TFLOPS if fragment in name), name.strip())


@dataclass(frozen=True)
class Measured:
    """One table entry: a model on a GPU kind."""

    model: str
    gpu_kind: str
    mfu: float
    mfu_from: str
    device: str
    date: str
    memory_error: float | None = None
    activation_scale: float = 1.0

    @property
    def mfu_source(self) -> str:
        return f"measured on {self.gpu_kind} {self.date} ({self.mfu_from})"

    @property
    def memory_corrected(self) -> bool:
        return self.memory_error is not None and abs(self.memory_error) > MEMORY_TOLERANCE

    @property
    def memory_source(self) -> str:
        return (
            f"activations x {self.activation_scale:.2f}: the model was {self.memory_error:+.0%} off what "
            f"{self.gpu_kind} measured on {self.date}"
        )


def read_table(path: Path | None = None) -> dict[str, dict[str, dict[str, Any]]]:
    """The table; {} when the file is absent or empty. ValueError when it is not a mapping."""
    path = path or mfu_file()
    if not path.is_file():
        return {}
    try:
        table = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as error:
        raise ValueError(f"{path} is not valid YAML ({error}); run python -m cluster.calibrate again") from None
    if not isinstance(table, dict) or not all(isinstance(v, dict) for v in table.values()):
        raise ValueError(f"{path} must map model -> GPU kind -> numbers; run python -m cluster.calibrate again")
    return table


def measured(model: str, gpu_type: str, path: Path | None = None) -> Measured | None:
    """The entry for ``model`` on ``gpu_type``'s kind, or None."""
    kind = gpu_kind(gpu_type)
    entry = read_table(path).get(model, {}).get(kind)
    if not isinstance(entry, dict) or not _is_fraction(entry.get("mfu")):
        return None
    return Measured(
        model=model,
        gpu_kind=kind,
        mfu=float(entry["mfu"]),
        mfu_from=str(entry.get("mfu_from", "bench.gpu")),
        device=str(entry.get("device", kind)),
        date=str(entry.get("date", "?")),
        memory_error=entry.get("memory_error"),
        activation_scale=float(entry.get("activation_scale", 1.0)),
    )


def _is_fraction(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and 0 < value <= 1


def _number(result: dict, key: str) -> float | None:
    value = result.get(key)
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return float(value) if ok else None


def entries_from(result: dict) -> dict[str, dict[str, Any]]:
    """model -> table entry: ``pretrain.train``'s MFU where the campaign ran it, else the eager step benchmark's
    (``pretrain.train`` without ``model.compile``); memory fields where measured."""
    entries = {}
    for model in MODELS:
        train_mfu, step_mfu = _number(result, f"train_path_mfu_{model}"), _number(result, f"mfu_eager_{model}")
        if train_mfu is not None and 0 < train_mfu <= 1:
            entry: dict[str, Any] = {"mfu": round(train_mfu, 4), "mfu_from": "pretrain.train"}
            entry["micro_batch_size"] = result.get("train_path_micro_batch")
        elif step_mfu is not None and 0 < step_mfu <= 1:
            entry = {"mfu": round(step_mfu, 4), "mfu_from": "step benchmark (eager)"}
            entry["micro_batch_size"] = result.get(f"eager_batch_{model}")
        else:
            continue
        entry.update(_memory_entry(result, model))
        entry.update({"device": result["device"], "date": str(result["date"])[:10]})
        entry.update({k: result.get(k) for k in ("torch", "cuda", "deepspeed", "driver") if result.get(k)})
        entries[model] = entry
    return entries


def _memory_entry(result: dict, model: str) -> dict[str, Any]:
    error = _number(result, f"plan_memory_error_{model}")
    planned, measured_gb = _number(result, f"plan_memory_gb_{model}"), _number(result, f"measured_memory_gb_{model}")
    activations = _number(result, f"plan_activations_gb_{model}")
    if error is None or planned is None or measured_gb is None:
        return {}
    scale = 1.0
    if abs(error) > MEMORY_TOLERANCE and activations:
        # Model states are exact (ZeRO's accounting): the error goes on the activations, the estimated part.
        low, high = ACTIVATION_SCALE_RANGE
        scale = min(high, max(low, (measured_gb - (planned - activations)) / activations))
    return {
        "memory_gb_measured": round(measured_gb, 3),
        "memory_gb_planned": round(planned, 3),
        "memory_error": round(error, 4),
        "activation_scale": round(scale, 4),
    }


def calibrate(result: dict, path: Path) -> dict[str, dict[str, Any]]:
    """Merge a campaign's entries into the table at ``path``; return them. ValueError when there are none."""
    if not isinstance(result, dict):
        raise ValueError("the GPU JSON must be an object (bench.gpu.campaign writes one)")
    if result.get("smoke"):
        raise ValueError("it is a --smoke run (tiny models on a CPU): it measured nothing to calibrate with")
    if not isinstance(result.get("device"), str) or not result.get("date"):
        raise ValueError("it has no 'device' and 'date', which python -m bench.gpu writes: is it that campaign's JSON?")
    entries = entries_from(result)
    if not entries:
        keys = ", ".join(f"train_path_mfu_{m} / mfu_eager_{m}" for m in MODELS)
        raise ValueError(f"it holds no MFU in (0, 1] for any model ({keys}); the campaign's parts failed")
    table = read_table(path)
    kind = gpu_kind(result["device"])
    for model, entry in entries.items():
        table.setdefault(model, {})[kind] = entry
    path.write_text(HEADER + yaml.safe_dump(table, sort_keys=True))
    return entries


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cluster.calibrate", description=__doc__.split("\n\n")[0])
    parser.add_argument("gpu_json", metavar="GPU_JSON", help="what python -m bench.gpu wrote (bench-results/gpu.json)")
    default = f"${MFU_FILE_ENV} or {MFU_FILE}"
    parser.add_argument("--mfu-file", default=None, help=f"the table to update (default: {default})")
    args = parser.parse_args(argv)
    path = Path(args.mfu_file) if args.mfu_file else mfu_file()
    try:
        try:
            result = json.loads(Path(args.gpu_json).read_text())
        except OSError as error:
            raise ValueError(f"cannot read it ({error.strerror}); run python -m bench.gpu first") from None
        except json.JSONDecodeError as error:
            raise ValueError(f"it is not JSON ({error.msg} at line {error.lineno})") from None
        entries = calibrate(result, path)
    except ValueError as error:
        print(f"cluster.calibrate: error: {args.gpu_json}: {error}", file=sys.stderr)
        return 2
    for model, e in entries.items():
        memory = f", memory off by {e['memory_error']:+.0%}" if "memory_error" in e else ""
        print(f"{model} on {gpu_kind(result['device'])}: MFU {e['mfu']:.1%} ({e['mfu_from']}){memory}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
