"""Running a cell in an IPython shell with everything it shows sent to a sink, on any rank.

A *sink* is a callable ``sink(msg_type, payload)`` taking the protocol's output types (stream,
display, result, error). On followers the sink sends over the control plane; on rank 0 it feeds
the same relay directly, so rank 0's part of a ``%%all`` cell travels the very same path.

This is the one rankd module that imports IPython: the followers run a real IPython shell so
cells behave on every rank as they do in the notebook (magics, ``!`` commands, last-value display).
"""

from __future__ import annotations

import codecs
import contextlib
import io
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from IPython.core.displayhook import DisplayHook
from IPython.core.displaypub import DisplayPublisher

from shardbook.rankd.control import protocol

Sink = Callable[[str, dict[str, Any]], None]

STREAM_FLUSH_S = 0.05  # coalesce prints for at most this long: live, yet few messages
STREAM_FLUSH_BYTES = 1 << 16


class SinkStream(io.TextIOBase):
    """A text stream that forwards writes to a sink, coalesced for up to ``STREAM_FLUSH_S``.

    A completed line after a quiet period goes out at once (so ``print`` before a long step is
    seen live); later writes, and partial lines, are batched and flushed by :meth:`flush_if_due`, called from the
    channel's tick, or by any non-stream output so the order of outputs is kept. ``buffer`` takes
    bytes, decoded as UTF-8.
    """

    def __init__(self, name: str, sink: Sink):
        self.name = name
        self._sink = sink
        self._parts: list[str] = []
        self._size = 0
        self._lock = threading.Lock()
        self._last_flush = 0.0
        self.buffer = SinkBuffer(self)

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        if not isinstance(text, str):
            raise TypeError(f"write() argument must be str, not {type(text).__name__}")
        with self._lock:
            self._parts.append(text)
            self._size += len(text)
            quiet = time.monotonic() - self._last_flush >= STREAM_FLUSH_S
            due = self._size >= STREAM_FLUSH_BYTES or (quiet and "\n" in text)
        if due:
            self.flush()
        return len(text)

    def flush(self) -> None:
        with self._lock:
            text = "".join(self._parts)
            self._parts.clear()
            self._size = 0
            self._last_flush = time.monotonic()
            if text:  # sent under the lock so two flushes cannot swap their order
                self._sink(protocol.STREAM, {"name": self.name, "text": text})

    def flush_if_due(self) -> None:
        if self._parts and time.monotonic() - self._last_flush >= STREAM_FLUSH_S:
            self.flush()

    @property
    def encoding(self) -> str:
        return "utf-8"

    def isatty(self) -> bool:
        return False


class SinkBuffer(io.RawIOBase):
    """A captured stream's ``buffer`` (``sys.stdout.buffer.write(b"...")``): bytes decoded as UTF-8 into the stream.

    Decoding is incremental, so a character split over two writes comes out whole; bytes that are
    not UTF-8 come out as U+FFFD.
    """

    def __init__(self, stream: SinkStream):
        self._stream = stream
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        data = bytes(data)
        self._stream.write(self._decoder.decode(data))
        return len(data)

    def flush(self) -> None:
        self._stream.flush()


class SinkDisplayPublisher(DisplayPublisher):
    """``display()`` sends a display message to the running cell's capture (after flushing pending prints)."""

    capture: CellCapture | None = None

    def publish(self, data, metadata=None, source=None, *, transient=None, update=False, **kwargs) -> None:
        self.capture.flush()
        payload = {"data": data, "metadata": metadata or {}, "transient": transient or {}, "update": update}
        self.capture.sink(protocol.DISPLAY, payload)

    def clear_output(self, wait: bool = False) -> None:
        self.capture.flush()


class SinkDisplayHook(DisplayHook):
    """The cell's last value goes to the running cell's capture as a result message instead of ``Out[n]``."""

    capture: CellCapture | None = None

    def start_displayhook(self) -> None:
        self.capture.flush()

    def write_output_prompt(self) -> None:
        pass

    def write_format_data(self, format_dict, md_dict=None) -> None:
        self.capture.sink(protocol.RESULT, {"data": format_dict, "metadata": md_dict or {}})

    def finish_displayhook(self) -> None:
        pass


