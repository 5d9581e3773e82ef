"""The plan's evals part: each suite's FLOPs, device-hours and memory per device, per checkpoint and over the run,
priced per evaluator entry from its options; all estimates (docs/vtab.md, "Eval cost in the plan")."""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from cluster.plan import memory
from cluster.plan.compute import ComputePlan
from cluster.plan.errors import PlanError
from cluster.plan.evals.cadence import MAX_PINNED, EvalCadence
from cluster.plan.evals.splits import split_classes, split_size
from cluster.profiles import ClusterProfile
from evals import vtab
from evals.fewshot import FewshotOptions
from evals.finetune import FinetuneOptions, autocast_dtype
from evals.inspection import InspectConfig
from evals.suites import EvaluatorSpec, load_suite
from evals.vtab import VtabOptions
from pretrain.config.train_config import TrainConfig
from pretrain.model import flops
from pretrain.model.vit import ViTConfig
from pretrain.telemetry.peak import Peak, cpu_peak, gpu_bf16, gpu_peak

GB = memory.GB
ACTIVATION_ALLOWANCE = 1.3  # allocator slack and backward's transient buffers over the saved activations (docs/vtab.md)
CUDA_CONTEXT_GB = 1.3  # an eval task's CUDA context and workspaces (docs/vtab.md)
INSPECT_ATTENTION_COPIES = 5  # a layer's fp32 attention weights + two float64 copies, at inspection's peak
MIN_REFUSED_DEVICE_HOURS = 1.0  # below this many eval device-hours in all, evals over budget only warn


@dataclass(frozen=True)
class Work:
    what: str
    model: ViTConfig  # at its resolution (fine-tuning: a fresh head, no pre-logits)
    flops: float
    train_images: float  # 0: inference only
    precision: str  # of its matmuls
    device_bytes: float  # peak, without the CUDA context
    host_bytes: float  # its data on the host


@dataclass(frozen=True)
class SuiteCost:
    suite: str
    every: int
    evaluations: int  # the baseline and the last included
    pflops: float  # per evaluated checkpoint
    device_hours: float  # per evaluated checkpoint, on one eval device
    memory_gb: float  # peak per eval device (host memory for CPU evals)
    share: float  # of the run's training FLOPs, over all its evaluations
    detail: str


@dataclass(frozen=True)
class EvalsPlan:
    """All numbers are estimates."""

    device: str
    capacity_gb: float  # GPU memory, or the eval's declared host memory
    mfu: float
    peaks: str
    budget_fraction: float
    share: float  # all suites together
    suites: tuple[SuiteCost, ...] = ()
    baseline: bool = True  # evals.baseline
    note: str = ""  # why there are no evals
    warnings: tuple[str, ...] = ()


@dataclass(frozen=True)
class EvalDevice:
    kind: str  # "cuda" | "cpu"
    capacity_bytes: float  # 0: not declared
    host_bytes: float  # evals.memory_gb; 0: not declared
    mfu: float
    describe: str
    peak_of: dict[str, Peak]  # by precision
    cuda_bf16: bool = True  # a GPU with bf16 tensor cores: `precision: auto` fine-tunes in bf16 there, else in fp32


