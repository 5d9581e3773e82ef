"""The GPU campaign's command line (`bench.gpu.campaign`; docs/benchmarks/gpu.md)."""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

from bench import out_file
from bench.gpu.campaign import Campaign, summary_lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--budget-s", type=float, default=480.0, help="seconds the whole campaign may take")
    add("--out", default="bench-results/gpu.json")
    add("--smoke", action="store_true", help="every part end to end on the CPU with tiny shapes")
    add(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also time compiled blocks (vitscale's and HF's); off with --smoke",
    )
    add(
        "--peak-tflops",
        type=float,
        help="the MFU denominator per device (default: pretrain.telemetry.peak's; --smoke: 1.0)",
    )
    add("--work-dir", help="scratch folder (default: a temporary one, removed after)")
    args = parser.parse_args(argv)
    if args.budget_s <= 0 or (args.peak_tflops is not None and args.peak_tflops <= 0):
        parser.error("--budget-s and --peak-tflops must be > 0")
    if not args.smoke and not torch.cuda.is_available():
        parser.error("no CUDA device here (a CPU build of torch, or no GPU); --smoke runs the campaign on the CPU")
    if args.smoke:
        args.compile, args.peak_tflops = False, args.peak_tflops or 1.0
    if (out := out_file(args.out, "bench.gpu")) is None:
        return 2
    with tempfile.TemporaryDirectory(prefix="bench-gpu-", dir=args.work_dir) as tmp:
        result = Campaign(args, out).run(Path(tmp))
    for line in summary_lines(result):
        print(line)
    print(f"{result['wall_s']:.0f} s -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
