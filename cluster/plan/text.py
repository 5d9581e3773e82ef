"""The plan as `cluster.launch` prints it: a line per part of `Plan`, an elastic job's ends, then the warnings."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import fields

from cluster.plan.comms import CommPlan
from cluster.plan.data_wait import DataWait, data_wait_line
from cluster.plan.evals.cost import evals_lines
from cluster.plan.planner import EXTRAS, DataPlan, Plan


def format_plan(plan: Plan, notes: Sequence[str] = ()) -> str:
    """The plan's printout, then ``notes`` (`cluster.plan.planner.resolve_with_notes`), one ``note:`` line each."""
    topo, batch, model, c, m, d = plan.topology, plan.batch, plan.model, plan.compute, plan.memory, plan.data
    micro = batch.micro_batch_size
    recompute = f", + recompute x {c.recompute_factor:.2f}" if m.activation_checkpointing else ""
    wait = DataWait(**{f.name: getattr(d, f.name) for f in fields(DataWait)})
    lines = [
        f"plan: recipe {plan.recipe} on profile {topo.profile} (run {plan.run_name})",
        f"  topology      {topo.nodes} node(s), {topo.device}; world size {topo.world_size}",
        f"  batch         global {batch.global_batch_size} = micro {micro} x accumulation "
        f"{batch.grad_accum_steps} x world {batch.world_size}",
        f"  model         {model.name} @ {model.image_size}px: {model.num_params / 1e6:.2f}M params "
        f"({model.num_params_1k_head / 1e6:.2f}M with a 1000-class head); forward {c.forward_gflops_per_image:.4g} "
        f"GFLOPs/image, training {c.train_gflops_per_image:.4g}",
        f"  precision     {c.precision} ({c.precision_reason}), ZeRO-{m.zero_stage}, activation checkpointing "
        f"{'on' if m.activation_checkpointing else 'off'}",
        f"  memory/device params {m.params_gb:.2f} GB + grads {m.grads_gb:.2f} GB + optimizer "
        f"{m.optimizer_gb:.2f} GB + activations {m.activations_gb:.2f} GB ({m.activation_mb_per_image:.0f} MB/image "
        f"x {micro}) + overhead {m.overhead_gb:.1f} GB = {m.total_gb:.2f} GB of {m.capacity_gb:.0f} GB"
        + (f" ({m.memory_source})" if m.memory_source else ""),
        f"  checkpointing activations {m.activations_gb_checkpointed:.2f} GB with it, "
        f"{m.activations_gb_not_checkpointed:.2f} GB without (micro-batch {micro}); "
        f"{m.checkpointing_advice}",
        f"  compute       {c.total_steps} steps x {c.step_time_s:.3g} s/step ({_mfu(c.assumed_mfu, c.mfu_source)} of "
        f"{c.peak_tflops:.4g} TFLOP/s per device: {c.peak_source}{recompute}) = "
        f"{c.days:.3g} days; {c.images_per_s:,.0f} images/s; {c.total_exaflops:.4g} exaFLOPs total",
        f"  interconnect  {plan.comms.interconnect}; worker env: {', '.join(plan.comms.env) or 'none needed'} "
        "(docs/network.md)",
        f"  communication {_communication(plan.comms)}",
        f"  reduction     DeepSpeed {'; '.join(f'{k} {v}' for k, v in plan.comms.settings)}",
        f"  data          {d.num_shards or 'unknown number of'} shards, {d.shards_per_stream:.1f} per stream; "
        f"{d.bytes_per_image / 1e3:.0f} KB/image -> read {d.read_mb_per_s:,.1f} MB/s ({d.note})",
        f"  loader memory {d.loader_gb_per_node:.3g} GB per node: {d.loader_detail}",
        f"  data wait     {data_wait_line(wait, batch.global_batch_size // batch.world_size)}",
        f"  storage       {d.storage}" + _storage_needs(d),
        f"  runtime env   {_runtime_env(plan)}",
        f"  baseline eval {plan.baseline_eval}",
        *evals_lines(plan.evals),
        f"  hang watchdog {_startup(plan)}",
        *_elastic_lines(plan),
    ]
    lines += [f"  WARNING       {w}" for w in (*d.warnings, *plan.evals.warnings)]
    return "\n".join([*lines, *(f"note: {line}" for line in notes)])


