"""Linear layers through oneDNN's packed weights, on a CPU with bfloat16 matrix kernels (AMX or AVX512-BF16).

Why: there `F.linear` in bfloat16 multiplies by the weight as it is laid out in memory, while oneDNN computes
fastest from a copy reordered into its own blocked layout (`torch.ops.mkldnn._reorder_linear_weight`, what
torch's compiler uses for frozen CPU models). `bench/bench_packed_linear.py` measured the demo model's linears
1.1x to 2.4x faster that way at 1 to 64 rows, with the same bits, its whole decode steps 1.05x to 1.18x, and
served under `tp` 1.1x to 1.5x the tokens a second (bench/RESULTS.md). float32 gains nothing at one row there,
so only bfloat16 takes this path.

A layer packs its weight once (`pack_linears`, at the end of a load, so the load's free-memory figure counts the
copy) and packs it again whenever the weight changes its version counter or its storage (an in-place operation,
a new tensor set with `.data =`). An edit in place through `.data` (`weight.data[...] = ...`) changes neither, so
every packed copy is dropped when user code starts and when it ends (`forget_packed`: a notebook cell other than a
lone `%%chat`, a `%%all` or `%%rank` cell on a follower) and made again at its next use (0.12 s for the demo
model), so a cell that edits a weight so and then generates sees the edit. A cell that generates, edits that way,
then generates again reads the old copy in its second generation: edit in place on the parameter
(`with torch.no_grad(): weight[...] = ...`), which is counted, or do it in two cells. The copies
live in a table keyed by the weight, held weakly, never on the parameter, so the model still deep-copies and
saves as before, and a copy goes when its weight goes. A forward that needs gradients, another dtype or device,
or a weight that is a DTensor uses `F.linear`. `SHARDBOOK_PACKED_LINEAR=0` turns the path off (the copies cost one
more copy of the linear weights' memory).
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from functools import cache

import torch
import torch.nn.functional as F
from torch import nn

from shardbook.rankd.parallel.fastest_dtype import cpu_has_bf16_kernels

log = logging.getLogger(__name__)

SWITCH = "SHARDBOOK_PACKED_LINEAR"
_packed: dict[int, tuple[weakref.ref, tuple[int, int], torch.Tensor]] = {}
"""id(weight) -> (the weight, weakly; its (version, data pointer) when packed; the packed copy)."""
_forgotten = threading.Event()
"""Set by `forget_packed`: the next `packed` drops every copy first."""


@cache
def packing_available() -> bool:
    """Whether this process packs: a CPU with bfloat16 matrix kernels, oneDNN in torch, and not switched off."""
    if os.environ.get(SWITCH, "1") == "0" or not torch.backends.mkldnn.is_available():
        return False
    return cpu_has_bf16_kernels() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def packable(weight: torch.Tensor) -> bool:
    """A plain bfloat16 matrix on the CPU (not a DTensor, not FP8 codes), where packing is available."""
    return (
        weight.dtype == torch.bfloat16
        and weight.device.type == "cpu"
        and weight.dim() == 2
        and type(weight) in (torch.Tensor, nn.Parameter)
        and packing_available()
    )


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, through the packed copy of `weight` where it applies (no gradients wanted)."""
    if x.dtype != weight.dtype or not packable(weight) or grad_wanted(x, weight, bias):
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed(weight), bias, "none", [], "")


def packed(weight: torch.Tensor) -> torch.Tensor:
    """The packed copy of `weight`, made again if the weight changed since (or user code ran since)."""
    if _forgotten.is_set():
        _forgotten.clear()
        _packed.clear()
    key = (weight._version, weight.data_ptr())
    held = _packed.get(id(weight))
    if held is not None and held[0]() is weight and held[1] == key:
        return held[2]
    copy = torch.ops.mkldnn._reorder_linear_weight(weight.detach())
    _packed[id(weight)] = (weakref.ref(weight, lambda _, held=id(weight): _packed.pop(held, None)), key, copy)
    return copy


def forget_packed() -> None:
    """Drop every packed copy at the next use of any (each is then made again from its weight): user code runs or
    ran, and may change a weight behind its version counter (`weight.data[...] = ...` is not counted)."""
    _forgotten.set()


def grad_wanted(*tensors: torch.Tensor | None) -> bool:
    """Whether autograd will record an operation on `tensors` (None: no tensor, e.g. a missing bias)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def packs(forward):
    """Mark a linear subclass' `forward` as computing through `linear`, so `pack_linears` packs its weight."""
    forward.packs = True
    return forward


class PackedLinear(nn.Linear):
    """`nn.Linear` whose forward goes through `linear` (the class a plain linear layer takes in `pack_linears`)."""

    @packs
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


def pack_linears(model: nn.Module) -> int:
    """Give every linear layer of `model` with a packable weight its packed copy; the number packed.

    A plain `nn.Linear` becomes a `PackedLinear` in place (same name, parameters and hooks); the tensor-parallel
    linears call `linear` themselves. Other subclasses (FP8-kept layers, a family's own) are left as they are.
    """
    count = 0
    for module in model.modules():
        if not isinstance(module, nn.Linear) or not packable(module.weight):
            continue
        if type(module) is nn.Linear:
            module.__class__ = PackedLinear
        elif not getattr(type(module).forward, "packs", False):
            continue
        packed(module.weight)
        count += 1
    if count:
        log.info("%d linear layers compute through oneDNN's packed bfloat16 weights (%s=0 turns it off)", count, SWITCH)
    return count
