"""A quantized stored tensor, read as any slice of its dequantized values without building the whole.

Every format sharded loading reads is the same computation: an element's value is its decoded code
times the scale of the block it lies in, `value[i] = decode(code[i]) * scale[i // block]` per dim,
where the scale grid is `ceil(shape / block)` (a dimension that is not a multiple of the block
ends in a partial block). What differs is how a code is stored:

- `float`: one code per element in an fp8 dtype (e4m3, e5m2), decoded by the cast;
- `e2m1`: two 4-bit floats per byte, low nibble first (MXFP4, DeepSeek-V4's FP4 experts);
- `int4` / `int8`: unsigned codes offset by half their range, two or one per byte, densely packed
  little-endian (compressed-tensors' `pack-quantized`, whose int32 words are read as bytes);

and how a scale is stored: a float multiplier (`weight_scale_inv`, `weight_scale`) or a biased
power of two (`e8m0`: 2^(byte - 127)). A rank reads only the codes and scales of its slice, which
may start or end inside a block, in chunks of bounded size straight from the mapped files.
"""

from __future__ import annotations

import itertools
import sys
from dataclasses import dataclass

import torch

from shardbook.rankd.loading.safetensors_files import MappedFiles, StoredTensor

CHUNK_ELEMENTS = 1 << 18
"""Elements dequantized at a time (1 MiB of float32, about twice that in temporaries): what a read adds to the slice
it fills, whatever the tensor's size."""

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""The sixteen values of a 4-bit e2m1 float, by code (sign bit, two exponent bits, one mantissa bit)."""

CODES_PER_BYTE = {"float": 1, "e2m1": 2, "int4": 2, "int8": 1}


@dataclass(frozen=True)
class QuantizedTensor:
    """A stored tensor of codes with its scales, seen as the dequantized tensor the model holds.

    Coordinates are the stored ones ("values": the codes unpacked, dims in the file's order);
    `order` says which stored dim each of the model's dims is (gpt-oss stores its experts
    transposed), so `shape` is the model's.
    """

    codes: StoredTensor
    scales: StoredTensor
    values: tuple[int, ...]
    """The unpacked codes' shape, in the file's order."""
    block: tuple[int, ...]
    """Elements per scale along each stored dim."""
    code: str
    """How codes are stored: one of `CODES_PER_BYTE`."""
    scale_code: str
    """`float` (a multiplier) or `e8m0` (a biased power of two in a byte)."""
    order: tuple[int, ...]
    """Model dim k is stored dim `order[k]`."""
    format: str
    """The checkpoint format this tensor came from, for the load summary (e.g. `fp8 e4m3, 128x128 blocks`)."""

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.values[dim] for dim in self.order)

    @property
    def file(self):
        return self.codes.file

    @property
    def stored_bytes(self) -> int:
        return self.codes.nbytes + self.scales.nbytes

    def grid(self) -> tuple[int, ...]:
        """The scale grid the values and blocks call for: ceil(values / block) per dim."""
        return tuple(-(-size // block) for size, block in zip(self.values, self.block))

    def read(self, files: MappedFiles, selection: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The dequantized `selection` (model coordinates: per dim, ranges or None), on `device` in `dtype`."""
        stored_selection = [None] * len(self.values)
        for model_dim, stored_dim in enumerate(self.order):
            stored_selection[stored_dim] = selection[model_dim]
        wanted = [_indices(ranges, size) for ranges, size in zip(stored_selection, self.values)]
        out = torch.empty([len(wanted[dim]) for dim in self.order], dtype=dtype, device=device)
        stored_view = out.permute(_inverse(self.order))
        codes, scales = self._code_view(files), self._scale_view(files)
        for where, indices in _chunks(wanted):
            stored_view[where] = self._dequantize(codes, scales, indices).to(device=device, dtype=dtype)
        return out

    def _code_view(self, files: MappedFiles) -> torch.Tensor:
        """The codes as stored (fp8), or their bytes with every dim but the last one the values' own."""
        view = files.view(self.codes)
        if self.code == "float":  # gathered as bytes (index_select has no fp8 kernels), cast after
            return view.view(torch.uint8)
        if sys.byteorder != "little" and view.dtype.itemsize > 1:
            raise ValueError("packed integer checkpoints are read as little-endian bytes; this host is big-endian")
        return view.contiguous().view(torch.uint8).reshape(*self.values[:-1], -1)

    def scale_grid(self, files: MappedFiles) -> torch.Tensor:
        """The scales as float32, one per block of the stored grid (`grid()`)."""
        return _decode_scale(self._scale_view(files), self.scale_code)

    def _scale_view(self, files: MappedFiles) -> torch.Tensor:
        view = files.view(self.scales).reshape(self.grid())
        return view.view(torch.uint8) if view.dtype.itemsize == 1 else view

    def _dequantize(self, codes: torch.Tensor, scales: torch.Tensor, indices: list[torch.Tensor]) -> torch.Tensor:
        """float32 values at the cross product of `indices` (one index tensor per stored dim)."""
        per_byte = CODES_PER_BYTE[self.code]
        byte_indices = [*indices[:-1], indices[-1] // per_byte]
        raw = _gather(codes, byte_indices)
        values = self._decode(raw, indices[-1] % per_byte)
        scale = _gather(scales, [index // block for index, block in zip(indices, self.block)])
        return values.mul_(_decode_scale(scale, self.scale_code))

    def _decode(self, raw: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        if self.code == "float":
            return raw.view(self.codes.dtype).to(torch.float32)
        if self.code == "int8":
            return raw.to(torch.float32) - 128
        nibble = (raw >> (position * 4).to(torch.uint8)) & 0xF
        if self.code == "int4":
            return nibble.to(torch.float32) - 8
        return torch.tensor(E2M1_VALUES, dtype=torch.float32)[nibble.long()]


def _decode_scale(scale: torch.Tensor, scale_code: str) -> torch.Tensor:
    if scale_code == "e8m0":  # a byte s means 2^(s - 127); 255 is NaN
        exponent = scale.to(torch.float32) - 127
        return torch.where(scale == 255, torch.nan, torch.exp2(exponent))
    return scale.to(torch.float32)


def _indices(ranges: tuple[range, ...] | None, size: int) -> torch.Tensor:
    if ranges is None:
        return torch.arange(size)
    return torch.cat([torch.arange(r.start, r.stop) for r in ranges])


def _gather(tensor: torch.Tensor, indices: list[torch.Tensor]) -> torch.Tensor:
    """`tensor` at the cross product of `indices`, touching only the span each index covers.

    A run of consecutive indices (a shard's rows, most often) is a view; any other index a gather.
    """
    for dim, index in enumerate(indices):
        low, high = int(index.min()), int(index.max()) + 1
        tensor = tensor.narrow(dim, low, high - low)
        if high - low != len(index) or int(index[0]) != low:
            tensor = tensor.index_select(dim, index - low)
    return tensor


def _chunks(wanted: list[torch.Tensor]):
    """(where in the output, indices to read) pieces of at most about `CHUNK_ELEMENTS` elements.

    The last stored dim is read whole; the one before it in runs of rows; any dims before those
    one index at a time (the experts of a stacked tensor).
    """
    if len(wanted) == 1:
        yield (slice(None),), wanted
        return
    *leading, rows, width = wanted
    step = max(1, CHUNK_ELEMENTS // max(1, len(width)))
    for position in itertools.product(*(range(len(index)) for index in leading)):
        for start in range(0, len(rows), step):
            stop = min(start + step, len(rows))
            where = (*(slice(p, p + 1) for p in position), slice(start, stop), slice(None))
            indices = [*(index[p : p + 1] for index, p in zip(leading, position)), rows[start:stop], width]
            yield where, indices


def _inverse(order: tuple[int, ...]) -> tuple[int, ...]:
    inverse = [0] * len(order)
    for model_dim, stored_dim in enumerate(order):
        inverse[stored_dim] = model_dim
    return tuple(inverse)
