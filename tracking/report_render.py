"""Render step of the cross-run report: runs.csv, the figures and index.html (linking only the PNGs beside it, so
the folder works anywhere). Every gap in the data is said in words."""

from __future__ import annotations

import csv
import datetime as dt
import html
from pathlib import Path

from tracking import keys
from tracking.report_collect import Comparison, RunSummary
from tracking.report_goodput import GOODPUT_PNG, _pct, goodput_cell, goodput_line, goodput_section_html, plot_goodput

LOSS_PNG = "loss_vs_images.png"
FEWSHOT_PNG = "fewshot_vs_exaflops.png"
CSV_NAME = "runs.csv"

CSV_COLUMNS = (
    "run_id run_name experiment status model patch recipe steps images_seen exaflops final_loss "
    "fewshot_10shot_mean fewshot_10shot_step0 fewshot_10shot_gain finetune_accuracy_mean finetune_datasets "
    "vtab_mean vtab_num_tasks vtab_num_tasks_expected "
    "notes model_uri model_step goodput_fraction goodput_wall_s"
).split() + [
    *(f"goodput_{b}_s" for b in keys.GOODPUT_BUCKETS),
    *(f"step_s_p{p}" for p in keys.TAIL_PERCENTILES),
    *(f"data_wait_s_p{p}" for p in keys.TAIL_PERCENTILES),
]  # goodput and tails last: older reports' columns keep their places


# ---- number formatting: the table rounds, runs.csv keeps full precision


def _count(value: float | None) -> str:
    return "—" if value is None else f"{int(round(value)):,}"


def _sig(value: float | None, digits: int = 3) -> str:
    return "—" if value is None else f"{value:.{digits}g}"


def _points(value: float | None) -> str:
    """An accuracy difference in signed percentage points."""
    return "—" if value is None else f"{100 * value:+.1f} pp"


def _vtab(run: RunSummary) -> str:
    if run.vtab_mean is None:
        return "—"
    if run.vtab_num_tasks is None:
        return _pct(run.vtab_mean)
    of = f"/{run.vtab_num_tasks_expected}" if run.vtab_num_tasks_expected else ""
    return f"{_pct(run.vtab_mean)} ({run.vtab_num_tasks}{of} tasks)"


def _finetune(run: RunSummary) -> str:
    if run.finetune_accuracy is None:
        return "—"
    if len(run.finetune_datasets) == 1:
        return f"{_pct(run.finetune_accuracy)} ({run.finetune_datasets[0]})"
    return f"{_pct(run.finetune_accuracy)} (mean of {len(run.finetune_datasets)})"


TABLE_COLUMNS = (
    ("Run", lambda r: r.run_name),
    ("Status", lambda r: r.status),
    ("Model", lambda r: r.model or "—"),
    ("Patch", lambda r: "—" if r.patch is None else str(r.patch)),
    ("Recipe", lambda r: r.recipe or "—"),
    ("Steps", lambda r: _count(r.steps)),
    ("Images seen", lambda r: _count(r.images_seen)),
    ("ExaFLOPs", lambda r: _sig(r.exaflops)),
    ("Final loss", lambda r: _sig(r.final_loss, 4)),
    ("Goodput", lambda r: goodput_cell(r.goodput)),
    ("10-shot mean", lambda r: _pct(r.fewshot_10shot)),
    ("Step 0", lambda r: _pct(r.fewshot_baseline)),
    ("Gain vs step 0", lambda r: _points(r.fewshot_gain)),
    ("Fine-tune acc.", _finetune),
    ("VTAB mean", _vtab),
)


def format_table(comparison: Comparison) -> str:
    if not comparison.runs:
        return "\n".join(comparison.notes) or "no runs"
    rows = [[name for name, _ in TABLE_COLUMNS]] + [[cell(r) for _, cell in TABLE_COLUMNS] for r in comparison.runs]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(text.ljust(w) for text, w in zip(row, widths)).rstrip() for row in rows]
    lines += [f"gain [{run.run_name}]: {line}" for run in comparison.runs if (line := gains_line(run))]
    lines += [f"model [{run.run_name}]: {line}" for run in comparison.runs if (line := model_line(run))]
    lines += [f"goodput [{run.run_name}]: {line}" for run in comparison.runs if (line := _goodput_line(run))]
    for run in comparison.runs:
        lines += [f"note [{run.run_name}]: {note}" for note in run.notes]
    return "\n".join(lines + list(comparison.notes))


