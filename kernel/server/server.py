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
import ipaddress
import logging
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardbook.kernel.server.openai_api import ApiError

log = logging.getLogger(__name__)

DEFAULT_PORT = 8000
MAX_BODY_BYTES = 4 * 1024 * 1024
"""Largest request body accepted (413 beyond): room for a long conversation, not for abuse."""
START_TIMEOUT_S = 10.0
STOP_GRACE_S = 10.0
"""How long stopping waits for the request in flight, after telling the ranks to stop it."""


@dataclass
class ServeOptions:
    """Where to listen and who may ask: loopback by default; any other address needs an API key."""

    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    api_key: str | None = None
    max_body_bytes: int = MAX_BODY_BYTES
    max_waiting: int | None = None
    """Requests that may wait for the model (429 beyond); None keeps the queue's own bound."""

    def check(self) -> None:
        """ValueError naming the fix when the server must not start with these options."""
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("the API key is empty: give a non-empty --api-key, or a file with one in --api-key-file")
        if self.api_key is None and not is_loopback(self.host):
            raise ValueError(
                f"refusing to serve on {self.host} without an API key: anyone who can reach that address could use "
                "the model. Give --api-key KEY or --api-key-file FILE (clients then send 'Authorization: Bearer KEY'), "
                "or serve on 127.0.0.1 (the default) and reach it through an SSH tunnel."
            )


def is_loopback(host: str) -> bool:
    """True when every address ``host`` resolves to is a loopback address."""
    try:
        infos = socket.getaddrinfo(host, None)
    except socket.gaierror as e:
        raise ValueError(f"cannot resolve the host {host!r}: {e}") from None
    return bool(infos) and all(ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback for info in infos)


def read_api_key(key: str | None, key_file: str | None) -> str | None:
    """The key from ``--api-key`` or the first line of ``--api-key-file``."""
    if key_file is None:
        return key
    try:
        return Path(key_file).expanduser().read_text().strip()
    except OSError as e:
        raise ValueError(f"cannot read the API key file {key_file}: {e.strerror}") from None


@dataclass
class ServerStats:
    served: int = 0
    errors: int = 0
    in_flight: int = 0


class Server:
    """Serves the loaded model over HTTP from a thread of its own; ``start`` raises if it cannot listen."""

    def __init__(self, runtime: Any, options: ServeOptions):
        options.check()
        self.runtime = runtime
        self.options = options
        self.stats = ServerStats()
        self.port = options.port
        self.started_at = int(time.time())
        self.streams: set[Any] = set()
        """Replies in flight or waiting (``AsyncChatStream``); touched on the server's loop only."""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping: asyncio.Event | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        if options.max_waiting is not None:
            runtime.generation_queue.max_waiting = options.max_waiting

    @property
    def url(self) -> str:
        host = self.options.host
        return f"http://{f'[{host}]' if ':' in host else host}:{self.port}/v1"

    def model_id(self) -> str | None:
        """The id clients name the loaded model by: its checkpoint directory's name; None when none is loaded."""
        config = self.runtime.ctx0.state.get("config")
        if config is None or "loaded" not in self.runtime.ctx0.state:
            return None
        return Path(config.model.model_name_or_path).name

    def served_model(self, requested: str) -> Any:
        """The loaded model if ``requested`` names it; ApiError 503 (none loaded) or 404 (another name)."""
        model_id = self.model_id()
        if model_id is None:
            raise ApiError(
                503,
                "no model is loaded yet: load one (%load_sharded) and retry",
                type="server_error",
                code="model_not_loaded",
            )
        if requested not in (model_id, self.runtime.ctx0.state["config"].model.model_name_or_path):
            raise ApiError(
                404,
                f"the model '{requested}' does not exist here; this server serves '{model_id}'",
                param="model",
                code="model_not_found",
            )
        return self.runtime.ctx0.state["loaded"]

    def status_text(self) -> str:
        s = self.stats
        return (
            f"serving {self.model_id() or '(no model loaded)'} at {self.url}\n"
            f"queue: {self.runtime.generation_queue.describe()}\n"
            f"requests: {s.served} served, {s.errors} errors, {s.in_flight} in flight"
            + ("" if self.options.api_key else "\nno API key: loopback clients only")
        )

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

        from shardbook.kernel.server.completions import BODY_READ_LIMIT, make_app

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
        for stream in list(self.streams):
            stream.interrupt()
        deadline = time.monotonic() + STOP_GRACE_S
        while self.streams and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await http.close_all_connections()
