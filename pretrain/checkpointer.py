"""Saving and resuming checkpoints (docs/contracts.md, "Checkpoints")."""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import time
import warnings
from argparse import Namespace
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, SupportsFloat

import numpy as np
import torch
import torch.distributed as dist
import yaml

from data_pipeline.cli import to_stderr
from data_pipeline.manifest import read_dataset_info
from data_pipeline.paths import is_remote
from data_pipeline.stream.order import merge_stream_states
from pretrain import randomness
from pretrain.checkpoint import checksums, run_folder
from pretrain.checkpoint.run_folder import CONFIG_YAML, DEEPSPEED_DIR, WEIGHTS_FILE, TrainerState
from pretrain.checkpoint.safe_load import check_weights_only, load_weights_only
from pretrain.checkpoint.writes import CheckpointSaveError, SaveAttempt, failure_message
from pretrain.config.ds_config import batch_plan
from pretrain.config.optim import build_schedule
from pretrain.config.train_config import TrainConfig
from pretrain.model.vit import VisionTransformer
from pretrain.resumable import DROP_RESUME_FROM, NEW_RUN, check_resumable, saved_setting
from pretrain.weights import source as weights_source
from pretrain.weights.formats import (
    check_init_architecture,
    load_npz,
    load_pretrained,
    save_pretrained,
)
from tracking.store import flatten_config
from tracking.tracker import Tracker


@dataclass(frozen=True)
class StartPoint:
    kind: str  # "run" (this run's newest checkpoint) | "resume_from" | "init_from" | "scratch"
    path: Path | None

    @property
    def folder(self) -> Path:
        if self.path is None:
            raise ValueError(f"a {self.kind} start reads no checkpoint")
        return self.path


def find_start(config: TrainConfig) -> StartPoint:
    """Collective: the run's newest intact checkpoint, else ``resume_from``, ``init_from`` (ValueError if damaged)
    or scratch."""
    latest = newest_verified(Path(config.checkpoint.dir))
    if latest is not None:
        check_resumable(config, latest, f"the run folder's newest checkpoint {latest}", NEW_RUN)
        return StartPoint("run", latest)
    c = config.checkpoint
    if c.resume_from is not None:
        folder = run_folder.require_complete(Path(c.resume_from), "checkpoint.resume_from")
        check_resumable(config, folder, f"checkpoint.resume_from={c.resume_from}", DROP_RESUME_FROM)
        return StartPoint("resume_from", _intact(folder, "checkpoint.resume_from"))
    if c.init_from is not None:
        if is_remote(c.init_from):
            return StartPoint("init_from", _fetched(c.init_from))
        source = weights_source.locate_setting(c.init_from, "checkpoint.init_from")
        if run_folder.is_complete(source):
            _intact(source, "checkpoint.init_from", only=checksums.WEIGHT_FILES)
        return StartPoint("init_from", source)
    return StartPoint("scratch", None)


def nothing_to_train(config: TrainConfig) -> str | None:
    """Before any rank starts: the line saying that the checkpoint a start would resume from already reaches where
    this run stops, else None; ValueError if it lies past ``schedule.total``, where a resume cannot follow the run's
    lr schedule. Reads the newest COMPLETE checkpoint's step; a done one is verified first, since a start skips a
    damaged one and trains again from an older one."""
    found = _resume_candidate(config)
    if found is None:
        return None
    folder, named, fix = found
    check_resumable(config, folder, named, fix)
    try:
        step = run_folder.open_checkpoint(folder).step
    except ValueError:  # a damaged trainer state: the start skips this checkpoint, or says why it cannot
        return None
    if step is None:
        return None
    s, d = config.schedule, config.data
    epoch_images = d.epoch_images or read_dataset_info(d.train).num_samples  # as `pretrain.trainer.prepare_data`
    total = build_schedule(config.optim, s, d.global_batch_size, epoch_images).total_steps
    total_text = f"schedule.total={s.total}" + ("" if str(s.total) == str(total) else f" ({total} steps)")
    if step > total:
        saved = _saved_total(folder)
        back = f"back to the run's own, {saved}," if saved is not None else f"to at least {step} steps"
        raise ValueError(
            f"{named} is at step {step}, past {total_text}: resuming at a lower total would follow another lr "
            f"schedule; set schedule.total {back} or {fix}"
        )
    if step < min(total, s.stop_at_step or total) or not checksums.verify(folder).ok:
        return None
    if step < total:
        return (
            f"nothing to train: {named} is at step {step}, which reaches schedule.stop_at_step={s.stop_at_step}; "
            f"to train on towards {total_text}, raise schedule.stop_at_step or remove it "
            "(--set schedule.stop_at_step=null)"
        )
    return (
        f"nothing to train: {named} is at step {step}, which reaches {total_text}: the run is done; to train "
        f"further, raise schedule.total (--set schedule.total=N: the lr schedule changes from here on), or {fix}"
    )