def gains_line(run: RunSummary) -> str:
    """e.g. "10-shot mean over step 0 (17.2%): step 50 +1.3 pp"."""
    if not run.fewshot_gains:
        return ""
    steps = ", ".join(f"step {step} {_points(gain)}" for step, gain in run.fewshot_gains)
    return f"10-shot mean over step 0 ({_pct(run.fewshot_baseline)}): {steps}"


def model_line(run: RunSummary) -> str:
    """e.g. "models:/m-1a2b… (step 200; load with mlflow.pyfunc.load_model)"; "" without a model."""
    if not run.model_uri:
        return ""
    step = f"step {run.model_step}; " if run.model_step is not None else ""
    return f"{run.model_uri} ({step}load with mlflow.pyfunc.load_model)"


def _goodput_line(run: RunSummary) -> str:
    return goodput_line(run.goodput, run.step_tails, run.data_wait_tails)


def _goodput_csv(run: RunSummary) -> list[str]:
    goodput, steps, waits = run.goodput, dict(run.step_tails), dict(run.data_wait_tails)
    ledger = [None] * (2 + len(keys.GOODPUT_BUCKETS))
    if goodput is not None:
        ledger = [goodput.fraction, goodput.wall_s, *(s for _, s in goodput.seconds)]
    tails = [steps.get(p) for p in keys.TAIL_PERCENTILES] + [waits.get(p) for p in keys.TAIL_PERCENTILES]
    return [_raw(v) for v in ledger + tails]


def write_csv(comparison: Comparison, path: Path) -> None:
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(CSV_COLUMNS)
        for r in comparison.runs:
            names = [r.run_id, r.run_name, r.experiment, r.status, r.model or "", r.patch or "", r.recipe or ""]
            numbers = [r.images_seen, r.exaflops, r.final_loss, r.fewshot_10shot, r.fewshot_baseline, r.fewshot_gain]
            vtab = [r.vtab_mean, r.vtab_num_tasks, r.vtab_num_tasks_expected]
            writer.writerow(
                [*names, r.steps if r.steps is not None else "", *map(_raw, [*numbers, r.finetune_accuracy])]
                + [";".join(r.finetune_datasets), *map(_raw, vtab), " | ".join(r.notes), r.model_uri or ""]
                + [_raw(r.model_step), *_goodput_csv(r)]
            )


def _raw(value) -> str:
    return "" if value is None else repr(value)


# ---- figures


def _figure():
    import matplotlib  # heavy

    matplotlib.use("Agg")  # headless
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.6), dpi=110)
    ax.grid(True, which="both", alpha=0.3)
    return plt, fig, ax


def _color(runs: tuple[RunSummary, ...], run: RunSummary) -> str:
    """The same in both figures."""
    return f"C{runs.index(run) % 10}"


def _placeholder(ax, message: str) -> None:
    ax.text(0.5, 0.5, message, ha="center", va="center", wrap=True, fontsize=11, color="#666", transform=ax.transAxes)
    ax.set_xticks([])
    ax.set_yticks([])


def plot_loss(runs: tuple[RunSummary, ...], path: Path) -> list[str]:
    """Training loss vs images seen per run; returns the notes for under the figure."""
    plt, fig, ax = _figure()
    drawn = [r for r in runs if r.loss_curve]
    notes = [f"{r.run_name}: no train/loss with train/images_seen logged" for r in runs if not r.loss_curve]
    for run in drawn:
        x, y = zip(*run.loss_curve)
        crashed = run.status != "FINISHED"
        color = _color(runs, run)
        ax.plot(x, y, linestyle="--" if crashed else "-", linewidth=1.6, label=run.label, color=color)
        if crashed:
            ax.plot(x[-1], y[-1], marker="x", markersize=9, color=color)
    if drawn:
        ax.set_xlabel("images seen")
        ax.set_ylabel("training loss (train/loss)")
        ax.ticklabel_format(axis="x", style="sci", scilimits=(0, 3))
        ax.legend(fontsize=8, loc="best")
    else:
        _placeholder(ax, "No run has logged train/loss together with train/images_seen yet.")
    ax.set_title("Training loss vs images seen")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return notes


def plot_fewshot(runs: tuple[RunSummary, ...], path: Path) -> list[str]:
    """10-shot accuracy vs exaFLOPs (paper Fig. 5) per run, a dashed line at its step-0 value; returns its notes."""
    plt, fig, ax = _figure()
    notes = draw_fewshot(ax, runs)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return notes