def plan_evals(profile: ClusterProfile, config: TrainConfig, vit: ViTConfig, compute: ComputePlan) -> EvalsPlan:
    """PlanError when the evals would take a training GPU, do not fit their device, or cost more than
    `evals.budget_fraction` of the training FLOPs (and MIN_REFUSED_DEVICE_HOURS)."""
    e = config.evals
    if not e.schedule():
        extra = "; evals.extra_suites off too" if e.extra_suites else ""
        return EvalsPlan("none", 0.0, 0.0, "", e.budget_fraction, 0.0, note=f"none (no evals.suite{extra})")
    _check_entry_names(e.schedule())
    device = eval_device(profile)
    cadence = EvalCadence(e.schedule(), config.checkpoint.every_steps, compute.total_steps)
    train_flops = compute.total_exaflops * 1e18
    costs = []
    for suite, every in e.schedule():
        cost = suite_cost(suite, vit, config, device)
        n = cadence.evaluations(every, e.baseline)
        costs.append(dataclasses.replace(cost, every=every, evaluations=n, share=n * cost.pflops * 1e15 / train_flops))
    share = sum(c.share for c in costs)
    part = EvalsPlan(
        device=device.describe,
        capacity_gb=(device.capacity_bytes or device.host_bytes) / GB,
        mfu=device.mfu,
        peaks=", ".join(f"{p} {peak.tflops:.3g}" for p, peak in device.peak_of.items()),
        budget_fraction=e.budget_fraction,
        share=share,
        suites=tuple(costs),
        baseline=e.baseline,
    )
    warnings = _pace_warnings(part, config, cadence, compute.step_time_s)
    if share > e.budget_fraction:
        hours = sum(c.device_hours * c.evaluations for c in costs)
        if hours >= MIN_REFUSED_DEVICE_HOURS:
            raise PlanError(_over_budget(part, cadence, e.baseline))
        small = f" (not refused: ~{hours:.2g} eval device-hours in all, under {MIN_REFUSED_DEVICE_HOURS:g})"
        warnings = (_over_budget(part, cadence, e.baseline) + small, *warnings)
    return dataclasses.replace(part, warnings=warnings)


def eval_device(profile: ClusterProfile) -> EvalDevice:
    """PlanError when the profile's evals would take a training GPU or run beside training without declaring memory."""
    ev, name = profile.evals, profile.name
    if ev.num_gpus > 0 and profile.uses_gpus and not ev.instance_type:
        raise PlanError(
            f"profile {name}: evals ask for a GPU (evals.num_gpus={ev.num_gpus:g}) but have no node group of their "
            "own (evals.instance_type), so an eval would take a training GPU or wait for one; give evals an eval "
            "node type (evals.instance_type, cluster.render) or run them on CPUs (evals.num_gpus: 0)"
        )
    if ev.num_gpus == 0 and not ev.instance_type and ev.memory_gb <= 0:
        raise PlanError(
            f"profile {name}: evals run on the training nodes' CPUs but declare no memory; set evals.memory_gb "
            "(the host memory an eval may take: Ray places it only where that much is free)"
        )
    mfu = ev.assumed_mfu or profile.assumed_mfu
    if ev.num_gpus > 0:
        bf16 = gpu_bf16(ev.gpu_type)  # one the peak table lists without (V100, T4) emulates bf16: priced at fp32
        peaks = {p: _gpu_eval_peak(profile, p) for p in (("bf16", "fp32") if bf16 else ("fp32",))}
        where = f"{ev.instance_type} node group" if ev.instance_type else "own GPUs"
        describe = f"1 x {ev.gpu_type or 'GPU'} ({ev.gpu_memory_gb:g} GB) per eval on the {where}"
        return EvalDevice("cuda", ev.gpu_memory_gb * GB, ev.memory_gb * GB, mfu, describe, peaks, bf16)
    peaks = {"fp32": _cpu_eval_peak(profile, "fp32")}
    where = f"an {ev.instance_type} node" if ev.instance_type else "the training nodes, beside training"
    describe = f"{ev.num_cpus:g} CPU(s) per eval on {where}, {ev.memory_gb:g} GB reserved in Ray"
    return EvalDevice("cpu", 0.0, ev.memory_gb * GB, mfu, describe, peaks)


def _gpu_eval_peak(profile: ClusterProfile, precision: str) -> Peak:
    ev = profile.evals
    known = gpu_peak(ev.gpu_type, precision) if ev.gpu_type else None
    if known is not None:
        return known
    if ev.peak_tflops is not None:
        return Peak(ev.peak_tflops, f"profile {profile.name}: evals.peak_tflops")
    raise PlanError(
        f"profile {profile.name}: no {precision} peak is known for evals.gpu_type={ev.gpu_type!r} "
        "(pretrain.telemetry.peak); name a GPU its table lists or declare evals.peak_tflops"
    )


def _cpu_eval_peak(profile: ClusterProfile, precision: str) -> Peak:
    ev = profile.evals
    if ev.peak_tflops is not None:
        return Peak(ev.peak_tflops, f"profile {profile.name}: evals.peak_tflops")
    if profile.is_local:
        return cpu_peak(precision, threads=max(1, int(ev.num_cpus)))
    raise PlanError(
        f"profile {profile.name}: CPU evals on remote nodes without evals.peak_tflops; declare the eval CPUs' "
        "peak TFLOP/s in the profile's evals section so the plan can price the evals"
    )