def _resume_candidate(config: TrainConfig) -> tuple[Path, str, str] | None:
    """The checkpoint `find_start` tries first, unverified: (folder, its name in a message, how to train afresh)."""
    c = config.checkpoint
    newest = run_folder.latest_checkpoint(c.dir)
    if newest is not None:
        return newest, f"the run folder's newest checkpoint {newest}", NEW_RUN
    if c.resume_from is not None and run_folder.is_complete(c.resume_from):
        return Path(c.resume_from), f"checkpoint.resume_from={c.resume_from}", DROP_RESUME_FROM
    return None


def _saved_total(folder: Path) -> Any:
    """The ``schedule.total`` the checkpoint was saved under, or None if unreadable."""
    return saved_setting(folder, "schedule", "total")


def _fetched(url: str) -> Path:
    """Collective: a verified local copy of the ``checkpoint.init_from`` URL, one per node."""
    rank, _ = _rank_and_world()
    first_on_node = int(os.environ.get("LOCAL_RANK", "0")) == 0
    copy: list[Path] = []  # this rank's verified copy, if it fetched one

    def fetch(source: str) -> str:
        copy.append(weights_source.resolve(source))
        return weights_source.origin(copy[0])

    exact = _every_rank(lambda: fetch(url) if rank == 0 else None, url)[0]
    _every_rank(lambda: fetch(exact) if first_on_node and rank != 0 else None, url)
    # the others find the node's copy by listing the store again, which may fail on one rank
    return _every_rank(lambda: copy[0] if copy else weights_source.locate(exact), url)[rank]


def _every_rank(fetch: Callable[[], Any], url: str) -> list[Any]:
    """Collective: each rank's ``fetch()``; ValueError on every rank if one failed."""
    try:
        result, problem = fetch(), None
    except (OSError, ImportError, weights_source.DamagedCheckpointError) as error:
        result, problem = None, f"checkpoint.init_from={url!r}: {error}"
    gathered = _gather((result, problem))
    problems = [p for _, p in gathered if p]
    if problems:
        raise ValueError(problems[0])
    return [r for r, _ in gathered]


def newest_verified(run_dir: Path) -> Path | None:
    """Collective: the run's newest COMPLETE checkpoint that is not damaged; None if none, ValueError if all are."""
    rank, world = _rank_and_world()
    candidates: list[Path] = _gather(run_folder.complete_checkpoints(run_dir))[0]
    damaged = []
    for folder in reversed(candidates):
        verdict = checksums.combine(folder, _gather(checksums.verify(folder, part=(rank, world))))
        if verdict.ok:
            if rank == 0 and verdict.status == "unverified":
                to_stderr(
                    f"warning: resuming {folder} unverified: it records no checksums (written before checkpoints did)"
                )
            return folder
        if rank == 0:
            to_stderr(f"skipping damaged checkpoint {folder}: {verdict.problem}; resuming from an older one")
        damaged.append(verdict)
    if damaged:
        raise ValueError(
            f"every checkpoint of {run_dir} is damaged ({'; '.join(v.line() for v in damaged)}); restore one from a "
            f"copy, or move {run_folder.checkpoints_dir(run_dir)} away to start the run over"
        )
    return None


def _intact(folder: Path, setting: str, only: tuple[str, ...] | None = None) -> Path:
    verdict = checksums.verify(folder, only=only)
    if not verdict.ok:
        raise ValueError(
            f"{setting}={folder} is damaged: {verdict.problem}; point it at an intact checkpoint "
            "(`python -m pretrain.checkpoint verify <run folder>` lists them)"
        )
    return folder


