"""VTAB-1k (Zhai et al. 2019; docs/reference.md §4) as the ViT paper runs it, and an offline stand-in over the built-in
datasets. Protocols: ``finetune`` (the paper's) and ``linear_probe`` (default: the few-shot ridge on frozen features,
not comparable with the paper's scores). A task without data is a ``missing`` row; each mean has its task count.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np

from data_pipeline.manifest import read_dataset_json
from evals.evaluator import EvalOutput, ResultRow
from evals.features import (
    StreamedSplit,
    check_sizes,
    resolve_split,
    shared_models_on_host,
    split_info,
    suite_features,
)
from evals.fewshot import L2_SWEEP, RidgeSolver
from evals.finetune import (
    FinetuneOptions,
    check_crop_padding,
    drawn_splits,
    select_lr_and_evaluate,
    vtab_indices,
)

GROUPS = ("natural", "specialized", "structured")


@dataclass(frozen=True)
class VtabTask:
    name: str  # folder under the VTAB root; metric vtab/<name>
    group: str  # natural | specialized | structured
    num_classes: int | None  # None: the folder's dataset.json (offline stand-ins)
    source: str = ""  # the real task's TFDS name and label


def _tasks(*tasks: VtabTask) -> dict[str, VtabTask]:
    return {t.name: t for t in tasks}


VTAB1K_TASKS = _tasks(
    VtabTask("caltech101", "natural", 102, "tfds caltech101"),
    VtabTask("cifar100", "natural", 100, "tfds cifar100"),
    VtabTask("dtd", "natural", 47, "tfds dtd"),
    VtabTask("flowers102", "natural", 102, "tfds oxford_flowers102"),
    VtabTask("pets", "natural", 37, "tfds oxford_iiit_pet"),
    VtabTask("sun397", "natural", 397, "tfds sun397"),
    VtabTask("svhn", "natural", 10, "tfds svhn_cropped"),
    VtabTask("camelyon", "specialized", 2, "tfds patch_camelyon"),
    VtabTask("eurosat", "specialized", 10, "tfds eurosat/rgb"),
    VtabTask("resisc45", "specialized", 45, "tfds resisc45"),
    VtabTask("retinopathy", "specialized", 5, "tfds diabetic_retinopathy_detection/btgraham-300"),
    VtabTask("clevr_count", "structured", 8, "tfds clevr: number of objects - 3"),
    VtabTask("clevr_dist", "structured", 6, "tfds clevr: distance of the closest object, binned"),
    VtabTask("dmlab", "structured", 6, "tfds dmlab"),
    VtabTask("kitti_dist", "structured", 4, "tfds kitti: distance of the closest vehicle, binned"),
    VtabTask("dsprites_loc", "structured", 16, "tfds dsprites: x position, 16 bins"),
    VtabTask("dsprites_ori", "structured", 16, "tfds dsprites: orientation, 16 bins"),
    VtabTask("smallnorb_azim", "structured", 18, "tfds smallnorb: azimuth"),
    VtabTask("smallnorb_elev", "structured", 9, "tfds smallnorb: elevation"),
)

# Offline built-ins standing in for one Natural and three Structured tasks.
CI_TASKS = _tasks(
    VtabTask("digits", "natural", None, "built-in rendered digits (an SVHN-like stand-in)"),
    VtabTask("dsprites_loc", "structured", None, "built-in dSprites-like shapes: x position bins"),
    VtabTask("dsprites_ori", "structured", None, "built-in dSprites-like shapes: orientation bins"),
    VtabTask("shapes_count", "structured", None, "built-in shape counting (a Clevr-Count-like stand-in)"),
)

BENCHMARKS = {"vtab1k": VTAB1K_TASKS, "ci": CI_TASKS}


def aggregate(scores: dict[str, float | None], tasks: dict[str, VtabTask], prefix: str = "vtab") -> list[dict]:
    """The mean and group means over the tasks with a score (None or absent: missing; ``value`` NaN if none)."""
    unknown = set(scores) - set(tasks)
    if unknown:
        raise ValueError(f"scores for tasks outside the benchmark: {sorted(unknown)}; known: {sorted(tasks)}")
    present = {n: float(s) for n, s in scores.items() if s is not None and not math.isnan(s)}
    out = []

    def summary(metric: str, count_metric: str, label: str, names: list[str]) -> None:
        covered = [n for n in names if n in present]
        missing = [n for n in names if n not in present]
        value = float(np.mean([present[n] for n in covered])) if covered else math.nan
        detail = f"{label} over {len(covered)}/{len(names)} tasks"
        if missing:
            detail += f" (missing: {', '.join(missing)})"
        out.append(
            dict(
                metric=metric,
                count_metric=count_metric,
                value=value,
                count=len(covered),
                expected=len(names),
                detail=detail,
            )
        )

    summary(f"{prefix}/mean", f"{prefix}/num_tasks", "VTAB mean", list(tasks))
    for group in GROUPS:  # every group, even one the benchmark lacks ("0/0 tasks")
        names = [n for n, t in tasks.items() if t.group == group]
        summary(f"{prefix}/{group}", f"{prefix}/{group}_num_tasks", f"{group.capitalize()} mean", names)
    return out


# FinetuneOptions that type: vtab does not read, and what it reads instead.
_DRAW = "its own train_examples and val_examples draw train800/val200"
_UNUSED_FINETUNE = {
    "datasets": "it fine-tunes on its tasks",
    "train_split": "it reads <task>/train and <task>/test",
    "test_split": "it reads <task>/train and <task>/test",
    "image_size": "set the entry's own image_size",
    "resize_size": "set the entry's own resize_size",
    "train_examples": _DRAW,
    "val_examples": _DRAW,
    "holdout_fraction": _DRAW,
    "max_train_examples": _DRAW,
    "eval_steps": "use type: finetune for a learning curve",
}


@dataclass(frozen=True)
class VtabOptions:
    benchmark: str = "vtab1k"  # vtab1k (the 19 real tasks) | ci (offline built-ins)
    tasks: tuple[str, ...] | None = None  # a subset; the others are reported missing
    data_root: str | None = None  # None: the runner's --data-root
    protocol: Literal["linear_probe", "finetune"] = "linear_probe"
    seed: int = 0  # draws train800 / val200
    train_examples: int = 800
    val_examples: int = 200
    image_size: int | None = None  # None: the model's (finetune: else pos-embed interpolation)
    resize_size: int | None = None
    batch_size: int = 256
    l2_grid: tuple[float, ...] = L2_SWEEP  # linear_probe's choice
    finetune: FinetuneOptions = FinetuneOptions()  # protocol finetune's schedule (datasets unused)

    def __post_init__(self):
        if self.benchmark not in BENCHMARKS:
            raise ValueError(f"unknown benchmark {self.benchmark!r}; choose one of {sorted(BENCHMARKS)}")
        if self.tasks is not None:
            unknown = set(self.tasks) - set(BENCHMARKS[self.benchmark])
            if unknown:
                raise ValueError(
                    f"tasks {sorted(unknown)} are not in benchmark {self.benchmark!r}; "
                    f"known: {sorted(BENCHMARKS[self.benchmark])}"
                )
        if self.train_examples < 1 or self.val_examples < 1:
            raise ValueError("train_examples and val_examples must be >= 1 (VTAB-1k: 800 and 200)")
        if not self.l2_grid or any(l2 <= 0 for l2 in self.l2_grid):
            raise ValueError(f"l2_grid must be non-empty positive l2 strengths; got {list(self.l2_grid)}")
        check_sizes(self)
        if self.protocol == "finetune" and self.image_size is not None:  # else the checkpoint's (evals.runner)
            check_crop_padding(self.finetune.crop_padding, self.image_size, "finetune.crop_padding")
        unused = [name for name in _UNUSED_FINETUNE if getattr(self.finetune, name) != getattr(FinetuneOptions, name)]
        if unused:
            raise ValueError(
                f"finetune.{unused[0]} is not used by type: vtab ({_UNUSED_FINETUNE[unused[0]]}); drop it from the "
                "finetune block"
            )


def _linear_probe(ctx, opts: VtabOptions, train_dir, test_dir, num_classes: int) -> tuple[float, str]:
    x, y, info = suite_features(ctx, train_dir, opts)
    test_x, test_y, _ = suite_features(ctx, test_dir, opts)
    # _finetune's draw: over the manifest's count, at stream positions (a skipped damaged sample does not redraw)
    tr, va = vtab_indices(info.num_samples, opts.train_examples, opts.val_examples, opts.seed)
    last = int(max(tr.max(), va.max()))
    if last >= len(y):
        raise ValueError(
            f"{info.path}: the stream read {len(y)} of the {info.num_samples} samples its manifest lists, but the draw "
            f"needs position {last}; repair the split (`python -m data_pipeline.validate {info.path}`)"
        )
    x, test_x = x.astype(np.float64), test_x.astype(np.float64)
    solver = RidgeSolver.fit(x[tr], y[tr], num_classes)
    val = {float(l2): solver.accuracy(x[va], y[va], l2) for l2 in opts.l2_grid}
    best = max(sorted(val), key=lambda l2: val[l2])
    both = np.concatenate([tr, va])
    acc = RidgeSolver.fit(x[both], y[both], num_classes).accuracy(test_x, test_y, best)
    return acc, f"linear_probe l2={best:g} (val200 {val[best]:.3f})"


def _finetune(ctx, opts: VtabOptions, train_dir, test_dir, num_classes: int) -> tuple[float, str]:
    """Only the drawn train800/val200 are read in, as uint8; test streams."""
    ft = opts.finetune
    size = int(opts.image_size or ctx.model.config.image_size)
    need = opts.train_examples + opts.val_examples
    tr, va = vtab_indices(split_info(train_dir).num_samples, opts.train_examples, opts.val_examples, opts.seed)
    sizes = dict(image_size=size, resize_size=opts.resize_size)
    train800, val200 = drawn_splits(train_dir, tr, va, batch_size=opts.batch_size, **sizes)
    test = StreamedSplit(test_dir, batch_size=ft.eval_batch_size, **sizes)
    with shared_models_on_host(ctx):
        result = select_lr_and_evaluate(
            lambda: ctx.load_model(image_size=size),
            train800,
            val200,
            test,
            num_classes=num_classes,
            opts=ft,
            device=ctx.device,
            log=ctx.log,
        )
    lr, val = result.lr, result.val_scores[result.lr]
    return result.accuracy, f"finetune lr={lr:g} (val200 {val:.3f}), {ft.steps} steps at {size}px on {need}"


def _stand_in(name: str, *splits) -> str:
    """Why a split is no VTAB-1k task, naming the fix, when it is a built-in stand-in (dataset.json ``builtin``)."""
    for split in splits:
        if "builtin" in (read_dataset_json(split) or {}):
            return (
                f"{split} is the built-in stand-in (data_pipeline.builtin), not the VTAB-1k task: write the real one "
                f"with `python -m data_pipeline.write --source tfds:TFDS_DIR --vtab {name}` (docs/vtab.md), or run "
                "the stand-ins with suite ci_vtab"
            )
    return ""


def evaluate(ctx, opts: VtabOptions) -> EvalOutput:
    """Suite entry: ``vtab/<task>`` per task with data, ``vtab/mean`` and group means, each with its task count."""
    tasks = BENCHMARKS[opts.benchmark]
    root = opts.data_root or ctx.data_root
    wanted = list(opts.tasks) if opts.tasks is not None else list(tasks)
    out, scores = EvalOutput(), {}

    def missing(name: str, why: str) -> None:
        scores[name] = None
        out.rows.append(ResultRow("vtab", name, f"vtab/{name}", math.nan, count=0, status="missing", detail=why))

    for name, task in tasks.items():
        if name not in wanted:
            missing(name, "not in this suite's task list")
            continue
        try:
            generate = opts.benchmark == "ci"  # built-ins can be generated offline; real VTAB data cannot
            train_dir = resolve_split(root, name, "train", generate_builtin=generate)
            test_dir = resolve_split(root, name, "test", generate_builtin=generate)
        except ValueError as error:
            missing(name, str(error))
            ctx.log(f"vtab: {name} missing: {error}")
            continue
        if not generate and (why := _stand_in(name, train_dir, test_dir)):  # a damaged dataset.json raises
            missing(name, why)
            ctx.log(f"vtab: {name} missing: {why}")
            continue
        declared = split_info(train_dir).num_classes
        if task.num_classes is not None and declared != task.num_classes:
            raise ValueError(
                f"vtab task {name} has {task.num_classes} classes but {train_dir} declares {declared}; "
                "the folder does not hold this task (or its labels were remapped)"
            )
        test_declared = split_info(test_dir).num_classes
        if test_declared != declared:
            raise ValueError(
                f"vtab task {name}: {train_dir} declares {declared} classes but {test_dir} declares {test_declared}; "
                "both splits must share one label space"
            )
        run = _finetune if opts.protocol == "finetune" else _linear_probe
        acc, detail = run(ctx, opts, train_dir, test_dir, declared)
        scores[name] = acc
        out.rows.append(ResultRow("vtab", name, f"vtab/{name}", acc, detail=f"{task.group}; {detail}"))
        ctx.log(f"vtab: {name} top-1 {acc:.4f} ({detail})")
    if not any(scores.get(name) is not None for name in wanted):  # a mistyped root is no evaluation at 0/19 tasks
        details = [row.detail for row in out.rows if row.dataset in wanted]
        first = min(details, key=lambda detail: "stand-in" not in detail, default="")  # a stand-in's says so first
        raise ValueError(
            f"none of the {len(wanted)} {opts.benchmark} tasks of the suite has data under {root} ({first}); "
            "give the --data-root (or the entry's data_root) holding <task>/{train,test} (docs/vtab.md)"
        )
    bench = opts.benchmark
    for agg in aggregate(scores, tasks):
        metric, covered, status = agg["metric"], agg["count"], "ok" if agg["count"] else "missing"
        out.rows.append(
            ResultRow("vtab", bench, metric, agg["value"], count=covered, status=status, detail=agg["detail"])
        )
        # Coverage is its own row, logged even when 0: no mean without its task count.
        coverage = f"tasks covered by {(ctx.entry or 'vtab') + metric[len('vtab') :]} (of {agg['expected']})"
        out.rows.append(ResultRow("vtab", bench, agg["count_metric"], float(covered), detail=coverage))
    out.rows.append(ResultRow("vtab", bench, "vtab/num_tasks_expected", float(len(tasks)), detail=f"tasks in {bench}"))
    return out
