"""Reading safetensors headers and mapping tensors: damaged files are refused before anything is mapped."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from shardbook.rankd.loading.safetensors_files import MappedFiles, read_index


def write_raw(path: Path, header: dict, data: bytes) -> Path:
    encoded = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + data)
    return path


def test_views_equal_the_stored_tensors_and_writes_stay_private(tmp_path):
    tensors = {"a": torch.arange(12, dtype=torch.float32).reshape(3, 4), "b": torch.tensor([1, 2], dtype=torch.int64)}
    save_file(tensors, tmp_path / "model.safetensors")
    before = (tmp_path / "model.safetensors").read_bytes()
    index = read_index(tmp_path)
    files = MappedFiles()
    views = {name: files.view(stored) for name, stored in index.items()}
    for name, tensor in tensors.items():
        assert torch.equal(views[name], tensor) and views[name].dtype == tensor.dtype
    views["a"].mul_(0)  # copy-on-write: the file is unchanged
    assert (tmp_path / "model.safetensors").read_bytes() == before


def test_misaligned_tensor_is_copied(tmp_path):
    value = torch.tensor([1.5, -2.0], dtype=torch.float32)
    header = {"x": {"dtype": "F32", "shape": [2], "data_offsets": [1, 9]}}  # one byte in: not 4-aligned
    write_raw(tmp_path / "odd.safetensors", header, b"\0" + value.numpy().tobytes())
    (stored,) = read_index(tmp_path).values()
    assert torch.equal(MappedFiles().view(stored), value)


@pytest.mark.parametrize(
    ("header", "data", "expected"),
    [
        ({"x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 8, "(truncated)"),
        ({"x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 12]}}, b"\0" * 16, "needs 16"),
        ({"x": {"dtype": "C64", "shape": [1], "data_offsets": [0, 8]}}, b"\0" * 8, "unreadable header entry"),
        ({"x": {"shape": [1]}}, b"", "unreadable header entry"),
    ],
    ids=["truncated", "wrong size", "unknown dtype", "no dtype"],
)
def test_damaged_header_entries_are_refused(tmp_path, header, data, expected):
    write_raw(tmp_path / "bad.safetensors", header, data)
    with pytest.raises(ValueError, match="not a complete safetensors file") as error:
        read_index(tmp_path)
    assert expected in str(error.value) and "bad.safetensors" in str(error.value)


def test_not_a_safetensors_file(tmp_path):
    (tmp_path / "short.safetensors").write_bytes(b"\x05\0\0\0\0\0\0\0{")
    with pytest.raises(ValueError, match="header length"):
        read_index(tmp_path)
    (tmp_path / "short.safetensors").write_bytes(b"\x05\0\0\0\0\0\0\0{nope")
    with pytest.raises(ValueError, match="header is not JSON"):
        read_index(tmp_path)


def test_same_tensor_in_two_files(tmp_path):
    save_file({"w": torch.zeros(2)}, tmp_path / "one.safetensors")
    save_file({"w": torch.ones(2)}, tmp_path / "two.safetensors")
    with pytest.raises(ValueError, match="w is in both one.safetensors and two.safetensors"):
        read_index(tmp_path)
