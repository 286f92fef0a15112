"""Read TensorFlow (TF1 ``tf.train.Saver`` V2 / TF2) checkpoints without TensorFlow.

A checkpoint ``PREFIX`` is a *tensor bundle*: ``PREFIX.index`` and one or more data shards
``PREFIX.data-00000-of-0000N``.

- ``PREFIX.index`` is an immutable sorted table in LevelDB's SSTable format: data blocks of
  prefix-compressed ``(key, value)`` entries followed by a restart array, each block followed
  by a 5-byte trailer (compression type, masked CRC-32C); an index block mapping the last key
  of each data block to its ``(offset, size)`` handle; and a 48-byte footer (metaindex handle,
  index handle, padding, magic ``0xdb4775248b80fb57``). TensorFlow writes it uncompressed.
- The entry with the empty key is a ``BundleHeaderProto`` (``num_shards``, ``endianness``,
  ``version``); every other key is a tensor name whose value is a ``BundleEntryProto``
  (``dtype``, ``shape``, ``shard_id``, ``offset``, ``size``, ``crc32c``, ``slices``).
- A tensor's bytes are ``data[offset : offset + size]`` of its shard: the raw array in C order
  (little-endian unless the header says otherwise).

Only the few protobuf fields needed are decoded, by a small wire-format reader. String
tensors and partitioned (sliced) variables are not supported; BERT checkpoints have neither.

Example:
    >>> ckpt = TFCheckpoint("bert_47/model.ckpt-36815")  # doctest: +SKIP
    >>> ckpt.read("bert/pooler/dense/kernel").shape  # doctest: +SKIP
    torch.Size([768, 768])
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

__all__ = ["TFCheckpoint", "crc32c", "masked_crc32c", "resolve_checkpoint_prefix"]

TABLE_MAGIC = 0xDB4775248B80FB57
FOOTER_SIZE = 48  # two block handles padded to 2·20 bytes, then the 8-byte magic
_MASK_DELTA = 0xA282EAD8

#: TensorFlow ``DataType`` enum → numpy dtype (``DT_BFLOAT16`` is read as uint16 bits).
_DTYPES: dict[int, np.dtype] = {
    1: np.dtype("float32"),
    2: np.dtype("float64"),
    3: np.dtype("int32"),
    4: np.dtype("uint8"),
    5: np.dtype("int16"),
    6: np.dtype("int8"),
    8: np.dtype("complex64"),
    9: np.dtype("int64"),
    10: np.dtype("bool"),
    14: np.dtype("uint16"),  # bfloat16
    17: np.dtype("uint16"),
    18: np.dtype("complex128"),
    19: np.dtype("float16"),
    22: np.dtype("uint32"),
    23: np.dtype("uint64"),
}
_DT_STRING, _DT_BFLOAT16 = 7, 14


# -- CRC-32C (Castagnoli), as LevelDB/TensorFlow use it ------------------------------------------
def _crc_table() -> list[int]:
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


_CRC_TABLE = _crc_table()


def crc32c(data: bytes, crc: int = 0) -> int:
    """CRC-32C of ``data`` (pure Python: fine for index blocks, slow for large tensors).

    Args:
        data: Bytes.
        crc: CRC of the preceding bytes, to extend.

    Returns:
        The 32-bit CRC.

    Example:
        >>> hex(crc32c(b"123456789"))  # the standard check value of CRC-32C
        '0xe3069283'
    """
    crc ^= 0xFFFFFFFF
    table = _CRC_TABLE
    for b in data:
        crc = table[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def masked_crc32c(data: bytes) -> int:
    """LevelDB's masked CRC ``rot15(crc) + 0xa282ead8`` stored in block trailers and entries.

    Args:
        data: Bytes.

    Returns:
        The masked 32-bit CRC.
    """
    crc = crc32c(data)
    return ((((crc >> 15) | (crc << 17)) & 0xFFFFFFFF) + _MASK_DELTA) & 0xFFFFFFFF


# -- varints and protobuf wire format ------------------------------------------------------------
def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    result, shift = 0, 0
    while True:
        if pos >= len(buf):
            raise ValueError("truncated varint")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise ValueError("varint longer than 64 bits")


def _proto_fields(buf: bytes) -> dict[int, list]:
    """Decode one protobuf message into ``{field number: [values]}`` (ints or bytes)."""
    fields: dict[int, list] = {}
    pos = 0
    while pos < len(buf):
        tag, pos = _varint(buf, pos)
        number, wire = tag >> 3, tag & 7
        if wire == 0:
            value, pos = _varint(buf, pos)
        elif wire == 1:
            value, pos = struct.unpack_from("<Q", buf, pos)[0], pos + 8
        elif wire == 2:
            n, pos = _varint(buf, pos)
            value, pos = bytes(buf[pos : pos + n]), pos + n
        elif wire == 5:
            value, pos = struct.unpack_from("<I", buf, pos)[0], pos + 4
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")
        fields.setdefault(number, []).append(value)
    return fields


def _signed64(v: int) -> int:
    return v - (1 << 64) if v >= 1 << 63 else v


# -- the SSTable ----------------------------------------------------------------------------------
def _block(data: bytes, offset: int, size: int, where: str) -> list[tuple[bytes, bytes]]:
    """The entries of one table block, after checking its trailer."""
    if offset + size + 5 > len(data):
        raise ValueError(f"{where}: block at {offset} (+{size}) runs past the end of the file")
    contents = data[offset : offset + size]
    kind = data[offset + size]
    (stored,) = struct.unpack_from("<I", data, offset + size + 1)
    if masked_crc32c(contents + bytes([kind])) != stored:
        raise ValueError(f"{where}: CRC mismatch in the block at offset {offset}; file corrupt")
    if kind != 0:
        raise ValueError(
            f"{where}: block at offset {offset} is compressed (type {kind}); TensorFlow writes "
            "bundle indexes uncompressed, so this is not a tensor-bundle index"
        )
    if size < 4:
        raise ValueError(f"{where}: block at offset {offset} is too short")
    (restarts,) = struct.unpack_from("<I", contents, size - 4)
    limit = size - 4 * (restarts + 1)
    if limit < 0:
        raise ValueError(f"{where}: bad restart count in the block at offset {offset}")
    entries, key, pos = [], b"", 0
    while pos < limit:
        shared, pos = _varint(contents, pos)
        unshared, pos = _varint(contents, pos)
        vlen, pos = _varint(contents, pos)
        if shared > len(key) or pos + unshared + vlen > limit:
            raise ValueError(f"{where}: malformed entry in the block at offset {offset}")
        key = key[:shared] + contents[pos : pos + unshared]
        pos += unshared
        entries.append((key, contents[pos : pos + vlen]))
        pos += vlen
    return entries


def _read_table(data: bytes, where: str) -> list[tuple[bytes, bytes]]:
    if len(data) < FOOTER_SIZE:
        raise ValueError(f"{where} is too short to be a tensor-bundle index")
    footer = data[-FOOTER_SIZE:]
    (magic,) = struct.unpack_from("<Q", footer, FOOTER_SIZE - 8)
    if magic != TABLE_MAGIC:
        raise ValueError(
            f"{where} is not a tensor-bundle index (bad magic number {magic:#x}); expected a "
            "'<prefix>.index' file written by tf.train.Saver (V2) or tf.train.Checkpoint"
        )
    _, pos = _varint(footer, 0)  # metaindex offset (the metaindex block is empty)
    _, pos = _varint(footer, pos)
    index_offset, pos = _varint(footer, pos)
    index_size, pos = _varint(footer, pos)
    entries = []
    for _, handle in _block(data, index_offset, index_size, where):
        offset, p = _varint(handle, 0)
        size, _ = _varint(handle, p)
        entries.extend(_block(data, offset, size, where))
    return entries


# -- the bundle -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lives (a decoded ``BundleEntryProto``)."""

    name: str
    dtype: int
    shape: tuple[int, ...]
    shard: int
    offset: int
    size: int
    crc32c: int | None
    sliced: bool


