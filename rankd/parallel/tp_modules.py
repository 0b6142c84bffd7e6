"""The pieces every tensor-parallel module is made of: `TPShard` (which part of a tensor each rank holds) and the
parallel linear and embedding modules that join their pieces with one collective.

The collectives take part in autograd (Megatron's conjugate "f" and "g" operators), so `loss.backward()` gives
every rank what one process would: the sum of partial outputs (`sum_over_group`) passes its gradient through
unchanged, a replicated input to split work (`copy_to_group`) sums its partial input gradients, and the gathered
logits (`gather_vocab`) give each rank its own columns of the gradient. Without grad they are the plain collectives.
Within `logits_on_first_rank_only` (the continuous batch's steps, where only rank 0 samples) the logits are
gathered on the group's first rank alone, and the others keep their own columns.

A module becomes parallel in place (`become`): its class is swapped for a subclass with a forward of its own,
so its name, parameters and hooks stay those of the transformers model.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from functools import cache

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from shardbook.rankd.parallel.host_sum import host_sum_for
from shardbook.rankd.parallel.packed_linear import grad_wanted, linear, packs


@dataclass(frozen=True)
class TPShard:
    """Which part of a global tensor each rank of the group holds: per rank, per dim, the index ranges it keeps."""

    global_shape: tuple[int, ...]
    selections: tuple[tuple[tuple[range, ...] | None, ...], ...]
    """`selections[r][d]`: the ranges of dim d that rank r holds, joined in this order (None: all of dim d)."""

    def local_shape(self, rank: int) -> tuple[int, ...]:
        return tuple(
            size if ranges is None else sum(len(r) for r in ranges)
            for size, ranges in zip(self.global_shape, self.selections[rank])
        )

    @property
    def split_dims(self) -> list[int]:
        """The dims some rank holds only part of."""
        return sorted(
            {dim for selection in self.selections for dim, ranges in enumerate(selection) if ranges is not None}
        )

    @classmethod
    def along(cls, shape: tuple[int, ...], dim: int, pieces) -> TPShard:
        """Each rank keeps its `pieces[r]` (ranges) of `dim` and all of every other dim."""
        whole = [None] * len(shape)
        return cls(
            tuple(shape), tuple(tuple(ranges if d == dim else whole[d] for d in range(len(shape))) for ranges in pieces)
        )

    @property
    def dim(self) -> int:
        """The one split dim of a tensor split along a single dim (weights of attention and MLPs)."""
        dims = self.split_dims
        if len(dims) != 1:
            raise ValueError(f"a tensor of shape {list(self.global_shape)} split on dims {dims}, not on one")
        return dims[0]

    @property
    def pieces(self) -> tuple[tuple[range, ...], ...]:
        """Every rank's ranges of `dim`."""
        return tuple(selection[self.dim] for selection in self.selections)


def tp_shard_of(param: torch.Tensor) -> TPShard | None:
    """The `TPShard` of a tensor-parallel parameter; None for a whole (replicated) or FSDP2 one."""
    return getattr(param, "tp_shard", None)


def global_numel(param: torch.Tensor) -> int:
    """Elements of the whole parameter, whatever slice of it this rank holds."""
    shard = tp_shard_of(param)
    return param.numel() if shard is None else int(torch.Size(shard.global_shape).numel())


def become(module: nn.Module, cls: type, group: dist.ProcessGroup, **attributes) -> None:
    """Turn `module` into `cls` (a subclass of its class) in place: same name, parameters and hooks."""
    assert issubclass(cls, type(module)), f"{cls.__name__} is not a kind of {type(module).__name__}"
    module.__class__ = cls
    module.tp_group = group
    for key, value in attributes.items():
        setattr(module, key, value)


def all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Sum `tensor` in place over `group` (nothing to do in a group of one): through shared memory where the
    group's ranks share a CPU host (`host_sum`), else through the group's backend."""
    if dist.get_world_size(group) == 1:
        return tensor
    host_sum = host_sum_for(group)
    if host_sum is not None and host_sum.fits(tensor):
        return host_sum.sum_(tensor)
    dist.all_reduce(tensor, group=group)
    return tensor


class _SumOverGroup(torch.autograd.Function):
    """g: forward sums partial tensors over the group; backward passes the (replicated) gradient through."""

    @staticmethod
    def forward(ctx, partial: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        return all_reduce(partial.contiguous().clone(), group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class _CopyToGroup(torch.autograd.Function):
    """f: forward is the identity on a replicated tensor; backward sums every rank's partial gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return all_reduce(grad.contiguous().clone(), ctx.group), None


_deferred = threading.local()
"""`group`: the group whose sums an enclosing module makes once, for everything inside it (this thread only)."""


@contextmanager
def sums_left_to_caller(group: dist.ProcessGroup) -> Iterator[None]:
    """Inside, `sum_over_group` over `group` returns the partial tensor: the caller sums what it builds from them.

    Only for code whose result is a sum of those partials (a linear combination), as a MoE block's
    routed plus shared experts are.
    """
    outer = getattr(_deferred, "group", None)
    _deferred.group = group
    try:
        yield
    finally:
        _deferred.group = outer


