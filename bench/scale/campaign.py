"""ImageNet-21k scale rehearsed without the images: the sizes each part runs at, and the generation part.

The parts: ``bench.scale.tables``, ``.dedup``, ``.writer`` and ``measure_generation``. CPU rates are per CPU second of
the measured process; planning and first-batch times are wall times. Every projection to i21k writes its inputs.
"""

from __future__ import annotations

from dataclasses import dataclass

from bench.scale.tables import I21K_CLASSES, I21K_SAMPLES, I21K_SHARDS
from data_pipeline.builtin import formula


@dataclass(frozen=True)
class Sizes:
    samples: int  # rows of the synthetic tables
    shards: int  # manifest rows (the first batch's stand-in's too)
    classes: int
    worlds: tuple[int, int]  # ranks planned for; the first batch is the larger's last rank's
    photos: int  # realistic JPEGs for the writer (the first 100 for the pHash check too)
    reencoded: int  # of them, re-encoded at 800x600 for the writer
    serial_candidates: int  # Candidates main_process_costs holds, pickles and dedups
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
    """Images per CPU second of each formula kind at 224 px, the slowest projected to i21k's classes x 1,000."""
    rates = {kind: formula.measure_generation(kind, 224, num_images) for kind in formula.CLASS_FORMULA}
    slowest = min(rates.values())
    total = I21K_CLASSES * 1000
    return dict(
        generate_img_s_per_core=round(slowest, 1),
        generate_img_s_per_core_by_kind={k: round(v, 1) for k, v in rates.items()},
        generate_projected_hours_96_cores=round(total / (slowest * 96) / 3600, 3),
        generate_projected_hours_1_core=round(total / slowest / 3600, 2),
        generate_projected_inputs=dict(
            formula="classes * images_per_class / (img_s_per_core of the slowest kind * cores) / 3600",
            classes=I21K_CLASSES,
            images_per_class=1000,
            resolution=224,
            measured_images_per_kind=num_images,
        ),
    )
