"""The multi-index hash behind --exclude-like and the writer's near-duplicate flag: exact against brute force."""

from __future__ import annotations

import struct
import zlib

import numpy as np
import pytest
from PIL import Image

from data_pipeline.write.dedup import (
    ExclusionSet,
    NearDuplicateIndex,
    choose_chunks,
    load_exclusion,
    near_duplicates_of_earlier,
    sha256_hex,
)


def planted(rng: np.random.Generator, stored: np.ndarray, count: int, max_flips: int) -> np.ndarray:
    """Copies of random stored hashes with 0..max_flips distinct bits flipped, among as many random hashes."""
    copies = stored[rng.integers(0, len(stored), count)].copy()
    for i in range(count):
        for bit in rng.choice(64, int(rng.integers(0, max_flips + 1)), replace=False):
            copies[i] ^= np.uint64(1) << np.uint64(bit)
    return np.concatenate([copies, rng.integers(0, 2**64, count, dtype=np.uint64)])


def brute_force(queries: np.ndarray, stored: np.ndarray, max_distance: int) -> set[tuple[int, int]]:
    close = np.bitwise_count(queries[:, None] ^ stored[None, :]) <= max_distance
    return {(int(q), int(s)) for q, s in zip(*np.nonzero(close))}


@pytest.mark.parametrize(("max_distance", "chunks"), [(0, None), (1, None), (3, None), (5, None), (3, 2), (2, 1)])
def test_pairs_equal_brute_force(max_distance, chunks):
    rng = np.random.default_rng(max_distance)
    stored = rng.integers(0, 2**64, 3000, dtype=np.uint64)
    stored[:50] = stored[50:100] ^ np.uint64(0b101)  # close pairs inside the index too
    queries = planted(rng, stored, 500, max_distance + 1)  # some just beyond the distance
    index = NearDuplicateIndex(stored, max_distance, chunks=chunks)
    qi, si = index.pairs(queries, batch=128)  # several batches
    found = {(int(q), int(s)) for q, s in zip(qi, si)}
    truth = brute_force(queries, stored, max_distance)
    assert found == truth and len(found) == len(qi)  # recall and precision 1.0, each pair once
    assert len(truth) >= 250  # the planted copies within the distance are there to be found
    assert np.array_equal(index.contains_near(queries), np.isin(np.arange(len(queries)), [q for q, _ in truth]))


def test_signed_int64_hashes_as_stored_in_parquet():
    index = NearDuplicateIndex(np.array([-1, 5], dtype=np.int64), 2)
    assert index.find(-1 ^ 0b11) == 0 and index.find(5) == 1 and index.find(1 << 40) is None
    assert index.find(0xFFFFFFFFFFFFFFFF) == 0  # the same bit pattern as a Python int


def test_near_duplicates_of_earlier_matches_the_sequential_definition():
    rng = np.random.default_rng(7)
    base = rng.integers(0, 2**64, 400, dtype=np.uint64)
    hashes = np.concatenate([base, planted(rng, base, 200, 4), base[:30]])  # near copies and exact repeats
    rng.shuffle(hashes)
    expected = [
        bool(i and (np.bitwise_count(hashes[:i] ^ hashes[i]) <= 3).any()) for i in range(len(hashes))
    ]  # an earlier hash within 3 bits
    assert near_duplicates_of_earlier(hashes, 3).tolist() == expected
    assert sum(expected) > 100


def test_exclusion_set_batch_and_single_lookups_agree():
    rng = np.random.default_rng(3)
    eval_hashes = rng.integers(0, 2**64, 1000, dtype=np.uint64)
    exclusion = ExclusionSet({"a" * 64}, eval_hashes.view(np.int64), max_distance=3)
    queries = planted(rng, eval_hashes, 100, 5).view(np.int64)
    shas = ["a" * 64 if i % 17 == 0 else f"{i:064x}" for i in range(len(queries))]
    batch = exclusion.matches_many(shas, queries)
    assert batch.tolist() == [exclusion.matches(s, int(h)) for s, h in zip(shas, queries)]
    other = ExclusionSet(set(), queries[:5], max_distance=3)
    exclusion.merge(other)
    assert exclusion.matches_many(["x"] * 5, queries[:5]).all()


def test_chunks_follow_the_index_size():
    assert choose_chunks(100_000, 3) == 4  # 16-bit chunks, exact probes
    assert choose_chunks(14_000_000, 3) == 2  # 32-bit chunks probed within 1 bit: few candidates per probe
    assert choose_chunks(10, 0) == 1
    with pytest.raises(ValueError, match="max_distance"):
        NearDuplicateIndex([], 16)


def bomb_png(width: int = 20000, height: int = 10000) -> bytes:
    """A valid PNG header of a 200-megapixel image, past Pillow's decompression-bomb limit (~179 MP)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b"")


def test_an_eval_image_past_the_decompression_bomb_limit_counts_by_its_sha256(tmp_path):
    """--exclude-like on a folder with an image over ~179 MP ended in PIL's DecompressionBombError traceback; it now
    counts by its sha256, as an unreadable image does (the writer skips such an image as corrupt)."""
    (tmp_path / "big.png").write_bytes(bomb_png())
    Image.new("RGB", (16, 16), (3, 4, 5)).save(tmp_path / "ok.png")
    exclusion = load_exclusion(tmp_path)
    assert exclusion.sha256s == {sha256_hex(p.read_bytes()) for p in tmp_path.iterdir()}
    assert len(exclusion) == 1  # the readable image's pHash


def test_an_eval_image_that_cannot_be_read_is_one_line_naming_it(tmp_path):
    """--exclude-like on a folder with a file that cannot be read (here a read that fails with EIO, as a damaged disk
    or a lost network mount gives) ended in an OSError traceback; skipping it would let the image into the training
    set unchecked, so it is one line naming the file and the fix."""
    Image.new("RGB", (16, 16), (3, 4, 5)).save(tmp_path / "ok.png")
    (tmp_path / "bad.jpg").symlink_to("/proc/self/mem")  # a regular file whose read at offset 0 fails with EIO
    with pytest.raises(ValueError, match=rf"^--exclude-like {tmp_path}: cannot read {tmp_path / 'bad.jpg'} \("):
        load_exclusion(tmp_path)
