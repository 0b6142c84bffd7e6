"""Command handlers that act on the rank's model: ``load`` (and, as they land, generation).

Each rank keeps its loaded model in its shell's namespace as ``model`` and ``tokenizer`` (so
``%%all`` cells can inspect the shards) and in ``RankContext.state`` for the engine.
"""

from __future__ import annotations

from typing import Any

from . import protocol
from .agreement import refuse
from .capture import Sink
from .config import ShardbookConfig
from .handlers import RankContext, handler
from .world import load_device


@handler("load", interrupt="event")
def handle_load(ctx: RankContext, args: dict[str, Any], sink: Sink) -> dict[str, Any]:
    """Load the configured checkpoint sharded over every rank, in place of the model loaded now (see `reload`).

    Interrupted through the stop event only: a KeyboardInterrupt could take one rank out of a
    sync point that the others still wait in; the load stops every rank at a safe point instead.
    """
    from .reload import replace_model

    config = ShardbookConfig.from_dict(args["config"], source="the kernel's load command")

    def progress(step: str, done: int, total: int) -> None:
        sink(protocol.PROGRESS, {"step": step, "done": done, "total": total})

    def notice(text: str) -> None:
        sink(protocol.STREAM, {"name": "stderr", "text": f"[shardbook] {text}\n"})

    device = load_device(config.parallel.device, ctx.world)
    loaded = replace_model(ctx, config, device=device, model_path=args["model_path"], progress=progress, notice=notice)
    return {"status": "ok", "value": loaded.summary}


@handler("generate", interrupt="event")
def handle_generate(ctx: RankContext, args: dict[str, Any], sink: Sink) -> dict[str, Any]:
    """Generate one reply with every rank stepping together; the ``stream_rank`` streams its text.

    Every rank first agrees that it can run the request (see :mod:`.agreement`), so a rank that
    cannot never leaves the others waiting inside ``generate``.
    """
    from .engine import PLAN_WORDS, GenerationRequest, generate
    from .interventions import raise_failures

    loaded = ctx.state.get("loaded")
    try:  # what fails here fails before generate's agreement: join it anyway, so no rank waits alone
        if loaded is None:
            raise ValueError(f"rank {ctx.world.rank} has no model loaded: run %load_sharded first")
        request = GenerationRequest.from_dict(args["request"])
    except Exception as e:
        refuse(e, PLAN_WORDS)

    def on_text(text: str) -> None:
        sink(protocol.TEXT, {"text": text})

    streams = args.get("stream_rank", 0) == ctx.world.rank
    result = generate(
        loaded.model, loaded.tokenizer, request,
        device=next(loaded.model.parameters()).device, on_text=on_text if streams else None, stop_event=ctx.stop_event,
    )
    raise_failures(loaded.model)  # an intervention that raised during this reply fails it on that rank
    return {"status": "ok", "value": result.to_dict()}


@handler("reshard")
def handle_reshard(ctx: RankContext, args: dict[str, Any], sink: Sink) -> dict[str, Any]:
    """Put the model back to its shards on this rank (every rank at once, so the next forward gathers alike).

    With ``reshard_after_forward=False`` the weights stay gathered after a reply, for speed; the
    parameters are then plain tensors. ``%shards`` reshards first so it reads DTensor metadata.
    """
    from .layout import reshard_model

    loaded = ctx.state.get("loaded")
    if loaded is not None:
        reshard_model(loaded.model)
    return {"status": "ok"}
