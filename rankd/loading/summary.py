"""The summary of a sharded load: what was loaded, how it is laid out, and what it costs each rank.

Every rank measures its own figures (`rank_figures`); the load gathers them at its last sync
point, and every rank then builds the same summary from them (`load_summary`, no collective);
the kernel shows rank 0's.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from shardbook.rankd.control.world import memory_in_use
from shardbook.rankd.loading.checkpoint_names import ExpertStack
from shardbook.rankd.loading.dequantize import QuantizedTensor
from shardbook.rankd.parallel.attention_split import kv_cache_bytes_per_token
from shardbook.rankd.parallel.fp8_experts import SCALES, FP8Experts
from shardbook.rankd.parallel.fp8_linear import FP8Linear
from shardbook.rankd.parallel.tensor_parallel import attention_splits
from shardbook.rankd.parallel.tp_modules import global_numel, tp_shard_of


def local_param_bytes(model: nn.Module) -> int:
    """Bytes of the parameters this rank holds (its shards; tied parameters counted once)."""
    return sum(_local(p).numel() * p.element_size() for p in model.parameters())


def full_param_bytes(model: nn.Module) -> int:
    """Bytes of the whole model's parameters, unsharded (tied parameters counted once)."""
    return sum(global_numel(p) * p.element_size() for p in model.parameters())


KV_CACHE_SHARE = 0.5
"""Share of a rank's free memory (after the load) the continuous batch's KV cache may take; the rest is for
activations and everything else."""


def rank_figures(model: nn.Module, device: torch.device, load_seconds: float) -> dict[str, Any]:
    """This rank's share of the summary: its parameter bytes, its memory and its load time."""
    return {"local_param_bytes": local_param_bytes(model), "seconds": load_seconds, **memory_in_use(str(device))}


def load_summary(
    model: nn.Module,
    every: list[dict[str, Any]],
    *,
    architecture: str,
    path: str,
    mesh: DeviceMesh,
    device: torch.device,
    decode: str,
    decode_reason: str,
) -> dict[str, Any]:
    """Architecture, sizes, layout, per-rank memory and the slowest rank's time, from every rank's `rank_figures`."""
    return {
        "architecture": architecture,
        "model_path": path,
        "num_parameters": sum(global_numel(p) for p in model.parameters()),
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "device": device.type,
        "world_size": len(every),
        "mesh_shape": list(mesh.shape),
        "mesh_axes": list(mesh.mesh_dim_names or ()),
        "full_param_bytes": full_param_bytes(model),
        "local_param_bytes": [rank["local_param_bytes"] for rank in every],
        "rss_bytes": [rank["rss"] for rank in every],
        "device_bytes": [rank.get("device") for rank in every],
        "load_seconds": round(max(rank["seconds"] for rank in every), 3),
        "decode": decode,
        "decode_reason": decode_reason,
    }


def checkpoint_figures(targets: dict[str, Any]) -> dict[str, Any]:
    """What the files hold against what the ranks hold: the bytes read from disk, and the quantized weights by format.

    `targets` are `weight_reading.plan_reads`' (stored tensors, quantized ones and expert stacks of either).
    """
    on_disk, formats = 0, {}
    for target in targets.values():
        stored = target.stored
        parts = [p for part in stored.parts for p in part] if isinstance(stored, ExpertStack) else [stored]
        for part in parts:
            if isinstance(part, QuantizedTensor):
                on_disk += part.stored_bytes
                formats[part.format] = formats.get(part.format, 0) + 1
            else:
                on_disk += part.nbytes
    return {"checkpoint_bytes": on_disk, "quantized_tensors": formats}


def fp8_figures(model: nn.Module, note: str) -> dict[str, Any]:
    """What `model.fp8_weights` came to: the linear layers and fused expert tensors holding FP8 codes (grouped by
    name with layer numbers as `*`), how many of each compute with torch's kernel, and this rank's bytes of their
    scales. Empty for the default."""
    if not note:
        return {}
    kept: dict[str, int] = {}
    counts = {"fp8_kept_modules": 0, "fp8_kernel_modules": 0, "fp8_kept_experts": 0, "fp8_kernel_experts": 0}
    scale_bytes = 0
    for name, module in model.named_modules():
        key = ".".join("*" if part.isdigit() else part for part in name.split("."))
        if isinstance(module, FP8Linear):
            held = {key: (module.weight_scale_inv, module.fp8_kernel)}
            kind = "modules"
        elif isinstance(module, FP8Experts):
            held = {f"{key}.{w}": (getattr(module, w + SCALES), on[2]) for w, on in module.fp8_layout.items()}
            kind = "experts"
        else:
            continue
        for what, (scales, kernel) in held.items():
            kept[what] = kept.get(what, 0) + 1
            counts[f"fp8_kept_{kind}"] += 1
            counts[f"fp8_kernel_{kind}"] += kernel
            scale_bytes += scales.numel() * scales.element_size()
    return {"fp8_weights": note, "fp8_kept": kept, **counts, "fp8_scale_bytes": scale_bytes}


def tp_figures(model: nn.Module, parts: int) -> dict[str, Any]:
    """What the `tp` layout costs each rank beyond its slices: the modules kept whole (grouped by name with layer
    numbers as `*`; every rank holds each of them in full)."""
    replicated: dict[str, int] = {}
    for name, param in model.named_parameters():
        if tp_shard_of(param) is None:
            key = ".".join("*" if part.isdigit() else part for part in name.split("."))
            replicated[key] = replicated.get(key, 0) + param.numel() * param.element_size()
    return {
        "replicated_param_bytes": sum(replicated.values()),
        "replicated_bytes": dict(sorted(replicated.items(), key=lambda item: -item[1])),
    }


def kv_cache_figures(model: nn.Module, free: list[int], tp_parts: int | None) -> dict[str, Any]:
    """The KV cache one token adds on each rank, and how many tokens the continuous batch may hold.

    `kv_cache_bytes_per_token[r]` covers every layer on rank r (under `tp` its heads, `tp_parts` ranks to a
    tensor-parallel group; otherwise every head on every rank). `kv_cache_tokens` is the smallest, over the
    ranks, of `KV_CACHE_SHARE` of the rank's free memory after the load (`free`, per rank) divided by its
    bytes per token. Empty for a model whose layers shardbook cannot read this from (no budget beyond the
    model's context then).
    """
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        return {}
    size = next(model.parameters()).element_size()
    splits = attention_splits(model, tp_parts) if tp_parts else [None] * len(layers)
    per_token = [kv_cache_bytes_per_token(model, splits, r, size) for r in range(tp_parts or 1)]
    per_rank = [per_token[r % len(per_token)] for r in range(len(free))]
    if not any(per_rank):  # no layer keeps a cache that grows (linear attention only)
        return {"kv_cache_bytes_per_token": per_token}
    tokens = [int(KV_CACHE_SHARE * f) // max(1, b) for f, b in zip(free, per_rank)]
    least = min(range(len(tokens)), key=tokens.__getitem__)
    return {
        "kv_cache_bytes_per_token": per_token,
        "kv_cache_tokens": tokens[least],
        "kv_cache_tokens_reason": (
            f"{KV_CACHE_SHARE:.0%} of rank {least}'s free memory after the load "
            f"({free[least] / 2**30:.1f} GiB) at {per_rank[least]:,} bytes per token"
        ),
    }


def _local(param: torch.Tensor) -> torch.Tensor:
    return param.to_local() if isinstance(param, DTensor) else param
