"""The `%shards` table: each parameter's global shape, placement and every rank's local shape (FSDP2 or tp).

Computed on one rank from DTensor metadata alone (mesh and placements), without asking the
others: ``Shard(dim)`` splits like ``torch.chunk`` along a mesh axis, ``Replicate`` keeps it whole.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from shardbook.rankd.parallel.layout import chunk_rows
from shardbook.rankd.parallel.tp_modules import TPShard, tp_shard_of


def local_shape(
    global_shape: tuple[int, ...], coordinate: list[int], mesh_shape: tuple[int, ...], placements
) -> tuple[int, ...]:
    """The shape a rank at ``coordinate`` of the mesh holds for a DTensor of ``global_shape``."""
    shape = list(global_shape)
    for axis, placement in enumerate(placements):
        if isinstance(placement, Shard):
            shape[placement.dim] = len(chunk_rows(shape[placement.dim], mesh_shape[axis], coordinate[axis])[0])
    return tuple(shape)


def rank_coordinates(mesh) -> dict[int, list[int]]:
    """Global rank -> its coordinate in ``mesh``."""
    ranks = mesh.mesh
    return {int(ranks[idx]): list(idx) for idx in _indices(tuple(ranks.shape))}


def _indices(shape: tuple[int, ...]):
    if not shape:
        yield ()
        return
    for i in range(shape[0]):
        for rest in _indices(shape[1:]):
            yield (i, *rest)


def shard_rows(model: nn.Module, prefix: str = "") -> list[dict[str, Any]]:
    """One row per parameter under ``prefix``: name, global shape, dtype, placement, local shape by rank."""
    rows = []
    for name, param in model.named_parameters():
        if not name.startswith(prefix):
            continue
        rows.append(_row(name, param))
    return rows


def _row(name: str, param: torch.Tensor) -> dict[str, Any]:
    dtype = str(param.dtype).removeprefix("torch.")
    tp_shard = tp_shard_of(param)
    if tp_shard is not None:
        return _tp_row(name, dtype, tp_shard)
    if not isinstance(param, DTensor):
        return {
            "name": name,
            "shape": list(param.shape),
            "dtype": dtype,
            "placement": "local (not sharded)",
            "local": {},
        }
    mesh = param.device_mesh
    coords = rank_coordinates(mesh)
    local = {
        r: list(local_shape(tuple(param.shape), c, tuple(mesh.shape), param.placements))
        for r, c in sorted(coords.items())
    }
    placement = ", ".join(str(p) for p in param.placements)
    return {"name": name, "shape": list(param.shape), "dtype": dtype, "placement": placement, "local": local}


def _tp_row(name: str, dtype: str, shard: TPShard) -> dict[str, Any]:
    """A `tp` slice: rank r holds the pieces of its place in its tensor-parallel group
    (groups are consecutive ranks)."""
    parts = len(shard.selections)
    local = {r: list(shard.local_shape(r % parts)) for r in range(dist.get_world_size())}
    names = ("experts", "rows", "columns") if len(shard.global_shape) == 3 else ("rows", "columns")
    sides = ", ".join(f"{names[dim]} (dim {dim})" for dim in shard.split_dims)
    even = len({tuple(shape) for shape in local.values()}) == 1
    placement = f"tp: {sides} over {parts} rank(s){'' if even else ', uneven'}"
    return {"name": name, "shape": list(shard.global_shape), "dtype": dtype, "placement": placement, "local": local}
