"""Checkpoints: save (atomically), resume, initialise from weights; the layout itself is
`pretrain.checkpoint.run_folder`'s.

Each ``<run_dir>/checkpoints/step_XXXXXXXX/`` holds the engine state (``deepspeed/``, every rank's ZeRO partitions),
the consolidated weights (``model.safetensors`` + ``model.json``: what evals and users load; fp32, in a bf16 run the
optimizer's fp32 master weights), the `TrainerState` (step, images seen, every rank's stream position and RNG states)
and the resolved ``config.yaml``. It is written into ``step_XXXXXXXX.tmp``, renamed, and only then marked COMPLETE, so
a crash mid-write leaves a folder without the marker that nothing reads, and the previous checkpoint stays the newest
loadable one.

Resume order (`find_start`): the newest COMPLETE checkpoint in the run folder that verifies > ``checkpoint.resume_from``
> ``checkpoint.init_from`` (weights only) > scratch.

Faults (docs/interfaces.md "Checkpoints"). Every save records each file's size and CRC-32 in ``checksums.json``
(`pretrain.checkpoint.checksums`), and a resume checks them first: a damaged checkpoint (a file missing, cut short or
changed) is skipped with one line naming the file, and the run resumes from the newest one that verifies. A save that
fails on any rank (a full disk, any write error) removes its staging folder, leaves the earlier checkpoints as they were
and raises `CheckpointSaveError` on every rank, with one message naming the path and the space needed
(`pretrain.checkpoint.writes`); ``checkpoint.on_save_error: skip`` trains on instead and saves at the next cadence.
`python -m pretrain.checkpoint verify DIR` checks them by hand (`pretrain.checkpoint.__main__`).
"""

from __future__ import annotations

import contextlib
import io
import shutil
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from data_pipeline.stream.order import merge_stream_states
from pretrain import randomness
from pretrain.checkpoint import checksums, run_folder
from pretrain.checkpoint.run_folder import CONFIG_YAML, DEEPSPEED_DIR, WEIGHTS_FILE, TrainerState
from pretrain.checkpoint.safe_load import check_weights_only, load_weights_only
from pretrain.checkpoint.writes import CheckpointSaveError, SaveAttempt, failure_message
from pretrain.config.ds_config import batch_plan
from pretrain.config.train_config import TrainConfig
from pretrain.model.vit import VisionTransformer
from pretrain.weights.formats import load_npz, load_pretrained, save_pretrained
from tracking.tracker import Tracker, flatten_config


@dataclass(frozen=True)
class StartPoint:
    kind: str  # "run" (newest checkpoint of this run) | "resume_from" | "init_from" | "scratch"
    path: Path | None

    @property
    def folder(self) -> Path:
        """The checkpoint (or ``init_from`` weights) this start reads; a scratch start reads none."""
        if self.path is None:
            raise ValueError(f"a {self.kind} start reads no checkpoint")
        return self.path


def find_start(config: TrainConfig) -> StartPoint:
    """Where training starts, by the documented resume order. Collective where a process group exists: the ranks
    share the checking of the run's checkpoints (`newest_verified`). A damaged ``resume_from`` or ``init_from``
    checkpoint is refused (ValueError naming the file): the user named it, so it is not skipped."""
    latest = newest_verified(Path(config.checkpoint.dir))
    if latest is not None:
        return StartPoint("run", latest)
    c = config.checkpoint
    if c.resume_from is not None:
        folder = run_folder.require_complete(Path(c.resume_from), "checkpoint.resume_from")
        return StartPoint("resume_from", _intact(folder, "checkpoint.resume_from"))
    if c.init_from is not None:
        source = Path(c.init_from)
        if run_folder.is_complete(source):  # a training checkpoint: the weights it gives must be as written
            _intact(source, "checkpoint.init_from", only=checksums.WEIGHT_FILES)
        return StartPoint("init_from", source)
    return StartPoint("scratch", None)


