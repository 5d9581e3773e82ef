"""Write the planner's measured MFU and memory table from a GPU campaign's JSON (``python -m bench.gpu``).

    python -m cluster.calibrate bench-results/gpu.json [--mfu-file cluster/mfu.yaml]

`cluster/mfu.yaml` maps model -> GPU kind -> entry (`entries_from`), read by `cluster.plan.mfu`;
``$VITSCALE_MFU_FILE`` or ``--mfu-file`` selects another table (docs/benchmarks/gpu.md, "The device calls").
"""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path
from typing import Any

import yaml

from cluster.plan.mfu import MEMORY_TOLERANCE, MFU_FILE, MFU_FILE_ENV, gpu_kind, measured, mfu_file, read_table
from data_pipeline.cli import fail
from data_pipeline.paths import write_text_atomically

MODELS = ("vit_b16", "vit_l16", "vit_h14")
ACTIVATION_SCALE_RANGE = (0.1, 10.0)  # beyond it the model is wrong, not its activations
HEADER = (
    "# Measured MFU and memory per model and GPU kind, written by `python -m cluster.calibrate GPU_JSON` from\n"
    "# `python -m bench.gpu` (docs/benchmarks/gpu.md); cluster.plan.planner uses them instead of a profile's\n"
    "# assumed_mfu.\n"
)


def _number(result: dict, key: str) -> float | None:
    value = result.get(key)
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return float(value) if ok else None


def entries_from(result: dict, path: Path | None = None) -> dict[str, dict[str, Any]]:
    """model -> table entry: ``pretrain.train``'s MFU where the campaign ran it, else the eager step benchmark's;
    memory fields where measured. ``path``: the table the campaign's plan read (`_applied_scale`)."""
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
        entry.update(_memory_entry(result, model, path))
        entry.update({"device": result["device"], "date": str(result["date"])[:10]})
        entry.update({k: result.get(k) for k in ("torch", "cuda", "deepspeed", "driver") if result.get(k)})
        entries[model] = entry
    return entries


def _memory_entry(result: dict, model: str, path: Path | None) -> dict[str, Any]:
    keys = ("plan_memory_error", "plan_memory_gb", "measured_memory_gb", "plan_activations_gb")
    error, planned, measured_gb, activations = (_number(result, f"{key}_{model}") for key in keys)
    if error is None or planned is None or measured_gb is None:
        return {}
    applied = _applied_scale(result, model, path)
    if applied != 1.0 and activations:  # the error and scale are the model's, not those of the plan it corrected
        planned, activations = planned - activations + activations / applied, activations / applied
        error = (planned - measured_gb) / measured_gb
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


def _applied_scale(result: dict, model: str, path: Path | None) -> float:
    """The activation scale the campaign's plan took from the table (1.0: none), which its memory numbers include."""
    source = result.get(f"plan_memory_source_{model}")
    if source in (None, "model"):
        return 1.0
    known = measured(model, result["device"], path) if path else None
    if known is None or not known.memory_corrected or known.memory_source != source:
        raise ValueError(
            f"its {model} plan scaled the activations ({source}), which this table does not hold; update the "
            "table the campaign read (--mfu-file)"
        )
    return known.activation_scale


def calibrate(result: dict, path: Path) -> dict[str, dict[str, Any]]:
    """Merge a campaign's entries into the table at ``path``; return them. ValueError when there are none."""
    if not isinstance(result, dict):
        raise ValueError("the GPU JSON must be an object (bench.gpu.campaign writes one)")
    if result.get("smoke"):
        raise ValueError("it is a --smoke run (tiny models on a CPU): it measured nothing to calibrate with")
    if not isinstance(result.get("device"), str) or not result.get("date"):
        raise ValueError("it has no 'device' and 'date', which python -m bench.gpu writes: is it that campaign's JSON?")
    entries = entries_from(result, path)
    if not entries:
        keys = ", ".join(f"train_path_mfu_{m} / mfu_eager_{m}" for m in MODELS)
        raise ValueError(f"it holds no MFU in (0, 1] for any model ({keys}); the campaign's parts failed")
    table = read_table(path)
    kind = gpu_kind(result["device"])
    for model, entry in entries.items():
        table.setdefault(model, {})[kind] = entry
    try:
        write_text_atomically(path, HEADER + yaml.safe_dump(table, sort_keys=True))
    except OSError as error:
        raise ValueError(f"cannot write MFU table {path} ({error.strerror}); give --mfu-file a writable file") from None
    return entries


def _check_table_file(path: Path, named: str) -> None:
    """ValueError unless ``path`` (``named`` in the message) is a table to update or a new file in a folder."""
    if path.is_dir():
        raise ValueError(f"{named} {path} is a folder; name the YAML file to write, e.g. {path / 'mfu.yaml'}")
    if not path.parent.is_dir():
        raise ValueError(f"{named} {path}: the folder {path.parent} does not exist; create it or name another file")
    read_table(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cluster.calibrate", description=__doc__.split("\n\n")[0])
    parser.add_argument("gpu_json", metavar="GPU_JSON", help="what python -m bench.gpu wrote (bench-results/gpu.json)")
    parser.add_argument("--mfu-file", help=f"the table to update (default: ${MFU_FILE_ENV} or {MFU_FILE})")
    args = parser.parse_args(argv)
    path = Path(args.mfu_file) if args.mfu_file else mfu_file()
    try:  # before any work
        named = "--mfu-file" if args.mfu_file else f"${MFU_FILE_ENV}" if os.environ.get(MFU_FILE_ENV) else "MFU table"
        _check_table_file(path, named)
    except ValueError as error:
        return fail(parser.prog, error)
    try:
        try:
            result = json.loads(Path(args.gpu_json).read_text())
        except OSError as error:
            raise ValueError(f"cannot read it ({error.strerror}); run python -m bench.gpu first") from None
        except json.JSONDecodeError as error:
            raise ValueError(f"it is not JSON ({error.msg} at line {error.lineno})") from None
        entries = calibrate(result, path)
    except ValueError as error:
        return fail(parser.prog, f"{args.gpu_json}: {error}")
    for model, e in entries.items():
        memory = f", memory off by {e['memory_error']:+.0%}" if "memory_error" in e else ""
        print(f"{model} on {gpu_kind(result['device'])}: MFU {e['mfu']:.1%} ({e['mfu_from']}){memory}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
