"""Exact and near-duplicate detection by sha256 and a 64-bit DCT perceptual hash (docs/reference.md §6)."""

from __future__ import annotations

import hashlib
import itertools
import math
import os
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
from PIL import ExifTags, Image, ImageOps

from data_pipeline.manifest import SAMPLES_FILE, iter_samples
from data_pipeline.paths import is_remote


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def eight_bit(image: Image.Image) -> Image.Image:
    """``image``, with 16-bit grey samples (modes I;16*, and I as 16-bit PNGs load in older Pillow) scaled to 8-bit
    grey: Pillow's ``convert`` clips them at 255, so nearly every pixel of such an image would turn white. Float grey
    (mode F, a 32-bit float TIFF) is read on the float convention's 0-1 scale where every sample lies in it, else on
    0-255 (clipped; NaN as 0): ``convert`` would round 0-1 samples to 0 or 1, a black image."""
    if image.mode == "F":
        pixels = np.nan_to_num(np.asarray(image, dtype=np.float64), nan=0.0, posinf=255.0, neginf=0.0)
        if pixels.size and pixels.min() >= 0 and pixels.max() <= 1:
            pixels = pixels * 255
        return Image.fromarray(np.clip(np.rint(pixels), 0, 255).astype(np.uint8))
    if not (image.mode.startswith("I;16") or image.mode == "I"):
        return image
    wide = np.clip(np.asarray(image).astype(np.int64), 0, 65535)
    return Image.fromarray(((wide * 255 + 32767) // 65535).astype(np.uint8))


def turned(image: Image.Image) -> bool:
    """Whether the image's EXIF orientation (2-8: a camera held sideways or upside down) asks to turn its pixels."""
    try:
        return image.getexif().get(ExifTags.Base.Orientation, 1) in range(2, 9)
    except Exception:  # noqa: BLE001 — a damaged EXIF block: the pixels as decoded, as before
        return False


def upright(image: Image.Image) -> Image.Image:
    """``image`` as it is meant to be seen: Pillow decodes the sensor's layout and leaves the EXIF orientation to the
    viewer, and a re-encode drops the tag, so a phone's portrait photo would be stored on its side."""
    return ImageOps.exif_transpose(image) if turned(image) else image


def perceptual_hash(image: Image.Image) -> int:
    """pHash: the 8x8 lowest DCT frequencies of a 32x32 grey image against their median, as int64."""
    import scipy.fft  # slow to import

    grey = np.asarray(
        eight_bit(upright(image)).convert("L").resize((32, 32), Image.Resampling.BILINEAR), dtype=np.float32
    )
    coeffs = scipy.fft.dctn(grey, norm="ortho")[:8, :8].ravel()
    median = np.median(coeffs[1:])  # without the DC term
    return int(np.packbits(coeffs > median).view(">i8")[0])  # the first coefficient's bit highest


class NearDuplicateIndex:
    """Multi-index hashing: all pairs of 64-bit pHashes within ``max_distance`` bits, exactly."""

    def __init__(self, hashes=(), max_distance: int = 3, chunks: int | None = None):
        if not 0 <= max_distance <= 15:
            raise ValueError(f"near-duplicate max_distance must be in [0, 15], got {max_distance}")
        self.max_distance = max_distance
        self.hashes = _as_u64(hashes)
        self.chunks = chunks or choose_chunks(len(self.hashes), max_distance)
        if not 1 <= self.chunks <= 64:
            raise ValueError(f"chunks must be in [1, 64], got {self.chunks}")
        edges = np.linspace(0, 64, self.chunks + 1).astype(int)
        self._bands = [(int(lo), int(hi)) for lo, hi in zip(edges[:-1], edges[1:])]
        self._masks = [_flip_masks(hi - lo, max_distance // self.chunks) for lo, hi in self._bands]
        self._sorted = []
        for lo, hi in self._bands:
            values = _chunk(self.hashes, lo, hi)
            order = np.argsort(values, kind="stable")
            self._sorted.append((values[order], order.astype(np.int64)))

    def __len__(self) -> int:
        return len(self.hashes)

    def pairs(self, queries, batch: int = 65536) -> tuple[np.ndarray, np.ndarray]:
        """Every (query position, stored slot) pair within ``max_distance`` bits, sorted, once."""
        queries = _as_u64(queries)
        found_q, found_s = [], []
        for first in range(0, len(queries), batch):
            q = queries[first : first + batch]
            cand_q, cand_s = [], []
            for (lo, hi), masks, (values, slots) in zip(self._bands, self._masks, self._sorted):
                probes = (_chunk(q, lo, hi)[:, None] ^ masks[None, :]).ravel()
                left = np.searchsorted(values, probes, side="left")
                count = np.searchsorted(values, probes, side="right") - left
                hit = np.nonzero(count)[0]
                if len(hit) == 0:
                    continue
                count, left = count[hit], left[hit]
                starts = np.repeat(left - np.cumsum(count) + count, count)
                positions = starts + np.arange(int(count.sum()))
                cand_q.append(np.repeat(hit // len(masks), count))
                cand_s.append(slots[positions])
            if not cand_q:
                continue
            qi, si = np.concatenate(cand_q), np.concatenate(cand_s)
            close = np.bitwise_count(q[qi] ^ self.hashes[si]) <= self.max_distance
            key = np.unique((qi[close] + first) * np.int64(len(self.hashes) + 1) + si[close])
            found_q.append(key // (len(self.hashes) + 1))
            found_s.append(key % (len(self.hashes) + 1))
        if not found_q:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        return np.concatenate(found_q), np.concatenate(found_s)

    def contains_near(self, queries) -> np.ndarray:
        qi, _ = self.pairs(queries)
        hit = np.zeros(len(_as_u64(queries)), dtype=bool)
        hit[qi] = True
        return hit

    def find(self, h: int) -> int | None:
        """The earliest stored slot within ``max_distance`` bits of ``h``, or None."""
        _, slots = self.pairs([h])
        return int(slots.min()) if len(slots) else None


def near_duplicates_of_earlier(hashes, max_distance: int) -> np.ndarray:
    """Per hash, whether an earlier one is within ``max_distance`` bits (equal hashes joined once)."""
    hashes = _as_u64(hashes)
    values, first, inverse = np.unique(hashes, return_index=True, return_inverse=True)
    flags = np.arange(len(hashes)) != first[inverse]
    index = NearDuplicateIndex(values, max_distance)
    qi, si = index.pairs(values)
    earlier = first[si] < first[qi]
    flags[first[qi[earlier]]] = True
    return flags


def choose_chunks(n: int, max_distance: int) -> int:
    """The cheapest chunk count of 1..``max_distance + 1`` with <= 2,000 probes per query."""
    best, best_cost = max_distance + 1, float("inf")
    for m in range(1, max_distance + 2):
        bits = 64 // m
        probes = m * sum(math.comb(bits, k) for k in range(max_distance // m + 1))
        if probes > 2000:
            continue
        cost = probes * (1 + max(n, 1) / 2.0**bits)
        if cost < best_cost:
            best, best_cost = m, cost
    return best


def _as_u64(hashes) -> np.ndarray:
    arr = np.asarray(hashes)
    if arr.dtype == np.uint64:
        return np.ascontiguousarray(arr).ravel()
    if arr.dtype == np.int64:
        return np.ascontiguousarray(arr).ravel().view(np.uint64)
    return np.array([int(h) & 0xFFFFFFFFFFFFFFFF for h in np.ravel(arr)], dtype=np.uint64)


def _chunk(hashes: np.ndarray, lo: int, hi: int) -> np.ndarray:
    return (hashes >> np.uint64(lo)) & np.uint64((1 << (hi - lo)) - 1)


def _flip_masks(bits: int, radius: int) -> np.ndarray:
    masks = [0]
    for k in range(1, radius + 1):
        masks += [sum(1 << b for b in combo) for combo in itertools.combinations(range(bits), k)]
    return np.array(masks, dtype=np.uint64)


class ExclusionSet:
    """An evaluation set's hashes, which ``--exclude-like`` keeps out."""

    def __init__(self, sha256s: set[str], phashes, max_distance: int):
        self.sha256s = set(sha256s)
        self.max_distance = max_distance
        self.index = NearDuplicateIndex(np.unique(_as_u64(phashes)), max_distance)

    def __len__(self) -> int:
        return len(self.index)

    def merge(self, other: ExclusionSet) -> None:
        self.sha256s |= other.sha256s
        both = np.concatenate([self.index.hashes, other.index.hashes])
        self.index = NearDuplicateIndex(np.unique(both), self.max_distance)

    def matches(self, sha256: str, phash: int) -> bool:
        return sha256 in self.sha256s or self.index.find(phash) is not None

    def matches_many(self, sha256s: list[str], phashes) -> np.ndarray:
        exact = np.fromiter((s in self.sha256s for s in sha256s), dtype=bool, count=len(sha256s))
        return exact | self.index.contains_near(phashes)


IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff")


def load_exclusion(path: str | Path, max_distance: int = 3) -> ExclusionSet:
    """From a shard folder, its samples.parquet or an image folder; ValueError otherwise."""
    if is_remote(path):  # Path() would read s3://b/x as the local path s3:/b/x
        raise ValueError(
            f"--exclude-like {path}: object storage is not read here; copy the evaluation shard folder to a local or "
            "shared folder first (e.g. `gcloud storage cp -r` or `aws s3 sync`) and give that folder"
        )
    path = Path(path)
    table_path = path / SAMPLES_FILE if path.is_dir() else path
    if table_path.suffix == ".parquet" and table_path.exists():
        return _exclusion_from_table(table_path, max_distance)
    if path.is_dir():
        return _exclusion_from_images(path, max_distance)
    raise ValueError(f"--exclude-like {path} is neither a shard folder, a {SAMPLES_FILE}, nor a folder of images")


def _exclusion_from_table(table_path: Path, max_distance: int) -> ExclusionSet:
    try:
        cols = set(pq.read_schema(table_path).names)
    except (OSError, ValueError) as error:
        raise ValueError(f"--exclude-like {table_path} is not a readable Parquet file ({error})") from None
    if "phash" not in cols or "sha256" not in cols:
        raise ValueError(
            f"--exclude-like {table_path} has no 'phash'/'sha256' columns; point it at a vitscale shard folder"
        )
    wanted = ["phash", "sha256"] + (["source_sha256"] if "source_sha256" in cols else [])
    sha: set[str] = set()
    phash_parts = []
    for batch in iter_samples(table_path, columns=wanted):
        for column in wanted[1:]:
            sha.update(batch.column(column).to_pylist())
        phash_parts.append(batch.column("phash").to_numpy(zero_copy_only=False).astype(np.int64))
    phashes = np.concatenate(phash_parts) if phash_parts else np.zeros(0, np.int64)
    return ExclusionSet(sha, phashes, max_distance)


def _image_files(folder: Path) -> list[Path]:
    """The image files under ``folder``, sorted; ValueError for a folder that cannot be listed (rglob passes over it,
    and its images would pass into the training set unchecked)."""

    def refuse(error: OSError) -> None:
        raise ValueError(
            f"--exclude-like {folder}: cannot list {error.filename} ({error.strerror or error}); make it readable by "
            "this process, or move it out of the folder"
        )

    files = (Path(root) / name for root, _, names in os.walk(folder, onerror=refuse) for name in names)
    return sorted(p for p in files if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file())


def _exclusion_from_images(folder: Path, max_distance: int) -> ExclusionSet:
    sha: set[str] = set()
    phashes: list[int] = []
    for file in _image_files(folder):
        try:
            data = file.read_bytes()
        except OSError as error:  # skipped, the image would pass into the training set unchecked
            raise ValueError(
                f"--exclude-like {folder}: cannot read {file} ({error.strerror or error}); make it readable by this "
                "process, or move it out of the folder"
            ) from None
        try:
            with Image.open(file) as img:
                phashes.append(perceptual_hash(img))
        except (OSError, SyntaxError, ValueError, Image.DecompressionBombError):
            continue  # its sha256 still counts (the writer skips such an image as corrupt)
        finally:
            sha.add(sha256_hex(data))
    if not sha:
        raise ValueError(f"--exclude-like {folder} holds no images and no {SAMPLES_FILE}")
    return ExclusionSet(sha, phashes, max_distance)
