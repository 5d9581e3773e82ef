"""A run's DeepSpeed engine and its precision."""

from __future__ import annotations

from pathlib import Path

import torch

from pretrain import checkpointer as ckpt
from pretrain.checkpoint import run_folder
from pretrain.checkpoint.run_folder import TrainerState
from pretrain.config.ds_config import engine_config
from pretrain.config.optim import build_optimizer
from pretrain.config.precision import PrecisionChoice, StepShape, decide, decide_on_rank0, probe_bf16_speedup
from pretrain.config.train_config import TrainConfig, model_overrides
from pretrain.distributed import Placement, import_deepspeed
from pretrain.model.tasks import build_task
from pretrain.model.vit import Block, build_model, model_config
from pretrain.randomness import seed_everything


def decide_precision(
    config: TrainConfig, place: Placement, num_classes: int, start: ckpt.StartPoint
) -> PrecisionChoice:
    """`deepspeed.precision` for this run, the same on every rank; a first `probe` is recorded in the run folder."""
    d, run_dir, overrides = config.data, Path(config.checkpoint.dir), model_overrides(config, num_classes)
    resumed = recorded = None
    if start.kind in ("run", "resume_from"):
        kept = TrainerState.read(start.folder).precision
        resumed = None if kept is None else (kept, start.folder.name)
    record = run_folder.read_precision_record(run_dir) if config.deepspeed.precision == "probe" else None
    if record is not None:
        why = f"{run_dir / run_folder.PRECISION_RECORD}: {record['reason']}"
        recorded = PrecisionChoice(record["precision"], "run-record", why)
    shape = StepShape.of(model_config(config.model.name, **overrides), d.micro_batch_size)

    def probe() -> tuple[float, float]:
        return probe_bf16_speedup(
            lambda: build_task(config, build_model(config.model.name, **overrides)), d.micro_batch_size, d.image_size
        )

    def here() -> PrecisionChoice:
        choice = decide(
            config.deepspeed.precision,
            place.device.type,
            shape,
            resumed=resumed,
            recorded=recorded,
            probe=probe,
            zero_stage=config.deepspeed.zero_stage,
        )
        if choice.rule == "probe":  # timed now
            run_folder.write_precision_record(run_dir, choice.precision, choice.rule, choice.reason)
        return choice

    return decide_on_rank0(here)


def build_engine(
    config: TrainConfig,
    place: Placement,
    num_classes: int,
    start: ckpt.StartPoint,
    precision: str,
    load_universal: bool = False,
):
    """Model (fresh or `init_from` weights) → task → torch AdamW → DeepSpeed engine; returns (engine, model)."""
    deepspeed = import_deepspeed()
    seed_everything(config.seed)  # identical initialisation on every rank
    model = build_model(config.model.name, **model_overrides(config, num_classes))
    if start.kind == "init_from":
        ckpt.init_weights(model, start.folder, config.data.image_size)
    if config.model.compile:
        # a CPU rank builds kernels on its own threads (docs/performance.md, "Compiled blocks")
        model.compile_blocks(compile_threads=torch.get_num_threads() if place.device.type == "cpu" else None)
    task = build_task(config, model)
    external_parameters = getattr(task, "external_parameters", None)
    if config.deepspeed.zero_stage == 3 and external_parameters is not None:
        # read outside their module's forward: ZeRO-3 gathers them around the task's
        for param in external_parameters():
            deepspeed.zero.register_external_parameter(task, param)
    if config.deepspeed.zero_stage == 3 and config.model.compile:
        # leaf blocks: hooks on their children would be traced and recompiled (docs/performance.md)
        deepspeed.utils.set_z3_leaf_modules(task, [Block])
    ds_config = engine_config(config, place.world_size, precision, load_universal)
    optimizer = build_optimizer(task, config.optim, place.device.type)
    engine, _, _, _ = deepspeed.initialize(model=task, optimizer=optimizer, config=ds_config)
    keep_grad_norm(engine)
    return engine, model


def keep_grad_norm(engine) -> None:
    """Without a ZeRO or bf16 optimizer (ZeRO-0 fp32) DeepSpeed drops the norm its clip computes, and
    `get_global_grad_norm` stays None (no `train/grad_norm`): keep it, from DeepSpeed's own clip (the same numerics), or
    measured before the step where nothing is clipped (the gradients are all-reduced by then)."""
    if hasattr(engine.optimizer, "_global_grad_norm"):
        return
    from deepspeed.runtime.utils import clip_grad_norm_

    def clip() -> None:
        parameters, max_norm = engine.module.parameters(), engine.gradient_clipping()
        engine._global_grad_norm = clip_grad_norm_(parameters, max_norm, mpu=engine.mpu)

    def measure(*_) -> None:
        norms = [p.grad.detach().float().norm() for p in engine.module.parameters() if p.grad is not None]
        engine._global_grad_norm = torch.linalg.vector_norm(torch.stack(norms)) if norms else None

    if engine.gradient_clipping() > 0:
        engine.clip_fp32_gradients = clip
    else:
        engine.optimizer.register_step_pre_hook(measure)
