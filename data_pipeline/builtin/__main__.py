"""Generate the built-in datasets as shard folders, offline (`data_pipeline.builtin.sets`).

python -m data_pipeline.builtin all --out data    # = `make shards`
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import fields

from data_pipeline.builtin.sets import (
    BUILTIN_NAMES,
    SPLITS,
    BuiltinConfig,
    _canonical,
    check_folder,
    check_sizes,
    config,
    ensure,
    option_minimum,
    set_fields,
    unread_options,
)
from data_pipeline.cli import fail, interrupted, output_folder
from data_pipeline.manifest import read_dataset_info


def main(argv: list[str] | None = None) -> int:
    known = ", ".join(f.name for f in fields(BuiltinConfig))
    p = argparse.ArgumentParser(
        prog="python -m data_pipeline.builtin",
        description="Generate built-in datasets as vitscale shard folders (offline).",
    )
    p.add_argument("name", help=f"one of {', '.join(BUILTIN_NAMES)}, or 'all'")
    p.add_argument("--out", required=True, help="root folder; writes OUT/<name>/<split>/")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=INT",
        help=f"size override over the set's defaults, fields: {known}",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=None,
        help="processes generating and writing (same bytes for any count; default: the `processes` field, 1)",
    )
    args = p.parse_args(argv)
    try:
        overrides = {}
        if args.workers is not None:
            if args.workers < 1:
                raise ValueError(f"--workers {args.workers}: use >= 1 process")
            overrides["processes"] = args.workers
        for item in args.set:
            key, sep, value = item.partition("=")
            if not sep:
                raise ValueError(f"--set {item!r} must look like FIELD=INT, e.g. --set resolution=32")
            low = option_minimum(key)
            if low is None:
                raise ValueError(f"--set {item!r}: no field {key!r}; fields: {known}")
            if not value.strip().isdigit() or int(value) < low:
                raise ValueError(f"--set {item!r}: {key} must be an integer >= {low}")
            overrides[key] = int(value)
        names = BUILTIN_NAMES if args.name == "all" else (_canonical(args.name),)
        unread = unread_options(names, overrides)
        if unread:
            key = unread[0]
            raise ValueError(f"--set {key}={overrides[key]}: {args.name} does not read {key}; {_reads(names)}")
        for name in names:
            check_sizes(name, config(name, **overrides))
        output_folder(args.out, "--out")
        for name in names:  # before `all` generates anything
            check_folder(name, args.out, **overrides)
        for name in names:
            start = time.perf_counter()
            folder = ensure(name, args.out, **overrides)
            counts = {s: read_dataset_info(folder / s).num_samples for s in SPLITS[name]}
            print(f"{name}: {counts} in {folder} ({time.perf_counter() - start:.1f}s)")
    except ValueError as err:
        return fail(p.prog, err)
    except KeyboardInterrupt:  # a re-run skips the finished sets, and keeps the finished shards of the one begun
        kept = f"the sets and shards finished under {args.out} are kept; the same command goes on from them"
        return interrupted(p.prog, kept)
    return 0


def _reads(names: tuple[str, ...]) -> str:
    if len(names) > 1:
        return "no built-in set reads it"
    return f"the fields it reads: {', '.join(set_fields(names[0]))}"


if __name__ == "__main__":
    sys.exit(main())
