"""Fill an FSDP2-sharded model from safetensors files, each rank taking only its own rows of each tensor.

FSDP2 shards every parameter along dim 0 over the mesh's shard axis, in `torch.chunk`'s sizes,
and replicates it over the replicate axis when there is one (HSDP). A rank's rows of a stored
tensor are therefore one contiguous byte range of the mapped file, and:

- on CPU, when the dtype matches and the rank's chunk needs no padding, the parameter becomes a
  DTensor over that range itself (`load_state_dict(assign=True)`, which FSDP2 hooks to adopt the
  new local tensor). Nothing is copied; the pages are read when first used and copied only if
  written, as `from_pretrained` does with its own mapping of the file;
- otherwise the rows are copied, converted to the model's dtype, onto the rank's device.

The model stays on the meta device until then (no `to_empty`): each shard is allocated once, here.

This replaces DCP's `HuggingFaceStorageReader`, which reads each slice into a fresh buffer and
then copies it into place: that was a third of a SmolLM2 load on CPU (0.2 of 0.6 s).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from shardbook.rankd.layout import chunk_rows
from shardbook.rankd.safetensors_files import MappedFiles, StoredTensor, read_index
from shardbook.rankd.tensor_parallel import TPShard

PROGRESS_STEPS = 50


@dataclass
class Target:
    """One stored tensor and the model tensor it fills (under every name it has, when tied)."""

    stored: StoredTensor
    tensor: torch.Tensor
    names: list[str]


def plan_reads(model: nn.Module, path: Path) -> dict[str, Target]:
    """Match every parameter and persistent buffer to a tensor in `path`'s files; each tied tensor once."""
    index = read_index(path)
    by_tensor: dict[int, list[str]] = {}
    tensors: dict[int, torch.Tensor] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        by_tensor.setdefault(id(tensor), []).append(name)
        tensors[id(tensor)] = tensor
    targets, missing = {}, []
    for key, names in by_tensor.items():
        found = [name for name in names if name in index]
        if not found:
            missing.append(" = ".join(names))
            continue
        target = Target(stored=index[found[0]], tensor=tensors[key], names=names)
        _check_shape(found[0], target)
        targets[found[0]] = target
    if missing:
        raise ValueError(
            f"{path} lacks {len(missing)} tensor(s) the model needs, e.g. {missing[:3]}; the files hold "
            f"e.g. {sorted(index)[:3]}: the checkpoint is incomplete or its names need a conversion "
            "transformers does on load, which sharded loading does not do"
        )
    return targets


def _check_shape(name: str, target: Target) -> None:
    if tuple(target.tensor.shape) != target.stored.shape:
        raise ValueError(
            f"{target.stored.file.name} holds {name} with shape {list(target.stored.shape)} but the model built "
            f"from config.json expects {list(target.tensor.shape)}: the config and the weights do not match"
        )


@torch.no_grad()
def read_shards(
    model: nn.Module, targets: dict[str, Target], device: torch.device, on_progress: Callable[[int, int], None]
) -> None:
    """Replace every target (still on the meta device) by this rank's part of its stored tensor, on `device`."""
    loaded: dict[str, torch.Tensor] = {}
    for target, source in _mapped(targets, on_progress):
        if isinstance(target.tensor, DTensor):
            tensor = _local_shard(target.tensor, source, device)
        else:  # a persistent buffer: every rank holds all of it
            tensor = source.to(device=device, dtype=target.tensor.dtype, copy=True)
        loaded.update(dict.fromkeys(target.names, tensor))
    # FSDP2 hooks load_state_dict(assign=True) to adopt each new local tensor (padding uneven ones).
    model.load_state_dict(loaded, strict=False, assign=True)


@torch.no_grad()
def read_tp_slices(
    model: nn.Module,
    targets: dict[str, Target],
    plan: dict[str, TPShard],
    rank: int,
    device: torch.device,
    on_progress: Callable[[int, int], None],
) -> None:
    """Fill a `tp` model: each sliced parameter with rank `rank`'s pieces of `plan`, the others whole."""
    for target, source in _mapped(targets, on_progress):
        shard = next((plan[name] for name in target.names if name in plan), None)
        pieces = shard.pieces[rank] if shard is not None else (range(source.shape[0]),) if source.dim() else ()
        tensor = _pieces(source, shard.dim if shard else 0, pieces, target.tensor.dtype, device)
        if isinstance(target.tensor, nn.Parameter):
            tensor = nn.Parameter(tensor, requires_grad=False)
            tensor.tp_shard = shard
        for name in target.names:  # tied names get the one tensor
            module_name, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(module_name), leaf, tensor)


def _mapped(targets: dict[str, Target], on_progress: Callable[[int, int], None]):
    """Each target with a view of its stored tensor in the mapped files, reporting progress along the way."""
    files = MappedFiles()
    every = max(1, len(targets) // PROGRESS_STEPS)
    for done, target in enumerate(targets.values(), start=1):
        yield target, files.view(target.stored)
        if done % every == 0 or done == len(targets):
            on_progress(done, len(targets))


def _pieces(
    source: torch.Tensor, dim: int, pieces: tuple[range, ...], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """`pieces` of `source` along `dim`, joined; on CPU one range of rows in the file's dtype is the mapping itself."""
    if not pieces:  # a scalar
        return source.to(device=device, dtype=dtype, copy=True)
    parts = [source.narrow(dim, piece.start, len(piece)) for piece in pieces]
    if len(parts) == 1 and dim == 0 and device.type == "cpu" and source.dtype == dtype:
        return parts[0]
    return torch.cat([part.to(device=device, dtype=dtype) for part in parts], dim=dim)


def _local_shard(param: DTensor, source: torch.Tensor, device: torch.device) -> nn.Parameter:
    """`param` over this rank's rows of `source`: the mapped rows themselves on CPU when they fit as they are."""
    rows, chunk = local_rows(param)
    mine = source.narrow(0, rows.start, len(rows))
    usable_in_place = device.type == "cpu" and mine.dtype == param.dtype and len(rows) == chunk
    if not usable_in_place:
        mine = mine.to(device=device, dtype=param.dtype, copy=True)
    sharded = DTensor.from_local(
        mine, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
    )
    return nn.Parameter(sharded, requires_grad=param.requires_grad)


def local_rows(param: DTensor) -> tuple[range, int]:
    """The rows of the whole tensor this rank holds, and the chunk size FSDP2 pads every rank's share to.

    Rows taken from the wrong place would show as logits that differ from one process (the
    multi-process tests compare them).
    """
    sharded = [(axis, placement) for axis, placement in enumerate(param.placements) if placement.is_shard()]
    total = param.shape[0]
    if not sharded:
        return range(total), total
    assert len(sharded) == 1 and sharded[0][1].dim == 0, f"FSDP2 shards dim 0 once, not {param.placements}"
    axis = sharded[0][0]
    return chunk_rows(total, param.device_mesh.size(axis), param.device_mesh.get_local_rank(axis))
