"""Benchmark vitscale's training step (ViT-S/16 and ViT-B/16 at 224) against Hugging Face transformers and this
machine's GEMM rate, at fp32 and at bf16.

A rate is the median over rounds (alternating the order) of the best of ``repeats`` steps. Keys per precision p
(suffix ``_b16`` for B/16): ``speedup_vs_hf_<p>`` against HF with SDPA, at bf16 ``speedup_vs_hf_best_<p>`` against
HF's faster kernel (docs/performance.md); ``gemm_fraction_<p>``: images/s x ``train_flops(as_run=True)`` / a square
GEMM's rate. Emulated bf16 runs a small setting. ``*_compiled_*`` keys: blocks compiled (``--no-compile``: none).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from bench import out_file, stopped, write_json
from bench.hf_models import compile_layers, hf_model, logits_of
from pretrain.model.flops import train_flops
from pretrain.model.vit import ViTConfig, build_model, model_config
from pretrain.telemetry.peak import gemm_tflops

# JSON key suffix per model; ViT-Ti/16 for the tests
SUFFIX = {"vit_s16": "", "vit_b16": "_b16", "vit_ti16": "_ti16"}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
_FLAGS_OF_INTEREST = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "avx512_vnni", "avx_vnni")


def cpu_bf16_native() -> bool:
    """AMX-BF16 or AVX512-BF16: bf16 GEMMs are not emulated."""
    return any(f in cpu_flags() for f in ("avx512_bf16", "amx_bf16"))


def bf16_native(device: torch.device) -> bool:
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device) >= (8, 0)
    return cpu_bf16_native()


def cpu_flags() -> list[str]:
    """This CPU's flags among those that decide the GEMM paths; [] if unreadable."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return []
    return [flag for flag in _FLAGS_OF_INTEREST if flag in flags]


def _autocast(precision: str, device: torch.device):
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=DTYPES[precision])


def sync(device: torch.device) -> None:
    """Wait for queued CUDA kernels, so that a timer reads finished work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_step(
    model: torch.nn.Module, logits_of: Callable, batch_size: int, precision: str, device: torch.device
) -> Callable[[], None]:
    model.to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
    g = torch.Generator().manual_seed(0)
    images = (torch.rand(batch_size, 3, 224, 224, generator=g) * 2 - 1).to(device)  # (B, 3, 224, 224) in [-1, 1]
    labels = torch.randint(0, 1000, (batch_size,), generator=g).to(device)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        with _autocast(precision, device):
            loss = F.cross_entropy(logits_of(images), labels)
        loss.backward()
        optimizer.step()

    return step


def build_steps(
    name: str,
    batch_size: int,
    precision: str,
    attn: str,
    with_eager: bool,
    device: torch.device,
    compiled: bool = False,
) -> tuple[dict, ViTConfig]:
    """The steps by label, and vitscale's config; ``compiled`` adds ``<label>_compiled`` twins of the same weights."""
    config = model_config(name, num_classes=1000)
    builders = {"vitscale": lambda: build_model(name, num_classes=1000), "hf": lambda: hf_model(config, attn)}
    if with_eager and attn != "eager":  # HF's default before SDPA
        builders["hf_eager"] = lambda: hf_model(config, "eager")
    torch.manual_seed(0)
    models = {label: build() for label, build in builders.items()}  # built in this order from one seed
    if compiled:
        for label, build in builders.items():
            twin = build()
            twin.load_state_dict(models[label].state_dict())  # the eager one's weights
            compile_layers(twin)
            models[f"{label}_compiled"] = twin
    steps = {label: make_step(m, logits_of(m), batch_size, precision, device) for label, m in models.items()}
    return steps, config


def time_steps(step: Callable[[], None], repeats: int, device: torch.device) -> list[float]:
    """Seconds of each of ``repeats`` synchronized steps."""
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        step()
        sync(device)
        times.append(time.perf_counter() - start)
    return times


_PROFILE_GROUPS = {  # operator families, by substring of the profiler's op name
    "gemm": ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm"),
    "attention": ("flash_attention", "scaled_dot_product", "_efficient_attention", "_cudnn_attention"),
    "gelu": ("gelu",),
    "copy": ("aten::copy_", "aten::_to_copy"),
    "optimizer": ("Adam", "adam", "aten::_foreach_"),
}


