"""Whole tensors from every rank's piece: which activations and parameters a layout splits, and how to join them.

Under `gather` and `reshard` (FSDP2) every rank computes whole activations, and parameters are
DTensors (or, after a forward that kept them gathered, plain whole tensors). Under `tp` the
residual stream is whole on every rank, but the outputs of the column-parallel projections
(q/k/v, gate/up), the MLP activation between them and Qwen3's per-head q/k norms are split by
heads or rows, and so are the inputs of the row-parallel ones (o_proj, down_proj). Each such
tensor is split along its last features like its projection's weight, so the weight's `TPShard`
says where every rank's piece goes. Everything here is the same on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from shardbook.rankd.parallel.fp8_experts import kept_values
from shardbook.rankd.parallel.tp_modules import TPShard, tp_shard_of

SIBLING_SPLITS = {"act_fn": "gate_proj", "q_norm": "q_proj", "k_norm": "k_proj"}
"""Modules without a split weight whose tensors are split like a sibling projection's outputs (input and output)."""


@dataclass(frozen=True)
class FeatureSplit:
    """How a `tp` activation is split: along its flattened trailing features, like `shard`'s dim-0 rows."""

    shard: TPShard
    group: dist.ProcessGroup
    per_head: bool = False
    """Laid out [..., heads, head_dim] (Qwen3's q/k norms) rather than [..., features]."""

    @property
    def whole_features(self) -> int:
        return self.shard.global_shape[0]


def tp_group(model: nn.Module) -> dist.ProcessGroup | None:
    """The tensor-parallel group of a `tp` model, None for FSDP2 layouts."""
    return getattr(model.get_input_embeddings(), "tp_group", None)


def activation_split(model: nn.Module, name: str, inputs: bool) -> FeatureSplit | None:
    """How module `name`'s output (or, with `inputs`, its first input) is split across ranks; None when whole."""
    group = tp_group(model)
    if group is None or dist.get_world_size(group) == 1:
        return None
    module = model.get_submodule(name)
    parent, _, leaf = name.rpartition(".")
    per_head = leaf in ("q_norm", "k_norm")
    if leaf in SIBLING_SPLITS:
        module = model.get_submodule(f"{parent}.{SIBLING_SPLITS[leaf]}" if parent else SIBLING_SPLITS[leaf])
        inputs = False
    weight = getattr(module, "weight", None)
    shard = tp_shard_of(weight) if weight is not None else None
    if shard is None or not isinstance(module, nn.Linear):
        return None
    split_side = 1 if inputs else 0  # a split input belongs to a row-parallel (dim 1) weight, a split output to dim 0
    if shard.dim != split_side or name == _output_name(model):
        return None
    if len(shard.split_dims) != 1:  # expert weights: their modules are not linear layers, so never here
        return None
    rows = TPShard.along((shard.global_shape[shard.dim],), 0, shard.pieces)
    return FeatureSplit(rows, group, per_head)


def _output_name(model: nn.Module) -> str | None:
    """The output layer's name: its logits are gathered whole inside its own forward."""
    out = model.get_output_embeddings()
    return next((n for n, m in model.named_modules() if m is out), None)


def whole_shape(local: torch.Size, split: FeatureSplit | None) -> tuple[int, ...]:
    """The shape the joined tensor will have (the same answer on every rank)."""
    if split is None:
        return tuple(local)
    if split.per_head:
        return (*local[:-2], split.whole_features // local[-1], local[-1])
    return (*local[:-1], split.whole_features)


def join(parts: list[torch.Tensor], split: FeatureSplit, whole: tuple[int, ...]) -> torch.Tensor:
    """Place each rank's flattened features (`parts[r]`, padded) into the whole tensor of shape `whole`."""
    lead = parts[0].shape[:-1]
    out = parts[0].new_empty((*lead, split.whole_features))
    for part, pieces in zip(parts, split.shard.pieces):
        start = 0
        for piece in pieces:  # a KV head kept by two ranks is written twice, with the same values
            out[..., piece.start : piece.stop] = part[..., start : start + len(piece)]
            start += len(piece)
    return out.reshape(whole)


def all_gather_whole(local: torch.Tensor, split: FeatureSplit) -> torch.Tensor:
    """Every rank of the group gets the whole tensor (a collective of the group).

    With grad, the gradient of the whole tensor (each rank's partial one) is summed over the group and each rank
    takes its own piece, so an intervention on a split tensor keeps the gradients one process would get.
    """
    if torch.is_grad_enabled() and local.requires_grad:
        return _AllGatherWhole.apply(local, split)
    return _all_gather_whole(local, split)


class _AllGatherWhole(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local: torch.Tensor, split: FeatureSplit) -> torch.Tensor:
        ctx.split = split
        return _all_gather_whole(local, split)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.split.group)
        return local_part(grad, ctx.split).contiguous(), None


def _all_gather_whole(local: torch.Tensor, split: FeatureSplit) -> torch.Tensor:
    whole = whole_shape(local.shape, split)
    flat = _padded_features(local, split)
    parts = [torch.empty_like(flat) for _ in split.shard.pieces]
    dist.all_gather(parts, flat, group=split.group)
    return join(parts, split, whole)


