"""Collect step of the cross-run report: MLflow runs → `Comparison`, from the store alone (any past run works)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np

from tracking import keys
from tracking.report_goodput import Goodput, is_finite, read_goodput, read_tails
from tracking.report_goodput import _finite as _latest

COMPARISON_KIND = "comparison"  # keys.KIND of the runs reports are logged to
COMPARISONS_EXPERIMENT = "comparisons"
MAX_RUNS = 100  # newest runs kept without a selection (noted)
_UNNAMED_ENTRIES = ("fewshot", "finetune", "vtab", "inspect")  # evals.suites' types: the columns' keys
_FINETUNE_KEY = re.compile(r"^finetune/([^/]+)/accuracy$")  # keys.finetune_accuracy(dataset)


@dataclass(frozen=True)
class RunSummary:
    """One row: each metric's latest value (MLflow's latest: the highest step)."""

    run_id: str
    run_name: str
    experiment: str
    status: str
    model: str | None
    patch: int | None
    recipe: str | None
    steps: int | None
    images_seen: float | None
    exaflops: float | None
    final_loss: float | None
    fewshot_10shot: float | None
    finetune_accuracy: float | None  # mean over datasets in finetune_datasets
    finetune_datasets: tuple[str, ...]
    vtab_mean: float | None
    vtab_num_tasks: int | None
    vtab_num_tasks_expected: int | None
    start_time_ms: int
    # Curves: (images_seen, loss) per step; (exaFLOPs, accuracy, step) per checkpoint after step 0.
    loss_curve: tuple[tuple[float, float], ...] = ()
    fewshot_curve: tuple[tuple[float, float, int], ...] = ()
    notes: tuple[str, ...] = field(default=())
    fewshot_baseline: float | None = None  # fewshot/mean/10shot at step 0
    fewshot_last_step: int | None = None  # the newest step with a fewshot/mean/10shot value
    model_uri: str | None = None  # tag vitscale.model_uri
    model_step: int | None = None  # the checkpoint step that model holds
    goodput: Goodput | None = None  # None: no ledger logged
    step_tails: tuple[tuple[int, float], ...] = ()  # (percentile, train/step_s_pNN) of the last logging window
    data_wait_tails: tuple[tuple[int, float], ...] = ()  # (percentile, train/data_wait_s_pNN) likewise

    @property
    def fewshot_gain(self) -> float | None:
        """The latest 10-shot mean minus its step-0 value (None without both, or with no checkpoint after step 0)."""
        if self.fewshot_baseline is None or self.fewshot_10shot is None or not self.fewshot_last_step:
            return None
        return self.fewshot_10shot - self.fewshot_baseline

    @property
    def fewshot_gains(self) -> tuple[tuple[int, float], ...]:
        """(step, gain over step 0) per checkpoint after step 0."""
        if self.fewshot_baseline is None:
            return ()
        return tuple((step, value - self.fewshot_baseline) for _, value, step in self.fewshot_curve)

    @property
    def label(self) -> str:
        parts = [p for p in (self.model, self.recipe) if p]
        return f"{self.run_name} ({', '.join(parts)})" if parts else self.run_name


@dataclass(frozen=True)
class Comparison:
    title: str
    tracking_uri: str
    experiments: tuple[str, ...]
    runs: tuple[RunSummary, ...]
    notes: tuple[str, ...] = ()


def _history(client, run_id: str, key: str) -> list[tuple[int, float]]:
    """(step, value) sorted by step; a step logged twice (a resumed run) keeps the later value."""
    by_step: dict[int, tuple[int, float]] = {}
    for m in client.get_metric_history(run_id, key):
        if is_finite(m.value) and (m.step not in by_step or m.timestamp >= by_step[m.step][0]):
            by_step[m.step] = (m.timestamp, m.value)
    return [(step, by_step[step][1]) for step in sorted(by_step)]


def _newest_ledger(client, run_id: str, metrics: dict) -> dict:
    """``metrics`` with the `goodput/` values of the newest ledger logged. Each job logs its own, at its steps; MLflow's
    latest value is the highest step's: an earlier job's, while a relaunch that resumed from an earlier checkpoint has
    not passed that step (or ended below it)."""
    if keys.GOODPUT_WALL_S not in metrics:
        return metrics
    wall = client.get_metric_history(run_id, keys.GOODPUT_WALL_S)
    newest = max(wall, key=lambda m: (m.timestamp, m.step), default=None)
    if newest is None or newest.step == max(m.step for m in wall):
        return metrics
    ledger = {k: v for k, v in metrics.items() if not k.startswith(keys.GOODPUT_PREFIX)}
    for key in (k for k in metrics if k.startswith(keys.GOODPUT_PREFIX)):
        at = [m for m in client.get_metric_history(run_id, key) if m.step == newest.step]
        if at:
            ledger[key] = max(at, key=lambda m: m.timestamp).value
    return ledger


def _interp(step: int, table: list[tuple[int, float]]) -> float:
    """A cumulative counter at ``step``, linear between logged steps."""
    steps, values = zip(*table)
    return float(np.interp(step, steps, values))


def _patch_size(model: str | None, params: dict) -> int | None:
    """Pixels per token side: the model name's trailing digits (``r50_vit_b16`` → 16, where param
    ``model.patch_size`` is 1: its ViT's patch on the ResNet's features), else that param (``vit_tiny_debug``)."""
    match = re.search(r"(\d+)$", model or "")
    if match:
        return int(match.group(1))
    return int(params["model.patch_size"]) if "model.patch_size" in params else None


def _effective_status(mlflow_status: str, vitscale_status: str) -> str:
    """MLflow's, except a RUNNING run whose ``vitscale.status`` says it ended takes that, and a FINISHED one that says
    it stopped (``schedule.stop_at_step``; a standalone run ends its MLflow run FINISHED then) is STOPPED."""
    if mlflow_status == "FINISHED" and vitscale_status.lower() == "stopped":
        return "STOPPED"
    if mlflow_status != "RUNNING":
        return mlflow_status
    return {"finished": "FINISHED", "failed": "FAILED", "stopped": "STOPPED"}.get(vitscale_status.lower(), "RUNNING")


def summarize_run(client, run, experiment_name: str) -> RunSummary:
    data, info = run.data, run.info
    metrics, params, tags = data.metrics, data.params, data.tags
    model = tags.get(keys.MODEL) or params.get("model.name")
    loss = _history(client, info.run_id, keys.LOSS)
    seen = _history(client, info.run_id, keys.IMAGES_SEEN)
    flops = _history(client, info.run_id, keys.EXAFLOPS)
    fewshot = _history(client, info.run_id, keys.FEWSHOT_MEAN_10SHOT)
    steps = max((s for s, _ in loss + seen), default=None)

    loss_curve: tuple = ()
    if loss and seen:
        loss_curve = tuple((_interp(step, seen), value) for step, value in loss)
    baseline = next((value for step, value in fewshot if step == 0), None)
    fewshot_curve: tuple = ()
    if fewshot and flops:
        fewshot_curve = tuple((_interp(step, flops), value, step) for step, value in fewshot if step > 0)

    finetune, finetune_note = _finetune_at_one_step(client, info.run_id, metrics)
    vtab, vtab_notes = _vtab_at_one_step(client, info.run_id)
    notes: list[str] = []
    status = _effective_status(info.status, tags.get(keys.STATUS, ""))
    if status == "FAILED":
        notes.append(f"run FAILED (crashed) at step {steps if steps is not None else '?'}; numbers are from then")
    elif status == "RUNNING":
        where = "no step logged yet" if steps is None else f"last logged step {steps}"
        notes.append(f"run still RUNNING (or crashed without reporting); {where}")
    elif status == "STOPPED":
        notes.append(f"run stopped before the end of its schedule, at step {steps}")
    elif status != "FINISHED":
        notes.append(f"run status {status}; last logged step {steps}")
    if not loss:
        notes.append(f"no training metrics ({keys.LOSS}) logged")
    elif not seen:
        notes.append(f"{keys.IMAGES_SEEN} not logged: left out of the loss plot")
    failed = sorted(k for k in metrics if k.startswith(keys.eval_failed("")))
    if not any(keys.is_eval_metric(k) for k in metrics):
        why = (
            f"every eval failed: {', '.join(failed)}; see the run's eval_failures/"
            if failed
            else "no checkpoint evaluated yet"
        )
        notes.append(f"no eval metrics logged ({why})")
    else:
        if fewshot and not flops:
            notes.append(f"{keys.EXAFLOPS} not logged: left out of the few-shot vs compute plot")
        if fewshot and baseline is None:
            notes.append(f"no step-0 {keys.FEWSHOT_MEAN_10SHOT} (evals.baseline off, or a run from before it): no gain")
        notes += [*vtab_notes, *finetune_note, *_named_means(metrics)]
    return RunSummary(
        run_id=info.run_id,
        run_name=info.run_name or info.run_id[:8],
        experiment=experiment_name,
        status=status,
        model=model,
        patch=_patch_size(model, params),
        recipe=tags.get(keys.RECIPE),
        steps=steps,
        images_seen=seen[-1][1] if seen else None,
        exaflops=flops[-1][1] if flops else None,
        final_loss=loss[-1][1] if loss else None,
        fewshot_10shot=_latest(metrics, keys.FEWSHOT_MEAN_10SHOT),
        finetune_accuracy=sum(finetune.values()) / len(finetune) if finetune else None,
        finetune_datasets=tuple(sorted(finetune)),
        vtab_mean=vtab[0],
        vtab_num_tasks=vtab[1],
        vtab_num_tasks_expected=vtab[2],
        start_time_ms=info.start_time or 0,
        loss_curve=loss_curve,
        fewshot_curve=fewshot_curve,
        notes=tuple(notes),
        fewshot_baseline=baseline,
        fewshot_last_step=fewshot[-1][0] if fewshot else None,
        model_uri=tags.get(keys.MODEL_URI),
        model_step=_int_tag(tags.get(keys.MODEL_STEP)),
        goodput=read_goodput(_newest_ledger(client, info.run_id, metrics)),
        step_tails=read_tails(metrics, keys.step_time_percentile),
        data_wait_tails=read_tails(metrics, keys.data_wait_percentile),
    )


def _finetune_at_one_step(client, run_id: str, metrics: dict) -> tuple[dict[str, float], list[str]]:
    """The accuracies of the datasets fine-tuned at the newest step that has any (each key's latest value may be
    another checkpoint's), and a note naming those scored only earlier."""
    tuned = {m.group(1): dict(_history(client, run_id, k)) for k in metrics if (m := _FINETUNE_KEY.match(k))}
    step = max((max(h) for h in tuned.values() if h), default=None)
    finetune = {name: h[step] for name, h in tuned.items() if step in h}
    untuned = sorted(name for name, h in tuned.items() if h and name not in finetune)
    if not untuned:
        return finetune, []
    mean = f"the column is the mean of that step's {len(finetune)}"
    return finetune, [f"fine-tune at step {step} has no {', '.join(untuned)} (scored at earlier steps): {mean}"]


def _vtab_at_one_step(client, run_id: str) -> tuple[tuple[float | None, int | None, int | None], list[str]]:
    """(mean, tasks, tasks expected) of the newest step with a mean, and notes: a later eval that scored no task
    logs its counts but no mean."""
    mean = _history(client, run_id, keys.VTAB_MEAN)
    counts = [dict(_history(client, run_id, k)) for k in (keys.VTAB_NUM_TASKS, keys.VTAB_NUM_TASKS_EXPECTED)]
    step = mean[-1][0] if mean else max(counts[0], default=None)
    count, expected = (int(c[step]) if step in c else None for c in counts)
    notes = []
    if count is not None and expected is not None and count < expected:
        notes.append(f"VTAB mean covers {count} of {expected} tasks")
    if mean and (later := [s for s in counts[0] if s > step]):
        notes.append(f"VTAB at step {max(later)} scored no task: the VTAB column is step {step}'s")
    return (mean[-1][1] if mean else None, count, expected), notes


def _named_means(metrics: dict) -> list[str]:
    """A note naming the means of named suite entries (`vtab1k_probe/mean`), which no column shows."""
    named = sorted(k for k in metrics if keys.is_eval_mean(k) and k.split("/")[0] not in _UNNAMED_ENTRIES)
    if not named:
        return []
    shown = ", ".join(f"{k} {metrics[k]:.4f}" for k in named[:6]) + (f" and {len(named) - 6} more" if named[6:] else "")
    return [f"named suite entries' means: {shown}; the columns show the unnamed entries' (fewshot/, finetune/, vtab/)"]


def _int_tag(value: str | None) -> int | None:
    return int(value) if value is not None and value.lstrip("-").isdigit() else None


def _newest_runs(client, experiment_ids: list[str]) -> list:
    """The newest `MAX_RUNS` + 1 runs that are not comparison runs, which each `make compare` adds: read page by page,
    so that they do not take the places of the runs compared."""
    runs, token = [], None
    while True:
        page = client.search_runs(
            experiment_ids, max_results=MAX_RUNS + 1, order_by=["start_time DESC"], page_token=token
        )
        runs += [r for r in page if r.data.tags.get(keys.KIND) != COMPARISON_KIND]
        token = page.token
        if len(runs) > MAX_RUNS or not token:
            return runs


def collect(client, tracking_uri: str, experiment: str | None = None, run_ids: tuple[str, ...] = ()) -> Comparison:
    """Summarize runs by id, by experiment, or all; ValueError on a bad name."""
    from mlflow.exceptions import MlflowException  # heavy

    names = {e.experiment_id: e.name for e in client.search_experiments()}
    notes: list[str] = []
    if run_ids:
        runs = []
        for run_id in dict.fromkeys(run_ids):  # a repeated id once, in the order given
            try:
                runs.append(client.get_run(run_id))
            except MlflowException as error:
                raise ValueError(f"run {run_id!r} not found in {tracking_uri}: check the id in `make ui`") from error
            if runs[-1].data.tags.get(keys.KIND) == COMPARISON_KIND:
                ids = (runs[-1].data.tags.get(keys.COMPARED_RUNS) or "").split(",")
                compared = ",".join(ids[:4]) + (",..." if len(ids) > 4 else "") or f"its tag {keys.COMPARED_RUNS}"
                raise ValueError(
                    f"run {run_id} is a comparison report (tag {keys.KIND}={COMPARISON_KIND}), not a pre-training run; "
                    f"pass the runs it compares ({compared})"
                )
        title = f"{len(runs)} selected runs"
    else:
        ids, title = list(names), "all experiments"
        if experiment:
            found = client.get_experiment_by_name(experiment)
            if found is None:
                listing = ", ".join(sorted(names.values())) or "(none: the store is empty)"
                raise ValueError(
                    f"experiment {experiment!r} not found in {tracking_uri}; existing experiments: {listing}. "
                    "Pass one of them with --experiment (make compare EXPERIMENT=...), or omit it to compare all runs."
                )
            ids, title = [found.experiment_id], f"experiment {experiment}"
        runs = _newest_runs(client, ids) if ids else []
    runs = [r for r in runs if r.data.tags.get(keys.KIND) != COMPARISON_KIND]
    if len(runs) > MAX_RUNS and not run_ids:
        notes.append(f"only the newest {MAX_RUNS} runs are shown; select runs with --runs or --experiment")
        runs = runs[:MAX_RUNS]
    runs.sort(key=lambda r: r.info.start_time or 0)
    summaries = tuple(summarize_run(client, r, names.get(r.info.experiment_id, r.info.experiment_id)) for r in runs)
    if not summaries:
        notes.append("no pre-training runs to compare: launch one with `make launch` (or pick another experiment)")
    experiments = tuple(sorted({s.experiment for s in summaries}))
    return Comparison(
        title, tracking_uri, experiments or ((experiment,) if experiment else ()), summaries, tuple(notes)
    )
