"""Benchmark a training step of vitscale's ViT-S/16 against Hugging Face transformers and this machine's GEMM.

    python -m bench.train [--batch-size 16] [--rounds 5] [--out bench-results/train.json]

Both models have the same configuration (ViT-S/16 at 224 px, 1000 classes, tanh GELU, LayerNorm eps 1e-6, fp32 on
CPU, SDPA attention in both) and run the same step: forward, softmax cross-entropy, backward, AdamW. The rounds are
interleaved (vitscale, HF, GEMM, vitscale, ...) so a machine whose load changes during the run (other jobs) hurts
both sides alike; each number is the median over rounds. `speedup_vs_hf` is against HF with SDPA attention (its
fastest CPU path, the fair baseline); HF with eager attention is timed too and reported beside it.

Achieved FLOP/s = images/s x training FLOPs per image (`pretrain.flops.train_flops`, 3 x forward, multiply-add = 2).
`gemm_fraction` divides it by the fp32 GEMM rate of a large square matmul measured in the same rounds: how close the
step comes to what the hardware's fastest kernel does here. Writes JSON with `vitscale_img_s`, `hf_img_s`,
`speedup_vs_hf`, `gemm_fraction` and the details.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from data_pipeline.cli import output_file
from pretrain.flops import train_flops
from pretrain.model import build_model


def vitscale_step(batch_size: int) -> tuple[Callable[[], None], int]:
    model = build_model("vit_s16", num_classes=1000)
    return _make_step(model, lambda x: model(x), batch_size), train_flops(model.config)


def hf_step(batch_size: int, attn: str) -> Callable[[], None]:
    from transformers import ViTConfig, ViTForImageClassification

    config = ViTConfig(
        hidden_size=384, num_hidden_layers=12, num_attention_heads=6, intermediate_size=1536, image_size=224,
        patch_size=16, num_labels=1000, hidden_act="gelu_pytorch_tanh", layer_norm_eps=1e-6, qkv_bias=True,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, attn_implementation=attn,
    )  # fmt: skip
    model = ViTForImageClassification(config)
    return _make_step(model, lambda x: model(pixel_values=x).logits, batch_size)


def _make_step(model: torch.nn.Module, logits_of: Callable, batch_size: int) -> Callable[[], None]:
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
    g = torch.Generator().manual_seed(0)
    images = torch.rand(batch_size, 3, 224, 224, generator=g) * 2 - 1  # (B, 3, 224, 224) in [-1, 1]
    labels = torch.randint(0, 1000, (batch_size,), generator=g)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(logits_of(images), labels)
        loss.backward()
        optimizer.step()

    return step


def time_steps(step: Callable[[], None], repeats: int) -> float:
    """Seconds per step, the best of ``repeats`` consecutive steps (the least disturbed by other processes)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return min(times)


def gemm_tflops(size: int = 2048, repeats: int = 5) -> float:
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(size, size, generator=g), torch.randn(size, size, generator=g)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best / 1e12


def run(batch_size: int, rounds: int, repeats: int, attn: str, with_eager: bool) -> dict:
    torch.manual_seed(0)
    ours, flops_per_image = vitscale_step(batch_size)
    steps = {"vitscale": ours, "hf": hf_step(batch_size, attn)}
    if with_eager and attn != "eager":
        steps["hf_eager"] = hf_step(batch_size, "eager")  # context: the HF default before SDPA
    for step in steps.values():  # warm-up: allocator, thread pool, optimizer state
        step()
    seconds: dict[str, list[float]] = {name: [] for name in steps}
    gemm = []
    for i in range(rounds):
        for name, step in steps.items():
            seconds[name].append(time_steps(step, repeats))
        gemm.append(gemm_tflops())
        rates = ", ".join(f"{name} {batch_size / s[-1]:.2f} img/s" for name, s in seconds.items())
        print(f"round {i + 1}/{rounds}: {rates}, GEMM {gemm[-1]:.3f} TFLOP/s", flush=True)
    img_s = {name: batch_size / statistics.median(s) for name, s in seconds.items()}
    vitscale_img_s, hf_img_s = img_s["vitscale"], img_s["hf"]
    gemm_tf = statistics.median(gemm)
    achieved_tf = vitscale_img_s * flops_per_image / 1e12
    extra = {}
    if "hf_eager" in img_s:
        extra = {"hf_eager_img_s": img_s["hf_eager"], "speedup_vs_hf_eager": vitscale_img_s / img_s["hf_eager"]}
    return {
        "vitscale_img_s": vitscale_img_s,
        "hf_img_s": hf_img_s,
        "speedup_vs_hf": vitscale_img_s / hf_img_s,
        **extra,
        "gemm_fraction": achieved_tf / gemm_tf,
        "achieved_tflops": achieved_tf,
        "gemm_tflops": gemm_tf,
        "train_gflops_per_image": flops_per_image / 1e9,
        "model": "vit_s16",
        "image_size": 224,
        "batch_size": batch_size,
        "precision": "fp32",
        "device": "cpu",
        "hf_attn_implementation": attn,
        "threads": torch.get_num_threads(),
        "rounds": rounds,
        "repeats_per_round": repeats,
        "torch": torch.__version__,
        "machine": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "load_average_1min": os.getloadavg()[0],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.train", description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=2, help="steps per model per round (the best one counts)")
    parser.add_argument("--hf-attn", default="sdpa", choices=["sdpa", "eager"], help="HF attention implementation")
    parser.add_argument("--no-eager", action="store_true", help="skip the extra HF eager-attention timing")
    parser.add_argument("--out", default="bench-results/train.json")
    args = parser.parse_args(argv)
    if args.batch_size < 1 or args.rounds < 1 or args.repeats < 1:
        parser.error("--batch-size, --rounds and --repeats must be >= 1")
    try:
        out = output_file(args.out, "--out")  # before minutes of timing
    except ValueError as error:
        print(f"bench.train: error: {error}", file=sys.stderr)
        return 2
    result = run(args.batch_size, args.rounds, args.repeats, args.hf_attn, with_eager=not args.no_eager)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"vitscale {result['vitscale_img_s']:.2f} img/s, HF ({args.hf_attn}) {result['hf_img_s']:.2f} img/s: "
          f"{result['speedup_vs_hf']:.2f}x (goal >= 1.5x); {result['achieved_tflops']:.3f} of "
          f"{result['gemm_tflops']:.3f} GEMM TFLOP/s = {result['gemm_fraction']:.0%} (goal >= 70%); "
          f"load average {result['load_average_1min']:.1f} -> {out}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