def _rank_and_world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def _gather(obj: Any) -> list[Any]:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def save_checkpoint(
    engine,
    model: VisionTransformer,
    config: TrainConfig,
    *,
    step: int,
    images_seen: int,
    stream_state: dict[str, Any],
    metrics: dict[str, float] | None = None,
    pin: str | None = None,
) -> Path:
    """Collective: save and publish; returns the COMPLETE folder. A failed write raises on every rank. ``pin``: the
    folder is pinned with this reason before it is COMPLETE, so no stop between the two leaves it unpinned."""
    rank, _ = _rank_and_world()
    run_dir = Path(config.checkpoint.dir)
    tag = run_folder.step_name(step)
    tmp = run_folder.staging_dir(run_dir, step)
    attempt = SaveAttempt(tmp, rank)
    if rank == 0:
        attempt.write(tmp, lambda: run_folder.start_staging(tmp), record=False)
    _agree(attempt)
    with attempt.routing(engine):
        # DeepSpeed writes "latest" outside the attempt, where a failure would raise on rank 0 alone: see below
        engine.save_checkpoint(str(tmp / DEEPSPEED_DIR), tag=tag, client_state={"step": step}, save_latest=False)
    stream_states, rng_states = _gather(_jsonable(stream_state)), _gather(randomness.rng_state())
    _save_consolidated(engine, model, tmp, rank, attempt)
    if rank == 0:
        state = TrainerState(
            step=step,
            images_seen=images_seen,
            world_size=len(stream_states),
            deepspeed_tag=tag,
            stream_state=merge_stream_states(stream_states),
            rng_states=tuple(rng_states),
            metrics=metrics or {},
            saved_at=time.time(),
            precision="bf16" if engine.bfloat16_enabled() else "fp32",
        )
        attempt.write(tmp / run_folder.TRAINER_STATE, lambda: state.write(tmp))
        attempt.write(tmp / CONFIG_YAML, lambda: run_folder.write_durably(tmp / CONFIG_YAML, config.to_yaml()))
        latest = tmp / DEEPSPEED_DIR / "latest"
        attempt.write(latest, lambda: run_folder.write_durably(latest, tag))
    for other in _agree(attempt):
        attempt.written.update(other.written)
    final = run_folder.checkpoint_dir(run_dir, step)
    if rank == 0:
        attempt.record_rest()
        attempt.write(tmp / run_folder.CHECKSUMS, lambda: checksums.write(tmp, attempt.written), record=False)
        if pin is not None:
            attempt.write(tmp / run_folder.PINNED, lambda: run_folder.pin_checkpoint(tmp, pin), record=False)
        attempt.write(final, lambda: run_folder.publish(tmp), record=False)
        if attempt.failure is None:
            run_folder.prune_checkpoints(run_dir, config.checkpoint.keep_last, upto=step)
    _agree(attempt)  # every rank waits until the checkpoint is COMPLETE
    return final


def _agree(attempt: SaveAttempt) -> list[SaveAttempt]:
    """Collective: every rank's attempt; on any failure rank 0 removes the partial files and all ranks raise."""
    attempts = _gather(attempt)
    failure = next((a.failure for a in attempts if a.failure is not None), None)
    if failure is None:
        return attempts
    message = None
    if attempt.rank == 0:
        staged = sum(p.stat().st_size for p in attempt.staging.rglob("*") if p.is_file())
        final = attempt.staging.with_name(attempt.staging.name.removesuffix(run_folder.STAGING_SUFFIX))
        shutil.rmtree(attempt.staging, ignore_errors=True)
        if final.is_dir() and not run_folder.is_complete(final):
            shutil.rmtree(final, ignore_errors=True)
        message = failure_message(failure, attempt.staging, staged)
    raise CheckpointSaveError(_gather(message)[0])


def _save_consolidated(engine, model: VisionTransformer, directory: Path, rank: int, attempt: SaveAttempt) -> None:
    """Collective: rank 0 writes ``model``'s weights; a bf16 run writes the fp32 masters, not the bf16 copy."""
    import deepspeed  # already imported by the engine

    masters = _fp32_masters(model, rank) if engine.bfloat16_enabled() else {}
    rest = [p for name, p in model.named_parameters() if name not in masters]
    with deepspeed.zero.GatheredParameters(rest, modifier_rank=None, enabled=engine.zero_optimization_stage() == 3):
        if rank == 0:
            held = {name: master for name, master in masters.items() if master is not None}
            weights = _holding(model, {**model.state_dict(), **held}) if held else model
            attempt.write(directory / WEIGHTS_FILE, lambda: save_pretrained(weights, directory), record=False)


