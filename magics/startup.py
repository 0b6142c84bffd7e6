"""A rank pool that failed to start: its error, shown to every frontend as soon as it connects.

The failure happens while the kernel starts, before any frontend listens on IOPub, and the
magics raise it only when someone runs one. Every frontend asks for ``kernel_info`` when it
connects, so the kernel answers that request and then publishes the error on IOPub, on stderr.
"""

from __future__ import annotations

import inspect
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