def _no_curve(run: RunSummary) -> str:
    if run.fewshot_10shot is None:
        return "no few-shot eval logged"
    if run.fewshot_last_step == 0:
        return "only step 0 evaluated so far (no checkpoint after it)"
    return "few-shot logged but no train/exaflops"


def draw_fewshot(ax, runs: tuple[RunSummary, ...]) -> list[str]:
    """`plot_fewshot` on ``ax``; returns its notes."""
    drawn = [r for r in runs if r.fewshot_curve]
    notes = [f"{r.run_name}: {_no_curve(r)}" for r in runs if not r.fewshot_curve]
    notes += [f"{r.run_name}: no step-0 evaluation, so no baseline line" for r in drawn if r.fewshot_baseline is None]
    for run in drawn:
        x, y, _ = zip(*run.fewshot_curve)
        y = [100 * v for v in y]
        color = _color(runs, run)
        ax.plot(x, y, marker="o", markersize=4, linewidth=1.2, alpha=0.8, label=run.label, color=color)
        ax.plot(x[-1], y[-1], marker="o", markersize=9, color=color)  # the latest checkpoint
        if run.fewshot_baseline is not None:  # step 0 has no compute to place on the log axis: a level line
            base = 100 * run.fewshot_baseline
            ax.axhline(base, linestyle="--", linewidth=1.0, color=color, label=f"{run.run_name}: step 0 {base:.1f}%")
            ax.annotate(
                "step 0 (random init)", (x[0], base), textcoords="offset points", xytext=(0, 4), fontsize=7, color=color
            )
    if drawn:
        ax.set_xscale("log")
        ax.set_xlabel("pre-training compute (exaFLOPs, log scale)")
        ax.set_ylabel("few-shot 10-shot accuracy, mean (%)")
        ax.legend(fontsize=8, loc="best")
    else:
        _placeholder(ax, "No run has few-shot 10-shot results (fewshot/mean/10shot)\nwith train/exaflops yet.")
    ax.set_title("Few-shot transfer vs pre-training compute (cf. paper Fig. 5)")
    return notes


# ---- HTML

_CSS = """
body { font-family: -apple-system, "Segoe UI", Helvetica, Arial, sans-serif; margin: 28px auto; max-width: 1200px;
       color: #1d2330; padding: 0 16px; }
h1 { font-size: 26px; margin-bottom: 4px; } h2 { font-size: 19px; margin-top: 30px; border-bottom: 1px solid #dde;
     padding-bottom: 4px; }
.meta { color: #5a6275; font-size: 13px; }
table { border-collapse: collapse; font-size: 13px; width: 100%; }
th, td { border: 1px solid #d5d9e2; padding: 6px 8px; text-align: right; white-space: nowrap; }
th { background: #eef1f7; } td.text, th.text { text-align: left; }
tr:nth-child(even) td { background: #f8f9fc; }
.status-FINISHED { color: #17803d; } .status-FAILED, .status-KILLED { color: #b42318; font-weight: 600; }
.status-RUNNING, .status-SCHEDULED, .status-STOPPED { color: #b26a00; font-weight: 600; }
.notes { background: #fff8e6; border-left: 4px solid #f0b429; padding: 8px 14px; font-size: 13px; }
.notes li { margin: 3px 0; } figure { margin: 10px 0 24px; } figure img { max-width: 100%; border: 1px solid #e2e5ec; }
figcaption { font-size: 13px; color: #4a5266; margin-top: 6px; }
code { font-size: 12px; color: #5a6275; }
table.goodput th, table.goodput td.tails { white-space: normal; }
"""


def _notes_html(notes: list[str]) -> str:
    if not notes:
        return ""
    return '<ul class="notes">' + "".join(f"<li>{html.escape(n)}</li>" for n in notes) + "</ul>"


def _gains_html(runs: tuple[RunSummary, ...]) -> str:
    lines = [f"{r.run_name}: {line}" for r in runs if (line := gains_line(r))]
    if not lines:
        return ""
    items = "".join(f"<li>{html.escape(line)}</li>" for line in lines)
    return f'<p class="meta">Gain of each checkpoint over its run\'s step 0:</p><ul class="meta">{items}</ul>'


def _model_html(run: RunSummary) -> str:
    if not run.model_uri:
        return ""
    step = f" (step {run.model_step})" if run.model_step is not None else ""
    return f" · model <code>{html.escape(run.model_uri)}</code>{step}"


