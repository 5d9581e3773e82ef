"""The goodput ledger (docs/goodput.md) in the cross-run report: read, format and draw it. A run without ``goodput/``
metrics has no `Goodput`: "—", no bar, no section when no run has one. Imports no other report module."""

from __future__ import annotations

import html
import math
import sys
from dataclasses import dataclass
from pathlib import Path

from tracking import keys

GOODPUT_PNG = "goodput.png"
# A bucket missing here gets matplotlib's default cycle.
BUCKET_COLORS = {
    "productive": "#2e7d32",
    "data_wait": "#f9a825",
    "checkpoint": "#1565c0",
    "eval_interference": "#8e24aa",
    "restart": "#c62828",
    "startup": "#6d4c41",
    "resource_wait": "#00838f",
    "other": "#9e9e9e",
}
LABEL_MIN_SHARE = 0.07  # narrower segments (share of the wall-clock) get no label
SUM_TOLERANCE = 0.01  # buckets summing further (relative) from the wall-clock get a note


@dataclass(frozen=True)
class Goodput:
    """One run's ledger: seconds per bucket (None: not logged) in ``keys.GOODPUT_BUCKETS`` order, and totals."""

    seconds: tuple[tuple[str, float | None], ...]
    wall_s: float | None  # goodput/wall_s, else the sum of the logged buckets
    fraction: float | None  # goodput/fraction, else productive_s / wall_s

    @property
    def accounted_s(self) -> float:
        """The logged buckets' sum."""
        return sum(s for _, s in self.seconds if s is not None)

    def share(self, bucket: str) -> float | None:
        """Of the wall-clock; None without both."""
        value = dict(self.seconds).get(bucket)
        return None if value is None or not self.wall_s else value / self.wall_s


def is_finite(value: float) -> bool:
    """Neither NaN nor +-inf, nor +-`sys.float_info.max`: MLflow's SQL stores keep +-inf so (runs logged before the
    Tracker sent NaN instead)."""
    return math.isfinite(value) and abs(value) != sys.float_info.max


def _finite(metrics: dict, key: str) -> float | None:
    value = metrics.get(key)
    return None if value is None or not is_finite(value) else float(value)


def read_goodput(metrics: dict) -> Goodput | None:
    """From a run's latest metrics; None without any ``goodput/`` metric."""
    if not any(k.startswith(keys.GOODPUT_PREFIX) for k in metrics):
        return None
    seconds = tuple((b, _finite(metrics, keys.goodput_bucket(b))) for b in keys.GOODPUT_BUCKETS)
    logged = [s for _, s in seconds if s is not None]
    wall = _finite(metrics, keys.GOODPUT_WALL_S)
    if wall is None and logged:
        wall = sum(logged)
    fraction = _finite(metrics, keys.GOODPUT_FRACTION)
    productive = dict(seconds).get("productive")
    if fraction is None and productive is not None and wall:
        fraction = productive / wall
    return Goodput(seconds, wall, fraction)


def read_tails(metrics: dict, key_of) -> tuple[tuple[int, float], ...]:
    """(percentile, seconds) of the last logging window, for those logged."""
    found = ((p, _finite(metrics, key_of(p))) for p in keys.TAIL_PERCENTILES)
    return tuple((p, v) for p, v in found if v is not None)


def _pct(value: float | None) -> str:
    return "—" if value is None else f"{100 * value:.1f}%"


def seconds_text(value: float | None) -> str:
    """e.g. "1,234 s", "2.5 s" below 10 s."""
    if value is None:
        return "—"
    return f"{value:.1f} s" if abs(value) < 10 else f"{value:,.0f} s"


def duration_text(value: float) -> str:
    """For a bar label: "45 s", "12.5 min", "3.4 h"."""
    if value < 120:
        return f"{value:.0f} s"
    return f"{value / 60:.1f} min" if value < 7200 else f"{value / 3600:.1f} h"


def goodput_cell(goodput: Goodput | None) -> str:
    """The productive fraction, "—" without a ledger."""
    return "—" if goodput is None else _pct(goodput.fraction)


def tails_text(tails: tuple[tuple[int, float], ...]) -> str:
    """e.g. "p50 0.12 s, p99 0.4 s"; "" when none was logged."""
    return ", ".join(f"p{p} {v:.3g} s" for p, v in tails)


def goodput_line(goodput: Goodput | None, step_tails=(), wait_tails=()) -> str:
    """The ledger and tails in one terminal line; "" without either."""
    parts = []
    if goodput is not None:
        buckets = ", ".join(
            f"{bucket} {seconds_text(s)} ({_pct(goodput.share(bucket))})" for bucket, s in goodput.seconds if s
        )
        parts.append(f"{_pct(goodput.fraction)} of {seconds_text(goodput.wall_s)} wall-clock: {buckets or 'no time'}")
    if step_tails:
        parts.append(f"step time {tails_text(step_tails)}")
    if wait_tails:
        parts.append(f"data wait per step {tails_text(wait_tails)}")
    return "; ".join(parts)