def _entry(name: str, value: bytes) -> TensorEntry:
    f = _proto_fields(value)
    dims: list[int] = []
    for shape_msg in f.get(2, []):
        for dim_msg in _proto_fields(shape_msg).get(2, []):
            dims.append(_signed64(_proto_fields(dim_msg).get(1, [0])[0]))
    return TensorEntry(
        name=name,
        dtype=f.get(1, [0])[0],
        shape=tuple(dims),
        shard=f.get(3, [0])[0],
        offset=f.get(4, [0])[0],
        size=f.get(5, [0])[0],
        crc32c=f[6][0] if 6 in f else None,
        sliced=7 in f,
    )


def resolve_checkpoint_prefix(path: str | Path) -> Path:
    """The checkpoint prefix ``…/model.ckpt-N`` for a folder, an ``.index`` file or a prefix.

    In a folder, the prefix named in the ``checkpoint`` file (``model_checkpoint_path: "…"``,
    looked up by its base name, since it is often an absolute path on the training machine) is
    used; without one, the ``*.index`` with the highest step number ``-N``.

    Args:
        path: Folder, ``PREFIX.index`` file or ``PREFIX``.

    Returns:
        ``PREFIX`` (``PREFIX.index`` exists).

    Raises:
        FileNotFoundError: If no tensor-bundle index is there.
    """
    path = Path(path)
    if path.is_file() and path.suffix == ".index":
        return path.with_suffix("")
    if Path(f"{path}.index").is_file():
        return path
    if not path.is_dir():
        raise FileNotFoundError(f"no TensorFlow checkpoint at {path} (no {path.name}.index)")
    state = path / "checkpoint"
    if state.is_file():
        m = re.search(r'^model_checkpoint_path:\s*"([^"]+)"', state.read_text(), flags=re.M)
        if m:
            prefix = path / Path(m.group(1)).name
            if Path(f"{prefix}.index").is_file():
                return prefix
    indexes = sorted(path.glob("*.index"))
    if not indexes:
        raise FileNotFoundError(
            f"{path} holds no TensorFlow checkpoint (no '<prefix>.index' with its "
            "'<prefix>.data-00000-of-0000N' shards)"
        )

    def step(p: Path) -> tuple[int, str]:
        m = re.search(r"-(\d+)$", p.stem)
        return (int(m.group(1)) if m else -1, p.name)

    return max(indexes, key=step).with_suffix("")