def newest_verified(run_dir: Path) -> Path | None:
    """Collective. The newest COMPLETE checkpoint of the run whose files are as its save wrote them (or that records
    no checksums: written before they were recorded), or None when the run has none. Rank 0's listing decides what
    is checked; each rank reads its `pretrain.checkpoint.checksums.share` of every candidate's files. Each damaged newer
    one is skipped with one line (rank 0) naming the file and what differs; ValueError when every checkpoint is
    damaged."""
    rank, world = _rank_and_world()
    candidates: list[Path] = _gather(run_folder.complete_checkpoints(run_dir))[0]
    damaged = []
    for folder in reversed(candidates):
        verdict = checksums.combine(folder, _gather(checksums.verify(folder, part=(rank, world))))
        if verdict.ok:
            if rank == 0 and verdict.status == "unverified":
                print(
                    f"warning: resuming {folder} unverified: it records no checksums (written before checkpoints did)",
                    file=sys.stderr,
                    flush=True,
                )
            return folder
        if rank == 0:
            print(
                f"skipping damaged checkpoint {folder}: {verdict.problem}; resuming from an older one",
                file=sys.stderr,
                flush=True,
            )
        damaged.append(verdict)
    if damaged:
        raise ValueError(
            f"every checkpoint of {run_dir} is damaged ({'; '.join(v.line() for v in damaged)}); restore one from a "
            f"copy, or move {run_folder.checkpoints_dir(run_dir)} away to start the run over"
        )
    return None


def _intact(folder: Path, setting: str, only: tuple[str, ...] | None = None) -> Path:
    """``folder`` if its files (``only`` these) are as written, else ValueError naming the setting and the file."""
    verdict = checksums.verify(folder, only=only)
    if not verdict.ok:
        raise ValueError(
            f"{setting}={folder} is damaged: {verdict.problem}; point it at an intact checkpoint "
            "(`python -m pretrain.checkpoint verify <run folder>` lists them)"
        )
    return folder


def _rank_and_world() -> tuple[int, int]:
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(), dist.get_world_size()


def _gather(obj: Any) -> list[Any]:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def save_checkpoint(
    engine,
    model: VisionTransformer,
    config: TrainConfig,
    *,
    step: int,
    images_seen: int,
    stream_state: dict[str, Any],
    metrics: dict[str, float] | None = None,
) -> Path:
    """Collective: every rank calls it. Returns the COMPLETE checkpoint folder (same path on every rank).

    ``model`` is the bare ViT inside the engine (consolidated into model.safetensors by `_save_consolidated`). Every
    write goes through a `SaveAttempt`; the ranks agree on the outcome at three points (`_agree`: the staging folder
    made, every file written, the checkpoint published), and a write that failed on any rank raises
    `CheckpointSaveError` on every rank once its partial files are removed. The files' sizes and checksums go into
    ``checksums.json``, the last file written before the rename and ``COMPLETE``.
    """
    rank = dist.get_rank() if dist.is_initialized() else 0
    run_dir = Path(config.checkpoint.dir)
    tag = run_folder.step_name(step)
    tmp = run_folder.staging_dir(run_dir, step)
    attempt = SaveAttempt(tmp, rank)
    if rank == 0:
        attempt.write(tmp, lambda: run_folder.start_staging(tmp), record=False)
    _agree(attempt)
    with attempt.routing(engine):
        # DeepSpeed writes its "latest" file outside its checkpoint engine, where a failed write would raise on rank
        # 0 alone (its peers then wait in the save's last barrier): rank 0 writes it below, through the attempt.
        engine.save_checkpoint(str(tmp / DEEPSPEED_DIR), tag=tag, client_state={"step": step}, save_latest=False)
    # Rank-local positions and random states, gathered to rank 0.
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
        latest = tmp / DEEPSPEED_DIR / "latest"  # what DeepSpeed's save_latest writes: the tag
        attempt.write(latest, lambda: run_folder.write_durably(latest, tag))
    for other in _agree(attempt):
        attempt.written.update(other.written)
    final = run_folder.checkpoint_dir(run_dir, step)
    if rank == 0:
        attempt.record_rest()
        attempt.write(tmp / run_folder.CHECKSUMS, lambda: checksums.write(tmp, attempt.written), record=False)
        attempt.write(final, lambda: run_folder.publish(tmp), record=False)
        if attempt.failure is None:
            run_folder.prune_checkpoints(run_dir, config.checkpoint.keep_last)
    _agree(attempt)  # also what makes every rank wait until the checkpoint is COMPLETE
    return final


