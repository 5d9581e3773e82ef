"""ImageNet-21k scale rehearsed without the images: manifests, planning, dedup, writing, generation (issue #16).

    python -m bench.scale [--out bench-results/scale.json] [--tiny]                    (make bench-scale)

1. Tables (``bench.scale.tables``): ``manifest.parquet`` / ``samples.parquet`` / ``classes.parquet`` for 14,197,122
   samples in 4,700 shards and 21,843 classes, written by ``data_pipeline.manifest`` (samples streamed a row group
   at a time). Reading them, and planning epoch 0 for 64 and 512 ranks x 8 loader workers, each in a fresh
   subprocess that does what one rank does (read the manifest, build the TrainStream, deal the shards of all 8
   workers): seconds and peak RSS. The time to the first batch uses a 4,700-row manifest whose rows point at a few
   real shards.
2. Dedup (``bench.scale.dedup``): 1M synthetic training hashes with planted near copies of 100k evaluation hashes,
   looked up in the writer's multi-index hash (``data_pipeline.write.dedup``); recall and precision against brute force
   on a sample; per-core rate projected to 14.2M queries on 16 cores.
3. Writer (``bench.scale.writer``): ``python -m data_pipeline.write`` on per-class tars of generated JPEGs (small,
   ~400x350, and re-encoded 800x600), images per CPU second; one run killed half-way and re-run must give
   byte-identical output; projected to i21k on a 96-core node.
4. Generation (here): ``data_pipeline.builtin.formula.measure_generation`` per formula kind at 224 px, projected to
   21,843 x 1,000.

CPU rates are per CPU second of the measured process (``time.process_time`` / ``RUSAGE_CHILDREN``), so other jobs
on the machine distort them little; wall times (planning, first batch) are taken as they come. Every projection
writes its formula and inputs beside it. Temporary files live in one temp folder, removed at the end.
"""

from __future__ import annotations

from dataclasses import dataclass

from bench.scale.tables import (
    I21K_CLASSES,
    I21K_SAMPLES,
    I21K_SHARDS,
)
from data_pipeline.builtin import formula


@dataclass(frozen=True)
class Sizes:
    """What each measurement runs at: i21k's own sizes (``FULL``), or ``--tiny``'s (``TINY``)."""

    samples: int  # rows of the synthetic tables
    shards: int  # manifest rows (the first batch's stand-in manifest too)
    classes: int
    worlds: tuple[int, int]  # ranks planned for; the first batch is the last rank's at the larger world
    photos: int  # realistic JPEGs generated for the writer (and, the first 100, the pHash check)
    reencoded: int  # of them, re-encoded at 800x600 for the writer
    serial_candidates: int  # writer Candidates held, pickled and deduped by main_process_costs
    serial_exclude_hashes: int  # its --exclude-like set
    dedup_train: int  # training hashes looked up in the near-duplicate index
    dedup_evals: int  # evaluation hashes in the index
    dedup_sample: int  # queries checked against brute force
    generated_per_kind: int  # images per formula kind


FULL = Sizes(
    samples=I21K_SAMPLES,
    shards=I21K_SHARDS,
    classes=I21K_CLASSES,
    worlds=(64, 512),
    photos=480,
    reencoded=60,
    serial_candidates=200_000,
    serial_exclude_hashes=100_000,
    dedup_train=1_000_000,
    dedup_evals=100_000,
    dedup_sample=2_000,
    generated_per_kind=64,
)
TINY = Sizes(  # a smoke test: its numbers mean little
    samples=60_000,
    shards=600,
    classes=300,
    worlds=(8, 64),
    photos=64,
    reencoded=16,
    serial_candidates=5_000,
    serial_exclude_hashes=1_000,
    dedup_train=20_000,
    dedup_evals=2_000,
    dedup_sample=200,
    generated_per_kind=8,
)


def measure_generation(num_images: int) -> dict:
    """Images per CPU second of each formula kind at 224 px, the slowest projected to 21,843 classes x 1,000."""
    rates = {kind: formula.measure_generation(kind, 224, num_images) for kind in formula.CLASS_FORMULA}
    slowest = min(rates.values())
    total = I21K_CLASSES * 1000
    return {
        "generate_img_s_per_core": round(slowest, 1),
        "generate_img_s_per_core_by_kind": {k: round(v, 1) for k, v in rates.items()},
        "generate_projected_hours_96_cores": round(total / (slowest * 96) / 3600, 3),
        "generate_projected_hours_1_core": round(total / slowest / 3600, 2),
        "generate_projected_inputs": dict(
            formula="classes * images_per_class / (img_s_per_core of the slowest kind * cores) / 3600",
            classes=I21K_CLASSES,
            images_per_class=1000,
            resolution=224,
            measured_images_per_kind=num_images,
        ),
    }