def _check_entry_names(schedule: tuple[tuple[str, int], ...]) -> None:
    """PlanError when two suites of the run have an entry of one name: their metrics would share MLflow keys (two
    few-shot suites: one `fewshot/mean/10shot` curve alternating between two measures)."""
    owner: dict[str, str] = {}
    for suite, _ in schedule:
        for spec in load_suite(suite).evaluators:
            if spec.name in owner:
                raise PlanError(
                    f"evals: suites {owner[spec.name]} and {suite} both have an entry named {spec.name!r}: their "
                    f"metrics ({spec.name}/...) would land on the same MLflow keys, one curve of two measures; give "
                    f"the entry a name of its own in one of the suites (`name: {Path(suite).stem}`), "
                    "whose metrics are then logged under it"
                )
            owner[spec.name] = suite


def suite_cost(suite: str, vit: ViTConfig, config: TrainConfig, device: EvalDevice) -> SuiteCost:
    """One evaluation of ``suite`` (cadence and share: the caller's); PlanError when an entry does not fit."""
    loaded = load_suite(suite)
    works = [
        _entry_work(spec, vit, config.evals.data_root, device.kind, device.cuda_bf16) for spec in loaded.evaluators
    ]
    hours = 0.0
    for spec, work in zip(loaded.evaluators, works):
        _check_fits(loaded.name, spec, work, device)
        peak = device.peak_of.get(work.precision) or device.peak_of["fp32"]
        hours += work.flops / (peak.tflops * 1e12 * device.mfu) / 3600
    total = sum(w.flops for w in works)
    peak_bytes = max(_work_memory(w, device) for w in works)
    detail = "; ".join(w.what for w in works)
    return SuiteCost(loaded.name, 1, 0, total / 1e15, hours, peak_bytes / GB, 0.0, detail)


def _entry_work(spec: EvaluatorSpec, vit: ViTConfig, data_root: str, kind: str, cuda_bf16: bool = True) -> Work:
    o = spec.options
    if isinstance(o, FewshotOptions):
        size = _size(o.image_size, vit, spec)
        images = [(split_size(data_root, d, o.train_split), split_size(data_root, d, o.test_split)) for d in o.datasets]
        return _features_work(f"fewshot {len(images)} datasets", size, o.batch_size, images, vit, kind, keep_all=True)
    if isinstance(o, VtabOptions):
        root = o.data_root or data_root
        tasks = list(o.tasks) if o.tasks is not None else list(vtab.BENCHMARKS[o.benchmark])
        size = _size(o.image_size, vit, spec)
        if o.protocol == "finetune":
            return _vtab_finetune_work(o, tasks, root, size, vit, kind, cuda_bf16)
        vtab_first = o.benchmark == "vtab1k"
        images = [(split_size(root, t, "train", vtab_first), split_size(root, t, "test", vtab_first)) for t in tasks]
        what = f"vtab linear probe {len(tasks)} tasks"  # every task's features stay in the suite's cache
        return _features_work(what, size, o.batch_size, images, vit, kind, keep_all=True)
    if isinstance(o, FinetuneOptions):
        return _finetune_work(o, data_root, _size(o.image_size, vit, spec), vit, kind, cuda_bf16)
    if isinstance(o, InspectConfig):
        return _inspect_work(o, vit)
    return Work(f"{spec.name}: not priced (no cost model for type {spec.type})", vit, 0.0, 0.0, "fp32", 0.0, 0.0)


def _finetune_model(vit: ViTConfig, size: int, num_classes: int) -> ViTConfig:
    return dataclasses.replace(vit, image_size=size, num_classes=num_classes, representation_size=None)


def _train_flops(model: ViTConfig, recompute: bool) -> float:
    return flops.forward_flops(model) * (4 if recompute else 3)


def _size(image_size: int | None, vit: ViTConfig, spec: EvaluatorSpec) -> int:
    size = int(image_size or vit.image_size)
    if size % vit.stride:
        near = max(vit.stride, round(size / vit.stride) * vit.stride)
        raise PlanError(
            f"eval entry {spec.name} ({spec.type}): image_size={size} is not a multiple of the model's patch stride "
            f"{vit.stride}; the eval would fail at the first checkpoint. Set its image_size to a multiple, e.g. {near}"
        )
    return size


