"""Check training checkpoints against the sizes and CRC-32s their saves recorded.

python -m pretrain.checkpoint verify DIR     # a run folder (each COMPLETE checkpoint) or one checkpoint; exit 2
                                             # on damage, or when DIR is neither
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from data_pipeline.cli import fail, interrupted
from data_pipeline.paths import is_remote
from pretrain.checkpoint import checksums


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pretrain.checkpoint", description="Check training checkpoints.")
    sub = parser.add_subparsers(dest="command", required=True)
    verify = sub.add_parser(
        "verify",
        help="check each file of a checkpoint (or of every COMPLETE checkpoint of a run "
        "folder) against the size and CRC-32 its save recorded; one line per checkpoint, exit 2 "
        "on damage",
    )
    verify.add_argument("dir", metavar="DIR", help="a run folder or one checkpoint folder (a filesystem path)")
    args = parser.parse_args(argv)
    try:
        if is_remote(args.dir):  # Path would make gs://b gs:/b
            raise ValueError(
                f"{args.dir} is object storage; verify reads every file of each checkpoint: run it where the run "
                "folder is (the shared filesystem), or on a copy"
            )
        return checksums.verify_command(Path(args.dir))
    except (ValueError, OSError) as error:  # OSError: a folder it may not list, failing storage
        return fail(parser.prog, error)
    except KeyboardInterrupt:
        # verify only reads: nothing to clean up
        listed = "the checkpoints listed above were checked"
        return interrupted(parser.prog, f"nothing changed; {listed}, the same command checks them all")


if __name__ == "__main__":
    sys.exit(main())
