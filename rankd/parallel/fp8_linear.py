"""Linear layers that keep FP8 block weights as FP8 (`model.fp8_weights keep`): e4m3 codes and their block scales.

A rank holds the rows of the checkpoint's codes it computes (any selection of rows: a `tp` slice,
KV rows shared by ranks) and one contiguous range of columns `[c0, c1)`, as e4m3 codes of exactly
that shape, so the weight's `TPShard` describes it as it describes any other weight. Beside it,
`weight_scale_inv` holds float32 scales per row and per block of columns: `scale[r, j]` is the
scale of local row r over the columns of the checkpoint's column block `c0 // block + j`, and
`fp8_lead = c0 % block` columns of the first of those blocks belong to other ranks.

Why per row: a slice may start inside a block of rows (5 heads split 3 and 2 put a boundary
inside a 128-row block), and a row's scale must not depend on which rank holds the rest of its
block. Repeating each block's scale over its rows stays exact whatever the boundaries, costs 4
bytes per row per block of columns (3% of the codes with 128 x 128 blocks), and is the layout
torch's blockwise FP8 matmul takes for its weight operand (`BlockWise1x128`: one scale per output
feature per 128 along the reduced dim).

Two ways to compute, fixed at load:
- the kernel: `torch.nn.functional.scaled_mm` with 1 x 128 scales on both operands (activations
  quantized to e4m3 per token and 128 features), on CUDA devices of compute capability 8.9 or
  higher where it runs (torch 2.13's needs SM 9.0: `kernel_unavailable` runs it once to find out),
  for shards whose columns are whole 128-blocks starting on a block boundary;
- the reference: dequantize a bounded piece of rows at a time (codes times their scales, as
  dequantized loading does) and multiply; exact against the dequantized weight's matmul, on any
  device. It exists to check the kernel and the bookkeeping, not for speed.
"""

from __future__ import annotations

from functools import cache

import torch
import torch.nn.functional as F
from torch import nn

from shardbook.rankd.parallel.tp_modules import ColumnParallelLinear, RowParallelLinear, copy_to_group, sum_over_group

E4M3_MAX = 448.0
KERNEL_BLOCK = 128
"""The block the kernel's 1 x 128 scales are cut in."""
PIECE_ELEMENTS = 1 << 20
"""Weight elements the reference path dequantizes at a time (4 MiB of float32)."""
MIN_CAPABILITY = (8, 9)


class FP8Linear:
    """Mixed into a linear layer (plain, column- or row-parallel) whose `weight` is e4m3 codes with block scales."""

    weight_scale_inv: torch.Tensor
    fp8_lead: int
    fp8_block: int
    fp8_kernel: bool

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(self, ColumnParallelLinear):  # the input's gradient is summed over the group
            x = copy_to_group(x, self.tp_group)
        out = self.fp8_matmul(x)
        if isinstance(self, RowParallelLinear):
            out = sum_over_group(out, self.tp_group)
        return out if self.bias is None else out + self.bias

    def fp8_matmul(self, x: torch.Tensor) -> torch.Tensor:
        """`x @ W.T` for the dequantized W this layer holds the codes of (no bias, no collective)."""
        if self.fp8_kernel:
            return kernel_matmul(x, self.weight, self.weight_scale_inv)
        return reference_matmul(x, self.weight, self.weight_scale_inv, self.fp8_lead, self.fp8_block)


KEEPABLE = (nn.Linear, ColumnParallelLinear, RowParallelLinear)
"""The layers whose forward `FP8Linear` stands in for (any other, e.g. the vocab-gathered output, dequantizes)."""


def keep_fp8(module: nn.Linear, scales: torch.Tensor, lead: int, block: int, kernel: bool) -> None:
    """Turn `module`, whose `weight` already holds e4m3 codes, into its FP8 kind of layer with `scales`."""
    if kernel:  # the kernel reads the weight's scales column-major: [N, K / 128] with strides (1, N)
        scales = column_major(scales)
    module.__class__ = _fp8_class(type(module))
    module.register_buffer("weight_scale_inv", scales)
    module.fp8_lead, module.fp8_block, module.fp8_kernel = lead, block, kernel


@cache
def _fp8_class(base: type) -> type:
    return type(f"FP8{base.__name__}", (FP8Linear, base), {})


def kernel_fits(codes: torch.Tensor, lead: int, block: int) -> bool:
    """Whether a shard's codes fit the kernel: whole 128-blocks of columns from a block boundary, rows by 16."""
    rows, cols = codes.shape
    return block == KERNEL_BLOCK and lead == 0 and cols % KERNEL_BLOCK == 0 and rows % 16 == 0