def _features_work(
    what: str, size: int, batch: int, images: list[tuple[int, int]], vit: ViTConfig, kind: str, keep_all=False
) -> Work:
    """The host keeps float32 features (every dataset's with ``keep_all``) and a float64 copy of the largest pair."""
    model = dataclasses.replace(vit, image_size=size, num_classes=0)  # no head runs
    total = sum(a + b for a, b in images)
    largest = max(a + b for a, b in images)
    host = (vit.representation_size or vit.width) * (4 * (total if keep_all else largest) + 8 * largest)
    block = memory.vit_activation_bytes(model, "fp32", depth=1, sdpa=kind == "cuda")  # inference's transient peak
    device = _weights(model, 4) + batch * (_image_bytes(size) + block)
    what = f"{what}, {total:,} images at {size}px"
    return Work(what, model, total * flops.forward_flops(model), 0.0, "fp32", device, host)


def _inspect_work(o: InspectConfig, vit: ViTConfig) -> Work:
    """One forward per image, all of them on the device; a layer of a batch at a time, its attention weights (heads,
    T, T) per image in fp32 and, at the peak, two float64 copies of them (`evals.inspection.run_inspection`)."""
    model, size = dataclasses.replace(vit, num_classes=0), vit.image_size
    tokens = model.num_patches + (model.pool == "token")
    attention = INSPECT_ATTENTION_COPIES * 4 * model.num_heads * tokens**2
    block = memory.vit_activation_bytes(model, "fp32", depth=1)  # the explicit weights counted apart
    device = _weights(model, 4) + min(o.batch_size, o.num_images) * (block + attention)
    images = o.num_images * _image_bytes(size)  # loaded as float32 on the host
    what = f"inspect {o.num_images} images at {size}px"
    return Work(what, model, o.num_images * flops.forward_flops(model), 0.0, "fp32", device + images, images)


def _vtab_finetune_work(
    o: VtabOptions, tasks: list[str], root: str, size: int, vit: ViTConfig, kind: str, cuda_bf16: bool
) -> Work:
    """A head of the task's classes (10 where the benchmark does not say)."""
    ft, vtab_first = o.finetune, o.benchmark == "vtab1k"
    search = ft.selection_steps or ft.steps
    runs = ft.batch_size * (len(ft.lr_grid) * search + ft.steps)  # per task
    total = forwards = 0.0
    models = []
    for task in tasks:
        models.append(_finetune_model(vit, size, vtab.BENCHMARKS[o.benchmark][task].num_classes or 10))
        scored = len(ft.lr_grid) * o.val_examples + split_size(root, task, "test", vtab_first)
        total += runs * _train_flops(models[-1], ft.activation_checkpointing) + scored * flops.forward_flops(models[-1])
        forwards += scored
    what = (
        f"vtab finetune {len(tasks)} tasks x ({len(ft.lr_grid)} lr x {search} + {ft.steps} steps) x batch "
        f"{ft.batch_size} at {size}px, + {forwards:,.0f} test/val images"
    )
    drawn = o.train_examples + o.val_examples
    return _finetune_result(what, ft, models, total, len(tasks) * runs, kind, drawn, cuda_bf16)


def _finetune_work(o: FinetuneOptions, root: str, size: int, vit: ViTConfig, kind: str, cuda_bf16: bool) -> Work:
    """Per dataset: lr-search runs on the kept part, the final run on kept + held-out, held-out scored per lr, test
    at the end and at each learning-curve point."""
    search = o.selection_steps or o.steps
    train = forwards = total = pool_most = 0.0
    models = []
    for name in o.datasets:
        models.append(model := _finetune_model(vit, size, split_classes(root, name, o.train_split)))
        pool = min(split_size(root, name, o.train_split), o.max_train_examples)
        held = o.val_examples if o.val_examples is not None else max(1, round(o.holdout_fraction * pool))
        kept = o.train_examples if o.train_examples is not None else pool - held
        images = len(o.lr_grid) * search * min(o.batch_size, kept) + o.steps * min(o.batch_size, kept + held)
        points = 1 + len(set(o.eval_steps) - {o.steps})
        scored = len(o.lr_grid) * held + points * split_size(root, name, o.test_split)
        total += images * _train_flops(model, o.activation_checkpointing) + scored * flops.forward_flops(model)
        train, forwards, pool_most = train + images, forwards + scored, max(pool_most, kept + held)
    what = (
        f"finetune {len(o.datasets)} datasets x ({len(o.lr_grid)} lr x {search} + {o.steps} steps) x batch "
        f"{o.batch_size} at {size}px, + {forwards:,.0f} test/held-out images"
    )
    return _finetune_result(what, o, models, total, train, kind, pool_most, cuda_bf16)


