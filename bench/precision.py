"""bf16 against fp32 per model shape on this CPU: the measurements `deepspeed.precision: auto`'s CPU rule is fitted to.

Per shape: one forward + backward per precision on one thread, best of ``--trials`` (`probe_bf16_speedup`), beside
`cpu_rule`'s pick: ``speedup_<shape>``, ``rule_<shape>``. ``min_speedup_ruled_bf16`` (the slowest shape sent to bf16)
and ``max_speedup_ruled_fp32`` (the fastest kept in fp32) check the rule. Without bf16 units only the quick shapes run.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from bench import out_file, stopped, write_json
from pretrain.config.precision import CPU_RULES, StepShape, cpu_bf16_units, cpu_rule, probe_bf16_speedup
from pretrain.model.vit import build_model, model_config
from pretrain.telemetry.peak import cpu_model

# (model, image size, micro-batch, overrides): local_demo's model, the paper's variants at small micro-batches (the
# rule's boundary in tokens x width²), a /32 whose patch convolution weighs, a hybrid
SHAPES = {
    "quick": [("vit_tiny_debug", 32, 8, {}), ("vit_tiny_debug", 32, 32, {}), ("vit_ti16", 224, 2, {})],
    "default": [
        ("vit_tiny_debug", 32, 8, {}),
        ("vit_tiny_debug", 32, 16, {}),
        ("vit_tiny_debug", 32, 32, {}),
        ("vit_tiny_debug", 32, 64, {}),
        ("vit_tiny_debug", 64, 32, {}),
        ("vit_ti16", 224, 2, {}),
        ("vit_ti16", 224, 3, {}),
        ("vit_ti16", 224, 8, {}),
        ("vit_s16", 224, 1, {}),
        ("vit_s16", 224, 8, {}),
        ("vit_s32", 224, 8, {}),
        ("vit_s32", 224, 32, {"depth": 2}),
        ("vit_b32", 224, 8, {}),
        ("vit_b16", 224, 4, {}),
        ("r26_vit_s32", 224, 4, {}),
    ],
}


def measure(name: str, image_size: int, batch: int, overrides: dict, trials: int) -> tuple[float, float]:
    """(fp32 s, bf16 s), best of ``trials`` probes of a 64-class classification step."""

    def build() -> torch.nn.Module:
        model = build_model(name, image_size=image_size, num_classes=64, **overrides)

        class Task(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.model = model

            def forward(self, images, labels):
                return torch.nn.functional.cross_entropy(self.model(images).float(), labels), {}

        return Task()

    runs = [probe_bf16_speedup(build, batch, image_size) for _ in range(trials)]
    return min(r[0] for r in runs), min(r[1] for r in runs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.precision", description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--shapes", choices=sorted(SHAPES), default="default", help="which shape list to time")
    add("--trials", type=int, default=3, help="probes per shape; the best counts (>= 1)")
    add("--out", default="bench-results/precision.json", help="JSON file to write")
    args = parser.parse_args(argv)
    if args.trials < 1:
        parser.error(f"--trials {args.trials}: give at least 1")
    if (out := out_file(args.out, parser.prog)) is None:
        return 2
    try:
        return _measure(args, out)
    except KeyboardInterrupt:
        return stopped(parser.prog, out)


def _measure(args: argparse.Namespace, out: Path) -> int:
    torch.set_num_threads(1)
    units = cpu_bf16_units()
    shapes = SHAPES[args.shapes if units else "quick"]
    if not units:
        print("this CPU has no AMX/AVX512-BF16: bf16 is emulated; timing the quick shapes only", flush=True)
    result: dict = dict(
        cpu=cpu_model(),
        bf16_units="+".join(units) or "none",
        torch=torch.__version__,
        threads=1,
        trials=args.trials,
        rule=CPU_RULES[units[0]].describe() if units else "fp32 (no bf16 units)",
    )
    ruled: dict[str, list[float]] = {"bf16": [], "fp32": []}
    start = time.time()
    for name, image_size, batch, overrides in shapes:
        label = f"{name}_{image_size}px_b{batch}" + "".join(f"_{k}{v}" for k, v in overrides.items())
        fp32, bf16 = measure(name, image_size, batch, overrides, args.trials)
        pick = cpu_rule(StepShape.of(model_config(name, image_size=image_size, **overrides), batch)).precision
        ruled[pick].append(fp32 / bf16)
        result |= {f"fp32_ms_{label}": fp32 * 1e3, f"bf16_ms_{label}": bf16 * 1e3}
        result |= {f"speedup_{label}": fp32 / bf16, f"rule_{label}": pick}
        print(
            f"{label}: fp32 {fp32 * 1e3:.1f} ms, bf16 {bf16 * 1e3:.1f} ms = {fp32 / bf16:.2f}x; rule: {pick}",
            flush=True,
        )
    result["min_speedup_ruled_bf16"] = min(ruled["bf16"], default=None)
    result["max_speedup_ruled_fp32"] = max(ruled["fp32"], default=None)
    result["seconds"] = time.time() - start
    write_json(out, result)
    low, high = result["min_speedup_ruled_bf16"], result["max_speedup_ruled_fp32"]
    said = [f"bf16 picked at speedups >= {low}" if low is not None else "bf16 picked for no shape"]
    said.append(f"fp32 at <= {high}" if high is not None else "fp32 for no shape")
    print(f"wrote {out}: {', '.join(said)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