def _agree(attempt: SaveAttempt) -> list[SaveAttempt]:
    """Collective: every rank's attempt so far. When a write failed on any rank, rank 0 removes the partial files
    (the staging folder, or a published folder that did not get its marker) and every rank raises the same
    `CheckpointSaveError`."""
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
    """Collective: every rank calls it. Rank 0 writes ``model`` into ``directory`` with `save_pretrained`, through
    ``attempt`` (a failed write is recorded, and the collectives here still complete on every rank).

    In a bf16 run the parameters written are the optimizer's fp32 master weights, not the engine's bf16 compute copy
    (rounded to 8 bits of mantissa): evals, exports and ``init_from`` start from what training holds. Parameters
    without optimizer state (frozen ones) and buffers are written as the module holds them. In an fp32 run the
    module's parameters are the master weights (DeepSpeed copies them back after every step): written as they are.
    """
    import deepspeed  # the engine has imported it already

    masters = _fp32_masters(model, rank) if engine.bfloat16_enabled() else {}
    rest = [p for name, p in model.named_parameters() if name not in masters]
    # ZeRO-3 partitions the parameters: gathering them is a collective every rank enters.
    with deepspeed.zero.GatheredParameters(rest, modifier_rank=None, enabled=engine.zero_optimization_stage() == 3):
        if rank == 0:
            held = {name: master for name, master in masters.items() if master is not None}  # all of them on rank 0
            weights = _holding(model, {**model.state_dict(), **held}) if held else model
            attempt.write(directory / WEIGHTS_FILE, lambda: save_pretrained(weights, directory), record=False)


def _fp32_masters(model: torch.nn.Module, rank: int) -> dict[str, torch.Tensor | None]:
    """Collective: every rank calls it. ``{name: fp32 master weights}`` of each of ``model``'s parameters that the
    optimizer trains, assembled from every rank's partition (ZeRO 1-3); on CPU on rank 0, None on the others."""
    from deepspeed.utils import safe_get_full_fp32_param

    masters = {}
    for name, param in model.named_parameters():
        full = safe_get_full_fp32_param(param)  # one collective per parameter: the same order on every rank
        if full is not None:  # None: no optimizer state (frozen), the same on every rank
            masters[name] = full.cpu() if rank == 0 else None
    return masters


def _holding(model: VisionTransformer, state: dict[str, torch.Tensor]) -> VisionTransformer:
    """A model of ``model``'s class and config whose tensors are ``state`` (built on the meta device: no memory or
    initialisation is spent on the weights it replaces)."""
    with torch.device("meta"):
        copy = type(model)(model.config)
    copy.load_state_dict(state, assign=True)
    return copy


UNIVERSAL_DIR = "universal"  # <checkpoint>/universal/<tag>/: the engine state converted for any world size


def prepare_resume(start: StartPoint, world_size: int, rank: int) -> Path | None:
    """Collective. Before the engine is built: the universal checkpoint to load when ``start`` was written at
    another world size and its optimizer state is partitioned by rank, else None.

    The partitioned state (ZeRO 1-3, and bf16 at any stage: DeepSpeed's bf16 optimizer partitions fp32 master
    weights and Adam moments by rank) is converted once, by rank 0, with DeepSpeed's ``ds_to_universal`` into
    ``<checkpoint>/universal/`` (staged in ``universal.tmp`` and renamed, reused by later resizes); every rank then
    loads its new partition from it. ZeRO-0 in fp32 keeps the whole optimizer in one file that loads at any world
    size, so it needs no conversion. The global batch is kept: `pretrain.config.ds_config.batch_plan` recomputes the
    accumulation, and a world size that cannot keep it was refused by ``TrainConfig.validate`` before this runs.
    """
    if start.kind not in ("run", "resume_from"):
        return None
    state = TrainerState.read(start.folder)
    if state.world_size == world_size:
        return None
    engine_dir = start.folder / DEEPSPEED_DIR / state.deepspeed_tag
    if not any(engine_dir.glob("*optim_states.pt")):
        return None
    target = start.folder / UNIVERSAL_DIR
    if rank == 0 and not target.is_dir():
        check_weights_only(engine_dir)  # the converter unpickles without the weights-only guard
        started = time.perf_counter()
        staging = target.with_name(UNIVERSAL_DIR + run_folder.STAGING_SUFFIX)
        shutil.rmtree(staging, ignore_errors=True)
        _to_universal(engine_dir, staging / state.deepspeed_tag)
        staging.rename(target)
        size = sum(f.stat().st_size for f in target.rglob("*") if f.is_file())
        print(
            f"converted {start.folder.name} (world size {state.world_size}) to a universal checkpoint for world size "
            f"{world_size}: {time.perf_counter() - started:.1f} s, {size / 1e6:.1f} MB",
            flush=True,
        )
    _barrier()
    return target


