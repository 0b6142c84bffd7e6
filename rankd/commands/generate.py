"""The ``generate`` command: one chat reply, with every rank stepping together through the engine.

Rank 0 sends the whole request (messages, settings, a seed) with every turn; this handler runs it on each rank
and streams the text from one of them (``stream_rank``).
"""

from __future__ import annotations

from typing import Any

from shardbook.rankd.control import protocol
from shardbook.rankd.control.agreement import refuse
from shardbook.rankd.control.capture import Sink
from shardbook.rankd.control.dispatch import RankContext, handler


@handler("generate", interrupt="event")
def handle_generate(ctx: RankContext, args: dict[str, Any], sink: Sink) -> dict[str, Any]:
    """Generate one reply with every rank stepping together; the ``stream_rank`` streams its text.

    Every rank first agrees that it can run the request (see :mod:`.agreement`), so a rank that
    cannot never leaves the others waiting inside ``generate``.
    """
    from shardbook.rankd.generation.engine import PLAN_WORDS, GenerationRequest, generate  # lazily, as in `load`
    from shardbook.rankd.inspection.interventions import raise_failures

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
        loaded.model,
        loaded.tokenizer,
        request,
        device=next(loaded.model.parameters()).device,
        on_text=on_text if streams else None,
        stop_event=ctx.stop_event,
    )
    raise_failures(loaded.model)  # an intervention that raised during this reply fails it on that rank
    return {"status": "ok", "value": result.to_dict()}


@handler("batch", interrupt="event")
def handle_batch(ctx: RankContext, args: dict[str, Any], sink: Sink) -> dict[str, Any]:
    """Run the continuous batch: rank 0 plans and broadcasts each step from its scheduler, followers execute.

    Rank 0's scheduler (``ctx.state["batch_scheduler"]``) holds the submitted sequences; the command ends on
    every rank when nothing runs or waits. An interrupt stops every sequence (rank 0 decides, at its next step).
    """
    from shardbook.rankd.generation.batching import follow_batch

    loaded = ctx.state.get("loaded")
    if loaded is None:
        raise ValueError(f"rank {ctx.world.rank} has no model loaded: run %load_sharded first")
    device = next(loaded.model.parameters()).device
    if ctx.world.rank == 0:
        steps = ctx.state["batch_scheduler"].run(loaded.model, device, stop_event=ctx.stop_event)
    else:
        steps = follow_batch(loaded.model, device)
    return {"status": "ok", "value": {"steps": steps}}  # an intervention's failure failed its rows at its step
