"""How a model is laid out over the ranks: the device mesh, the decode layout choice, and FSDP2 applied in one place.

Every function here runs identically on every rank; the only collectives are the ones
`init_device_mesh` makes to create process groups.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable

import psutil
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard

# Keeping the gathered layers after forward means a full copy of the weights per rank; the
# loader chooses it only when that copy takes at most this share of the memory free per rank.
KEEP_GATHERED_MAX_SHARE = 0.5


def fsdp_mesh_layout(fsdp_size: int, world_size: int) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """Mesh shape and axis names: ("shard",) for FSDP over the world, ("replicate", "shard") for HSDP.

    `fsdp_size` -1 means every rank. With fewer, each group of `fsdp_size` consecutive ranks
    holds one sharded copy and the groups replicate each other (HSDP).
    """
    size = world_size if fsdp_size == -1 else fsdp_size
    if size < 1 or world_size % size != 0:
        raise ValueError(
            f"parallel.fsdp_size={fsdp_size} does not divide the world size {world_size}: "
            f"use -1 (all {world_size} ranks) or a divisor of {world_size}"
        )
    if size == world_size:
        return (world_size,), ("shard",)
    return (world_size // size, size), ("replicate", "shard")


def chunk_rows(total: int, parts: int, index: int) -> tuple[range, int]:
    """The rows of `total` that part `index` of `parts` holds, and the chunk size every part is padded to.

    FSDP2 splits dim 0 as `torch.chunk` does: chunks of ceil(total / parts) rows, the last ones
    shorter or empty. Loading (which rows a rank reads) and `%shards` (what each rank holds) both
    use this.
    """
    chunk = -(-total // parts)
    start = min(index * chunk, total)
    return range(start, min(start + chunk, total)), chunk


_MESHES: dict[tuple, DeviceMesh] = {}
"""Every mesh made so far, by (device type, shape, axes): a load reuses the mesh of an earlier one with its layout."""


def init_mesh(device_type: str, shape: tuple[int, ...], axes: tuple[str, ...]) -> DeviceMesh:
    """The device mesh for this layout: made once (a collective: every rank must call it), then reused.

    Each new mesh makes process groups that nothing destroys, and destroying them when a model is
    freed is not safe: torch caches meshes by equality (the same layout's next mesh would be found
    there, its groups gone). So each layout's mesh is made once; ten reloads add no group. Every
    rank loads the same sequence of layouts, so every rank finds the same meshes here.
    """
    key = (device_type, tuple(shape), tuple(axes))
    mesh = _MESHES.get(key)
    if mesh is None or not _alive(mesh):
        mesh = _MESHES[key] = init_device_mesh(device_type, shape, mesh_dim_names=axes)
    return mesh


def _alive(mesh: DeviceMesh) -> bool:
    """The mesh's groups still exist (a process group destroyed and started again makes every mesh stale)."""
    try:
        return all(mesh.get_group(axis) in dist.distributed_c10d._world.pg_map for axis in range(mesh.ndim))
    except (RuntimeError, ValueError, KeyError):
        return False