def _finetune_precision(o: FinetuneOptions, kind: str, cuda_bf16: bool = True) -> str:
    return "bf16" if autocast_dtype(o.precision, kind, cuda_bf16=cuda_bf16) is not None else "fp32"


def _finetune_result(
    what: str,
    o: FinetuneOptions,
    models: list[ViTConfig],
    total: float,
    train: float,
    kind: str,
    drawn: float,
    cuda_bf16: bool,
) -> Work:
    """At the widest head; the ``drawn`` images are uint8 on the host, float32 on the device."""
    model = max(models, key=lambda m: m.num_classes)
    micro, size = min(o.micro_batch_size or o.batch_size, o.batch_size), model.image_size
    per_image = finetune_activation_bytes(o, model, kind, cuda_bf16)
    device = _weights(model, 12) + micro * per_image + o.batch_size * _image_bytes(size)
    return Work(what, model, total, train, _finetune_precision(o, kind, cuda_bf16), device, drawn * 3 * size * size)


def finetune_activation_bytes(o: FinetuneOptions, model: ViTConfig, kind: str, cuda_bf16: bool = True) -> float:
    """Bytes one fine-tuning image keeps for backward, a hybrid's ResNet stem included, x ACTIVATION_ALLOWANCE
    (docs/vtab.md, "Fine-tuning memory")."""
    precision, checkpointing = _finetune_precision(o, kind, cuda_bf16), o.activation_checkpointing
    per_image = memory.vit_activation_bytes(
        model, precision, dropout=model.dropout, activation_checkpointing=checkpointing, sdpa=kind == "cuda"
    )
    return ACTIVATION_ALLOWANCE * (per_image + memory.stem_activation_bytes(model, precision))  # no recompute there


def _weights(vit: ViTConfig, bytes_per_param: int) -> float:
    return bytes_per_param * flops.param_count(vit)


def _image_bytes(size: int) -> float:
    return 3 * size * size * 4  # a float32 image on the device


def _work_memory(work: Work, device: EvalDevice) -> float:
    if device.kind == "cuda":
        return work.device_bytes + CUDA_CONTEXT_GB * GB
    return work.device_bytes + _host_bytes(work)


def _host_bytes(work: Work) -> float:
    """Beside the device's: its data, the loaded fp32 weights, the process."""
    return work.host_bytes + _weights(work.model, 4) + memory.CPU_OVERHEAD_GB * GB


def _check_fits(suite: str, spec: EvaluatorSpec, work: Work, device: EvalDevice) -> None:
    """PlanError when ``work`` does not fit its eval device or the host memory the eval declares."""
    host = _host_bytes(work)
    if device.kind == "cuda" and device.host_bytes and host > device.host_bytes:
        raise PlanError(
            f"eval suite {suite}, entry {spec.name}: needs ~{host / GB:.3g} GB of host memory (an estimate: features "
            f"or drawn images, the loaded weights, the process), over the {device.host_bytes / GB:.3g} GB it reserves "
            "in Ray (the profile's evals.memory_gb); raise evals.memory_gb within the eval node's memory, or evaluate "
            "fewer or smaller datasets"
        )
    need, capacity = _work_memory(work, device), device.capacity_bytes or device.host_bytes
    if need <= capacity:
        return
    where = "GPU memory" if device.kind == "cuda" else "evals.memory_gb"
    fixes = _memory_fixes(spec, work, device, need - capacity)
    raise PlanError(
        f"eval suite {suite}, entry {spec.name}: needs ~{need / GB:.3g} GB per eval device (an estimate), over the "
        f"{capacity / GB:.3g} GB of {where}; the eval would fail at the first checkpoint. Fix: " + "; or ".join(fixes)
    )


