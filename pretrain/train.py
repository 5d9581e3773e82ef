"""Train a recipe: DeepSpeed ZeRO over a ViT classification (or other) task, one process or one per rank.

python -m pretrain.train --config configs/local_demo.yaml [--set optim.lr=3e-4 ...] [--dry-run] [--summary PATH]
torchrun --nproc-per-node 2 -m pretrain.train --config local_demo
"""

from __future__ import annotations

from pretrain import collector

if __name__ == "__main__":  # before the imports below
    collector.pause()

import argparse
import json
import os
from collections.abc import Sequence
from pathlib import Path

from data_pipeline.cli import INTERRUPTED, fail, interrupted, output_file
from pretrain.checkpoint import checksums, run_folder
from pretrain.checkpointer import nothing_to_train
from pretrain.config.ds_config import batch_plan
from pretrain.config.train_config import TrainConfig, load_config
from pretrain.distributed import exit_rank, finish_distributed
from pretrain.loop import train_worker
from pretrain.telemetry.metrics import NonFiniteLossError

PROG = "python -m pretrain.train"


def _env_world_size() -> int:
    text = os.environ.get("WORLD_SIZE", "1")
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"WORLD_SIZE={text!r} in the environment is not a positive integer; unset it or use torchrun")
    return int(text)


def _summary_path(template: str, rank: int) -> str:
    try:
        return template.format(rank=rank)
    except (KeyError, IndexError, ValueError):
        raise ValueError(
            f"--summary {template!r}: only {{rank}} may appear in braces, e.g. runs/summary_{{rank}}.json"
        ) from None


def _kept(config: TrainConfig | None) -> str:
    """What a Ctrl-C leaves: the newest COMPLETE checkpoint (a save cut short never is one) and how to go on. Not
    verified here: a Ctrl-C must not wait for a read of the whole checkpoint (the next start verifies it)."""
    if config is None:
        return "nothing was started"
    newest = run_folder.latest_checkpoint(config.checkpoint.dir)
    if newest is None:
        return f"{config.checkpoint.dir} holds no complete checkpoint yet: the same command starts the run over"
    return f"kept {newest}, the newest complete checkpoint: the same command resumes from it"


def _resumes_from(run_dir: str, saved: Sequence[str] = ()) -> Path | None:
    """The checkpoint a run launched again resumes from: the last of ``saved`` (this run's), else the newest COMPLETE
    one that is not damaged, checked by this process alone (`checkpointer.newest_verified` is collective)."""
    if saved:
        return Path(saved[-1])
    for folder in reversed(run_folder.complete_checkpoints(run_dir)):
        if checksums.verify(folder).ok:
            return folder
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="a recipe YAML path or a name under configs/")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="dotted override, repeatable")
    parser.add_argument("--dry-run", action="store_true", help="validate and print the config, then stop")
    parser.add_argument("--summary", metavar="PATH", help="write each rank's summary as JSON ('{rank}' is filled in)")
    # the DeepSpeed launcher appends --local_rank; LOCAL_RANK counts
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    config: TrainConfig | None = None
    rank0 = os.environ.get("RANK", "0") == "0"  # every rank of a torchrun launch runs this
    local0 = os.environ.get("LOCAL_RANK", "0") == "0"
    started = False
    try:
        world_size = _env_world_size()
        config = load_config(args.config, args.set)
        config.validate(world_size)
        if args.summary:  # fail now, not after the run
            output_file(_summary_path(args.summary, 0), "--summary")
        if args.dry_run:
            print(config.format())
            plan = batch_plan(config.data, world_size)
            print(
                f"world size {world_size}: micro-batch {plan.micro_batch_size} x accumulation "
                f"{plan.grad_accum_steps} x world {world_size} = global batch {plan.global_batch_size}"
            )
            return 0
        config.data.ensure_builtin()  # every process of a torchrun launch: one writes, the others wait
        done = nothing_to_train(config)  # before any rank starts DeepSpeed, a run, an attempt
        if done is not None:
            if rank0:
                print(done)
            return 0
        started = True
        summary = train_worker(config, validated=True)
    except ValueError as error:  # found before training: the same on every rank, said once per machine
        return fail(PROG, error) if local0 or started else 2
    except NonFiniteLossError as error:  # a failed run, not bad input; every rank ends so, with the same loss
        return fail(PROG, error, status=1) if local0 else 1  # one line per machine
    except KeyboardInterrupt:  # train_worker closed the run's records on its way out
        return interrupted(PROG, _kept(config)) if rank0 else INTERRUPTED
    if args.summary:
        Path(_summary_path(args.summary, summary.rank)).write_text(json.dumps(summary.to_dict()))
    if summary.rank == 0:
        loss = "-" if summary.final_loss is None else f"{summary.final_loss:.4f}"
        newest = _resumes_from(config.checkpoint.dir, summary.checkpoints)
        print(
            f"done: {summary.steps} steps, final loss {loss}, images seen {summary.images_seen:,}; "
            + (f"newest checkpoint {newest}" if newest else f"no checkpoint in {config.checkpoint.dir}")
        )
    finish_distributed()
    return 0


if __name__ == "__main__":
    exit_rank(main())