def expert_group(device_type: str, set_size: int, parts: int, tp_group: dist.ProcessGroup) -> dist.ProcessGroup:
    """This rank's expert-set group, from a mesh (the tensor-parallel group itself when a set spans it).

    Expert sets are `set_size` consecutive ranks (tensor-parallel groups are consecutive too), so
    they are the inner axis of a (world / set_size, set_size) mesh, made once like every mesh here.
    """
    if set_size == parts:
        return tp_group
    world = dist.get_world_size()
    return init_mesh(device_type, (world // set_size, set_size), ("expert_sets", "expert")).get_group("expert")


def gather_fits(full_bytes: int, device: torch.device) -> tuple[bool, str]:
    """This rank's view of the automatic rule: can it keep a full gathered copy of the weights?

    Measured on 2 CPU ranks with SmolLM2-135M: keeping layers gathered decodes at 8.6 tok/s,
    resharding after every layer at 0.87 tok/s, because each token then all-gathers every layer.
    So the rule keeps them gathered whenever the full copy is at most half the free memory.
    """
    free = free_memory_per_rank(device)
    fits = full_bytes <= KEEP_GATHERED_MAX_SHARE * free
    verb = "fits" if fits else "does not fit"
    return fits, (
        f"the gathered model ({_gib(full_bytes)}) {verb} in half of the memory free per rank "
        f"({_gib(free)} on {device.type})"
    )


def choose_layout(requested: str, views: list[tuple[bool, str]], tp_unavailable: str | None) -> tuple[str, str]:
    """Resolve `parallel.decode` (same answer on every rank): the layout and why.

    `views` are every rank's `gather_fits`; `tp_unavailable` says why this model cannot run `tp`
    (None when it can). `auto` keeps the gathered model when every rank has room for it (fastest),
    else `tp`, and `reshard` only for a model `tp` does not support.
    """
    if requested != "auto":
        if requested == "tp" and tp_unavailable:
            raise ValueError(tp_unavailable)
        return requested, "set by parallel.decode"
    misfits = [rank for rank, (fits, _) in enumerate(views) if not fits]
    if not misfits:
        return "gather", f"{views[0][1]}: keep layers gathered after forward (fastest decoding)"
    why = f"on rank {misfits[0]} {views[misfits[0]][1]}"
    if tp_unavailable:
        return "reshard", f"{why}, and tensor parallel is not available ({tp_unavailable}): reshard after forward"
    return "tp", f"{why}: tensor parallel (weights stay in their shards, activations move)"


def free_memory_per_rank(device: torch.device) -> int:
    """Bytes this rank may still use: free device memory, or on CPU the host's share per local rank."""
    if device.type == "cpu":
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", torch.distributed.get_world_size()))
        return psutil.virtual_memory().available // max(1, local_ranks)
    module = getattr(torch, device.type)
    free, _total = module.mem_get_info(device)
    return int(free)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The blocks to shard one by one: modules of the classes transformers never splits, else the largest ModuleList."""
    block_names = set(getattr(model, "_no_split_modules", None) or ())
    blocks = [m for m in model.modules() if type(m).__name__ in block_names]
    if blocks:
        return blocks
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    return list(max(lists, key=len)) if lists else []


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    reshard_after_forward: bool,
    on_group: Callable[[int, int], None],
) -> None:
    """Shard `model` with FSDP2, in place; `on_group(done, total)` reports each group sharded.

    The fixed order (torchtitan's): tensor parallel, activation checkpointing, compile, FSDP per
    block, FSDP on the root. Inference here has no tensor parallel, no checkpointing and no
    compile, so only the last two steps run.
    """
    layers = decoder_layers(model)
    total = len(layers) + 1
    # FSDP per decoder block: one all-gather per block, freed (or kept) after its forward.
    for done, layer in enumerate(layers, start=1):
        for island in dtype_islands(layer):  # a group of its own: FSDP2 gathers one dtype per group
            fully_shard(island, mesh=mesh, reshard_after_forward=reshard_after_forward)
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard_after_forward)
        on_group(done, total)
    # FSDP on the root: embeddings, final norm and lm_head (tied ones stay one parameter).
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward)
    on_group(total, total)


def dtype_islands(block: nn.Module) -> list[nn.Module]:
    """Submodules of `block` whose own parameters are not in the block's main dtype.

    Models keep some weights in float32 whatever the load's dtype (DeepSeek-V3's and GLM's router
    `gate.weight`, `_keep_in_fp32_modules_strict`); FSDP2 all-gathers a group in one dtype and
    refuses a bf16 block holding one, so each such module is sharded as a group of its own.
    """
    counts = Counter(p.dtype for p in block.parameters())
    if len(counts) < 2:
        return []
    main = counts.most_common(1)[0][0]
    return [
        module
        for module in block.modules()
        if module is not block and any(p.dtype != main for p in module.parameters(recurse=False))
    ]


def reshard_model(model: nn.Module) -> None:
    """Free the gathered weights ``reshard_after_forward=False`` keeps, back to this rank's shards.

    Purely local (no collective), but every rank must do it together: the next forward then
    all-gathers on every rank alike.
    """
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def _gib(num_bytes: float) -> str:
    return f"{num_bytes / 2**30:.2f} GiB"
