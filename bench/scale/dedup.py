"""Near duplicates at ImageNet-21k scale: synthetic training hashes with planted near and exact copies of evaluation
hashes looked up as ``--exclude-like`` does, against brute force; the writer's self-join; the pHash's robustness.
"""

from __future__ import annotations

import io
import math
import time

import numpy as np
from PIL import Image

from bench.scale.tables import I21K_SAMPLES, hex_digests
from data_pipeline.write.dedup import ExclusionSet, NearDuplicateIndex, near_duplicates_of_earlier, perceptual_hash


def _plant_near_copies(
    rng: np.random.Generator, train: int, evals: int, max_distance: int, planted_fraction: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(eval hashes, train hashes, planted train indices): ``planted_fraction`` of the training hashes replaced by an
    evaluation hash with 0..``max_distance`` distinct bits flipped."""
    eval_hashes = rng.integers(0, 2**64, evals, dtype=np.uint64)
    train_hashes = rng.integers(0, 2**64, train, dtype=np.uint64)
    planted = rng.choice(train, int(train * planted_fraction), replace=False)
    sources = rng.integers(0, evals, len(planted))
    flips = np.zeros(len(planted), dtype=np.uint64)
    for i, k in enumerate(rng.integers(0, max_distance + 1, len(planted))):
        for bit in rng.choice(64, int(k), replace=False):
            flips[i] |= np.uint64(1) << np.uint64(bit)
    train_hashes[planted] = eval_hashes[sources] ^ flips
    return eval_hashes, train_hashes, planted


def _bruteforce_pairs(
    index: NearDuplicateIndex, train_hashes: np.ndarray, pick: np.ndarray, max_distance: int
) -> tuple[set[tuple[int, int]], set[tuple[int, int]]]:
    """(true pairs, pairs the index found) of (training index in ``pick``, evaluation slot) within ``max_distance``."""
    truth: set[tuple[int, int]] = set()
    for lo in range(0, len(pick), 256):
        q = train_hashes[pick[lo : lo + 256]]
        close = np.bitwise_count(q[:, None] ^ index.hashes[None, :]) <= max_distance  # (q, evals)
        truth |= {(int(pick[lo + a]), int(b)) for a, b in zip(*np.nonzero(close))}
    qi, si = index.pairs(train_hashes[pick])
    found = {(int(pick[a]), int(b)) for a, b in zip(qi, si)}
    return truth, found


def bench_dedup(train: int, evals: int, max_distance: int, planted_fraction: float, sample: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    eval_hashes, train_hashes, planted = _plant_near_copies(rng, train, evals, max_distance, planted_fraction)

    # --exclude-like over every training image at once; as many exact sha256 copies as planted near ones
    eval_sha = hex_digests(rng, evals).to_pylist()
    train_sha = hex_digests(rng, train).to_pylist()
    exact = rng.choice(np.setdiff1d(np.arange(train), planted), len(planted), replace=False)
    for i, j in zip(exact, rng.integers(0, evals, len(exact))):
        train_sha[i] = eval_sha[j]
    cpu = time.process_time()
    exclusion = ExclusionSet(set(eval_sha), eval_hashes.view(np.int64), max_distance)
    build_s = time.process_time() - cpu
    cpu = time.process_time()
    hit = exclusion.matches_many(train_sha, train_hashes.view(np.int64))
    query_s = time.process_time() - cpu
    index = exclusion.index
    recall_planted = float(hit[np.concatenate([planted, exact])].mean()) if len(planted) else 1.0

    # brute force on a sample of planted and random queries
    near = rng.choice(planted, min(len(planted), sample // 2), replace=False)
    pick = np.unique(np.concatenate([near, rng.choice(train, sample // 2, replace=False)]))
    truth, found = _bruteforce_pairs(index, train_hashes, pick, max_distance)
    both = len(found & truth)

    cpu = time.process_time()
    flags = near_duplicates_of_earlier(train_hashes, max_distance)
    self_join_s = time.process_time() - cpu

    rate = train / query_s
    cores = 16
    hours = (I21K_SAMPLES / rate) / cores / 3600
    log_ratio = math.log2(I21K_SAMPLES) / math.log2(train)
    return dict(
        neardup_recall=round(both / len(truth), 4) if truth else 1.0,
        neardup_precision=round(both / len(found), 4) if found else 1.0,
        neardup_recall_planted=round(recall_planted, 4),  # near and exact copies
        neardup_bruteforce_sample=dict(queries=len(pick), true_pairs=len(truth), found_pairs=len(found)),
        neardup_query_per_s_per_core=round(rate, 1),
        neardup_index_build_s=round(build_s, 3),
        neardup_projected_hours_16_cores=round(hours, 4),
        neardup_projected_seconds_16_cores=round(hours * 3600, 1),
        neardup_projected_hours_16_cores_formula="i21k_samples / query_per_s_per_core / cores / 3600 (a query is "
        "one training image checked for an exact sha256 and a near pHash match: ExclusionSet.matches_many)",
        neardup_projected_hours_16_cores_inputs=dict(
            i21k_samples=I21K_SAMPLES,
            query_per_s_per_core=round(rate, 1),
            cores=cores,
            eval_hashes_in_index=len(index),
            measured_queries=train,
            max_distance=max_distance,
            chunks=index.chunks,
            planted_near=len(planted),
            planted_exact=len(exact),
            note="queries are independent: split them over processes; the index (eval hashes) is the same size "
            "as measured. Uniform synthetic hashes: real pHashes cluster, so buckets and candidates grow",
        ),
        neardup_selfjoin_s_1_core=round(self_join_s, 2),
        neardup_selfjoin_flagged=int(flags.sum()),
        neardup_selfjoin_projected_hours_1_core=round(self_join_s * I21K_SAMPLES / train * log_ratio / 3600, 3),
        neardup_selfjoin_projected_formula="selfjoin_s_1_core * i21k_samples / measured * log2(i21k)/log2(measured)"
        " / 3600 (the writer's in-set near-duplicate flag, one process)",
    )


def bench_phash_robustness(images: list[bytes], max_distance: int) -> float:
    """Share of 0.8x-resized, quality-60 copies whose pHash stays within ``max_distance`` bits."""
    within = 0
    for data in images:
        with Image.open(io.BytesIO(data)) as img:
            original = perceptual_hash(img)
            small = img.convert("RGB").resize((int(img.width * 0.8), int(img.height * 0.8)), Image.BILINEAR)
        buf = io.BytesIO()
        small.save(buf, format="JPEG", quality=60)
        with Image.open(io.BytesIO(buf.getvalue())) as copy:
            within += bin((perceptual_hash(copy) ^ original) & 0xFFFFFFFFFFFFFFFF).count("1") <= max_distance
    return within / len(images)


def measure_dedup(train: int, evals: int, sample: int, photos: list[bytes]) -> dict:
    """``bench_dedup`` at 3 bits with 1% planted copies, and the pHash's robustness on ``photos``."""
    result = bench_dedup(train=train, evals=evals, max_distance=3, planted_fraction=0.01, sample=sample, seed=0)
    result["phash_reencode_within_3_bits"] = round(bench_phash_robustness(photos, 3), 3)
    print(
        f"near-dup: recall {result['neardup_recall']} precision {result['neardup_precision']}, "
        f"{result['neardup_query_per_s_per_core']:.0f} queries/s per core -> "
        f"{result['neardup_projected_hours_16_cores']} h on 16 cores"
    )
    return result
