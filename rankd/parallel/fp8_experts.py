"""Routed experts that keep FP8 block weights as FP8 (`model.fp8_weights keep`): e4m3 codes and per-row scales.

A fused experts module under `tp` (`expert_parallel.ExpertParallel`) holds `gate_up_proj`
[experts, 2 x rows, hidden] and `down_proj` [experts, hidden, rows] for its experts and its slice
of their rows. Kept in FP8, each holds the e4m3 codes of exactly that selection, and beside it
`gate_up_proj_scale_inv` / `down_proj_scale_inv` [experts, rows held, column blocks touched]:
each expert's scales in `fp8_linear`'s per-row layout, so an expert's row slice may start inside
a 128-row block (gate and up rows of an `ep_fsdp` slice) and down_proj's column slice inside a
column block (`fp8_lead` columns of its first block belong to other ranks).

The experts' forward computes each expert that received tokens from its own codes and scales, one
expert at a time: by torch's blockwise FP8 matmul where the load found it runs and the slice
fits it, else by the reference path (a bounded piece of one expert's weight dequantized at a
time). The rank never holds a dequantized copy of its experts.
"""

from __future__ import annotations

from functools import cache

import torch
from torch import nn

from shardbook.rankd.parallel.fp8_linear import (
    FP8Linear,
    column_major,
    dequantize,
    dequantized,
    kernel_matmul,
    reference_matmul,
)

EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")
"""The fused expert tensors that can be kept in FP8 (`expert_parallel.EXPECTED_FLAGS`' layout)."""
SCALES = "_scale_inv"
"""Suffix of the buffer beside a kept expert weight holding its scales."""


class FP8Experts:
    """Mixed into an expert-parallel experts module whose `gate_up_proj` and/or `down_proj` hold e4m3 codes."""

    fp8_layout: dict[str, tuple[int, int, bool]]
    """Per kept weight: (lead, block, whether torch's kernel computes it)."""

    def expert_matmul(self, x: torch.Tensor, weight: str, expert: int) -> torch.Tensor:
        if weight not in self.fp8_layout:
            return super().expert_matmul(x, weight, expert)
        lead, block, kernel = self.fp8_layout[weight]
        codes, scales = getattr(self, weight)[expert], getattr(self, weight + SCALES)[expert]
        if kernel:
            return kernel_matmul(x, codes, scales)
        return reference_matmul(x, codes, scales, lead, block)


def keep_fp8_experts(
    experts: nn.Module, weight: str, scales: torch.Tensor, lead: int, block: int, kernel: bool
) -> None:
    """Make `experts` hold `weight` (whose codes the loader sets) as FP8 with `scales` [experts, rows, blocks]."""
    if not isinstance(experts, FP8Experts):
        experts.__class__ = _fp8_class(type(experts))
        experts.fp8_layout = {}
    experts.register_buffer(weight + SCALES, column_major(scales) if kernel else scales)
    experts.fp8_layout[weight] = (lead, block, kernel)


@cache
def _fp8_class(base: type) -> type:
    return type(f"FP8{base.__name__}", (FP8Experts, base), {})


def kept_values(model: nn.Module, param: torch.Tensor) -> torch.Tensor | None:
    """The float32 values that `param`'s codes stand for (this rank's part) when a module keeps it in FP8; else None."""
    for module in model.modules():
        if isinstance(module, FP8Linear) and module.weight is param:
            return dequantized(module)
        if isinstance(module, FP8Experts):
            for weight, (lead, block, _) in module.fp8_layout.items():
                if getattr(module, weight) is param:
                    scales = getattr(module, weight + SCALES)
                    return torch.stack([dequantize(c, s, lead, block) for c, s in zip(param, scales)])
    return None