def profiled(step: Callable[[], None], device: torch.device):
    """The profiler's per-operator averages over one synchronized ``step`` (CPU, and CUDA on a GPU)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        step()
        sync(device)
    return prof.key_averages()


def profile_step(step: Callable[[], None], device: torch.device, top: int = 10) -> dict:
    """One profiled step: the top operators by self time as [[name, share], ...] and each ``_PROFILE_GROUPS``
    family's share (operator rows only: on a GPU kernel rows would count kernels twice)."""
    from torch.autograd import DeviceType

    on_gpu = device.type == "cuda"

    def self_time(event) -> float:
        return event.self_device_time_total if on_gpu else event.self_cpu_time_total

    events = [e for e in profiled(step, device) if self_time(e) > 0 and e.device_type == DeviceType.CPU]
    total = sum(map(self_time, events))
    events.sort(key=self_time, reverse=True)
    groups = {
        f"share_{group}": round(sum(self_time(e) for e in events if any(n in e.key for n in names)) / total, 3)
        for group, names in _PROFILE_GROUPS.items()
    }
    return {"top": [[e.key, round(self_time(e) / total, 3)] for e in events[:top]], **groups}


def log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def bench_one(name: str, precision: str, batch_size: int, rounds: int, repeats: int, args) -> dict:
    """Interleaved rounds of one model at one precision; its keys."""
    tag = f"{precision}{SUFFIX[name]}"
    # HF's eager attention: context for fp32 ViT-S/16, and at bf16 vitscale's CPU attention is that kernel
    with_eager = not args.no_eager and (tag == "fp32" or precision == "bf16")
    device = torch.device(args.device)
    steps, config = build_steps(name, batch_size, precision, args.hf_attn, with_eager, device, args.compile)
    flops_per_image = train_flops(config, as_run=True)
    gemm_size = args.gemm_size if precision == "fp32" else args.bf16_gemm_size or args.gemm_size
    out: dict = {}
    if precision == "bf16" and args.profile and name == args.models[0]:
        log(f"{name} {precision}: profiling one vitscale step (batch {batch_size}) ...")
        out["bf16_profile_model"] = name
        # a first step creates oneDNN's primitives or loads a GPU's kernels, which would lead the profile
        steps["vitscale"]()
        profiled = profile_step(steps["vitscale"], device)
        out["bf16_profile_vitscale"] = profiled.pop("top")
        out |= {f"bf16_profile_{key}": value for key, value in profiled.items()}
        for label, step in steps.items():
            if label != "vitscale":
                step()
    else:  # warm-up: allocator, thread pool, optimizer state; emulated bf16: only the compiles
        warm = precision == "fp32" or args.bf16_warmup or bf16_native(device)
        for label, step in steps.items():
            if warm or label.endswith("_compiled"):
                step()
    seconds: dict[str, list[float]] = {label: [] for label in steps}
    gemm: dict[str, list[float]] = {"nn": [], "nt": []}
    for i in range(rounds):
        order = list(steps.items())
        for label, step in order if i % 2 == 0 else order[::-1]:
            seconds[label].append(min(time_steps(step, repeats, device)))  # the least disturbed
        for layout, rate in gemm_tflops(precision, gemm_size, device).items():
            gemm[layout].append(rate)
        rates = ", ".join(f"{label} {batch_size / s[-1]:.3g} img/s" for label, s in seconds.items())
        log(
            f"{name} {precision} round {i + 1}/{rounds}: {rates}, GEMM nn {gemm['nn'][-1]:.4g} nt "
            f"{gemm['nt'][-1]:.4g} TFLOP/s"
        )
    img_s = {label: batch_size / statistics.median(s) for label, s in seconds.items()}
    gemm_layout = {layout: statistics.median(r) for layout, r in gemm.items()}
    gemm_tf = max(gemm_layout.values())
    achieved_tf = img_s["vitscale"] * flops_per_image / 1e12
    out |= {
        f"speedup_vs_hf_{tag}": img_s["vitscale"] / img_s["hf"],
        f"gemm_fraction_{tag}": achieved_tf / gemm_tf,
        f"vitscale_img_s_{tag}": img_s["vitscale"],
        f"hf_img_s_{tag}": img_s["hf"],
        f"achieved_tflops_{tag}": achieved_tf,
        f"gemm_tflops_{tag}": gemm_tf,
        f"gemm_tflops_nn_{tag}": gemm_layout["nn"],
        f"gemm_tflops_nt_{tag}": gemm_layout["nt"],
        f"gemm_size_{tag}": gemm_size,
        f"batch_size_{tag}": batch_size,
        f"rounds_{tag}": rounds,
        f"repeats_{tag}": repeats,
        f"train_gflops_per_image{SUFFIX[name]}": train_flops(config) / 1e9,  # the published convention
        f"train_gflops_per_image_as_run{SUFFIX[name]}": flops_per_image / 1e9,
    }
    if "hf_eager" in img_s:
        out[f"hf_eager_img_s_{tag}"] = img_s["hf_eager"]
        out[f"speedup_vs_hf_eager_{tag}"] = img_s["vitscale"] / img_s["hf_eager"]
        out[f"speedup_vs_hf_best_{tag}"] = img_s["vitscale"] / max(img_s["hf"], img_s["hf_eager"])
    if "vitscale_compiled" in img_s:
        compiled = img_s["vitscale_compiled"]
        hf_compiled = max(img_s[label] for label in ("hf_compiled", "hf_eager_compiled") if label in img_s)
        out |= {f"{label}_img_s_{tag}": rate for label, rate in img_s.items() if label.endswith("_compiled")}
        out[f"speedup_compiled_vs_hf_{tag}"] = compiled / img_s["hf"]
        out[f"speedup_compiled_vs_hf_compiled_{tag}"] = compiled / hf_compiled
        out[f"gemm_fraction_compiled_{tag}"] = compiled * flops_per_image / 1e12 / gemm_tf
    return out