def sink_parts(shell) -> tuple[SinkDisplayPublisher, SinkDisplayHook]:
    """The shell's own publisher and display hook for captured cells, made once and reused by every cell.

    IPython 9 registers a new publisher's callbacks on the shell's events and never removes them: a
    publisher per cell made every later cell call one more callback per earlier cell (rank 0 ran 320
    of them per event after 200 cells). Building the two traitlets objects also cost about 0.5 ms a cell.
    """
    parts = vars(shell).get("_shardbook_sink_parts")
    if parts is None:
        parts = shell._shardbook_sink_parts = (SinkDisplayPublisher(shell=shell), SinkDisplayHook(shell=shell))
    return parts


class CellCapture:
    """Routes a shell's stdout, stderr, displays, last value and tracebacks to one sink."""

    def __init__(self, shell, sink: Sink):
        self.shell = shell
        self.sink = sink
        self.stdout = SinkStream("stdout", sink)
        self.stderr = SinkStream("stderr", sink)
        self.failed = False
        self.error: dict[str, Any] | None = None

    def flush(self) -> None:
        self.stdout.flush()
        self.stderr.flush()

    def flush_if_due(self) -> None:
        self.stdout.flush_if_due()
        self.stderr.flush_if_due()

    def show_traceback(self, etype, evalue, stb) -> None:
        """Replaces the shell's ``_showtraceback``: the error becomes a message, not terminal text."""
        self.flush()
        self.failed = True
        self.error = {
            "ename": getattr(etype, "__name__", str(etype)),
            "evalue": exception_text(evalue),
            "traceback": list(stb),
        }
        self.sink(protocol.ERROR, self.error)

    @contextlib.contextmanager
    def installed(self) -> Iterator[CellCapture]:
        """Swap the shell's output machinery for this capture, restoring it afterwards."""
        shell = self.shell
        publisher, hook = sink_parts(shell)
        saved = (sys.stdout, sys.stderr, shell.display_pub, shell.displayhook, shell.display_trap.hook)
        saved_captures = (publisher.capture, hook.capture)  # a cell captured inside another gives it back
        had_own_showtraceback = "_showtraceback" in vars(shell)
        own_showtraceback = vars(shell).get("_showtraceback")
        sys.stdout, sys.stderr = self.stdout, self.stderr
        publisher.capture = hook.capture = self
        shell.display_pub = publisher
        shell.displayhook = shell.display_trap.hook = hook
        shell._showtraceback = self.show_traceback
        try:
            yield self
        finally:
            self.flush()
            sys.stdout, sys.stderr, shell.display_pub, shell.displayhook, shell.display_trap.hook = saved
            publisher.capture, hook.capture = saved_captures
            if had_own_showtraceback:
                shell._showtraceback = own_showtraceback
            else:
                del shell._showtraceback


def exception_text(exc: BaseException) -> str:
    """``str(exc)``, or what went wrong when the exception's own ``__str__`` raises (its type must not be lost)."""
    try:
        return str(exc)
    except Exception as e:
        return f"(the {type(exc).__name__}'s message could not be shown: its __str__ raised {type(e).__name__})"


def run_cell(
    shell,
    code: str,
    sink: Sink,
    *,
    store_history: bool,
    on_capture: Callable[[CellCapture | None], None] = lambda c: None,
) -> dict[str, Any]:
    """Run ``code`` in ``shell`` with all output going to ``sink``; returns ``{"status": ...}``.

    ``on_capture`` receives the live capture (and ``None`` at the end) so the caller's periodic
    tick can flush coalesced prints while the cell runs.
    """
    capture = CellCapture(shell, sink)
    on_capture(capture)
    try:
        with capture.installed():
            result = shell.run_cell(code, store_history=store_history, silent=False)
    finally:
        on_capture(None)
    failed = capture.failed or not result.success
    return {"status": "error" if failed else "ok", "error": capture.error}


def make_follower_shell():
    """The persistent IPython shell a follower runs ``%%all`` cells in (no terminal, no history file)."""
    from IPython.core.interactiveshell import InteractiveShell
    from traitlets.config import Config

    config = Config({"HistoryManager": {"enabled": False}})  # N ranks must not share one sqlite file
    return InteractiveShell.instance(config=config, colors="linux")
