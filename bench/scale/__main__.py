"""ImageNet-21k scale rehearsed without the images: the command line (`bench.scale.campaign`)."""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from bench import out_file, stopped, write_json
from bench.images import imagenet_like_jpegs
from bench.scale.campaign import FULL, TINY, Sizes, measure_generation
from bench.scale.dedup import measure_dedup
from bench.scale.tables import LOADER_WORKERS, measure_first_batch, measure_tables
from bench.scale.writer import measure_writer


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.scale", description="ImageNet-21k-scale rehearsal: tables, planning, dedup, writer"
    )
    p.add_argument("--out", default="bench-results/scale.json")
    p.add_argument("--tiny", action="store_true", help="small sizes throughout (a smoke test; numbers mean little)")
    args = p.parse_args(argv)
    if (out := out_file(args.out, p.prog)) is None:
        return 2
    try:
        result = measure(TINY if args.tiny else FULL, args.tiny)
    except KeyboardInterrupt:
        return stopped(p.prog, out)
    write_json(out, result)
    print(f"wrote {out}")
    return 0


def measure(sizes: Sizes, tiny: bool) -> dict:
    result: dict = dict(
        tiny=tiny, samples=sizes.samples, shards=sizes.shards, classes=sizes.classes, loader_workers=LOADER_WORKERS
    )
    with tempfile.TemporaryDirectory(prefix="bench-scale-") as tmp_name:
        tmp = Path(tmp_name)
        result.update(measure_tables(tmp / "i21k", sizes.samples, sizes.shards, sizes.classes, sizes.worlds))
        photos = imagenet_like_jpegs(sizes.photos, seed=1)
        result |= measure_writer(tmp, photos, sizes.reencoded, sizes.serial_candidates, sizes.serial_exclude_hashes)
        # the writer's shards stand in for i21k's
        result.update(measure_first_batch(tmp / "clean-realistic", tmp / "first-batch", sizes.shards, sizes.worlds[1]))
        result.update(measure_dedup(sizes.dedup_train, sizes.dedup_evals, sizes.dedup_sample, photos[:100]))
    result.update(measure_generation(sizes.generated_per_kind))
    return result


if __name__ == "__main__":
    sys.exit(main())
