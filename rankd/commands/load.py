"""Command handlers that load the rank's model and put it back to its shards: ``load`` and ``reshard``.

Each rank keeps its loaded model in its shell's namespace as ``model`` and ``tokenizer`` (so
``%%all`` cells can inspect the shards) and in ``RankContext.state`` for the engine.
"""

from __future__ import annotations

from typing import Any

from shardbook.rankd.config.parsing import config_from_dict
from shardbook.rankd.control import protocol
from shardbook.rankd.control.capture import Sink
from shardbook.rankd.control.dispatch import RankContext, handler
from shardbook.rankd.control.world import load_device


@handler("load", interrupt="event")
def handle_load(ctx: RankContext, args: dict[str, Any], sink: Sink) -> dict[str, Any]:
    """Load the configured checkpoint sharded over every rank, in place of the model loaded now (see `reload`).

    Interrupted through the stop event only: a KeyboardInterrupt could take one rank out of a
    sync point that the others still wait in; the load stops every rank at a safe point instead.
    """
    from shardbook.rankd.loading.reload import replace_model  # lazily: torch and transformers cost seconds at start-up

    config = config_from_dict(args["config"], source="the kernel's load command")

    def progress(step: str, done: int, total: int) -> None:
        sink(protocol.PROGRESS, {"step": step, "done": done, "total": total})

    def notice(text: str) -> None:
        sink(protocol.STREAM, {"name": "stderr", "text": f"[shardbook] {text}\n"})

    device = load_device(config.parallel.device, ctx.world)
    loaded = replace_model(ctx, config, device=device, model_path=args["model_path"], progress=progress, notice=notice)
    return {"status": "ok", "value": loaded.summary}


@handler("reshard")
def handle_reshard(ctx: RankContext, args: dict[str, Any], sink: Sink) -> dict[str, Any]:
    """Put the model back to its shards on this rank (every rank at once, so the next forward gathers alike).

    With ``reshard_after_forward=False`` the weights stay gathered after a reply, for speed; the
    parameters are then plain tensors. ``%shards`` reshards first so it reads DTensor metadata.
    """
    from shardbook.rankd.parallel.layout import reshard_model

    loaded = ctx.state.get("loaded")
    if loaded is not None:
        reshard_model(loaded.model)
    return {"status": "ok"}