def _startup(plan: Plan) -> str:
    a = plan.startup
    terms = " + ".join(f"{name} {seconds:.3g}" for name, seconds in a.terms)
    write_s = a.checkpoint_gb * 1e3 / a.write_mb_per_s
    return (
        f"start {a.startup_s:.0f} s = max(hang.startup_s {a.floor_s:g}, {a.margin:g} x ({terms} = {a.estimate_s:.3g} "
        f"s)); first save {a.first_save_s:.0f} s = max(hang.checkpoint_s {a.save_floor_s:g}, {a.margin:g} x "
        f"{write_s:.3g} s); a checkpoint of {a.checkpoint_gb:.3g} GB at {a.write_mb_per_s:g} MB/s "
        f"(hang.write_mb_per_s); a manifest of {a.num_shards} shards, {a.manifest_mb:.2g} MB at {a.read_mb_per_s:g} "
        "MB/s (storage.read_mb_per_s)"
    )


def _communication(c: CommPlan) -> str:
    if not c.collectives:
        return c.verdict
    parts = " + ".join(f"{x.what} {_bytes(x.bytes_per_gpu)} ({x.tensor})" for x in c.collectives)
    sent = f"{_bytes(c.bytes_per_gpu)} per GPU per step = {parts}"
    if c.comm_s is None:
        return f"{sent}; time not estimated: {c.bandwidth_source}"
    calls = sum(x.calls for x in c.collectives)
    return (
        f"{sent}; {c.comm_s * 1e3:.3g} ms at {c.bandwidth_gb_per_s:.3g} GB/s ({c.bandwidth_source}) incl. {calls} "
        f"collectives x {c.latency_us:g} us = {c.verdict}"
    )


def _bytes(n: float) -> str:
    return f"{n / 1e9:.3g} GB" if n >= 1e8 else f"{n / 1e6:.3g} MB"


def _mfu(mfu: float, source: str) -> str:
    return f"assumed MFU {mfu:.0%}" if source == "assumed" else f"MFU {mfu:.0%} {source}"


def _elastic_lines(plan: Plan) -> list[str]:
    if not plan.elastic_ends:
        return []
    lo, hi = plan.elastic_ends
    lines = [
        f"  elastic       workers {lo.world_size}..{hi.world_size} (Ray Train may run at any of "
        f"{', '.join(map(str, range(lo.world_size, hi.world_size + 1)))}; global batch "
        f"{plan.batch.global_batch_size} kept, accumulation recomputed)"
    ]
    for name, end in (("min", lo), ("max", hi)):
        lines.append(
            f"    at {name} {end.world_size:>3}  accumulation {end.grad_accum_steps}, {end.step_time_s:.3g} s/step, "
            f"{end.images_per_s:,.0f} images/s, {end.days:.3g} days if it stayed there, "
            f"{end.total_gb:.2f} GB of {end.capacity_gb:.0f} GB per worker"
        )
    return lines


def _extras(names: tuple[str, ...]) -> str:
    return ", ".join(f"vitscale[{n}] ({EXTRAS[n].module})" for n in names)


def _runtime_env(plan: Plan) -> str:
    extras = plan.runtime_extras
    installs = f"pip installs {_extras(extras)} on the cluster" if extras else "installs no extras"
    return f"{installs}; {plan.final_model}"


def _storage_needs(d: DataPlan) -> str:
    needs = f"; needs {_extras(d.storage_extras)}" if d.storage_extras else ""
    if d.storage_missing_here:
        needs += "; " + "; ".join(d.storage_missing_here) + " (only to read the manifest from this machine)"
    return needs
