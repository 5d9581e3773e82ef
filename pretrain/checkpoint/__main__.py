"""Check training checkpoints against the sizes and CRC-32s their saves recorded.

python -m pretrain.checkpoint verify DIR     # a run folder (each COMPLETE checkpoint) or one checkpoint; exit 2
                                             # on damage, or when DIR is neither
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pretrain.checkpoint import checksums


def main(argv: list[str] | None = None) -> int:
    """``python -m pretrain.checkpoint verify DIR`` (`pretrain.checkpoint.checksums.verify_command`)."""
    parser = argparse.ArgumentParser(prog="python -m pretrain.checkpoint", description="Check training checkpoints.")
    sub = parser.add_subparsers(dest="command", required=True)
    verify = sub.add_parser(
        "verify",
        help="check each file of a checkpoint (or of every COMPLETE checkpoint of a run "
        "folder) against the size and CRC-32 its save recorded; one line per checkpoint, exit 2 "
        "on damage",
    )
    verify.add_argument("dir", type=Path, metavar="DIR", help="a run folder or one checkpoint folder")
    args = parser.parse_args(argv)
    try:
        return checksums.verify_command(args.dir)
    except ValueError as error:  # no run folder or checkpoint there, or one without COMPLETE
        print(f"{parser.prog} verify: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
