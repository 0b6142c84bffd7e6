"""The tensors of a safetensors checkpoint, as views of its privately memory-mapped files.

A safetensors file is an 8-byte little-endian header length, a JSON header naming each tensor's
dtype, shape and byte range, then the raw data. Mapping the file (copy-on-write) and viewing a
byte range as a tensor costs nothing until the pages are touched, and then only for the pages a
rank actually uses: the rows of its shards. Every header is checked against the file's size
before anything is mapped, because touching a mapped page past the end of a truncated file kills
the process (SIGBUS) instead of raising.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": torch.float8_e8m0fnu,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
HEADER_LIMIT = 100 * 2**20  # the safetensors format caps its header at 100 MB


@dataclass(frozen=True)
class StoredTensor:
    """Where one tensor lies in a checkpoint file."""

    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    """Bytes from the start of the file to the tensor's first byte."""

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def read_index(directory: Path) -> dict[str, StoredTensor]:
    """Every tensor of every `*.safetensors` file in `directory`, by name, from the headers alone.

    When the directory has a `*.safetensors.index.json` (a checkpoint split into several files),
    every file it names must be there and hold the tensors it lists.
    """
    index: dict[str, StoredTensor] = {}
    for file in sorted(directory.glob("*.safetensors")):
        for name, stored in _read_header(file).items():
            if name in index:
                raise ValueError(
                    f"tensor {name} is in both {index[name].file.name} and {file.name}: the directory mixes "
                    "two checkpoints; keep one set of *.safetensors files in it"
                )
            index[name] = stored
    for index_file in sorted(directory.glob("*.safetensors.index.json")):
        _check_weight_map(index_file, index)
    return index


def _check_weight_map(index_file: Path, index: dict[str, StoredTensor]) -> None:
    """The index file's `weight_map` (tensor name -> file name) agrees with the files' headers."""
    try:
        weight_map = json.loads(index_file.read_text())["weight_map"]
        files = set(weight_map.values())
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(
            f"{index_file} is not a readable safetensors index ({type(e).__name__}: {e}); copy or download the "
            "checkpoint again"
        ) from e
    missing = sorted(name for name in files if not (index_file.parent / name).is_file())
    if missing:
        raise ValueError(
            f"{index_file.parent} lacks {len(missing)} of the {len(files)} weight file(s) its {index_file.name} "
            f"names, e.g. {missing[:3]}: the checkpoint is incomplete; copy or download the missing files"
        )
    wrong = [name for name, file in weight_map.items() if name not in index or index[name].file.name != file]
    if wrong:
        name = wrong[0]
        found = index[name].file.name if name in index else "no file"
        raise ValueError(
            f"{index_file} puts {len(wrong)} tensor(s) where the files' headers do not, e.g. {name} in "
            f"{weight_map[name]} (found in {found}): the files belong to different checkpoints; copy or "
            "download the checkpoint again"
        )


def _read_header(file: Path) -> dict[str, StoredTensor]:
    """The tensors listed in `file`'s header, each checked to lie inside the file."""
    size = file.stat().st_size
    with open(file, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
        if not 0 < length <= min(HEADER_LIMIT, size - 8):
            raise _damaged(file, f"its header length ({length} bytes) does not fit a {size}-byte file")
        try:
            header = json.loads(f.read(length))
        except ValueError as e:
            raise _damaged(file, f"its header is not JSON ({e})") from e
    header.pop("__metadata__", None)
    return {name: _stored(file, name, entry, 8 + length, size) for name, entry in header.items()}


def _stored(file: Path, name: str, entry: dict, data_start: int, size: int) -> StoredTensor:
    """One header entry as a `StoredTensor`, after checking its dtype and byte range."""
    try:
        dtype = SAFETENSORS_DTYPES[entry["dtype"]]
        shape = tuple(int(n) for n in entry["shape"])
        begin, end = (int(n) for n in entry["data_offsets"])
    except (KeyError, TypeError, ValueError) as e:
        raise _damaged(file, f"tensor {name} has an unreadable header entry {entry!r}") from e
    expected = math.prod(shape) * dtype.itemsize
    if end - begin != expected:
        raise _damaged(file, f"tensor {name} is {end - begin} bytes but its shape {list(shape)} needs {expected}")
    if data_start + end > size:
        raise _damaged(file, f"tensor {name} ends at byte {data_start + end} but the file has {size} (truncated)")
    return StoredTensor(file=file, dtype=dtype, shape=shape, offset=data_start + begin)


def _damaged(file: Path, why: str) -> ValueError:
    return ValueError(f"{file} is not a complete safetensors file: {why}; copy or download the checkpoint again")


class MappedFiles:
    """Copy-on-write maps of checkpoint files, each opened on first use and kept by the views made from it."""

    def __init__(self) -> None:
        self._storages: dict[Path, torch.UntypedStorage] = {}

    def view(self, stored: StoredTensor) -> torch.Tensor:
        """The whole tensor as a view of the mapped file (a copy only if its bytes are misaligned for its dtype)."""
        storage = self._storages.get(stored.file)
        if storage is None:
            size = stored.file.stat().st_size
            storage = torch.UntypedStorage.from_file(str(stored.file), shared=False, nbytes=size)
            self._storages[stored.file] = storage
        itemsize = stored.dtype.itemsize
        if stored.offset % itemsize == 0:
            return torch.empty(0, dtype=stored.dtype).set_(storage, stored.offset // itemsize, stored.shape)
        raw = torch.empty(0, dtype=torch.uint8).set_(storage, stored.offset, (stored.nbytes,))
        return raw.clone().view(stored.dtype).view(stored.shape)
