"""The GPU campaign's command line (`bench.gpu.campaign`; docs/benchmarks/gpu.md)."""

from __future__ import annotations

import argparse
import signal
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from bench import out_file
from bench.gpu.campaign import SHARES, Campaign, summary_lines
from bench.gpu.step import MODELS, VARIANTS
from bench.gpu.train import TrainSpec
from data_pipeline.cli import interrupted, output_folder


def _names(known) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        names = [name for name in text.split(",") if name]
        if not names:
            raise argparse.ArgumentTypeError(f"{text!r} names nothing; choose from {', '.join(known)}")
        if unknown := [n for n in names if n not in known]:
            raise argparse.ArgumentTypeError(f"{text!r}: {unknown} is not one of {', '.join(known)}")
        return names

    return parse


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _check_train_set(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--train-set: KEY=VALUE overrides the recipe takes, model.name left as it is; parser.error otherwise."""
    if bad := [s for s in args.train_set if "=" not in s]:
        parser.error(f"--train-set {bad[0]!r} is not KEY=VALUE (e.g. --train-set model.compile=true)")
    if model := [s for s in args.train_set if s.partition("=")[0].strip() == "model.name"]:
        parser.error(  # its keys are H/14's (train_path_mfu_vit_h14), and `cluster.calibrate` files them so
            f"--train-set {model[0]!r}: the train part measures the vit_h14_i21k recipe, whose keys calibrate "
            "ViT-H/14; leave model.name as it is (the step part measures other models: --models)"
        )
    try:  # a key or value the recipe refuses: now, not after the other parts' minutes of device time
        TrainSpec(data="shards", run_root="runs", smoke=args.smoke, more=tuple(args.train_set)).config(Path("run"))
    except ValueError as error:
        parser.error(f"--train-set: {error}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--budget-s", type=float, default=480.0, help="seconds the whole campaign may take")
    add("--out", help="default: bench-results/gpu.json, the committed record; --smoke: bench-results/gpu-smoke.json")
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
    rerun = parser.add_argument_group("a rerun of some of it, after a change")
    rerun.add_argument("--parts", type=_names(SHARES), default=list(SHARES), help="comma-separated (default: all)")
    rerun.add_argument("--models", type=_names(MODELS), default=list(MODELS), help="the step part's (default: all)")
    rerun.add_argument(
        "--variants",
        type=_names(VARIANTS),
        default=list(VARIANTS),
        help="the step part's (default: all; without eager, the others start at the model's cap)",
    )
    rerun.add_argument(
        "--train-set", action="append", default=[], metavar="KEY=VALUE", help="a recipe override for the train part"
    )
    rerun.add_argument("--train-steps", type=int, help="the real path's steps (one checkpoint at the end, no resume)")
    args = parser.parse_args(argv)
    if not args.budget_s > 0 or (args.peak_tflops is not None and not args.peak_tflops > 0):  # nan too
        parser.error("--budget-s and --peak-tflops must be > 0")
    warmup = 0 if args.smoke else TrainSpec.warmup_steps  # the timed steps come after these (smoke: none)
    if args.train_steps is not None and args.train_steps < warmup + 2:
        parser.error(f"--train-steps must be at least {warmup + 2}: {warmup} warm-up steps, then two timed ones")
    _check_train_set(parser, args)
    if args.work_dir is not None:
        try:
            output_folder(args.work_dir, "--work-dir")
        except ValueError as error:
            parser.error(str(error))
    if not args.smoke and not torch.cuda.is_available():
        parser.error("no CUDA device here (a CPU build of torch, or no GPU); --smoke runs the campaign on the CPU")
    if args.smoke:
        args.compile, args.peak_tflops = False, args.peak_tflops or 1.0
    args.out = args.out or f"bench-results/gpu{'-smoke' if args.smoke else ''}.json"
    if (out := out_file(args.out, parser.prog)) is None:
        return 2
    campaign = Campaign(args, out)
    # device.sh's `timeout` ends the campaign with SIGTERM, which must end the train part's child (a session of its
    # own, out of the signal's reach) as Ctrl-C does, or it trains on, holding the GPU, after the device call
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        with tempfile.TemporaryDirectory(prefix="bench-gpu-", dir=args.work_dir) as tmp:
            result = campaign.run(Path(tmp))
    except KeyboardInterrupt:
        done = [part for part in SHARES if f"seconds_{part}" in campaign.result]
        if campaign.cut is not None:  # its keys so far were written, beside the finished parts'
            cut = f"what the {campaign.cut} part measured"
            return interrupted(parser.prog, f"the finished parts ({', '.join(done) or 'none'}) and {cut} are in {out}")
        if done:
            return interrupted(parser.prog, f"the finished parts ({', '.join(done)}) are in {out}")
        return interrupted(parser.prog, f"nothing was written to {out}")
    finally:
        signal.signal(signal.SIGTERM, previous)
    for line in summary_lines(result):
        print(line)
    print(f"{result['wall_s']:.0f} s -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
