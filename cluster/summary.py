"""The end-of-job table: one row per checkpoint step with its training loss and eval metrics."""

from __future__ import annotations

from typing import Any

from tracking import keys

# Columns shown when present, in this order; other eval metrics follow alphabetically up to MAX_EVAL_COLUMNS.
PREFERRED = (*map(keys.fewshot_mean, (1, 5, 10, 25)), keys.VTAB_MEAN, keys.finetune_accuracy("digits"))
MAX_EVAL_COLUMNS = 8


def _eval_columns(rows: dict[int, dict[str, Any]]) -> list[str]:
    names = sorted({k for r in rows.values() for k in r.get("metrics", {})})
    cols = [k for k in PREFERRED if k in names]
    cols += [k for k in names if k.endswith("/10shot") and k not in cols]  # the paper's headline shot count
    cols += [k for k in names if k not in cols]
    return cols[:MAX_EVAL_COLUMNS]


def format_summary(rows: dict[int, dict[str, Any]]) -> str:
    """`rows` is EvalScheduler.drain()'s result: {step: {train: {...}, metrics: {...} | error: str}}."""
    if not rows:
        return "summary: no checkpoint was completed"
    cols = _eval_columns(rows)
    header = ["step", keys.LOSS, *cols]
    table = []
    notes = []
    for step in sorted(rows):
        r = rows[step]
        loss = r.get("train", {}).get(keys.LOSS, r.get("train", {}).get("loss"))
        cells = [str(step), f"{loss:.4f}" if isinstance(loss, float) else "-"]
        cells += [f"{r['metrics'][c]:.4f}" if c in r.get("metrics", {}) else "-" for c in cols]
        table.append(cells)
        if r.get("error"):
            notes.append(f"  step {step}: eval error: {r['error'].splitlines()[0]}")
    widths = [max(len(h), *(len(row[i]) for row in table)) for i, h in enumerate(header)]
    fmt = "  ".join(f"{{:>{w}}}" for w in widths)
    lines = [
        "summary (fractions in 0-1; every metric is also in the MLflow run at its checkpoint step):",
        fmt.format(*header),
        fmt.format(*("-" * w for w in widths)),
    ]
    lines += [fmt.format(*row) for row in table]
    return "\n".join(lines + notes)
