"""The kernel's stop button: the reply in flight stops directly; SIGINT only reaches cell code that needs it.

ipykernel turns every ``interrupt_request`` into a SIGINT, which raises KeyboardInterrupt wherever
rank 0's main thread happens to be: in the cell, but also in the code that records a chat turn, or in
IPython's and ipykernel's own code right after a cell when the button is pressed several times (the
cell then ends with a traceback, or its reply is never sent and it looks stuck), and not at all in an
idle kernel (an HTTP reply would not stop). Here the handler stops the reply the cell waits for
(``kernel/ranks/foreground.py``: a ``%%chat`` cell's, ``ChatModel``'s), on the batch or alone, and sends
nothing else; without one, it stops the running cell's own work in the generation queue (the
continuous batch's sequences that cell submitted; an HTTP client's requests run on, alone or in the
batch: its client or the server stops them), then sends the SIGINT only while a cell runs user code.
A cell that is only a ``%%chat`` magic runs no user code: once its reply has started, no press becomes
a SIGINT there.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from shardbook.kernel.ranks import foreground
from shardbook.kernel.ranks.generation_queue import CHAT_SOURCE, HTTP_SOURCE, GenerationQueue


class CellActivity:
    """Whether the shell runs a cell's code: between IPython's ``pre_run_cell`` and ``post_run_cell`` events.

    Counted, not flagged: rank 0's part of ``%%all`` runs the cell in the same shell, a nested
    run whose end must not look like the end of the notebook's cell.
    """

    def __init__(self, shell: Any):
        self.depth = 0
        self.chat_cell = False
        """The cell is a ``%%chat`` cell magic, with no code of the user's around it."""
        self.replies_before = 0
        shell.events.register("pre_run_cell", self._started)
        shell.events.register("post_run_cell", self._ended)

    @property
    def running(self) -> bool:
        return self.depth > 0

    @property
    def chat_replied(self) -> bool:
        """Whether the running cell is a ``%%chat`` cell whose reply has started (all that is left is its end)."""
        return self.running and self.chat_cell and foreground.num_entered() > self.replies_before

    def _started(self, info: Any) -> None:
        if self.depth == 0:
            self.chat_cell = (getattr(info, "raw_cell", None) or "").lstrip().startswith("%%chat")
            self.replies_before = foreground.num_entered()
            foreground.cell_started()
        self.depth += 1

    def _ended(self, result: Any) -> None:
        self.depth = max(0, self.depth - 1)  # a cell that failed before it started fires only the end
        if self.depth == 0:
            foreground.cell_ended()


def install_interrupt_hook(shell: Any, generation_queue: Callable[[], GenerationQueue | None]) -> None:
    """Wrap the kernel's ``interrupt_request`` handlers (shell and control channels) once; no kernel, nothing.

    Installed before the first cell (the ranks start in a thread meanwhile), so it sees every cell start;
    ``generation_queue`` gives the runtime's queue, or None while there is none.
    """
    kernel = getattr(shell, "kernel", None)
    if kernel is None or not hasattr(kernel, "control_handlers") or getattr(kernel, "_shardbook_interrupt_hook", False):
        return
    activity = CellActivity(shell)
    for table in (kernel.shell_handlers, kernel.control_handlers):
        original = table.get("interrupt_request")
        if original is not None:
            table["interrupt_request"] = _stop_reply_first(kernel, original, generation_queue, activity)
    kernel._shardbook_interrupt_hook = True


def _stop_reply_first(
    kernel: Any, original, generation_queue: Callable[[], GenerationQueue | None], activity: CellActivity
):
    async def interrupt_request(stream, ident, parent):
        replied = activity.chat_replied  # read first: a reply that starts meanwhile is stopped below, or by SIGINT
        if not (foreground.stop_foreground_reply() or replied):
            queue = generation_queue()
            stopped = queue.stop_running(spare=(HTTP_SOURCE,)) if queue is not None else None
            if activity.running and (stopped is None or stopped.source != CHAT_SOURCE):
                result = original(stream, ident, parent)  # SIGINT for the cell's own code
                if inspect.isawaitable(result):
                    await result
                return
        kernel.session.send(stream, "interrupt_reply", {"status": "ok"}, parent, ident=ident)

    return interrupt_request