def _to_universal(engine_dir: Path, output: Path) -> None:
    """DeepSpeed's ds_to_universal on one engine folder, in this process (one extract and one merge worker: the
    conversion runs while the training ranks wait). ``inject_missing_state``: the converter wants the
    ``universal_checkpoint_info`` that Megatron-style clients save for tensor/pipeline parallelism; vitscale is data
    parallel only, so it holds nothing but the format version, which the converter fills in."""
    from argparse import Namespace

    from deepspeed.checkpoint import ds_to_universal  # heavy optional external: only a resize needs it

    args = Namespace(
        input_folder=str(engine_dir),
        output_folder=str(output),
        num_extract_workers=1,
        num_merge_workers=1,
        keep_temp_folder=False,
        strict=True,
        inject_missing_state=True,
    )
    with contextlib.redirect_stdout(io.StringIO()):  # its step-by-step prints; errors still raise
        ds_to_universal.main(args)


def load_checkpoint(engine, checkpoint_dir: Path, universal: Path | None = None) -> TrainerState:
    """Collective: restore the engine (model + optimizer) and return the trainer state; RNG is restored by caller.

    ``universal`` (from `prepare_resume`): load the engine from that universal checkpoint, at this world size.
    Engine files are read with ``torch.load(weights_only=True)`` plus the allow-list above, so a tampered
    checkpoint cannot run code.
    """
    state = TrainerState.read(checkpoint_dir)
    load_weights_only(engine.checkpoint_engine)
    folder = universal if universal is not None else Path(checkpoint_dir) / DEEPSPEED_DIR
    if universal is not None:  # DeepSpeed reads these with weights_only=False: refuse a code-running pickle first
        check_weights_only(folder)
    optimizer = getattr(engine.optimizer, "optimizer", engine.optimizer)  # the torch AdamW inside ZeRO
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    load_path, _ = engine.load_checkpoint(str(folder), tag=state.deepspeed_tag, load_lr_scheduler_states=False)
    if load_path is None:
        raise RuntimeError(f"DeepSpeed found no engine state under {folder}")
    if universal is not None:
        # Two things ZeRO-3's universal load gets wrong (DeepSpeed 0.19.8), put right here: (1) every param group
        # gets the hyperparameters of group 0, so the parameters that are not decayed (biases, norms, embeddings:
        # pretrain.config.optim) would be decayed; the groups' settings come from the config (the lr from the schedule
        # at every step). (2) All groups' Adam ``step`` is one shared tensor, which torch's AdamW increments in
        # place once per group and step, so the second group's bias correction runs ahead (losses drifted 6e-4
        # from the uninterrupted run within three steps); each group gets its own copy.
        for group, saved in zip(optimizer.param_groups, groups):
            group.update(saved)
        for param_state in optimizer.state.values():
            if torch.is_tensor(param_state.get("step")):
                param_state["step"] = param_state["step"].clone()
    return state


def init_weights(model: torch.nn.Module, source: Path, image_size: int) -> list[str]:
    """Copy weights (same name and shape) from a model.safetensors folder or an official .npz into ``model``.

    Position embeddings are resized to ``image_size`` by the loader. Returns the names left at their
    initialisation (e.g. a head with another class count), which the caller reports.
    """
    src = load_npz(source, image_size=image_size) if source.suffix == ".npz" else load_pretrained(source, image_size)
    theirs = src.state_dict()
    mine = model.state_dict()
    usable = {k: v for k, v in theirs.items() if k in mine and mine[k].shape == v.shape}
    model.load_state_dict(usable, strict=False)
    skipped = sorted(set(mine) - set(usable))
    if skipped:
        warnings.warn(f"init_from {source}: kept the fresh initialisation for {skipped}", stacklevel=2)
    return skipped


def _jsonable(obj: Any) -> Any:
    """Stream states may hold numpy scalars/arrays or tuples; JSON keeps them as plain numbers and lists."""
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, np.generic):
        return obj.item()
    return obj


# --------------------------------------------------------------------------------------------- resume


# Settings a resumed run may change without changing what it computes up to the old schedule's end.
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
    """Say which settings differ from the checkpoint's config.yaml: resuming with them is allowed but not exact."""
    import yaml  # only resumes read a saved config

    saved = flatten_config(yaml.safe_load((checkpoint_dir / CONFIG_YAML).read_text()))
    now = flatten_config(config.to_dict())
    changed = sorted(
        k for k in set(saved) | set(now) if saved.get(k) != now.get(k) and not k.startswith(_RESUME_MAY_CHANGE)
    )
    if changed:
        diffs = ", ".join(f"{k}: {saved.get(k)} -> {now.get(k)}" for k in changed)
        print(
            f"warning: resuming {checkpoint_dir} with changed settings ({diffs}); the run is no longer an exact "
            "continuation",
            file=sys.stderr,
            flush=True,
        )