def _memory_fixes(spec: EvaluatorSpec, work: Work, device: EvalDevice, over: float) -> list[str]:
    o = spec.options.finetune if isinstance(spec.options, VtabOptions) else spec.options
    fixes = []
    if isinstance(o, FinetuneOptions) and work.train_images:
        per_image = finetune_activation_bytes(o, work.model, device.kind, device.cuda_bf16)
        micro = min(o.micro_batch_size or o.batch_size, o.batch_size)
        room = micro - math.ceil(over / per_image)
        fits = [d for d in range(1, max(room, 0) + 1) if o.batch_size % d == 0]
        if fits:
            fixes.append(f"micro_batch_size: {max(fits)} (a divisor of batch_size {o.batch_size})")
        if not o.activation_checkpointing:
            fixes.append("activation_checkpointing: true (each block's input only; one more forward per step)")
    elif hasattr(spec.options, "batch_size"):
        fixes.append(f"a smaller batch_size than {spec.options.batch_size}")
    fixes.append("a bigger eval device (the profile's evals: gpu_type, gpu_memory_gb, instance_type; or memory_gb)")
    return fixes


def _over_budget(part: EvalsPlan, cadence: EvalCadence, baseline: bool) -> str:
    shares = ", ".join(f"{c.suite} {_percent(c.share)} ({c.evaluations} evals)" for c in part.suites)
    worst = max(part.suites, key=lambda c: c.share)
    room = part.budget_fraction - (part.share - worst.share)
    per_eval = worst.share / worst.evaluations
    every = next(
        (n for n in range(worst.every, 10 * worst.every + 1000) if cadence.evaluations(n, baseline) * per_eval <= room),
        None,
    )
    cadence_fix = (
        f"raise its every to {every}"
        if every
        else "evaluate it less often (its baseline and last alone exceed the budget)"
    )
    return (
        f"the evals would cost {_percent(part.share)} of the training FLOPs, over evals.budget_fraction="
        f"{part.budget_fraction:g} ({shares}; estimates). Fix: for {worst.suite}, {cadence_fix} (evals.every or "
        "evals.extra_suites[].every); or change its protocol (a linear probe or few-shot instead of fine-tuning, "
        "fewer lr values, steps or tasks, a lower image_size); or give evals more of the budget "
        "(evals.budget_fraction)"
    )


def _pace_warnings(part: EvalsPlan, config: TrainConfig, cadence: EvalCadence, step_s: float) -> tuple[str, ...]:
    warnings = []
    load = sum(c.device_hours * 3600 / (c.every * config.checkpoint.every_steps * step_s) for c in part.suites)
    wait_s, skipped, due = _queue(part, cadence, step_s)
    if load > 1 or skipped:
        # Evals that keep up on average still skip checkpoints that come due while a slow suite holds the device.
        times = next(
            t for t in itertools.count(max(2, math.ceil(load))) if not _queue(part, _every(cadence, t), step_s)[1]
        )
        if load > 1:
            why, cheaper = (
                f"evals need ~{load:.2g} eval devices to keep up with training (device-hours per hour of training, "
                "estimated): they fall behind",
                "",
            )
        else:
            slow = max(part.suites, key=lambda c: c.device_hours)
            why = f"evals queue behind {slow.suite}'s ~{slow.device_hours:.2g} h per checkpoint on one eval device"
            cheaper = f" for {slow.suite}"
        skips = (
            f", and the scheduler, which pins at most {MAX_PINNED} checkpoints for pending evals, would skip the "
            f"evals of ~{skipped} of the {due} checkpoints due for them (estimated)"
            if skipped
            else ", and the scheduler skips evals beyond its pinned checkpoints"
        )
        warnings.append(
            f"{why}{skips}; raise their every ({times}x: {_every_times(config, times)}), give evals more devices (a "
            f"faster evals.gpu_type / instance_type), or a cheaper protocol{cheaper}"
        )
    last_s = sum(c.device_hours for c in part.suites) * 3600
    if wait_s > config.evals.timeout_s:
        behind = wait_s - last_s
        queued = f", behind ~{behind / 3600:.2g} h of earlier checkpoints' still queued" if behind > 0 else ""
        warnings.append(
            f"the last checkpoint's evals take ~{last_s / 3600:.2g} h on one eval device{queued} (estimated), but the "
            f"job's end waits evals.timeout_s={config.evals.timeout_s:g} s for them, then cancels them; raise "
            f"evals.timeout_s (--set evals.timeout_s={math.ceil(1.25 * wait_s / 3600) * 3600} with a quarter's "
            "margin)"
        )
    return tuple(warnings)


