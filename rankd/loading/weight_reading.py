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

import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from shardbook.rankd.loading.checkpoint_names import ExpertStack, Selection, checkpoint_sources, select
from shardbook.rankd.loading.dequantize import QuantizedTensor
from shardbook.rankd.loading.fp8_keep import FP8Keeping
from shardbook.rankd.loading.quantized_formats import dequantizing_index
from shardbook.rankd.loading.safetensors_files import MappedFiles, StoredTensor, read_index
from shardbook.rankd.parallel.layout import chunk_rows
from shardbook.rankd.parallel.tp_modules import TPShard

PROGRESS_STEPS = 50


@dataclass
class Target:
    """One stored tensor and the model tensor it fills (under every name it has, when tied)."""

    stored: StoredTensor | QuantizedTensor | ExpertStack
    tensor: torch.Tensor
    names: list[str]


def plan_reads(model: nn.Module, path: Path) -> dict[str, Target]:
    """Match every parameter and persistent buffer to what fills it in `path`'s files; each tied tensor once.

    Names go through transformers' conversion mapping first (`checkpoint_names`), so the fused
    experts of a mixture-of-experts model are matched to their per-expert tensors.
    """
    index = checkpoint_sources(model, dequantizing_index(read_index(path), model.config))
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
            f"e.g. {sorted(index)[:3]}: the checkpoint is incomplete, or it was saved for another architecture"
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
    for target, read in _readers(targets, on_progress):
        if isinstance(target.tensor, DTensor):
            tensor = _local_shard(target.tensor, read, device)
        else:  # a persistent buffer: every rank holds all of it
            tensor = read(_whole(target.tensor), target.tensor.dtype, device).clone()
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
    keeping: FP8Keeping | None = None,
) -> None:
    """Fill a `tp` model: each sliced parameter with rank `rank`'s selection in `plan`, the others whole.

    With `keeping`, the linear weights stored as FP8 blocks are held as their codes and scales (`fp8_keep`).
    """
    for target, read in _readers(targets, on_progress):
        shard = next((plan[name] for name in target.names if name in plan), None)
        selection = shard.selections[rank] if shard is not None else _whole(target.tensor)
        module = keeping.module_of(model, target.names, target.stored) if keeping is not None else None
        if module is not None:
            tensor = keeping.keep(module, target.names[0], target.stored, selection, device)
        else:
            tensor = read(selection, target.tensor.dtype, device)
        if isinstance(target.tensor, nn.Parameter):
            tensor = nn.Parameter(tensor, requires_grad=False)
            tensor.tp_shard = shard
        for name in target.names:  # tied names get the one tensor
            module_name, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(module_name), leaf, tensor)


Reader = Callable[[Selection, torch.dtype, torch.device], torch.Tensor]
"""`read(selection, dtype, device)`: a selection of one stored (or fused) tensor, on `device` in `dtype`."""


def _readers(targets: dict[str, Target], on_progress: Callable[[int, int], None]):
    """Each target with a `Reader` over the mapped files, reporting progress along the way."""
    files = MappedFiles()
    every = max(1, len(targets) // PROGRESS_STEPS)
    for done, target in enumerate(targets.values(), start=1):
        stored = target.stored
        if isinstance(stored, (ExpertStack, QuantizedTensor)):
            yield target, functools.partial(stored.read, files)
        else:
            yield target, functools.partial(_read_stored, files.view(stored))
        if done % every == 0 or done == len(targets):
            on_progress(done, len(targets))


def _read_stored(source: torch.Tensor, selection: Selection, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`selection` of a mapped tensor: on CPU, in the file's dtype and contiguous, the mapping itself; else a copy."""
    mine = select(source, selection)
    in_place = device.type == "cpu" and mine.dtype == dtype and mine.is_contiguous()
    return mine if in_place else mine.to(device=device, dtype=dtype).contiguous()


def _whole(tensor: torch.Tensor) -> Selection:
    return (None,) * tensor.dim()


def _local_shard(param: DTensor, read: Reader, device: torch.device) -> nn.Parameter:
    """`param` over this rank's rows: the mapped rows themselves on CPU when they fit as they are, else a copy."""
    rows, chunk = local_rows(param)
    mine = read(((rows,), *([None] * (param.dim() - 1))), param.dtype, device)
    if len(rows) != chunk and mine.untyped_storage().nbytes() > mine.nbytes:  # FSDP2 pads it: a view must not be padded
        mine = mine.clone()
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