def resume(
    engine, stream, start: StartPoint, rank: int, world_size: int, config: TrainConfig, universal: Path | None = None
) -> TrainerState | None:
    """Restore engine + stream position from a full checkpoint; its trainer state (None when starting fresh).

    At another world size the engine loads ``universal`` (`pretrain.checkpointer.prepare_resume`) and the stream takes
    its streams' positions from the global one: the run continues the same sequence of global batches.
    """
    if start.kind not in ("run", "resume_from"):
        return None
    state = load_checkpoint(engine, start.folder, universal)
    stream.load_state_dict(state.stream_state)
    if rank == 0:
        print(f"resumed from {start.folder} at step {state.step} ({start.kind})", flush=True)
        if state.world_size != world_size:
            before = batch_plan(config.data, state.world_size).grad_accum_steps
            after = batch_plan(config.data, world_size).grad_accum_steps
            print(
                f"resuming step {state.step} at world size {world_size} (was {state.world_size}): accumulation "
                f"{before} -> {after}, global batch {config.data.global_batch_size}",
                flush=True,
            )
        _warn_config_changes(start.folder, config)
    return state


# --------------------------------------------------------------------------------------------- the checkpointer

CheckpointCallback = Callable[[Path, int, dict], None]


class Checkpointer:
    """When the trainer saves, and who hears of it: every ``checkpoint.every_steps`` steps and at the run's last step,
    plus the step-0 weights of a fresh run whose checkpoints are evaluated (`wants_baseline`); ``checkpoint.keep_last``
    prunes older ones as each save publishes (`pretrain.checkpoint.run_folder.prune_checkpoints`, sparing pinned ones);
    and ``on_checkpoint(folder, step, metrics)`` runs on every rank after each COMPLETE checkpoint (the cluster driver
    hands it to the evals). Before each save the ``tracker`` delivers what it holds (`Tracker.sync`): a checkpoint
    is published only once the metrics of its steps are in the run, so a worker lost after it, whose group resumes
    from it, loses no metric of a step that is not trained again. A save that fails (`CheckpointSaveError`) stops
    the run, or with ``checkpoint.on_save_error: skip`` is reported and retried at the next cadence step (never the
    last step's)."""

    def __init__(
        self,
        config: TrainConfig,
        last_step: int,
        on_checkpoint: CheckpointCallback | None = None,
        tracker: Tracker | None = None,
    ):
        self.every, self.last_step, self.on_checkpoint = config.checkpoint.every_steps, last_step, on_checkpoint
        self.tracker = tracker
        self.on_save_error = config.checkpoint.on_save_error
        self.baseline = on_checkpoint is not None and bool(config.evals.suite) and config.evals.baseline
        self.saved: list[str] = []  # this attempt's COMPLETE checkpoints, in order
        self.save_seconds = 0.0  # wall seconds this attempt spent saving (and handing saves over): the goodput ledger

    def save_baseline(self, trainer) -> None:
        """A fresh run's step-0 weights, before the first update, so every transfer curve starts at its baseline. A
        resumed run never saves it (its first attempt did), so a restart does not evaluate step 0 again. The save
        draws no random numbers, so the losses are the same with and without it."""
        if self.baseline and trainer.start_step == 0 and trainer.state is None:
            self._save(trainer, {})

    def after_step(self, trainer, metrics: dict[str, float]) -> None:
        """Save if ``trainer.step`` is on the cadence or the last step; ``metrics`` go into the trainer state."""
        if trainer.step % self.every == 0 or trainer.step == self.last_step:
            self._save(trainer, metrics)

    def _save(self, trainer, metrics: dict[str, float]) -> None:
        started = time.perf_counter()
        try:
            self._save_and_hand_over(trainer, metrics)
        finally:  # a failed save's time was spent saving too
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
                print(
                    f"warning: {error}; training goes on (checkpoint.on_save_error: skip) and saves again at step "
                    f"{later}",
                    file=sys.stderr,
                    flush=True,
                )
            return
        self.saved.append(str(folder))
        if self.on_checkpoint is not None:
            self.on_checkpoint(folder, trainer.step, metrics)
