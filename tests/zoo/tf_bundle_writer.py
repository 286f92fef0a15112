"""A minimal writer of TensorFlow tensor bundles (``PREFIX.index`` + ``PREFIX.data-*``), for tests.

Written from the format's description (LevelDB table format; TensorFlow's ``tensor_bundle.proto``),
independently of the reader in ``geosharp.zoo._tf_checkpoint``: an SSTable of data blocks with
prefix-compressed keys and a restart point every ``restart_interval`` entries, a 5-byte trailer
per block (type 0 = uncompressed, masked CRC-32C of contents + type), an empty metaindex block,
an index block whose keys are short separators (not the last keys themselves), and the 48-byte
footer ending in the magic number. Shapes, dtypes and offsets go in ``BundleEntryProto``
messages encoded by hand.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

MAGIC = 0xDB4775248B80FB57

#: numpy dtype -> TensorFlow DataType enum (types.proto)
TF_DTYPE = {
    np.dtype("float32"): 1,
    np.dtype("float64"): 2,
    np.dtype("int32"): 3,
    np.dtype("uint8"): 4,
    np.dtype("int16"): 5,
    np.dtype("int8"): 6,
    np.dtype("int64"): 9,
    np.dtype("bool"): 10,
    np.dtype("float16"): 19,
}
DT_BFLOAT16 = 14


def _make_table() -> list[int]:
    table = []
    for n in range(256):
        crc = n
        for _ in range(8):  # reflected CRC-32C polynomial
            crc = (crc >> 1) ^ (0x82F63B78 & -(crc & 1))
        table.append(crc)
    return table


_TABLE = _make_table()


def crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def masked(data: bytes) -> int:
    c = crc32c(data)
    return ((((c >> 15) | (c << 17)) & 0xFFFFFFFF) + 0xA282EAD8) & 0xFFFFFFFF


def varint(n: int) -> bytes:
    out = bytearray()
    n &= (1 << 64) - 1
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _field_varint(number: int, value: int) -> bytes:
    return varint(number << 3) + varint(value) if value else b""


def _field_bytes(number: int, payload: bytes) -> bytes:
    return varint((number << 3) | 2) + varint(len(payload)) + payload


def entry_proto(dtype: int, shape: tuple, shard: int, offset: int, size: int, crc: int) -> bytes:
    dims = b"".join(_field_bytes(2, _field_varint(1, d)) for d in shape)
    return (
        _field_varint(1, dtype)
        + _field_bytes(2, dims)
        + _field_varint(3, shard)
        + _field_varint(4, offset)
        + _field_varint(5, size)
        + varint((6 << 3) | 5)
        + struct.pack("<I", crc)
    )


def header_proto(num_shards: int, big_endian: bool) -> bytes:
    version = _field_varint(1, 1)  # VersionDef.producer = 1
    return (
        _field_varint(1, num_shards) + _field_varint(2, int(big_endian)) + _field_bytes(3, version)
    )


def _block(entries: list[tuple[bytes, bytes]], restart_interval: int) -> bytes:
    out, restarts, last = bytearray(), [], b""
    for i, (key, value) in enumerate(entries):
        shared = 0
        if i % restart_interval == 0:
            restarts.append(len(out))
        else:
            while shared < min(len(key), len(last)) and key[shared] == last[shared]:
                shared += 1
        out += varint(shared) + varint(len(key) - shared) + varint(len(value))
        out += key[shared:] + value
        last = key
    if not restarts:
        restarts = [0]
    out += b"".join(struct.pack("<I", r) for r in restarts) + struct.pack("<I", len(restarts))
    return bytes(out)


def _separator(last: bytes, following: bytes | None) -> bytes:
    """A key >= last and < following (LevelDB's FindShortestSeparator, simplified)."""
    if following is None:
        return last
    i = 0
    while i < min(len(last), len(following)) and last[i] == following[i]:
        i += 1
    if i < min(len(last), len(following)) and last[i] + 1 < following[i]:
        return last[:i] + bytes([last[i] + 1])
    return last


def write_table(
    items: list[tuple[bytes, bytes]], block_entries: int, restart_interval: int
) -> bytes:
    items = sorted(items)
    out = bytearray()
    handles = []
    groups = [items[i : i + block_entries] for i in range(0, len(items), block_entries)]
    for g, group in enumerate(groups):
        contents = _block(group, restart_interval)
        handles.append((len(out), len(contents)))
        out += contents + b"\x00" + struct.pack("<I", masked(contents + b"\x00"))
        nxt = groups[g + 1][0][0] if g + 1 < len(groups) else None
        handles[-1] = (*handles[-1], _separator(group[-1][0], nxt))

    def put(contents: bytes) -> bytes:
        nonlocal out
        handle = varint(len(out)) + varint(len(contents))
        out += contents + b"\x00" + struct.pack("<I", masked(contents + b"\x00"))
        return handle

    meta = put(_block([], 1))
    index = put(_block([(sep, varint(off) + varint(size)) for off, size, sep in handles], 1))
    footer = (meta + index).ljust(40, b"\x00") + struct.pack("<Q", MAGIC)
    return bytes(out + footer)


def write_bundle(
    prefix: str | Path,
    tensors: dict[str, np.ndarray],
    *,
    num_shards: int = 1,
    block_entries: int = 7,
    restart_interval: int = 3,
    big_endian: bool = False,
    bfloat16: tuple[str, ...] = (),
) -> None:
    """Write ``tensors`` as a tensor bundle at ``prefix``.

    Names in ``bfloat16`` must hold uint16 arrays: the upper halves of float32 bit patterns.
    """
    prefix = Path(prefix)
    shards = [bytearray() for _ in range(num_shards)]
    items = [(b"", header_proto(num_shards, big_endian))]
    for i, name in enumerate(sorted(tensors)):
        arr = np.array(tensors[name], order="C")  # (ascontiguousarray makes scalars 1-d)
        dtype = DT_BFLOAT16 if name in bfloat16 else TF_DTYPE[arr.dtype]
        raw = arr.astype(arr.dtype.newbyteorder(">" if big_endian else "<")).tobytes()
        shard = i % num_shards
        offset = len(shards[shard])
        shards[shard] += raw
        entry = entry_proto(dtype, arr.shape, shard, offset, len(raw), masked(raw))
        items.append((name.encode(), entry))
    for s, data in enumerate(shards):
        Path(f"{prefix}.data-{s:05d}-of-{num_shards:05d}").write_bytes(bytes(data))
    Path(f"{prefix}.index").write_bytes(write_table(items, block_entries, restart_interval))
