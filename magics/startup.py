"""What happened while the kernel started, told to the user once a frontend can listen.

The ranks start in a thread while the kernel already answers (``begin_runtime``): until they are
connected, the ``kernel_info`` banner says they are still starting.

A rank pool that failed to start: the magics raise the failure when someone runs one. When it
fails, its text goes to the Jupyter server's log and on IOPub, on stderr (under the last request
the kernel got); after that, every frontend that connects asks for ``kernel_info``, so the kernel
answers that request and then publishes the error again.

It also goes into the ``kernel_info`` banner and, as one line, into the output of the next cell that
runs, since a notebook shows no stream that answers ``kernel_info``.

A Slurm job that waited in the queue: the provisioner could only log it on the Jupyter server
while the kernel did not exist yet, so the kernel says it (``SHARDBOOK_SLURM_NOTE``) in its
``kernel_info`` banner and as one line in the output of the first cell that runs.
"""

from __future__ import annotations

import inspect
import sys
from typing import Any

from shardbook.kernel.ranks.runtime import started_runtime
from shardbook.magics.interrupts import install_interrupt_hook
from shardbook.magics.relay import IOPubFrontend
from shardbook.rankd.control.startup_marks import mark
from shardbook.rankd.control.world import CONNECT_TIMEOUT_S, JobShape, slurm_note


def report_start(shell: Any):
    """Say in the banner that the ranks are starting; return what reports how their start ended (``on_end``)."""
    maybe_show_slurm_note(shell, slurm_note())
    world_size = JobShape.from_env().world_size
    starting = (
        f"shardbook: the {world_size} ranks of this kernel are still starting (up to {CONNECT_TIMEOUT_S:.0f} s, "
        "SHARDBOOK_CONNECT_TIMEOUT): cells that need them wait for them, other cells run now"
    )
    if world_size > 1:
        set_banner_line(shell, starting)
    install_interrupt_hook(shell, lambda: getattr(started_runtime(), "generation_queue", None))

    def on_end(runtime: Any, failure: str | None, awaited: bool) -> None:
        """``awaited``: a magic waits for the start, and shows the failure itself (as its error)."""
        set_banner_line(shell, None, replacing=starting)
        kernel = getattr(shell, "kernel", None)
        if failure is None:
            mark("ranks connected")
        elif kernel is not None and hasattr(kernel, "shell_handlers"):
            announce_on_connect(kernel, failure)
            if awaited:
                set_banner_line(shell, failure)
            else:
                IOPubFrontend(kernel).stream("stderr", f"[shardbook] {failure}\n")
                show_at_start(shell, failure)

    return on_end


def set_banner_line(shell: Any, line: str | None, replacing: str | None = None) -> None:
    """Add ``line`` to the ``kernel_info`` banner, or drop ``replacing`` from it (``line`` None)."""
    lines = [x for x in shell.banner2.split("\n") if x and x != replacing]
    shell.banner2 = "\n".join([*lines, line] if line else lines)


def announce_on_connect(kernel: Any, text: str) -> None:
    """After every ``kernel_info_request``, publish ``text`` on IOPub as that request's stderr."""
    answer = kernel.shell_handlers.get("kernel_info_request")
    if answer is None:
        return

    async def kernel_info_request(stream, ident, parent):
        result = answer(stream, ident, parent)
        if inspect.isawaitable(result):
            await result
        IOPubFrontend(kernel, parent=parent).stream("stderr", f"[shardbook] {text}\n")

    kernel.shell_handlers["kernel_info_request"] = kernel_info_request


def maybe_show_slurm_note(shell: Any, note: str) -> None:
    """Put ``note`` in the banner and print it (stderr) in the output of the first cell run; nothing without one."""
    if note:
        show_at_start(shell, note)


def show_at_start(shell: Any, note: str) -> None:
    """Put ``note`` in the banner (``kernel_info``'s, which consoles show) and print it (stderr) in the output of
    the next cell run: a stream on IOPub that a notebook shows, as the start-up failure of a rank pool needs."""
    set_banner_line(shell, note)

    def first_cell(info: Any = None) -> None:
        shell.events.unregister("pre_run_cell", first_cell)
        print(f"[shardbook] {note}", file=sys.stderr, flush=True)

    shell.events.register("pre_run_cell", first_cell)
