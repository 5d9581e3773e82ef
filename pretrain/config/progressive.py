"""Progressive resolution, ``data.resolution_schedule: [[0, 16], [100, 32]]``: small images first, then
``data.image_size`` (docs/contracts.md, "Tasks and the resolution schedule")."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import nn

from pretrain.weights.formats import resize_pos_embed

__all__ = ["check_config", "check_schedule", "config_at", "resolution_at", "start_config", "switch_resolution"]

ADAM_STATES = ("exp_avg", "exp_avg_sq")
# (working-copy groups, fp32 partitions) of DeepSpeed's ZeRO-1/2 and bf16 optimizers
_FRAGMENT_GROUPS = (("bit16_groups", "single_partition_of_fp32_groups"), ("bf16_groups", "fp32_groups_flat_partition"))


def check_schedule(schedule: Sequence, image_size: int, stride: int) -> tuple[tuple[int, int], ...]:
    """``data.resolution_schedule`` checked, as ((step, size), ...)."""
    pairs = []
    for i, entry in enumerate(schedule):
        if not isinstance(entry, (list, tuple)) or len(entry) != 2 or not all(isinstance(v, int) for v in entry):
            raise ValueError(
                f"data.resolution_schedule[{i}]={entry!r} must be a pair [step, image_size] of integers, "
                "e.g. [[0, 16], [100, 32]]"
            )
        pairs.append((int(entry[0]), int(entry[1])))
    if not pairs:
        return ()
    if pairs[0][0] != 0:
        raise ValueError(f"data.resolution_schedule must start at step 0, got {pairs[0][0]}; add [0, <size>] first")
    for (s0, _), (s1, _) in zip(pairs, pairs[1:]):
        if s1 <= s0:
            raise ValueError(f"data.resolution_schedule steps must increase strictly, got {s0} then {s1}")
    for step, size in pairs:
        if size <= 0 or size % stride:
            raise ValueError(
                f"data.resolution_schedule: size {size} at step {step} is not a positive multiple of the patch stride "
                f"{stride}; use e.g. {max(1, round(size / stride)) * stride}"
            )
    if pairs[-1][1] != image_size:
        raise ValueError(
            f"data.resolution_schedule ends at {pairs[-1][1]} px but data.image_size={image_size}; the schedule's "
            f"last size is the final resolution, so set data.image_size={pairs[-1][1]} or end the schedule at "
            f"{image_size}"
        )
    return tuple(pairs)


def check_config(schedule: Sequence, image_size: int, stride: int, zero_stage: int) -> None:
    if schedule:
        check_schedule(schedule, image_size, stride)
        if zero_stage > 2:
            raise ValueError(
                "data.resolution_schedule needs deepspeed.zero_stage ≤ 2 (the engine switch moves Adam state "
                "through ZeRO-1/2 fragments); set deepspeed.zero_stage=2 or drop the schedule"
            )


def resolution_at(schedule: Sequence, step: int, image_size: int) -> int:
    """Image size for 0-based optimizer step ``step``."""
    size = image_size
    for start, s in schedule:
        if start <= step:
            size = int(s)
    return size


def config_at(config, step: int):
    """``config`` with ``data.image_size`` set to the resolution of ``step``."""
    return _sized(config, resolution_at(config.data.resolution_schedule, step, config.data.image_size))


def _sized(config, size: int):
    d = config.data
    return config if size == d.image_size else config.replace(data=dataclasses.replace(d, image_size=size))


def _full_fp32(param: nn.Parameter) -> torch.Tensor:
    from deepspeed.utils import safe_get_full_fp32_param

    value = safe_get_full_fp32_param(param)
    return (param.detach() if value is None else value).float().clone()


def _inner_optimizer(engine) -> torch.optim.Optimizer:
    opt = engine.optimizer
    return getattr(opt, "optimizer", opt)


def _adam_state(engine, param: nn.Parameter) -> dict[str, torch.Tensor] | None:
    """Full Adam moments of ``param``; None before the first optimizer step."""
    from deepspeed.utils import safe_get_full_optimizer_state

    if hasattr(param, "_hp_mapping") or hasattr(param, "ds_id"):  # ZeRO 1-3 / bf16 optimizer: collective
        out = {k: safe_get_full_optimizer_state(param, k) for k in ADAM_STATES}
        return None if any(v is None for v in out.values()) else {k: v.float().clone() for k, v in out.items()}
    state = _inner_optimizer(engine).state.get(param)
    return {k: state[k].float().clone() for k in ADAM_STATES} if state else None


def _adam_step(engine) -> torch.Tensor | None:
    for state in _inner_optimizer(engine).state.values():
        if "step" in state:
            return state["step"].clone() if torch.is_tensor(state["step"]) else torch.tensor(float(state["step"]))
    return None


def _seed_adam_state(engine, step: torch.Tensor) -> None:
    """Create torch's lazy Adam state now, to write the moments before the first step."""
    inner = _inner_optimizer(engine)
    for group in inner.param_groups:
        for p in group["params"]:
            if not inner.state.get(p):
                zeros = {k: torch.zeros_like(p) for k in ADAM_STATES}
                inner.state[p] = {"step": step.clone(), **zeros}
    _link_states(engine)