def local_part(whole: torch.Tensor, split: FeatureSplit) -> torch.Tensor:
    """This rank's piece of a whole tensor (the inverse of `join` for one rank)."""
    rank = dist.get_rank(split.group)
    flat = whole.flatten(-2) if split.per_head else whole
    local = torch.cat([flat[..., p.start : p.stop] for p in split.shard.pieces[rank]], dim=-1)
    return local.unflatten(-1, (-1, whole.shape[-1])) if split.per_head else local


def gather_whole_to_rank0(local: torch.Tensor, split: FeatureSplit) -> tuple[torch.Tensor | None, int]:
    """Rank 0 gets the whole tensor (others None) and the bytes its peers sent it; ranks outside rank 0's group skip."""
    group_ranks = dist.get_process_group_ranks(split.group)
    if 0 not in group_ranks:
        return None, 0
    whole = whole_shape(local.shape, split)
    flat = _padded_features(local, split)
    parts = [torch.empty_like(flat) for _ in group_ranks] if dist.get_rank() == 0 else None
    dist.gather(flat, parts, dst=0, group=split.group)
    if parts is None:
        return None, 0
    return join(parts, split, whole), flat.numel() * flat.element_size() * (len(group_ranks) - 1)


def _padded_features(local: torch.Tensor, split: FeatureSplit) -> torch.Tensor:
    """The local features flattened to one last dim and padded to the widest rank's, contiguous (for collectives)."""
    flat = local.flatten(-2) if split.per_head else local
    width = max(sum(len(p) for p in pieces) for pieces in split.shard.pieces)
    return torch.nn.functional.pad(flat, (0, width - flat.shape[-1])).contiguous()


def parameter_bytes(param: torch.Tensor) -> int:
    """Bytes of the whole parameter, whatever this rank holds of it."""
    shard = tp_shard_of(param)
    numel = param.numel() if shard is None else int(torch.Size(shard.global_shape).numel())
    return numel * param.element_size()


def full_parameter_on_rank0(model: nn.Module, param: torch.Tensor) -> torch.Tensor | None:
    """The whole parameter on rank 0 (None elsewhere); a collective under every sharded layout."""
    if isinstance(param, DTensor):
        whole = param.full_tensor()  # an all-gather over the parameter's mesh
        return whole if dist.get_rank() == 0 else None
    local = _values(model, param)
    shard = tp_shard_of(param)
    if shard is None:
        return local if dist.get_rank() == 0 else None
    return _gather_selections(local, shard, tp_group(model))


def _values(model: nn.Module, param: torch.Tensor) -> torch.Tensor:
    """This rank's values of `param`: the dequantized weight (float32) where a layer or experts hold it as codes."""
    values = kept_values(model, param)
    return param.detach() if values is None else values


def full_gradient_on_rank0(model: nn.Module, param: torch.Tensor) -> torch.Tensor | None:
    """The whole gradient of a parameter on rank 0 (None elsewhere, and None when it has none on any rank alike).

    Each rank holds the gradient of its own slice (a DTensor under FSDP2, a plain slice under `tp`), joined like
    the parameter itself (`full_parameter_on_rank0`). A collective under every sharded layout.
    """
    grad = param.grad
    if grad is None:
        return None
    if isinstance(grad, DTensor):
        whole = grad.full_tensor()
        return whole if dist.get_rank() == 0 else None
    shard = tp_shard_of(param)
    if shard is None:
        return grad.detach() if dist.get_rank() == 0 else None
    return _gather_selections(grad.detach(), shard, tp_group(model))


def _gather_selections(local: torch.Tensor, shard: TPShard, group: dist.ProcessGroup) -> torch.Tensor | None:
    """Rank 0 joins every rank's selection of a `tp` parameter (split on one dim or several, as experts are)."""
    group_ranks = dist.get_process_group_ranks(group)
    if 0 not in group_ranks:
        return None
    width = max(int(torch.Size(shard.local_shape(r)).numel()) for r in range(len(group_ranks)))
    flat = torch.nn.functional.pad(local.reshape(-1), (0, width - local.numel())).contiguous()
    parts = [torch.empty_like(flat) for _ in group_ranks] if dist.get_rank() == 0 else None
    dist.gather(flat, parts, dst=0, group=group)
    if parts is None:
        return None
    whole = local.new_empty(shard.global_shape)
    for rank, part in enumerate(parts):
        shape = shard.local_shape(rank)
        index = [_positions(ranges, size) for ranges, size in zip(shard.selections[rank], shard.global_shape)]
        grid = [idx.view([-1 if d == i else 1 for d in range(len(index))]) for i, idx in enumerate(index)]
        whole[tuple(grid)] = part[: int(torch.Size(shape).numel())].view(shape)
    return whole


def _positions(ranges: tuple[range, ...] | None, size: int) -> torch.Tensor:
    """The indices along one dim that a rank's ranges cover, in its order (all of them for None)."""
    if ranges is None:
        return torch.arange(size)
    return torch.cat([torch.arange(r.start, r.stop) for r in ranges])