def sum_over_group(partial: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Partial results summed over `group` (in place without grad); its gradient is passed through unchanged."""
    if dist.get_world_size(group) == 1 or getattr(_deferred, "group", None) is group:
        return partial
    if grad_wanted(partial):
        return _SumOverGroup.apply(partial, group)
    return all_reduce(partial, group)


def copy_to_group(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """A replicated tensor about to feed split work: the same tensor, whose gradient is summed over `group`."""
    if dist.get_world_size(group) == 1 or not grad_wanted(x):
        return x
    return _CopyToGroup.apply(x, group)


class ColumnParallelLinear(nn.Linear):
    """A linear layer holding a range of output rows: its input is replicated, so its input gradient is summed."""

    tp_group: dist.ProcessGroup

    @packs
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shard = tp_shard_of(self.weight)
        if shard is not None and grad_wanted(x, self.weight):  # a whole weight's gradient is whole on every rank
            if _overlapping(shard):
                raise NotImplementedError(
                    "gradients under tp are not supported for a model whose key/value heads are shared by several "
                    "ranks (more ranks than KV heads, or heads split unevenly across them): each rank would hold "
                    "only its part of the shared rows' gradient. Load with parallel.decode gather or reshard"
                )
            x = copy_to_group(x, self.tp_group)
        return linear(x, self.weight, self.bias)


@cache
def _overlapping(shard: TPShard) -> bool:
    """Some rows are held by more than one rank (a KV head shared by ranks)."""
    rows = [i for pieces in shard.pieces for piece in pieces for i in piece]
    return len(rows) != len(set(rows))


class SplitInputModule:
    """Mixed into a module with whole parameters that runs on a split tensor (Qwen3's per-head q/k norms under
    `tp`): each rank's parameter gradient covers only its heads, so the parameters go through `copy_to_group`."""

    tp_group: dist.ProcessGroup

    def forward(self, *args, **kwargs):
        base = super().forward  # the family's own forward, reading its parameters by attribute
        params = {n: p for n, p in self._parameters.items() if p is not None and tp_shard_of(p) is None}
        if not any(grad_wanted(p) for p in params.values()):
            return base(*args, **kwargs)
        for name, param in params.items():
            del self._parameters[name]
            object.__setattr__(self, name, copy_to_group(param, self.tp_group))
        try:
            return base(*args, **kwargs)
        finally:
            for name, param in params.items():
                object.__delattr__(self, name)
                self._parameters[name] = param


def become_split_input(module: nn.Module, group: dist.ProcessGroup) -> None:
    """Give `module` (whole parameters, split input) gradients summed over the group."""
    become(module, _split_input_class(type(module)), group)


@cache
def _split_input_class(base: type) -> type:
    return type(f"SplitInput{base.__name__}", (SplitInputModule, base), {})


class RowParallelLinear(nn.Linear):
    """A linear layer holding a range of input columns: partial outputs are summed over the group."""

    tp_group: dist.ProcessGroup

    @packs
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = sum_over_group(linear(x, self.weight), self.tp_group)
        return out if self.bias is None else out + self.bias


class VocabParallelEmbedding(nn.Embedding):
    """An embedding holding a range of the vocabulary: each rank looks up its tokens, the sum fills the rest."""

    tp_group: dist.ProcessGroup
    vocab_start: int

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0)
        return sum_over_group(out, self.tp_group)


class VocabGatheredLinear(nn.Linear):
    """The output layer holding a range of the vocabulary: every rank's logits are gathered into the whole."""

    tp_group: dist.ProcessGroup
    vocab_sizes: list[int]

    @packs
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if len(self.vocab_sizes) == 1:
            return linear(x, self.weight, self.bias)
        local = linear(copy_to_group(x, self.tp_group), self.weight, self.bias)
        if grad_wanted(local):
            return _GatherVocab.apply(local, self.tp_group, self.vocab_sizes)
        if _FIRST_RANK_ONLY.get():
            return gather_vocab_on_first(local, self.tp_group, self.vocab_sizes)
        return gather_vocab(local, self.tp_group, self.vocab_sizes)


_FIRST_RANK_ONLY: ContextVar[bool] = ContextVar("logits_on_first_rank_only", default=False)


@contextmanager
def logits_on_first_rank_only() -> Iterator[None]:
    """Forwards within gather the vocabulary-parallel logits on each group's first rank only: a gather instead of
    an all-gather, half the bytes on 2 ranks. The other ranks' output layer returns their own columns, which
    must not be read (every rank must enter it alike, so it is for steps every rank runs with the same plan)."""
    token = _FIRST_RANK_ONLY.set(True)
    try:
        yield
    finally:
        _FIRST_RANK_ONLY.reset(token)


def gather_vocab(local: torch.Tensor, group: dist.ProcessGroup, sizes: list[int]) -> torch.Tensor:
    """Every rank's columns (`sizes[r]` of them, in rank order) joined along the last dim."""
    padded = _padded(local, sizes)
    parts = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(parts, padded, group=group)
    return _joined(parts, sizes)


def gather_vocab_on_first(local: torch.Tensor, group: dist.ProcessGroup, sizes: list[int]) -> torch.Tensor:
    """`gather_vocab` on the group's first rank; every other rank sends its columns and gets them back."""
    padded = _padded(local, sizes)
    first = dist.get_rank(group) == 0
    parts = [torch.empty_like(padded) for _ in sizes] if first else None
    dist.gather(padded, parts, group_dst=0, group=group)
    return _joined(parts, sizes) if first else local


def _padded(local: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """This rank's columns padded to the widest rank's (collectives move tensors of one shape)."""
    return F.pad(local, (0, max(sizes) - local.shape[-1])).contiguous()


def _joined(parts: list[torch.Tensor], sizes: list[int]) -> torch.Tensor:
    return torch.cat([part[..., :size] for part, size in zip(parts, sizes)], dim=-1)


class _GatherVocab(torch.autograd.Function):
    """The all-gather of logits; backward takes this rank's columns of the (replicated) gradient."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, group: dist.ProcessGroup, sizes: list[int]) -> torch.Tensor:
        rank = dist.get_rank(group)
        ctx.columns = (sum(sizes[:rank]), sum(sizes[: rank + 1]))
        return gather_vocab(local, group, sizes)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        start, stop = ctx.columns
        return grad[..., start:stop].contiguous(), None, None
