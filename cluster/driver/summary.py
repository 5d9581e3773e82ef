"""The end-of-job table: a row per checkpoint step with its loss, eval metrics and the headline's gain over step 0."""

from __future__ import annotations

import time
from typing import Any

from tracking import keys

PREFERRED = (*map(keys.fewshot_mean, (1, 5, 10, 25)), keys.VTAB_MEAN, keys.finetune_accuracy("digits"))
MAX_EVAL_COLUMNS = 8
HEADLINE = (keys.FEWSHOT_MEAN_10SHOT, keys.VTAB_MEAN, keys.finetune_accuracy("digits"))
BASELINE_STEP = 0


def _eval_columns(rows: dict[int, dict[str, Any]]) -> list[str]:
    names = sorted({k for r in rows.values() for k in r.get("metrics", {})})
    cols = [k for k in PREFERRED if k in names]
    cols += [k for k in names if k.endswith("/10shot") and k not in cols]  # the paper's headline
    cols += [k for k in names if k not in cols]
    return cols[:MAX_EVAL_COLUMNS]


def headline_metric(cols: list[str]) -> str | None:
    return next((k for k in HEADLINE if k in cols), cols[0] if cols else None)


def gains_over_baseline(rows: dict[int, dict[str, Any]], metric: str) -> dict[int, float]:
    """{} without a step-0 value."""
    base = rows.get(BASELINE_STEP, {}).get("metrics", {}).get(metric)
    if base is None:
        return {}
    return {s: r["metrics"][metric] - base for s, r in rows.items() if metric in r.get("metrics", {})}


def format_summary(rows: dict[int, dict[str, Any]]) -> str:
    """``rows``: `EvalScheduler.drain`'s result."""
    if not rows:
        return "summary: no checkpoint was completed"
    cols = _eval_columns(rows)
    headline = headline_metric(cols)
    gains = gains_over_baseline(rows, headline) if headline else {}
    header = ["step", keys.LOSS, *cols, *([f"gain vs step 0 ({headline})"] if gains else [])]
    table, notes = [], []
    for step in sorted(rows):
        r = rows[step]
        loss = r.get("train", {}).get(keys.LOSS, r.get("train", {}).get("loss"))
        cells = [str(step), f"{loss:.4f}" if isinstance(loss, float) else "-"]
        cells += [f"{r['metrics'][c]:.4f}" if c in r.get("metrics", {}) else "-" for c in cols]
        if gains:
            cells.append(f"{gains[step]:+.4f}" if step in gains else "-")
        table.append(cells)
        if r.get("error"):
            notes.append(f"  step {step}: eval error: {r['error'].splitlines()[0]}")
    lines = ["summary (fractions in 0-1; every metric is also in the MLflow run at its checkpoint step):"]
    lines += aligned(header, table)
    if headline and not gains:
        notes.append(
            f"  no step-0 baseline of {headline} in this job (evals.baseline=false, a resumed run, or its eval "
            "failed): gains over random initialisation are not shown"
        )
    return "\n".join(lines + notes)


def aligned(header: list[str], table: list[list[str]]) -> list[str]:
    """The header, a rule and the rows, each column right-aligned to its widest cell."""
    widths = [max(len(h), *(len(row[i]) for row in table)) for i, h in enumerate(header)]
    fmt = "  ".join(f"{{:>{w}}}" for w in widths)
    return [fmt.format(*row) for row in (header, ["-" * w for w in widths], *table)]


def format_resizes(events: list[dict[str, Any]]) -> list[str]:
    """ "step 40: world size 2 -> 1 (at 2026-11-23 20:41:07 UTC)" per resize."""
    lines = []
    for e in events:
        when = f" (at {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime(e['time']))})" if e.get("time") else ""
        step = f"step {e['step']}" if e.get("step") is not None else "a start of the worker group (step not recorded)"
        lines.append(f"{step}: world size {e['from']} -> {e['to']}{when}")
    return lines