def ledger_notes(rows) -> list[str]:
    """Per run: no ledger, no wall-clock yet, or buckets that do not sum to it."""
    notes = []
    for name, goodput in rows:
        if goodput is None:
            notes.append(f"{name}: no goodput ledger logged (a run from before it, or one that logged no step)")
        elif not goodput.wall_s:
            notes.append(f"{name}: no wall-clock in its goodput ledger yet")
        elif abs(goodput.accounted_s - goodput.wall_s) > SUM_TOLERANCE * goodput.wall_s:
            notes.append(
                f"{name}: its buckets sum to {seconds_text(goodput.accounted_s)} of {seconds_text(goodput.wall_s)} "
                "wall-clock (values logged at different moments, or time the ledger missed)"
            )
    return notes


def bucket_color(bucket: str) -> str:
    return BUCKET_COLORS.get(bucket) or f"C{keys.GOODPUT_BUCKETS.index(bucket) % 10}"


def _text_color(color: str) -> str:
    from matplotlib.colors import to_rgb

    r, g, b = to_rgb(color)
    return "black" if 0.2126 * r + 0.7152 * g + 0.0722 * b > 0.5 else "white"


def draw_goodput(ax, rows) -> list[str]:
    """A stacked bar of bucket shares (%) per ``(name, Goodput)`` with a wall-clock; returns the `ledger_notes`."""
    from matplotlib.patches import Patch

    drawn = [(name, g) for name, g in rows if g is not None and g.wall_s]
    widest = 100.0
    for y, (_, goodput) in enumerate(drawn):
        left = 0.0
        for bucket, seconds in goodput.seconds:
            if not seconds:
                continue
            width = 100 * seconds / goodput.wall_s
            color = bucket_color(bucket)
            ax.barh(y, width, left=left, height=0.6, color=color, edgecolor="white", linewidth=0.5)
            if seconds / goodput.wall_s >= LABEL_MIN_SHARE:
                label = dict(ha="center", va="center", fontsize=7, color=_text_color(color))
                ax.text(left + width / 2, y, duration_text(seconds), **label)
            left += width
        widest = max(widest, left)
    ax.set_yticks(range(len(drawn)))
    ax.set_yticklabels(
        [f"{name}\n{duration_text(g.wall_s)} · {goodput_cell(g)} goodput" for name, g in drawn], fontsize=8
    )
    ax.set_ylim(len(drawn) - 0.5, -0.5)  # the first run on top, as in the table
    ax.set_xlim(0, widest)
    ax.set_xlabel("share of the job's wall-clock (%); durations on the segments")
    handles = [Patch(color=bucket_color(b), label=b) for b in keys.GOODPUT_BUCKETS]
    ax.legend(handles=handles, fontsize=7, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.28), frameon=False)
    ax.set_title("Goodput: where each run's wall-clock went")
    return ledger_notes(rows)


def plot_goodput(rows, path: Path) -> list[str]:
    import matplotlib  # heavy

    matplotlib.use("Agg")  # headless
    import matplotlib.pyplot as plt

    bars = sum(1 for _, g in rows if g is not None and g.wall_s)
    fig, ax = plt.subplots(figsize=(7.5, 2.2 + 0.55 * bars), dpi=110)
    ax.grid(True, axis="x", alpha=0.3)
    notes = draw_goodput(ax, rows)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return notes


def _bucket_cell(goodput: Goodput, bucket: str) -> str:
    seconds = dict(goodput.seconds).get(bucket)
    if seconds is None:
        return "<td>—</td>"
    share = _pct(goodput.share(bucket))
    return f'<td title="{html.escape(bucket)}: {seconds!r} s">{share}<br>{seconds_text(seconds)}</td>'


def goodput_section_html(rows, notes: list[str]) -> str:
    """Figure, ledger table and notes of ``(name, Goodput | None, step_tails, wait_tails)`` rows; "" if no ledger."""
    ledgers = [row for row in rows if row[1] is not None]
    if not ledgers:
        return ""
    esc = html.escape
    swatch = '<span style="display:inline-block;width:10px;height:10px;background:{};margin-right:4px"></span>'
    head = "".join(f"<th>{swatch.format(bucket_color(b))}{esc(b)}</th>" for b in keys.GOODPUT_BUCKETS)
    body = []
    for name, goodput, step_tails, wait_tails in ledgers:
        cells = "".join(_bucket_cell(goodput, b) for b in keys.GOODPUT_BUCKETS)
        body.append(
            f'<tr><td class="text">{esc(name)}</td><td>{seconds_text(goodput.wall_s)}</td>'
            f'<td>{goodput_cell(goodput)}</td>{cells}<td class="tails">{esc(tails_text(step_tails)) or "—"}</td>'
            f'<td class="tails">{esc(tails_text(wait_tails)) or "—"}</td></tr>'
        )
    items = "".join(f"<li>{esc(n)}</li>" for n in notes)
    return f"""<h2>Goodput: where the wall-clock went</h2>
<figure><img src="{GOODPUT_PNG}" alt="goodput ledger per run, stacked bars">
<figcaption>Each run's wall-clock split into the ledger's buckets (docs/goodput.md), as a share of it; goodput is
the productive share. Latest values of <code>goodput/&lt;bucket&gt;_s</code>; the run's own table, per attempt, is
its <code>{keys.GOODPUT_ARTIFACT}/ledger.txt</code> artifact.</figcaption></figure>
<table class="goodput"><thead><tr><th class="text">Run</th><th>Wall-clock</th><th>Goodput</th>{head}
<th>Step time (last window)</th><th>Data wait per step</th></tr></thead><tbody>{"".join(body)}</tbody></table>
{'<ul class="notes">' + items + "</ul>" if items else ""}
"""
