"""Exact and near-duplicate detection: sha256 of the bytes and a 64-bit DCT perceptual hash of the pixels.

The paper de-duplicated its pre-training data against the downstream test sets (following BiT); ``--exclude-like``
in the writer uses :class:`NearDuplicateIndex` built from an evaluation set's hashes to do the same.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import scipy.fft
from PIL import Image

from data_pipeline.manifest import SAMPLES_FILE

_POPCOUNT8 = np.array([bin(i).count("1") for i in range(256)], dtype=np.uint8)


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def perceptual_hash(image: Image.Image) -> int:
    """pHash: the signs of the 8x8 lowest DCT frequencies of a 32x32 grey image against their median.

    Robust to re-encoding, rescaling and small colour shifts; returned as a signed 64-bit int so it fits Parquet
    int64 columns (the bit pattern is what matters).
    """
    grey = np.asarray(image.convert("L").resize((32, 32), Image.BILINEAR), dtype=np.float32)
    coeffs = scipy.fft.dctn(grey, norm="ortho")[:8, :8].ravel()  # (64,)
    median = np.median(coeffs[1:])  # the DC term only measures brightness
    bits = coeffs > median
    value = 0
    for bit in bits:
        value = (value << 1) | int(bit)
    return int(np.array(value, dtype=np.uint64).view(np.int64))


def hamming(a: int, b: int) -> int:
    return bin((a ^ b) & 0xFFFFFFFFFFFFFFFF).count("1")


class NearDuplicateIndex:
    """Perceptual hashes bucketed by bands, so a lookup compares against a few candidates instead of all.

    With ``max_distance + 1`` bands, two hashes within ``max_distance`` bits share at least one band exactly
    (pigeonhole), so the band lookup never misses a true near duplicate.
    """

    def __init__(self, max_distance: int = 3):
        if not 0 <= max_distance <= 15:
            raise ValueError(f"near-duplicate max_distance must be in [0, 15], got {max_distance}")
        self.max_distance = max_distance
        self.num_bands = max_distance + 1
        edges = np.linspace(0, 64, self.num_bands + 1).astype(int)
        self._bands = [(int(lo), int(hi)) for lo, hi in zip(edges[:-1], edges[1:])]
        self._buckets: list[dict[int, list[int]]] = [defaultdict(list) for _ in self._bands]
        self._hashes: list[int] = []
        self._ids: list[object] = []

    def __len__(self) -> int:
        return len(self._hashes)

    def _band_values(self, h: int):
        u = h & 0xFFFFFFFFFFFFFFFF
        for lo, hi in self._bands:
            yield (u >> lo) & ((1 << (hi - lo)) - 1)

    def add(self, h: int, ident: object = None) -> None:
        slot = len(self._hashes)
        self._hashes.append(h)
        self._ids.append(ident)
        for bucket, value in zip(self._buckets, self._band_values(h)):
            bucket[value].append(slot)

    def find(self, h: int) -> object | None:
        """Return the id of a stored hash within ``max_distance`` bits of ``h`` (the earliest added), or None."""
        candidates: set[int] = set()
        for bucket, value in zip(self._buckets, self._band_values(h)):
            candidates.update(bucket.get(value, ()))
        best = None
        for slot in sorted(candidates):
            if hamming(self._hashes[slot], h) <= self.max_distance:
                best = slot
                break
        return None if best is None else self._ids[best]


class ExclusionSet:
    """Hashes of an evaluation set that pre-training data must not contain (exact bytes or near pixels)."""

    def __init__(self, sha256s: set[str], phashes: list[int], max_distance: int):
        self.sha256s = sha256s
        self.index = NearDuplicateIndex(max_distance)
        for h in phashes:
            self.index.add(h, h)

    def __len__(self) -> int:
        return len(self.index)

    def merge(self, other: ExclusionSet) -> None:
        self.sha256s |= other.sha256s
        for h in other.index._hashes:
            self.index.add(h, h)

    def matches(self, sha256: str, phash: int) -> bool:
        return sha256 in self.sha256s or self.index.find(phash) is not None


IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff")


def load_exclusion(path: str | Path, max_distance: int = 3) -> ExclusionSet:
    """Build an ExclusionSet from a shard folder (its samples.parquet), a samples.parquet file, or an image folder.

    Raises ValueError when the path holds none of these.
    """
    path = Path(path)
    table_path = path / SAMPLES_FILE if path.is_dir() else path
    if table_path.suffix == ".parquet" and table_path.exists():
        table = pq.read_table(table_path)
        cols = set(table.column_names)
        if "phash" not in cols:
            raise ValueError(f"--exclude-like {table_path} has no 'phash' column; point it at a vitscale shard folder")
        sha = set(table.column("sha256").to_pylist())
        if "source_sha256" in cols:
            sha |= set(table.column("source_sha256").to_pylist())
        return ExclusionSet(sha, [int(h) for h in table.column("phash").to_pylist()], max_distance)
    if path.is_dir():
        sha: set[str] = set()
        phashes: list[int] = []
        for file in sorted(p for p in path.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES):
            data = file.read_bytes()
            try:
                with Image.open(file) as img:
                    phashes.append(perceptual_hash(img))
            except OSError:
                continue  # an unreadable file cannot be near-duplicated; its bytes still count below
            finally:
                sha.add(sha256_hex(data))
        if not sha:
            raise ValueError(f"--exclude-like {path} holds no images and no samples.parquet")
        return ExclusionSet(sha, phashes, max_distance)
    raise ValueError(f"--exclude-like {path} is neither a shard folder, a samples.parquet, nor a folder of images")
