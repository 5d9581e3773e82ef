"""TFRecord files of ``tf.train.Example`` records without TensorFlow (docs/vtab.md, "The formats")."""

from __future__ import annotations

import functools
import struct
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import BinaryIO

import numpy as np

_POLY = 0x82F63B78  # CRC-32C, reflected
_MASK_DELTA = 0xA282EAD8
_VECTOR_MIN = 1024  # bytes: below, the plain loop is as fast
_MAX_LANES = 32768


def _byte_table() -> np.ndarray:
    table = np.arange(256, dtype=np.uint32)
    for _ in range(8):
        table = np.where(table & 1, (table >> 1) ^ np.uint32(_POLY), table >> 1).astype(np.uint32)
    return table


_TABLE = _byte_table()
_TABLE_LIST = [int(v) for v in _TABLE]


def _crc_loop(data: bytes | memoryview, register: int) -> int:
    table = _TABLE_LIST
    for byte in bytes(data):
        register = table[(register ^ byte) & 0xFF] ^ (register >> 8)
    return register


def _apply(operator: np.ndarray, registers: np.ndarray) -> np.ndarray:
    return (
        operator[0][registers & 0xFF]
        ^ operator[1][(registers >> 8) & 0xFF]
        ^ operator[2][(registers >> 16) & 0xFF]
        ^ operator[3][registers >> 24]
    )


@functools.cache
def _zeros_operator(log2_bytes: int) -> np.ndarray:
    """The map "feed 2^log2_bytes zero bytes" as 4 x 256 tables."""
    basis = np.left_shift(np.uint32(1), np.arange(32, dtype=np.uint32))
    if log2_bytes == 0:
        columns = _TABLE[basis & 0xFF] ^ (basis >> 8)
    else:
        half = _zeros_operator(log2_bytes - 1)
        columns = _apply(half, _apply(half, basis))
    bits = (np.arange(256)[:, None] >> np.arange(8)) & 1  # table[byte][v]: XOR of the columns of v's bits
    return np.bitwise_xor.reduce(np.where(bits == 1, columns.reshape(4, 1, 8), 0).astype(np.uint32), axis=2)


