"""The commands a rank can run, dispatched by name from one table (``HANDLERS``).

Rank 0 runs the very same handler in-process for its own part of a command, so whatever the
handler does collectively lines up on every rank by construction. A handler never lets an
exception escape: the rank reports it (status, rank, exception name, message, traceback) and
stays alive for the next command.
"""

from __future__ import annotations

import logging
import sys
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from shardbook.rankd.control import protocol
from shardbook.rankd.control.capture import CellCapture, Sink, exception_text, run_cell
from shardbook.rankd.control.world import World

log = logging.getLogger(__name__)


@dataclass
class RankContext:
    """What handlers on one rank share: the world, the rank's shell and the running command."""

    world: World
    shell: Any
    capture: CellCapture | None = None
    stop_event: threading.Event = field(default_factory=threading.Event)
    state: dict[str, Any] = field(default_factory=dict)

    def set_capture(self, capture: CellCapture | None) -> None:
        self.capture = capture

    def flush_if_due(self) -> None:
        capture = self.capture
        if capture is not None:
            capture.flush_if_due()


Handler = Callable[[RankContext, dict[str, Any], Sink], dict[str, Any]]
HANDLERS: dict[str, Handler] = {}
STOPPED_BY_EVENT: set[str] = set()
"""Kinds interrupted only through ``RankContext.stop_event``: a KeyboardInterrupt at the wrong
moment would make this rank leave collectives (generation steps) that the others still run."""


def handler(kind: str, *, interrupt: str = "raise") -> Callable[[Handler], Handler]:
    """Register a ``handle_*`` function under the command kind rank 0 sends.

    ``interrupt="raise"`` turns an interrupt into KeyboardInterrupt in the rank's main thread;
    ``interrupt="event"`` only sets ``stop_event``, which the handler checks at safe points.
    """
    assert interrupt in ("raise", "event"), interrupt

    def register(fn: Handler) -> Handler:
        HANDLERS[kind] = fn
        if interrupt == "event":
            STOPPED_BY_EVENT.add(kind)
        return fn

    return register


@handler("exec")
def handle_exec(ctx: RankContext, args: dict[str, Any], sink: Sink) -> dict[str, Any]:
    """Run a cell in the rank's IPython shell, its namespace persisting between cells.

    The cell may edit weights behind their version counters: the packed copies of linear weights are dropped
    before it runs and after (`packed_linear.forget_packed`)."""
    forget_packed_weights()
    try:
        return run_cell(ctx.shell, args["code"], sink, store_history=False, on_capture=ctx.set_capture)
    finally:
        forget_packed_weights()


def forget_packed_weights() -> None:
    """`packed_linear.forget_packed`, where a load imported it (nothing is packed before; importing it here would
    import torch into a kernel that has not loaded a model)."""
    packed_linear = sys.modules.get("shardbook.rankd.parallel.packed_linear")
    if packed_linear is not None:
        packed_linear.forget_packed()


def error_payload(exc: BaseException, rank: int) -> dict[str, Any]:
    return {
        "ename": type(exc).__name__,
        "evalue": exception_text(exc),
        "traceback": [f"[rank {rank}] " + line for line in traceback.format_exception(exc)],
    }


def dispatch(ctx: RankContext, kind: str, args: dict[str, Any], sink: Sink) -> dict[str, Any]:
    """Run the handler for ``kind``; any exception (or an interrupt) becomes an error reply."""
    fn = HANDLERS.get(kind)
    try:
        if fn is None:
            raise protocol.ProtocolError(f"unknown command {kind!r}; known: {', '.join(sorted(HANDLERS))}")
        return fn(ctx, args, sink)
    except (Exception, KeyboardInterrupt) as e:
        log.debug("rank %d: %s failed", ctx.world.rank, kind, exc_info=True)
        error = error_payload(e, ctx.world.rank)
        sink(protocol.ERROR, error)
        return {"status": "error", "error": error}
