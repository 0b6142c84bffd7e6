"""Command handlers for inspecting the loaded model: ``trace``, ``full_parameter``, ``intervene`` and ``share``.

Each runs on every rank at once (rank 0 in-process); rank 0's reply carries whole tensors in
its own process, the followers' replies only small JSON summaries. Tensors move between ranks
on the data plane (torch.distributed), never through the control plane. Each is one short
collective step, so an interrupt lets it finish on every rank (a KeyboardInterrupt on one rank
inside a gather would leave the others waiting in it).
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from shardbook.rankd.control.capture import Sink
from shardbook.rankd.control.dispatch import RankContext, handler

SHAREABLE = "a tensor, or a dict of name -> tensor (a %%trace result, say)"


def loaded_model(ctx: RankContext):
    loaded = ctx.state.get("loaded")
    if loaded is None:
        raise ValueError(f"rank {ctx.world.rank} has no model loaded: run %load_sharded first")
    return loaded


@handler("trace", interrupt="event")
def handle_trace(ctx: RankContext, args: dict[str, Any], sink: Sink) -> dict[str, Any]:
    """One forward capturing the chosen modules; rank 0's value is the whole `Trace`."""
    from shardbook.rankd.inspection.tracing import trace

    loaded = loaded_model(ctx)
    if args.get("prompts") is not None:
        from shardbook.rankd.inspection.batched import trace_many

        value = trace_many(loaded.model, loaded.tokenizer, args, ctx.shell.user_ns, ctx.stop_event)
        return {"status": "ok", "value": value}
    return {"status": "ok", "value": trace(loaded.model, loaded.tokenizer, args, ctx.shell.user_ns)}


@handler("patch", interrupt="event")
def handle_patch(ctx: RankContext, args: dict[str, Any], sink: Sink) -> dict[str, Any]:
    """An activation-patching sweep (or attribution patching); every rank computes the same table."""
    from shardbook.rankd.inspection.patching import patch_sweep

    loaded = loaded_model(ctx)
    return {"status": "ok", "value": patch_sweep(loaded.model, loaded.tokenizer, args, ctx.shell.user_ns)}


@handler("full_parameter", interrupt="event")
def handle_full_parameter(ctx: RankContext, args: dict[str, Any], sink: Sink) -> dict[str, Any]:
    """The whole parameter `args["name"]` on rank 0 (on CPU), within `args["max_bytes"]`."""
    from shardbook.rankd.parallel.wholes import full_parameter_on_rank0, parameter_bytes

    model = loaded_model(ctx).model
    params = dict(model.named_parameters())
    name = args["name"]
    if name not in params:
        close = difflib.get_close_matches(name, list(params), n=3, cutoff=0.5)
        hint = f"; did you mean {', '.join(close)}?" if close else "; %shards lists them"
        raise ValueError(f"the model has no parameter named {name!r}{hint}")
    size = parameter_bytes(params[name])
    if size > args["max_bytes"]:
        raise ValueError(
            f"{name} is {size / 2**20:.1f} MiB whole, over the limit of {args['max_bytes'] / 2**20:.1f} MiB: "
            "pass a larger max_mb if rank 0 has room for it, or look at a slice in %%all"
        )
    whole = full_parameter_on_rank0(model, params[name])
    value = whole.detach().cpu().clone() if whole is not None else {"shape": list(params[name].shape)}
    return {"status": "ok", "value": value}


@handler("intervene", interrupt="event")
def handle_intervene(ctx: RankContext, args: dict[str, Any], sink: Sink) -> dict[str, Any]:
    """Add (by the name of a function in this rank's namespace), remove, or list the interventions."""
    from shardbook.rankd.inspection import interventions
    from shardbook.rankd.inspection.tracing import match_modules

    model = loaded_model(ctx).model
    action = args["action"]
    if action == "add":
        modules = match_modules(model, args["modules"])
        interventions.add(model, ctx.shell.user_ns, args["name"], modules, args.get("input", False))
    elif action == "remove":
        removed = interventions.remove(model, args.get("name"))
        if args.get("name") and not removed:
            known = ", ".join(interventions.registry(model)) or "none"
            raise ValueError(f"no intervention named {args['name']!r} (registered: {known})")
    return {"status": "ok", "value": [iv.describe() for iv in interventions.registry(model).values()]}


@handler("share", interrupt="event")
def handle_share(ctx: RankContext, args: dict[str, Any], sink: Sink) -> dict[str, Any]:
    """Copy rank 0's ``args["name"]`` (tensors, described in ``args["entries"]``) into every rank's namespace."""
    namespace = ctx.shell.user_ns
    name, entries = args["name"], args["entries"]
    device = _device(ctx)
    received = {}
    for key, entry in entries.items():  # only rank 0 reads its namespace: the others have no such name yet
        if dist.get_rank() == 0:
            source = namespace[name] if key == "" else namespace[name][key]
            tensor = source.detach().to(device).contiguous()
        else:
            tensor = torch.empty(entry["shape"], dtype=getattr(torch, entry["dtype"]), device=device)
        if dist.get_world_size() > 1:
            dist.broadcast(tensor, src=0)
        received[key] = tensor
    if dist.get_rank() != 0:
        namespace[name] = received[""] if list(entries) == [""] else received
    return {"status": "ok", "value": sorted(entries)}


def describe_shareable(value: Any, name: str) -> dict[str, dict[str, Any]]:
    """`share`'s entries for `value` (rank 0 calls it before sending): key -> shape and dtype; "" for one tensor."""
    items = {"": value} if isinstance(value, torch.Tensor) else dict(value) if isinstance(value, Mapping) else None
    if (
        items is None
        or not all(isinstance(t, torch.Tensor) for t in items.values())
        or not all(isinstance(k, str) for k in items)
    ):
        raise ValueError(f"{name} is a {type(value).__name__}; share needs {SHAREABLE}")
    return {k: {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")} for k, t in items.items()}


def _device(ctx: RankContext) -> torch.device:
    loaded = ctx.state.get("loaded")
    return next(loaded.model.parameters()).device if loaded is not None else torch.device("cpu")