def crc32c(data: bytes | memoryview) -> int:
    """CRC-32C of ``data``: ``crc32c(b"123456789") == 0xE3069283``. Long buffers run as lanes, merged by CRC
    linearity."""
    n = len(data)
    if n < _VECTOR_MIN:
        return _crc_loop(data, 0xFFFFFFFF) ^ 0xFFFFFFFF
    size = 1 << (n - 1).bit_length()
    lanes = min(size // 16, _MAX_LANES)
    width = size // lanes
    padded = np.zeros(size, dtype=np.uint8)
    padded[size - n :] = np.frombuffer(data, dtype=np.uint8)
    padded[size - n : size - n + 4] ^= 0xFF  # the initial register, as data
    columns = padded.reshape(lanes, width).T.copy()
    registers = np.zeros(lanes, dtype=np.uint32)
    for column in columns:
        registers = _TABLE[(registers ^ column) & 0xFF] ^ (registers >> 8)
    level = width.bit_length() - 1
    while registers.size > 1:
        registers = _apply(_zeros_operator(level), registers[0::2]) ^ registers[1::2]
        level += 1
    return int(registers[0]) ^ 0xFFFFFFFF


def masked_crc32c(data: bytes | memoryview) -> int:
    crc = crc32c(data)
    return ((((crc >> 15) | (crc << 17)) & 0xFFFFFFFF) + _MASK_DELTA) & 0xFFFFFFFF


def frame_record(data: bytes) -> bytes:
    length = struct.pack("<Q", len(data))
    return length + struct.pack("<I", masked_crc32c(length)) + data + struct.pack("<I", masked_crc32c(data))


def write_records(path: str | Path, records: Sequence[bytes]) -> None:
    with open(path, "wb") as f:
        for record in records:
            f.write(frame_record(record))


def scan_records(f: BinaryIO, start: int, stop: int | None, stats: Counter) -> Iterator[tuple[int, int, bytes]]:
    """(index, data offset, data) of the records ``start <= index < stop``; damage counted in ``stats``."""
    index = 0
    while stop is None or index < stop:
        header = f.read(12)
        if not header and stop is None:
            return
        if len(header) < 12:
            if header:
                stats["broken_files"] += 1
            if stop is not None:
                stats["missing_records"] += stop - max(index, start)
            return
        length, length_crc = struct.unpack("<QI", header)
        if masked_crc32c(header[:8]) != length_crc:
            stats["broken_files"] += 1
            stats["missing_records"] += (stop - max(index, start)) if stop is not None else 1
            return
        offset = f.tell()
        if index < start:
            f.seek(length + 4, 1)
            index += 1
            continue
        data = f.read(length)
        footer = f.read(4)
        if len(data) < length or len(footer) < 4:
            stats["broken_files"] += 1
            stats["missing_records"] += (stop - index) if stop is not None else 1
            return
        if masked_crc32c(data) != struct.unpack("<I", footer)[0]:
            stats["corrupt_records"] += 1
        else:
            yield index, offset, data
        index += 1


def count_records(path: str | Path) -> int:
    count = 0
    with open(path, "rb") as f:
        while header := f.read(12):
            if len(header) < 12 or masked_crc32c(header[:8]) != struct.unpack("<I", header[8:])[0]:
                break
            f.seek(struct.unpack("<Q", header[:8])[0] + 4, 1)
            count += 1
    return count


FeatureValues = list[bytes] | list[float] | list[int]


class ExampleError(ValueError):
    """A record is not a well-formed ``tf.train.Example``."""


def _varint(buf: memoryview, pos: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise ExampleError("truncated or overlong varint")
        byte = buf[pos]
        value |= (byte & 0x7F) << shift
        pos += 1
        if byte < 0x80:
            return value, pos
        shift += 7


def _fields(buf: memoryview) -> Iterator[tuple[int, int, int, memoryview]]:
    """(field, wire type, varint or fixed64, payload or fixed32) of each field of a message."""
    empty = memoryview(b"")
    pos = 0
    while pos < len(buf):
        key, pos = _varint(buf, pos)
        field, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(buf, pos)
            yield field, wire, value, empty
            continue
        size = {1: 8, 5: 4}.get(wire)
        if wire == 2:
            size, pos = _varint(buf, pos)
        if size is None:
            raise ExampleError(f"wire type {wire} (groups) is not used by tf.train.Example")
        if pos + size > len(buf):
            raise ExampleError(f"field {field} runs past the end of its message")
        body, pos = buf[pos : pos + size], pos + size
        yield field, wire, int.from_bytes(body, "little") if wire == 1 else 0, body


def _signed64(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def _list_values(kind: int, body: memoryview) -> FeatureValues:
    values: list = []
    for field, wire, number, item in _fields(body):
        if field != 1:
            continue
        if kind == 1 and wire == 2:
            values.append(bytes(item))
        elif kind == 2 and wire in (2, 5):
            values.extend(struct.unpack(f"<{len(item) // 4}f", item))
        elif kind == 3 and wire == 2:
            pos = 0
            while pos < len(item):
                raw, pos = _varint(item, pos)
                values.append(_signed64(raw))
        elif kind == 3 and wire == 0:
            values.append(_signed64(number))
        else:
            raise ExampleError(f"feature list kind {kind} with wire type {wire}")
    return values


def _decode_feature(buf: memoryview) -> FeatureValues:
    """A ``Feature``: a oneof of field 1 BytesList, 2 FloatList, 3 Int64List."""
    values: FeatureValues = []
    for kind, wire, _, body in _fields(buf):
        if wire == 2 and kind in (1, 2, 3):
            values = _list_values(kind, body)
    return values


def decode_example(data: bytes) -> dict[str, FeatureValues]:
    """``{feature name: values}`` of a serialized ``tf.train.Example``; ExampleError when malformed."""
    features: dict[str, FeatureValues] = {}
    for field, wire, _, body in _fields(memoryview(data)):
        if field != 1 or wire != 2:
            continue
        for entry_field, entry_wire, _, entry in _fields(body):  # map<string, Feature>: {key=1, value=2}
            if entry_field != 1 or entry_wire != 2:
                continue
            key, value = b"", memoryview(b"")
            for part_field, part_wire, _, part in _fields(entry):
                if part_wire == 2 and part_field == 1:
                    key = bytes(part)
                elif part_wire == 2 and part_field == 2:
                    value = part
            try:
                features[key.decode()] = _decode_feature(value)
            except UnicodeDecodeError as error:
                raise ExampleError(f"feature name is not UTF-8 ({error})") from None
    return features


def _encode_varint(value: int) -> bytes:
    value &= (1 << 64) - 1  # negative: two's complement, as protobuf
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _delimited(number: int, payload: bytes) -> bytes:
    return _encode_varint(number << 3 | 2) + _encode_varint(len(payload)) + payload


def _encode_feature(values: Sequence) -> bytes:
    """Bytes → BytesList, floats → FloatList, ints, bools or nothing → Int64List."""
    items = list(values.tolist() if isinstance(values, np.ndarray) else values)
    if items and all(isinstance(v, (bytes, bytearray)) for v in items):
        return _delimited(1, b"".join(_delimited(1, bytes(v)) for v in items))
    if items and any(isinstance(v, float) for v in items):
        return _delimited(2, _delimited(1, struct.pack(f"<{len(items)}f", *items)))
    if not all(isinstance(v, (int, bool)) for v in items):
        raise TypeError(f"feature values must be all bytes, all numbers; got {[type(v).__name__ for v in items]}")
    return _delimited(3, _delimited(1, b"".join(_encode_varint(int(v)) for v in items)))


def encode_example(features: Mapping[str, Sequence]) -> bytes:
    entries = b"".join(
        _delimited(1, _delimited(1, name.encode()) + _delimited(2, _encode_feature(values)))
        for name, values in features.items()
    )
    return _delimited(1, entries)