def _fp32_masters(model: torch.nn.Module, rank: int) -> dict[str, torch.Tensor | None]:
    """Collective: ``{name: fp32 master}`` of the trained parameters; None off rank 0."""
    from deepspeed.utils import safe_get_full_fp32_param

    masters = {}
    for name, param in model.named_parameters():
        full = safe_get_full_fp32_param(param)  # a collective
        if full is not None:  # None: frozen
            masters[name] = full.cpu() if rank == 0 else None
    return masters


def _holding(model: VisionTransformer, state: dict[str, torch.Tensor]) -> VisionTransformer:
    with torch.device("meta"):
        copy = type(model)(model.config)
    copy.load_state_dict(state, assign=True)
    return copy


UNIVERSAL_DIR = "universal"  # <checkpoint>/universal/<tag>/: engine state for any world size


def prepare_resume(start: StartPoint, world_size: int, rank: int) -> Path | None:
    """Collective: the universal checkpoint to load, or None (docs/elastic.md, "Checkpoints at another world size");
    ValueError on every rank if rank 0 cannot convert it."""
    if start.kind not in ("run", "resume_from"):
        return None
    state = TrainerState.read(start.folder)
    if state.world_size == world_size:
        return None
    engine_dir = start.folder / DEEPSPEED_DIR / state.deepspeed_tag
    if not any(engine_dir.glob("*optim_states.pt")):
        return None
    target = start.folder / UNIVERSAL_DIR
    problem = None
    if rank == 0 and not target.is_dir():
        try:
            _convert(start.folder, engine_dir, target, state, world_size)
        except ValueError as error:  # the others wait in `_gather`: a raise here would leave them to the timeout
            problem = str(error)
    problems = [p for p in _gather(problem) if p is not None]
    if problems:
        raise ValueError(problems[0])
    return target


def _convert(folder: Path, engine_dir: Path, target: Path, state: TrainerState, world_size: int) -> None:
    """Rank 0: ``engine_dir`` as a universal checkpoint at ``target``; ValueError if it cannot be read or converted."""
    check_weights_only(engine_dir)  # the converter unpickles unguarded
    started = time.perf_counter()
    staging = target.with_name(UNIVERSAL_DIR + run_folder.STAGING_SUFFIX)
    shutil.rmtree(staging, ignore_errors=True)
    try:
        _to_universal(engine_dir, staging / state.deepspeed_tag)
    except Exception as error:  # e.g. a partition file missing from a checkpoint without checksums.json
        shutil.rmtree(staging, ignore_errors=True)
        cause = " ".join(f"{type(error).__name__}: {error}".split())
        raise ValueError(
            f"{engine_dir} cannot be converted for world size {world_size} ({cause}): resume it at the world size "
            f"that saved it ({state.world_size}), or resume from another checkpoint (checkpoint.resume_from, "
            "`python -m pretrain.checkpoint verify <run folder>` lists them)"
        ) from error
    staging.rename(target)
    size = sum(f.stat().st_size for f in target.rglob("*") if f.is_file())
    print(
        f"converted {folder.name} (world size {state.world_size}) to a universal checkpoint for world size "
        f"{world_size}: {time.perf_counter() - started:.1f} s, {size / 1e6:.1f} MB",
        flush=True,
    )


def _to_universal(engine_dir: Path, output: Path) -> None:
    """DeepSpeed's ds_to_universal, in-process (``inject_missing_state``: Megatron's universal_checkpoint_info)."""
    from deepspeed.checkpoint import ds_to_universal  # heavy; only a resize needs it

    args = Namespace(
        input_folder=str(engine_dir),
        output_folder=str(output),
        num_extract_workers=1,
        num_merge_workers=1,
        keep_temp_folder=False,
        strict=True,
        inject_missing_state=True,
    )
    # its lines and progress bars (stderr), each resize; errors still raise
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        ds_to_universal.main(args)