def _link_states(engine) -> None:
    """Point every ZeRO / bf16 fragment at its partition's Adam state (DeepSpeed links the first group's only)."""
    from deepspeed.utils.mixed_precision_linkage import lazy_init_hp_params_optimizer_state

    opt = engine.optimizer
    state = _inner_optimizer(engine).state
    for lp_attr, hp_attr in _FRAGMENT_GROUPS:
        if hasattr(opt, lp_attr) and hasattr(opt, hp_attr):
            for lp_group, hp in zip(getattr(opt, lp_attr), getattr(opt, hp_attr)):
                if state.get(hp):
                    lazy_init_hp_params_optimizer_state(lp_group, hp, state)


def _set_adam_state(engine, param: nn.Parameter, values: dict[str, torch.Tensor]) -> None:
    from deepspeed.utils import safe_set_full_optimizer_state

    if hasattr(param, "_hp_mapping") or hasattr(param, "ds_id"):
        for key, value in values.items():
            safe_set_full_optimizer_state(param, value, key)
        return
    state = _inner_optimizer(engine).state[param]
    for key, value in values.items():
        state[key].copy_(value.to(state[key].dtype))


def _resize(name: str, value: torch.Tensor, target: torch.Tensor, num_prefix_tokens: int) -> torch.Tensor:
    if value.shape == target.shape:
        return value
    if not name.endswith("pos_embed"):
        raise ValueError(
            f"parameter {name} changed shape {tuple(value.shape)} → {tuple(target.shape)} with the "
            "resolution; only the position embeddings may"
        )
    g = int(round((target.shape[1] - num_prefix_tokens) ** 0.5))
    return resize_pos_embed(value, (g, g), num_prefix_tokens)


def switch_resolution(engine, model: nn.Module, build: Callable[[], tuple]) -> tuple:
    """Collective: move fp32 weights, buffers and Adam state from ``engine`` (destroyed) to ``build() -> (engine,
    model)``, returned; RNG states survive ``build``. ZeRO 0-2 only."""
    old_task = engine.module
    named = dict(old_task.named_parameters())
    weights = {name: _full_fp32(p) for name, p in named.items()}
    adam_step = _adam_step(engine)  # None before the first step: no moments to carry
    _link_states(engine)
    moments = {name: _adam_state(engine, p) if adam_step is not None else None for name, p in named.items()}
    buffers = {name: b.detach().clone() for name, b in old_task.named_buffers()}
    prefix = getattr(model, "num_prefix_tokens", 1)
    engine.destroy()
    del engine, old_task

    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    new_engine, new_model = build()
    torch.set_rng_state(cpu_rng)
    if cuda_rng is not None:
        torch.cuda.set_rng_state_all(cuda_rng)

    from deepspeed.utils import safe_set_full_fp32_param

    new_named = dict(new_engine.module.named_parameters())
    if set(new_named) != set(named):
        raise ValueError(f"the rebuilt task has different parameters: {sorted(set(new_named) ^ set(named))}")
    if adam_step is not None:
        _seed_adam_state(new_engine, adam_step)
    with torch.no_grad():
        for name, p in new_named.items():
            value = _resize(name, weights[name], p, prefix)
            p.data.copy_(value.to(p.dtype))  # the working copy
            safe_set_full_fp32_param(p, value)  # the fp32 master
            moment = moments[name]
            if moment is not None and adam_step is not None:
                _set_adam_state(new_engine, p, {k: _resize(name, v, p, prefix) for k, v in moment.items()})
        for name, b in new_engine.module.named_buffers():
            if name in buffers:
                b.copy_(buffers[name])
    return new_engine, new_model


def start_config(config, start):
    """The config in force when a run starts from ``start``: the schedule's first size, or a checkpoint's own."""
    if start.kind in ("run", "resume_from"):
        return _sized(config, int(json.loads((Path(start.path) / "model.json").read_text())["image_size"]))
    return config_at(config, 0)