class TFCheckpoint:
    """A TensorFlow tensor bundle, read with numpy and torch only.

    Args:
        path: Checkpoint prefix, its ``.index`` file, or a folder (see
            :func:`resolve_checkpoint_prefix`).

    Raises:
        FileNotFoundError: If the index or a data shard is missing.
        ValueError: If the index is malformed or uses an unsupported feature.
    """

    def __init__(self, path: str | Path) -> None:
        self.prefix = resolve_checkpoint_prefix(path)
        index = Path(f"{self.prefix}.index")
        where = str(index)
        entries = _read_table(index.read_bytes(), where)
        header = dict(entries).get(b"")
        if header is None:
            raise ValueError(f"{where} has no bundle header (the entry with the empty key)")
        h = _proto_fields(header)
        self.num_shards = h.get(1, [1])[0]
        self.big_endian = h.get(2, [0])[0] == 1
        self.entries: dict[str, TensorEntry] = {}
        for key, value in entries:
            if key:
                name = key.decode("utf-8")
                self.entries[name] = _entry(name, value)
        for shard in sorted({e.shard for e in self.entries.values()}):
            if not self._shard(shard).is_file():
                raise FileNotFoundError(
                    f"data shard {self._shard(shard)} of checkpoint {self.prefix} is missing"
                )

    def _shard(self, shard: int) -> Path:
        return Path(f"{self.prefix}.data-{shard:05d}-of-{self.num_shards:05d}")

    def names(self) -> list[str]:
        """All tensor names, sorted.

        Returns:
            The names.
        """
        return sorted(self.entries)

    def shape(self, name: str) -> tuple[int, ...]:
        """The shape of one tensor (read from the index only).

        Args:
            name: Tensor name.

        Returns:
            Its shape.
        """
        return self._get(name).shape

    def _get(self, name: str) -> TensorEntry:
        if name not in self.entries:
            raise KeyError(f"checkpoint {self.prefix} has no tensor {name!r}")
        return self.entries[name]

    def read(self, name: str, *, verify: bool = False) -> Tensor:
        """One tensor.

        Args:
            name: Tensor name.
            verify: Check the stored CRC-32C of its bytes (pure Python, a few MB/s: about
                a minute for BERT-base's weights, so off by default).

        Returns:
            A CPU tensor of the stored dtype and shape (``bfloat16`` for ``DT_BFLOAT16``).

        Raises:
            KeyError: If there is no such tensor.
            ValueError: For string tensors, sliced variables, size or CRC mismatches.
        """
        e = self._get(name)
        if e.sliced:
            raise ValueError(f"{name!r} is a partitioned (sliced) variable; not supported")
        if e.dtype == _DT_STRING or e.dtype not in _DTYPES:
            raise ValueError(f"{name!r} has TensorFlow dtype enum {e.dtype}, not supported")
        dt = _DTYPES[e.dtype].newbyteorder(">" if self.big_endian else "<")
        numel = int(np.prod(e.shape, dtype=np.int64))
        if numel * dt.itemsize != e.size:
            raise ValueError(
                f"{name!r}: the index says {e.size} bytes but shape {e.shape} of "
                f"{dt.name} needs {numel * dt.itemsize}"
            )
        with open(self._shard(e.shard), "rb") as f:
            f.seek(e.offset)
            raw = f.read(e.size)
        if len(raw) != e.size:
            raise ValueError(f"{name!r}: data shard {self._shard(e.shard)} is truncated")
        if verify and e.crc32c is not None and masked_crc32c(raw) != e.crc32c:
            raise ValueError(f"{name!r}: CRC mismatch; the data shard is corrupt")
        arr = np.frombuffer(raw, dtype=dt).astype(dt.newbyteorder("="), copy=True)
        t = torch.from_numpy(arr.reshape(e.shape))
        return t.view(torch.bfloat16) if e.dtype == _DT_BFLOAT16 else t