def run(args) -> dict:
    result: dict = dict(
        cpu_bf16_native=cpu_bf16_native(),
        cpu_flags=cpu_flags(),
        torch=torch.__version__,
        threads=torch.get_num_threads(),
        cpu_capability=torch.backends.cpu.get_cpu_capability(),
        machine=platform.processor() or platform.machine(),
        cpu_count=os.cpu_count(),
        image_size=224,
        hf_attn_implementation=args.hf_attn,
        load_average_1min_start=os.getloadavg()[0],
        device=args.device,
    )
    device = torch.device(args.device)
    if device.type == "cuda":
        result["device_name"] = torch.cuda.get_device_name(device)
        result["tf32_matmul"] = torch.backends.cuda.matmul.allow_tf32
    native = bf16_native(device)
    if not native:  # an emulated bf16 step takes tens of seconds
        for key, value in dict(bf16_batch_size=1, bf16_rounds=1, bf16_gemm_size=512).items():
            setattr(args, key, getattr(args, key) or value)
    for name in args.models:
        for precision in args.precisions:
            bf16 = precision == "bf16"
            batch_size = args.bf16_batch_size or args.batch_size if bf16 else args.batch_size
            rounds = args.bf16_rounds or args.rounds if bf16 else args.rounds
            repeats = 1 if bf16 and not native else args.repeats
            result |= bench_one(name, precision, batch_size, rounds, repeats, args)
    result["load_average_1min_end"] = os.getloadavg()[0]
    return result


def summary_lines(result: dict) -> list[str]:
    lines = []
    for name, suffix in SUFFIX.items():
        for precision in DTYPES:
            tag = f"{precision}{suffix}"
            if f"speedup_vs_hf_{tag}" not in result:
                continue
            lines.append(
                f"{name} {precision}: vitscale {result[f'vitscale_img_s_{tag}']:.3g} img/s, HF "
                f"{result[f'hf_img_s_{tag}']:.3g} img/s: {result[f'speedup_vs_hf_{tag}']:.2f}x; "
                f"{result[f'achieved_tflops_{tag}']:.4g} of {result[f'gemm_tflops_{tag}']:.4g} GEMM TFLOP/s = "
                f"{result[f'gemm_fraction_{tag}']:.0%}"
            )
            if f"speedup_compiled_vs_hf_{tag}" in result:
                lines.append(
                    f"{name} {precision} compiled blocks: vitscale {result[f'vitscale_compiled_img_s_{tag}']:.3g} "
                    f"img/s: {result[f'speedup_compiled_vs_hf_{tag}']:.2f}x HF, "
                    f"{result[f'speedup_compiled_vs_hf_compiled_{tag}']:.2f}x HF compiled the same way; "
                    f"{result[f'gemm_fraction_compiled_{tag}']:.0%} of the GEMM rate"
                )
    return lines