def eval_queue(part: EvalsPlan, cadence: EvalCadence, step_s: float, steps: list[int]) -> Iterator[tuple[bool, float]]:
    """For each save of ``steps`` (ascending, the last step last): (whether a suite is due, when its evals end; NaN
    where none run) on one eval device taking the checkpoints in turn, as the scheduler holds them: a due one waits
    pinned, or is skipped while MAX_PINNED wait (never the last)."""
    seconds = {suite: c.device_hours * 3600 for (suite, _), c in zip(cadence.suites, part.suites)}
    free_at, pending = 0.0, []  # when the device is free; when each pinned one's evals end
    for step in steps:
        now, due = step * step_s, cadence.due(step)
        pending = [end for end in pending if end > now]
        if due and (len(pending) < MAX_PINNED or step == cadence.last_step):
            free_at = max(free_at, now) + sum(seconds[suite] for suite in due)
            pending.append(free_at)
            yield True, free_at
        else:
            yield bool(due), math.nan


def _queue(part: EvalsPlan, cadence: EvalCadence, step_s: float) -> tuple[float, int, int]:
    """(seconds from the last save to the end of its evals, checkpoints whose evals are skipped, checkpoints due)
    (`eval_queue`)."""
    last = cadence.last_step
    grid = math.gcd(*(every for _, every in cadence.suites)) * cadence.checkpoint_every  # where any suite is due
    queue = list(eval_queue(part, cadence, step_s, [*([0] if part.baseline else []), *range(grid, last, grid), last]))
    free_at = max((end for _, end in queue if not math.isnan(end)), default=0.0)
    skipped = sum(due and math.isnan(end) for due, end in queue)
    return free_at - last * step_s, skipped, sum(due for due, _ in queue)


def _every(cadence: EvalCadence, times: int) -> EvalCadence:
    """``cadence`` with every suite ``times`` as far apart (`_every_times`)."""
    return dataclasses.replace(cadence, suites=tuple((suite, every * times) for suite, every in cadence.suites))


def _every_times(config: TrainConfig, times: int) -> str:
    """The `--set`s that evaluate every suite ``times`` as far apart."""
    e = config.evals
    sets = [f"--set evals.every={e.every * times}"]
    if e.extra_suites:
        extras = ", ".join(f"{{suite: {s.suite}, every: {s.every * times}}}" for s in e.extra_suites)
        sets.append(f"--set 'evals.extra_suites=[{extras}]'")
    return " ".join(sets)


def evals_lines(p: EvalsPlan) -> list[str]:
    if not p.suites:
        return [f"  evals         {p.note}"]
    lines = [f"  evals         on {p.device}; assumed MFU {p.mfu:.0%} of its dense peak ({p.peaks} TFLOP/s); estimates"]
    for c in p.suites:
        ends = "the baseline and the last" if p.baseline else "the last"
        cadence = "every checkpoint" if c.every == 1 else f"every {_ordinal(c.every)} checkpoint, {ends}"
        lines.append(
            f"    {c.suite:<13} {cadence} ({c.evaluations} evals): {c.pflops:.3g} PFLOPs = {c.device_hours:.3g} "
            f"device-hours, {c.memory_gb:.3g} GB of {p.capacity_gb:.3g} GB per device per checkpoint; "
            f"{_percent(c.share)} of training ({c.detail})"
        )
    within = "within" if p.share <= p.budget_fraction else "OVER"
    lines.append(
        f"  evals budget  {_percent(p.share)} of the training FLOPs in all, {within} evals.budget_fraction "
        f"{_percent(p.budget_fraction)}"
    )
    return lines


def _percent(share: float) -> str:
    return f"{100 * share:.3g}%"


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"