def dequantized(module: FP8Linear) -> torch.Tensor:
    """The float32 values of the weight `module` holds (this rank's rows and columns)."""
    return dequantize(module.weight, module.weight_scale_inv, module.fp8_lead, module.fp8_block)


def dequantize(codes: torch.Tensor, scales: torch.Tensor, lead: int, block: int) -> torch.Tensor:
    """The float32 values of held `codes` [R, C] with their per-row `scales` (for showing a weight, not computing)."""
    return _dequantize_rows(codes, scales, lead, block, 0, None)


def _dequantize_rows(
    codes: torch.Tensor, scales: torch.Tensor, lead: int, block: int, start: int, stop: int | None
) -> torch.Tensor:
    values = codes[start:stop].to(torch.float32)
    per_column = scales[start:stop].repeat_interleave(block, dim=1)[:, lead : lead + values.shape[1]]
    return values.mul_(per_column)


def reference_matmul(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, lead: int, block: int):
    """`x @ W.T`, dequantizing W a piece of rows at a time (at most `PIECE_ELEMENTS` of it at once)."""
    step = max(1, PIECE_ELEMENTS // max(1, codes.shape[1]))
    pieces = [
        F.linear(x, _dequantize_rows(codes, scales, lead, block, start, start + step).to(x.dtype))
        for start in range(0, codes.shape[0], step)
    ]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=-1)


def kernel_matmul(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """`x @ W.T` by torch's blockwise FP8 matmul: x quantized per token and 128 features, W's 1 x 128 scales."""
    from torch.nn.functional import ScalingType, scaled_mm

    flat = x.reshape(-1, x.shape[-1])
    codes_a, scales_a = quantize_activations(flat)
    out = scaled_mm(
        codes_a,
        codes.t(),
        scales_a,
        ScalingType.BlockWise1x128,
        scales,
        ScalingType.BlockWise1x128,
        output_dtype=x.dtype,
    )
    return out.reshape(*x.shape[:-1], codes.shape[0])


def quantize_activations(flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 codes of `flat` [M, K] and float32 scales [M, K / 128] (column-major), one per token and 128 features."""
    rows, cols = flat.shape
    groups = flat.to(torch.float32).reshape(rows, cols // KERNEL_BLOCK, KERNEL_BLOCK)
    scales = groups.abs().amax(dim=-1).clamp(min=1e-12) / E4M3_MAX
    codes = (groups / scales.unsqueeze(-1)).to(torch.float8_e4m3fn).reshape(rows, cols)
    return codes, column_major(scales)


def column_major(matrix: torch.Tensor) -> torch.Tensor:
    """`matrix` [R, C] stored with strides (1, R), as the kernel's scales must be (one row included: a token's
    scales at decode, where `t().contiguous().t()` would keep strides (C, 1)); a stack [E, R, C] of them with
    strides (R * C, 1, R), so that each `matrix[e]` is one."""
    assert matrix.dim() in (2, 3), f"scales are a matrix or a stack of them, not {list(matrix.shape)}"
    rows, cols = matrix.shape[-2:]
    strides = (rows * cols, 1, rows) if matrix.dim() == 3 else (1, rows)
    out = torch.empty_strided(matrix.shape, strides, dtype=matrix.dtype, device=matrix.device)
    return out.copy_(matrix)


def kernel_unavailable(device: torch.device) -> str | None:
    """Why torch's blockwise FP8 matmul cannot run on `device` (None when it can), tried once on a tiny input."""
    if device.type != "cuda":
        return f"{device.type} devices have no FP8 matmul torch runs (CUDA of compute capability 8.9 or higher do)"
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        return f"this GPU has compute capability {capability[0]}.{capability[1]}; FP8 matmuls need 8.9 or higher"
    return _probe(str(device))


@cache
def _probe(device: str) -> str | None:
    codes = torch.ones(16, KERNEL_BLOCK, device=device).to(torch.float8_e4m3fn)
    scales = torch.ones(16, 1, device=device)
    try:
        kernel_matmul(torch.ones(16, KERNEL_BLOCK, device=device, dtype=torch.bfloat16), codes, scales)
    except (RuntimeError, ImportError, NotImplementedError) as e:
        return f"torch {torch.__version__}'s blockwise FP8 matmul failed on this GPU ({type(e).__name__}: {e})"
    return None