def _names(text: str, allowed: tuple, flag: str) -> list[str]:
    names = [n for n in text.split(",") if n]
    bad = [n for n in names if n not in allowed]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"{flag} {text!r}: use a comma-separated subset of {','.join(allowed)}")
    return names


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.train", description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--models", default="vit_s16,vit_b16", type=lambda t: _names(t, tuple(SUFFIX), "--models"))
    add("--precisions", default="fp32,bf16", type=lambda t: _names(t, tuple(DTYPES), "--precisions"))
    add("--batch-size", type=int, default=16, help="fp32 batch")
    add("--rounds", type=int, default=3, help="fp32 rounds")
    add("--repeats", type=int, default=2, help="fp32 steps per model per round (the best one counts)")
    native = "default: as fp32 where bf16 is native (AMX/AVX512-BF16, CUDA compute capability 8+), else"
    add("--bf16-batch-size", type=int, help=f"{native} 1")
    add("--bf16-rounds", type=int, help=f"{native} 1")
    add(
        "--bf16-warmup",
        action="store_true",
        help="an untimed emulated-bf16 step first (always on with AMX/AVX512-BF16)",
    )
    add("--gemm-size", type=int, default=2048, help="fp32 GEMM side")
    add("--bf16-gemm-size", type=int, help=f"bf16 GEMM side ({native} 512)")
    on = dict(action=argparse.BooleanOptionalAction, default=True)
    add("--profile", **on, help="profile one bf16 vitscale step of the first model, after a warm-up step")
    add("--compile", **on, help="also time both models with their blocks torch.compile'd (model.compile)")
    add("--hf-attn", default="sdpa", choices=["sdpa", "eager"], help="HF attention implementation")
    add("--no-eager", action="store_true", help="skip the extra HF eager-attention timing")
    on_gpu = "cuda: both models and the GEMMs on GPU 0, autocast on CUDA, timers after a synchronize"
    add("--device", default="cpu", choices=["cpu", "cuda"], help=on_gpu)
    add("--out", default="bench-results/train.json")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device here (a CPU build, or no GPU); leave --device out")
    for key in ("batch_size", "rounds", "repeats", "bf16_batch_size", "bf16_rounds", "gemm_size", "bf16_gemm_size"):
        if getattr(args, key) is not None and getattr(args, key) < 1:
            parser.error(f"--{key.replace('_', '-')} must be >= 1")
    if (out := out_file(args.out, parser.prog)) is None:  # before minutes of timing
        return 2
    start = time.perf_counter()
    try:
        result = run(args)
    except KeyboardInterrupt:
        return stopped(parser.prog, out)
    result["wall_s"] = round(time.perf_counter() - start, 1)
    write_json(out, result)
    for line in summary_lines(result):
        print(line)
    if "bf16_profile_vitscale" in result:
        top = ", ".join(f"{name} {share:.0%}" for name, share in result["bf16_profile_vitscale"][:5])
        groups = ", ".join(f"{g} {result[f'bf16_profile_share_{g}']:.0%}" for g in _PROFILE_GROUPS)
        what = "self CPU time" if result["device"] == "cpu" else "self kernel time"
        print(f"bf16 {result['bf16_profile_model']} step, largest {what}: {top}; families: {groups}")
    flags = " ".join(result["cpu_flags"])
    where = result.get("device_name") or f"cpu_bf16_native {result['cpu_bf16_native']} ({flags})"
    print(f"{where}; {result['threads']} threads; {result['wall_s']:.0f} s -> {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
