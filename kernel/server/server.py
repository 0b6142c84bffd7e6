"""The OpenAI-compatible HTTP server on rank 0: its options, security checks, thread and lifecycle.

It serves whatever model is loaded (``runtime.ctx0.state``), so a new ``%load_sharded`` switches
what is served, and its requests wait in the runtime's generation queue with ``%%chat`` cells.

Why tornado, not starlette + uvicorn (``bench/bench_http_libs.py``, 5 runs on this shared 2-core
machine): both answer in well under the ~100 ms a token takes here. Tornado streamed 64 events
in 0.2-1.0x starlette + uvicorn's time (1.3-3.9 against 1.7-7.0 ms); its first event (0.5-2.9
against 0.6-1.1 ms, noisy) and a JSON GET (0.30-0.43 against 0.24-0.30 ms) were a little slower,
and it imports in 0.7-1.2x the time.
What decides: tornado already comes with ipykernel (nothing new to install into a kernel's
environment, no version to reconcile with Jupyter's), and it runs on an event loop of its own in
a thread, so the server answers while a cell blocks the kernel's main thread.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time

from shardbook.kernel.ranks.runtime import Runtime
from shardbook.kernel.server.state import ServeOptions, ServerState

log = logging.getLogger(__name__)

START_TIMEOUT_S = 10.0
STOP_GRACE_S = 10.0
"""How long stopping waits for the request in flight, after telling the ranks to stop it."""


class Server(ServerState):
    """Serves the loaded model over HTTP from a thread of its own; ``start`` raises if it cannot listen."""

    def __init__(self, runtime: Runtime, options: ServeOptions):
        super().__init__(runtime, options)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping: asyncio.Event | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    # --- lifecycle -----------------------------------------------------------------------
    def start(self) -> Server:
        ready = threading.Event()
        self._thread = threading.Thread(
            target=asyncio.run, args=(self._serve(ready),), name="shardbook-serve", daemon=True
        )
        self._thread.start()
        if not ready.wait(START_TIMEOUT_S):
            raise RuntimeError(f"the HTTP server did not start within {START_TIMEOUT_S:.0f} s")
        if self._error is not None:
            raise self._error
        self.runtime.server = self
        return self

    def stop(self) -> None:
        """Stop listening, stop the replies in flight (on every rank) and waiting, and end the thread."""
        if self.runtime.server is self:
            self.runtime.server = None
        if self._loop is None or self._thread is None or not self._thread.is_alive():
            return
        self._loop.call_soon_threadsafe(self._stopping.set)
        self._thread.join(STOP_GRACE_S + 5)

    async def _serve(self, ready: threading.Event) -> None:
        from tornado.httpserver import HTTPServer
        from tornado.netutil import bind_sockets

        from shardbook.kernel.server.app import make_app
        from shardbook.kernel.server.completions import BODY_READ_LIMIT

        self._loop, self._stopping = asyncio.get_running_loop(), asyncio.Event()
        try:
            sockets = bind_sockets(self.options.port, self.options.host)
        except OSError as e:
            self._error = ValueError(
                f"cannot listen on {self.options.host}:{self.options.port}: {e.strerror}. "
                "Is another server using that port? Choose another with --port."
            )
            ready.set()
            return
        self.port = sockets[0].getsockname()[1]
        http = HTTPServer(make_app(self), max_body_size=max(BODY_READ_LIMIT, self.options.max_body_bytes))
        http.add_sockets(sockets)
        ready.set()
        await self._stopping.wait()
        http.stop()
        for stream in list(self.streams):  # the replies in flight end, each with what it generated
            stream.stop()
        deadline = time.monotonic() + STOP_GRACE_S
        while self.streams and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await http.close_all_connections()
