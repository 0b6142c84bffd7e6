"""The per-rank output relay: every rank's output of a command, live, into the running cell.

Output arrives from the pool's I/O thread (followers) and the main thread (rank 0's own part);
the relay serialises it, writes a ``[rank N]`` label whenever the rank changes and tags display
data with ``metadata["rank"]``. In a kernel it publishes on IOPub under the parent of the cell
that started the command, so output lands in that cell even while the main thread is busy.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import Any

from shardbook.rankd.control import protocol


class IOPubFrontend:
    """Publishes stream and display messages on the kernel's IOPub socket (thread-safe)."""

    def __init__(self, kernel: Any, parent: dict[str, Any] | None = None):
        self.kernel = kernel
        self.parent = parent if parent is not None else kernel.get_parent("shell")

    def _send(self, msg_type: str, content: dict[str, Any]) -> None:
        kernel = self.kernel
        kernel.session.send(kernel.iopub_socket, msg_type, content, parent=self.parent, ident=kernel._topic(msg_type))

    def stream(self, name: str, text: str) -> None:
        self._send("stream", {"name": name, "text": text})

    def display(self, data: dict[str, Any], metadata: dict[str, Any], transient: dict[str, Any]) -> None:
        msg_type = (
            "update_display_data" if transient.get("display_id") and metadata.pop("_update", False) else "display_data"
        )
        self._send(msg_type, {"data": data, "metadata": metadata, "transient": transient})


class TerminalFrontend:
    """Where no kernel is attached (terminal IPython): plain text on the process's own streams."""

    def stream(self, name: str, text: str) -> None:
        out = sys.__stderr__ if name == "stderr" else sys.__stdout__
        out.write(text)
        out.flush()

    def display(self, data: dict[str, Any], metadata: dict[str, Any], transient: dict[str, Any]) -> None:
        self.stream("stdout", str(data.get("text/plain", "")) + "\n")


def frontend_for(shell: Any):
    kernel = getattr(shell, "kernel", None)
    return IOPubFrontend(kernel) if kernel is not None and hasattr(kernel, "iopub_socket") else TerminalFrontend()


class RankRelay:
    """Callable as the pool's ``on_output(rank, msg_type, payload)``; also takes notices."""

    def __init__(self, frontend: Any, label_ranks: bool, on_progress: Callable[[dict[str, Any]], None] | None = None):
        self.frontend = frontend
        self.label_ranks = label_ranks
        self.on_progress = on_progress
        self._lock = threading.Lock()
        self._last_rank: int | None = None
        self._line_open = False

    def __call__(self, rank: int, msg_type: str, payload: dict[str, Any]) -> None:
        with self._lock:
            if msg_type == protocol.STREAM:
                self._stream(rank, payload["name"], payload["text"])
            elif msg_type in (protocol.DISPLAY, protocol.RESULT):
                self._display(rank, payload)
            elif msg_type == protocol.PROGRESS and rank == 0 and self.on_progress is not None:
                self.on_progress(payload)  # every rank makes the same progress; rank 0 speaks for all
            # errors are reported once per group when the command ends (see magics.errors)

    def notice(self, text: str) -> None:
        """A message from shardbook itself (not from a rank), on stderr."""
        with self._lock:
            prefix = "\n" if self._line_open else ""
            self.frontend.stream("stderr", f"{prefix}[shardbook] {text}\n")
            self._last_rank, self._line_open = None, False

    def _label(self, rank: int) -> str:
        if not self.label_ranks or rank == self._last_rank:
            return ""
        self._last_rank = rank
        return ("\n" if self._line_open else "") + f"[rank {rank}]\n"

    def _stream(self, rank: int, name: str, text: str) -> None:
        if not text:
            return
        self.frontend.stream(name, self._label(rank) + text)
        self._line_open = not text.endswith("\n")

    def _display(self, rank: int, payload: dict[str, Any]) -> None:
        label = self._label(rank)
        if label:
            self.frontend.stream("stdout", label)
            self._line_open = False
        metadata = {**payload.get("metadata", {}), "rank": rank}
        if payload.get("update"):
            metadata["_update"] = True
        self.frontend.display(payload["data"], metadata, payload.get("transient", {}))