def render_html(
    comparison: Comparison, loss_notes: list[str], fewshot_notes: list[str], goodput_notes: list[str] | None = None
) -> str:
    esc = html.escape
    runs = comparison.runs
    text_columns = {"Run", "Status", "Model", "Recipe"}
    head = "".join(f'<th class="{"text" if n in text_columns else ""}">{esc(n)}</th>' for n, _ in TABLE_COLUMNS)
    body = []
    for run in runs:
        cells = []
        for name, cell in TABLE_COLUMNS:
            value = esc(cell(run))
            if name == "Status":
                cells.append(f'<td class="text status-{esc(run.status)}">{value}</td>')
            elif name == "Run":
                cells.append(f'<td class="text" title="{esc(run.run_id)}">{value}</td>')
            else:
                cells.append(f'<td class="{"text" if name in text_columns else ""}">{value}</td>')
        body.append("<tr>" + "".join(cells) + "</tr>")
    table = f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>" if runs else ""
    run_notes = [f"{r.run_name}: {'; '.join(r.notes)}" for r in runs if r.notes] + list(comparison.notes)
    generated = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    experiments = ", ".join(comparison.experiments) or "—"
    ids = "".join(
        f"<li><code>{esc(r.run_id)}</code> {esc(r.run_name)} ({esc(r.experiment)}){_model_html(r)}</li>" for r in runs
    )
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>vitscale comparison — {esc(comparison.title)}</title>
<style>{_CSS}</style></head>
<body>
<h1>vitscale — run comparison: {esc(comparison.title)}</h1>
<p class="meta">{len(runs)} run(s) · experiment(s): {esc(experiments)}
 · read from <code>{esc(comparison.tracking_uri)}</code> · generated {generated}</p>
<h2>Runs</h2>
{table}
<p class="meta">Latest value of each metric. Accuracies are on the evaluation suite's test splits; the fine-tune
column is the mean over the fine-tuned datasets, VTAB the mean over the tasks that ran (count shown); goodput is
the productive share of the job's wall-clock (<code>goodput/fraction</code>, "—" for a run without a ledger).
Full precision in <a href="{CSV_NAME}">{CSV_NAME}</a>.</p>
{_notes_html(run_notes) if run_notes else '<p class="meta">No notes: every run finished and has eval metrics.</p>'}
<h2>Training loss vs images seen</h2>
<figure><img src="{LOSS_PNG}" alt="training loss vs images seen">
<figcaption>train/loss against train/images_seen, one line per run; a dashed line ending in × is a run that
did not finish (crashed or still running).</figcaption></figure>
{_notes_html(loss_notes)}
<h2>Few-shot accuracy vs pre-training compute</h2>
<figure><img src="{FEWSHOT_PNG}" alt="few-shot 10-shot accuracy vs exaFLOPs">
<figcaption>fewshot/mean/10shot at each evaluated checkpoint (the large point is the latest) against the
cumulative train/exaflops at that step (log x), as in Figure 5 of Dosovitskiy et al. (2021). The dashed line of
each run is its step-0 value: the same model at random initialisation, evaluated with the same suite.</figcaption>
</figure>
{_notes_html(fewshot_notes)}
{_gains_html(runs)}
{goodput_section_html([(r.run_name, r.goodput, r.step_tails, r.data_wait_tails) for r in runs], goodput_notes or [])}
<h2>Run ids and models</h2>
<p class="meta">A run's model is the HF ViT folder its job (or <code>python -m pretrain.weights export ...
--mlflow-run ID</code>) logged to it: <code>mlflow.pyfunc.load_model(uri).predict(pixels)</code> gives its logits.</p>
<ul class="meta">{ids or "<li>none</li>"}</ul>
</body></html>
"""


def write_report(comparison: Comparison, out_dir: Path) -> Path:
    """Write index.html, the PNGs and runs.csv into ``out_dir`` (created); returns the index path."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_csv(comparison, out_dir / CSV_NAME)
    loss_notes = plot_loss(comparison.runs, out_dir / LOSS_PNG)
    fewshot_notes = plot_fewshot(comparison.runs, out_dir / FEWSHOT_PNG)
    goodput_notes: list[str] = []
    if any(r.goodput is not None for r in comparison.runs):
        goodput_notes = plot_goodput([(r.run_name, r.goodput) for r in comparison.runs], out_dir / GOODPUT_PNG)
    else:  # an earlier report's goodput.png would be logged
        (out_dir / GOODPUT_PNG).unlink(missing_ok=True)
    index = out_dir / "index.html"
    index.write_text(render_html(comparison, loss_notes, fewshot_notes, goodput_notes), encoding="utf-8")
    return index
