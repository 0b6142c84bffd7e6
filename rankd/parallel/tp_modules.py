"""The pieces every tensor-parallel module is made of: `TPShard` (which part of a tensor each rank holds) and the
parallel linear and embedding modules that join their pieces with one collective.

A module becomes parallel in place (`become`): its class is swapped for a subclass with a forward of its own,
so its name, parameters and hooks stay those of the transformers model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


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
    """Sum `tensor` in place over `group` (nothing to do in a group of one)."""
    if dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, group=group)
    return tensor


class RowParallelLinear(nn.Linear):
    """A linear layer holding a range of input columns: partial outputs are summed over the group."""

    tp_group: dist.ProcessGroup

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = all_reduce(F.linear(x, self.weight), self.tp_group)
        return out if self.bias is None else out + self.bias


class VocabParallelEmbedding(nn.Embedding):
    """An embedding holding a range of the vocabulary: each rank looks up its tokens, the sum fills the rest."""

    tp_group: dist.ProcessGroup
    vocab_start: int

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return all_reduce(out, self.tp_group)


class VocabGatheredLinear(nn.Linear):
    """The output layer holding a range of the vocabulary: every rank's logits are gathered into the whole."""

    tp_group: dist.ProcessGroup
    vocab_sizes: list[int]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = F.linear(x, self.weight, self.bias)
        if len(self.vocab_sizes) == 1:
            return local
        width = max(self.vocab_sizes)
        padded = F.pad(local, (0, width - local.shape[-1])).contiguous()
        parts = [torch.empty_like(padded) for _ in self.vocab_sizes]
        dist.all_gather(parts, padded, group=self.tp_group)
        return torch.cat([part[..., :size] for part, size in zip(parts, self.vocab_sizes)], dim=-1)