def load_checkpoint(engine, checkpoint_dir: Path, universal: Path | None = None) -> TrainerState:
    """Collective: restore the engine (from ``universal`` if given); returns the trainer state, not restoring RNG."""
    state = TrainerState.read(checkpoint_dir)
    load_weights_only(engine.checkpoint_engine)
    folder = universal if universal is not None else Path(checkpoint_dir) / DEEPSPEED_DIR
    if universal is not None:  # DeepSpeed loads these unguarded
        check_weights_only(folder)
    optimizer = getattr(engine.optimizer, "optimizer", engine.optimizer)  # the AdamW inside ZeRO
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    load_path, _ = engine.load_checkpoint(str(folder), tag=state.deepspeed_tag, load_lr_scheduler_states=False)
    if load_path is None:
        raise RuntimeError(f"DeepSpeed found no engine state under {folder}")
    if universal is not None:
        # two ZeRO-3 universal-load bugs (docs/elastic.md)
        for group, saved in zip(optimizer.param_groups, groups):
            group.update(saved)
        place_steps(optimizer)
    return state


def place_steps(optimizer: torch.optim.Optimizer) -> None:
    """Each Adam ``step`` as torch's own ``load_state_dict`` leaves it, which DeepSpeed's universal loader skips: a
    copy of its own (ZeRO-3 shares one tensor), on its parameter's device (its moments') as float32 for a fused or
    capturable optimizer (the CUDA AdamW `build_optimizer` makes is fused: its kernel reads the step on the GPU)."""
    on_device = any(group.get("fused") or group.get("capturable") for group in optimizer.param_groups)
    for param_state in optimizer.state.values():  # ZeRO-3's universal load empties the groups' params
        step = param_state.get("step")
        if torch.is_tensor(step):
            where = param_state.get("exp_avg", step).device
            param_state["step"] = step.to(where, torch.float32, copy=True) if on_device else step.clone()


def init_weights(model: VisionTransformer, source: Path, image_size: int) -> list[str]:
    """Copy same-name, same-shape weights from a model.safetensors folder or an .npz; returns the names not copied.
    Across pools the position embeddings' patch rows are copied; a class row the source lacks stays fresh."""
    src = load_npz(source, image_size=image_size) if source.suffix == ".npz" else load_pretrained(source, image_size)
    check_init_architecture(src.config, model.config, weights_source.origin(source))
    mine, theirs = model.state_dict(), src.state_dict()
    if src.num_prefix_tokens != model.num_prefix_tokens:  # another pool: the patch rows carry over, the class row not
        mine_prefix = mine["pos_embed"][:, : model.num_prefix_tokens]
        theirs["pos_embed"] = torch.cat([mine_prefix, theirs["pos_embed"][:, src.num_prefix_tokens :]], dim=1)
    usable = {k: v for k, v in theirs.items() if k in mine and mine[k].shape == v.shape}
    model.load_state_dict(usable, strict=False)
    skipped = sorted(set(mine) - set(usable))
    if skipped:
        warnings.warn(f"init_from {source}: kept the fresh initialisation for {skipped}", stacklevel=2)
    return skipped


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, (np.ndarray, np.generic)):  # a numpy scalar's tolist() is item()
        return obj.tolist()
    return obj


# settings a resume may change without changing what it computes
_RESUME_MAY_CHANGE = (
    "checkpoint.",
    "logging.",
    "evals.",
    "schedule.stop_at_step",
    "data.num_workers",
    "data.loader_start_method",
    "deepspeed.timeout_minutes",
)


def _warn_config_changes(checkpoint_dir: Path, config: TrainConfig) -> None:
    saved = flatten_config(yaml.safe_load((checkpoint_dir / CONFIG_YAML).read_text()))
    now = flatten_config(config.to_dict())
    changed = sorted(
        k for k in set(saved) | set(now) if saved.get(k) != now.get(k) and not k.startswith(_RESUME_MAY_CHANGE)
    )
    if changed:
        diffs = ", ".join(f"{k}: {saved.get(k)} -> {now.get(k)}" for k in changed)
        to_stderr(
            f"warning: resuming {checkpoint_dir} with changed settings ({diffs}); the run is no longer an exact "
            "continuation"
        )


