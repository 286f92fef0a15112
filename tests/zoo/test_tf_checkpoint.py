"""The TensorFlow tensor-bundle reader, on bundles fabricated byte by byte by tf_bundle_writer."""

import struct

import numpy as np
import pytest
import torch

from geosharp.zoo._tf_checkpoint import (
    TFCheckpoint,
    crc32c,
    masked_crc32c,
    resolve_checkpoint_prefix,
)

from . import tf_bundle_writer as w


def _tensors(rng: np.random.Generator) -> dict[str, np.ndarray]:
    t = {
        # names sharing long prefixes exercise the prefix compression of keys
        f"bert/encoder/layer_{i}/attention/self/{p}/kernel": rng.standard_normal((4, 6)).astype(
            np.float32
        )
        for i in range(3)
        for p in ("query", "key", "value")
    }
    t["bert/embeddings/word_embeddings"] = rng.standard_normal((11, 6)).astype(np.float32)
    t["a_double"] = rng.standard_normal((2, 3, 4))
    t["global_step"] = np.array(36815, dtype=np.int64)  # a scalar
    t["ints"] = rng.integers(-5, 5, size=(7,), dtype=np.int32)
    t["half"] = rng.standard_normal((3,)).astype(np.float16)
    t["mask"] = rng.random((2, 2)) > 0.5
    t["empty"] = np.zeros((0, 4), dtype=np.float32)
    return t


def test_crc32c_check_values():
    # the standard check value of CRC-32C, and agreement with the writer's separate table
    assert crc32c(b"123456789") == 0xE3069283 == w.crc32c(b"123456789")
    data = np.random.default_rng(0).integers(0, 256, 1000, dtype=np.uint8).tobytes()
    assert crc32c(data) == w.crc32c(data)
    assert crc32c(data[500:], crc32c(data[:500])) == crc32c(data)  # extension
    assert masked_crc32c(data) == w.masked(data)


@pytest.mark.parametrize(("shards", "big_endian"), [(1, False), (3, False), (2, True)])
def test_round_trip(tmp_path, shards, big_endian):
    tensors = _tensors(np.random.default_rng(shards))
    w.write_bundle(tmp_path / "model.ckpt-7", tensors, num_shards=shards, big_endian=big_endian)
    ckpt = TFCheckpoint(tmp_path / "model.ckpt-7")
    assert ckpt.names() == sorted(tensors)
    assert ckpt.num_shards == shards
    for name, arr in tensors.items():
        got = ckpt.read(name, verify=True)
        assert ckpt.shape(name) == arr.shape == tuple(got.shape)
        assert got.numpy().dtype == arr.dtype
        assert np.array_equal(got.numpy(), arr), name


def test_index_uses_several_blocks(tmp_path):
    # with 7 entries a block the index block has several handles; every key is still found
    tensors = _tensors(np.random.default_rng(0))
    w.write_bundle(tmp_path / "m", tensors, block_entries=2, restart_interval=1)
    assert TFCheckpoint(tmp_path / "m").names() == sorted(tensors)
    data = (tmp_path / "m.index").read_bytes()
    assert data[-8:] == bytes.fromhex("57fb808b247547db")  # the LevelDB magic, little-endian


def test_bfloat16(tmp_path):
    x = torch.randn(5, 3).to(torch.bfloat16)
    bits = x.view(torch.int16).numpy().view(np.uint16)
    w.write_bundle(tmp_path / "m", {"w": bits}, bfloat16=("w",))
    got = TFCheckpoint(tmp_path / "m").read("w")
    assert got.dtype == torch.bfloat16 and torch.equal(got, x)


def test_resolve_prefix(tmp_path):
    for step in (1000, 36815, 2000):
        w.write_bundle(tmp_path / f"model.ckpt-{step}", {"x": np.full(2, step, np.int64)})
    # no 'checkpoint' file: the highest step
    assert resolve_checkpoint_prefix(tmp_path).name == "model.ckpt-36815"
    # the 'checkpoint' file of TF names an absolute path on the training machine
    (tmp_path / "checkpoint").write_text(
        'model_checkpoint_path: "/home/someone/mnli_save/model.ckpt-2000"\n'
        'all_model_checkpoint_paths: "/home/someone/mnli_save/model.ckpt-1000"\n'
    )
    assert resolve_checkpoint_prefix(tmp_path).name == "model.ckpt-2000"
    assert TFCheckpoint(tmp_path).read("x").tolist() == [2000, 2000]
    assert resolve_checkpoint_prefix(tmp_path / "model.ckpt-1000.index").name == "model.ckpt-1000"
    with pytest.raises(FileNotFoundError, match="no TensorFlow checkpoint"):
        resolve_checkpoint_prefix(tmp_path / "elsewhere")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="holds no TensorFlow checkpoint"):
        resolve_checkpoint_prefix(empty)


def test_corruption_and_bad_files(tmp_path):
    w.write_bundle(tmp_path / "m", {"x": np.arange(6, dtype=np.float32)})
    index = tmp_path / "m.index"
    good = index.read_bytes()
    # a flipped byte in the first block is caught by the block CRC
    index.write_bytes(bytes([good[0] ^ 0xFF]) + good[1:])
    with pytest.raises(ValueError, match="CRC mismatch"):
        TFCheckpoint(tmp_path / "m")
    index.write_bytes(good[:-8] + struct.pack("<Q", 0x1234))
    with pytest.raises(ValueError, match="bad magic number"):
        TFCheckpoint(tmp_path / "m")
    index.write_bytes(good)
    data = tmp_path / "m.data-00000-of-00001"
    raw = data.read_bytes()
    data.write_bytes(raw[:4] + bytes([raw[4] ^ 1]) + raw[5:])
    ckpt = TFCheckpoint(tmp_path / "m")
    ckpt.read("x")  # no verification by default
    with pytest.raises(ValueError, match="'x': CRC mismatch"):
        ckpt.read("x", verify=True)
    with pytest.raises(KeyError, match="no tensor 'y'"):
        ckpt.read("y")
    data.unlink()
    with pytest.raises(FileNotFoundError, match=r"data shard .* is missing"):
        TFCheckpoint(tmp_path / "m")
