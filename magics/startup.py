"""What happened while the kernel started, told to the user once a frontend can listen.

A rank pool that failed to start: the failure happens before any frontend listens on IOPub, and the
magics raise it only when someone runs one. Every frontend asks for ``kernel_info`` when it
connects, so the kernel answers that request and then publishes the error on IOPub, on stderr.

It also goes into the ``kernel_info`` banner and, as one line, into the output of the first cell that
runs, since a notebook shows no stream that answers ``kernel_info``.

A Slurm job that waited in the queue: the provisioner could only log it on the Jupyter server
while the kernel did not exist yet, so the kernel says it (``SHARDBOOK_SLURM_NOTE``) in its
``kernel_info`` banner and as one line in the output of the first cell that runs.
"""

from __future__ import annotations

import inspect
import sys
from typing import Any

from shardbook.magics.relay import IOPubFrontend


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
    the first cell run: a stream on IOPub that a notebook shows, as the start-up failure of a rank pool needs."""
    shell.banner2 = f"{shell.banner2}\n{note}" if shell.banner2 else note

    def first_cell(info: Any = None) -> None:
        shell.events.unregister("pre_run_cell", first_cell)
        print(f"[shardbook] {note}", file=sys.stderr, flush=True)

    shell.events.register("pre_run_cell", first_cell)