def resume(
    engine, stream, start: StartPoint, rank: int, world_size: int, config: TrainConfig, universal: Path | None = None
) -> TrainerState | None:
    """Restore engine and stream from a full checkpoint; its trainer state, or None."""
    if start.kind not in ("run", "resume_from"):
        return None
    state = load_checkpoint(engine, start.folder, universal)
    stream.load_state_dict(state.stream_state)
    if rank == 0:
        print(f"resumed from {start.folder} at step {state.step} ({start.kind})", flush=True)
        if state.world_size != world_size:
            # the saved run's micro-batch: the one in force now may not split the batch at the old world size
            saved = saved_setting(start.folder, "data", "micro_batch_size")
            per_step, G = state.world_size * saved if isinstance(saved, int) else 0, config.data.global_batch_size
            before = f"{G // per_step} -> " if per_step > 0 and G % per_step == 0 else ""
            after = batch_plan(config.data, world_size).grad_accum_steps
            print(
                f"resuming step {state.step} at world size {world_size} (was {state.world_size}): accumulation "
                f"{before}{after}, global batch {config.data.global_batch_size}",
                flush=True,
            )
        _warn_config_changes(start.folder, config)
    return state


CheckpointCallback = Callable[[Path, int, dict], None]
PinReason = Callable[[int], str | None]  # a step's pin reason (`save_checkpoint`'s ``pin``), None: no pin


class Checkpointer:
    """Saves on the cadence, at the last step, and step 0 of a fresh evaluated run; then runs ``on_checkpoint`` on
    every rank. The tracker is synced first, so a checkpoint is published only once its steps' metrics are logged. A
    failed save stops the run unless ``on_save_error: skip``."""

    def __init__(
        self,
        config: TrainConfig,
        last_step: int,
        on_checkpoint: CheckpointCallback | None = None,
        tracker: Tracker | None = None,
        pin: PinReason | None = None,
    ):
        self.every, self.last_step, self.on_checkpoint = config.checkpoint.every_steps, last_step, on_checkpoint
        self.pin = pin
        self.tracker, self.on_save_error = tracker, config.checkpoint.on_save_error
        self.baseline = on_checkpoint is not None and bool(config.evals.suite) and config.evals.baseline
        self.saved: list[str] = []  # this attempt's checkpoints
        self.save_seconds = 0.0  # wall seconds spent saving (goodput)

    def save_baseline(self, trainer) -> None:
        """Save a fresh run's step-0 weights; draws no random numbers."""
        if self.baseline and trainer.start_step == 0 and trainer.state is None:
            self._save(trainer, {})

    def due(self, step: int) -> bool:
        return step % self.every == 0 or step == self.last_step

    def after_step(self, trainer, metrics: Mapping[str, SupportsFloat]) -> None:
        """Save if ``trainer.step`` is `due`; only then are ``metrics`` read."""
        if self.due(trainer.step):
            self._save(trainer, {key: float(value) for key, value in metrics.items()})

    def _save(self, trainer, metrics: dict[str, float]) -> None:
        started = time.perf_counter()
        try:
            self._save_and_hand_over(trainer, metrics)
        finally:  # a failed save counts too
            self.save_seconds += time.perf_counter() - started

    def _save_and_hand_over(self, trainer, metrics: dict[str, float]) -> None:
        if self.tracker is not None:
            self.tracker.sync()
        try:
            folder = save_checkpoint(
                trainer.engine,
                trainer.model,
                trainer.current,
                step=trainer.step,
                images_seen=trainer.images_seen,
                stream_state=trainer.stream.state_dict(),
                metrics=metrics,
                pin=self.pin(trainer.step) if self.pin is not None else None,
            )
        except CheckpointSaveError as error:
            if self.on_save_error == "stop" or trainer.step >= self.last_step:
                why = "stop" if self.on_save_error == "stop" else "skip, but the last checkpoint cannot be skipped"
                raise CheckpointSaveError(
                    f"{error}; then launch the run again: it resumes from its newest "
                    f"checkpoint (checkpoint.on_save_error: {why})"
                ) from None
            if trainer.place.rank == 0:
                later = min(trainer.step - trainer.step % self.every + self.every, self.last_step)
                to_stderr(
                    f"warning: {error}; training goes on (checkpoint.on_save_error: skip) and saves again at step "
                    f"{later}"
                )
            return
        self.saved.append(str(folder))
        if self.on_checkpoint is not None:
            self.on_checkpoint(folder, trainer.step, metrics)
