"""What the HTTP handlers see of a server: where it listens and who may ask, the model it serves, its counters.

`Server` (``server``) adds the thread and the lifecycle on top; the handlers (``completions``) need only this.
"""

from __future__ import annotations

import ipaddress
import logging
import re
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from shardbook.kernel.api.reasoning import PARSERS
from shardbook.kernel.api.tool_calls import FORMATS
from shardbook.kernel.ranks.runtime import Runtime
from shardbook.kernel.server.openai_api import ApiError

if TYPE_CHECKING:
    from shardbook.kernel.api.batch_sizing import BatchLimits
    from shardbook.rankd.loading.load_sharded import LoadedModel

log = logging.getLogger(__name__)

DEFAULT_PORT = 8000
MAX_BODY_BYTES = 4 * 1024 * 1024
"""Largest request body accepted (413 beyond): room for a long conversation, not for abuse."""


@dataclass
class ServeOptions:
    """Where to listen and who may ask: loopback by default; any other address needs an API key."""

    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    api_key: str | None = None
    max_body_bytes: int = MAX_BODY_BYTES
    max_waiting: int | None = None
    """Requests (sequences, on the batch) that may wait beyond those running (429 beyond); None keeps the
    queue's own bound."""
    batch: bool = True
    """Chat completions decode together in the continuous batch; False (``--no-batch``) takes turns through
    transformers' ``generate`` instead. ``/v1/completions`` always batches."""
    reasoning_parser: str | None = None
    """How chat replies' reasoning is read apart from the answer (``reasoning_content``): ``auto`` (from the
    model's config and vocabulary), ``think``, ``harmony`` or ``none``; None (no ``--reasoning-parser``) follows
    the loaded config's ``inference.reasoning_parser``."""
    tool_call_parser: str | None = None
    """How chat replies' tool calls are read (``tool_calls``): ``auto`` (from the model's config and vocabulary),
    ``none`` (requests with tools are refused), or a format of ``tool_calls.FORMATS`` (``hermes``, ``glm45``, ...);
    None (no ``--tool-call-parser``) follows the loaded config's ``inference.tool_call_parser``."""
    allowed_hosts: tuple[str, ...] = ()
    """Names a request's ``Host`` may give besides localhost and the address listened on (a reverse proxy's,
    a tunnel's; ``--allowed-host``); ``*`` allows any."""
    allowed_origins: tuple[str, ...] = ()
    """Web pages (``Origin``, as ``https://app.example:8080``) whose requests are answered, with CORS headers
    (``--allowed-origin``); ``*`` allows any. Requests from any other page are refused."""

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
        if self.reasoning_parser not in (None, "auto", *PARSERS):
            raise ValueError(
                f"unknown reasoning parser {self.reasoning_parser!r}: use one of auto, {', '.join(PARSERS)}"
            )
        if self.tool_call_parser not in (None, "auto", "none", *FORMATS):
            raise ValueError(
                f"unknown tool-call parser {self.tool_call_parser!r}: use one of auto, none, {', '.join(FORMATS)}"
            )
        for name in self.allowed_hosts:
            if not name.strip() or "/" in name:
                raise ValueError(
                    f"--allowed-host {name!r} is not a host name: give a name as clients write it in their URL, "
                    "without scheme or path (say --allowed-host llm.example.org), or * to allow any"
                )
        for origin in self.allowed_origins:
            if origin not in ("*", "null") and not re.fullmatch(r"https?://[^/\s]+", origin.rstrip("/")):
                raise ValueError(
                    f"--allowed-origin {origin!r} is not a web origin: give the page's scheme, host and port as "
                    "the browser sends them (say --allowed-origin https://app.example.org:8443), or * to allow any"
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


class Stoppable(Protocol):
    def stop(self) -> None: ...


@dataclass
class ServerStats:
    served: int = 0
    errors: int = 0
    in_flight: int = 0


class ServerState:
    """A server's options, counters and replies in flight, and the model it serves (whatever is loaded now)."""

    def __init__(self, runtime: Runtime, options: ServeOptions):
        from shardbook.kernel.server.metrics import Metrics

        self.metrics = Metrics()
        options.check()
        self.runtime = runtime
        self.options = options
        self.stats = ServerStats()
        self.port = options.port
        self.started_at = int(time.time())
        self.overridden: set[tuple[str, str]] = set()
        """The config values a flag overrode that were warned about (once each)."""
        self.streams: set[Stoppable] = set()
        """Replies in flight or waiting (a chat stream, a batched reply): the server's stop stops each and waits
        until they are gone; touched on the server's loop only."""
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

    def parser(self, key: str) -> str:
        """The ``reasoning_parser`` or ``tool_call_parser`` (`key`) for a request now: the server's flag when it was
        given (a warning, once, when it overrides another value in the loaded config), else the loaded config's
        ``inference`` value (asked per request, so a later load counts)."""
        from shardbook.kernel.api.replies import configured_parser

        configured, flag = configured_parser(self.runtime, key), getattr(self.options, key)
        if flag is None:
            return configured
        if configured not in ("auto", flag) and (key, configured) not in self.overridden:
            self.overridden.add((key, configured))
            log.warning("--%s %s overrides the config's inference.%s %s", key.replace("_", "-"), flag, key, configured)
        return flag

    def served_model(self, requested: str) -> LoadedModel:
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

    def health(self) -> tuple[int, dict]:
        """``/health``'s status code and body: 503 when the ranks cannot serve (no model, a dead or missing rank).

        ``status`` is one word a load balancer can act on: ``ok`` (idle), ``busy`` (generating; requests wait
        in line), ``loading`` (a model is being loaded), ``no_model`` or ``rank_dead`` / ``ranks_connecting``.
        ``waiting`` counts what waits: turns in the generation queue and sequences not yet in the batch;
        ``batch_running`` the sequences decoding together now.
        """
        ranks = self.runtime.pool.health()
        queue = self.runtime.generation_queue
        model = self.model_id()
        if ranks["dead_ranks"]:
            status = "rank_dead"
        elif not ranks["can_serve"]:
            status = "ranks_connecting"
        elif ranks["loading"]:
            status = "loading"
        elif model is None:
            status = "no_model"
        elif ranks["busy"] or queue.running is not None:
            status = "busy"
        else:
            status = "ok"
        scheduler = self.runtime.ctx0.state.get("batch_scheduler")
        batch_running, batch_waiting = scheduler.occupancy() if scheduler is not None else (0, 0)
        body = {
            "status": status,
            "model": model,
            "waiting": queue.num_waiting() + batch_waiting,
            "running": queue.running.source if queue.running is not None else None,
            "batch_running": batch_running,
            **ranks,
        }
        can_serve = ranks["can_serve"] and model is not None
        return (200 if can_serve else 503), body

    def status_text(self) -> str:
        s = self.stats
        return (
            f"serving {self.model_id() or '(no model loaded)'} at {self.url}\n"
            f"queue: {self.runtime.generation_queue.describe()}\n"
            f"chat completions: {self.chat_text()}\n"
            f"batch: {self.batch_text()}\n"
            f"requests: {s.served} served, {s.errors} errors, {s.in_flight} in flight"
            + ("" if self.options.api_key else "\nno API key: loopback clients only")
        )

    def chat_refusal(self) -> str | None:
        """Why chat completions take turns instead of joining the batch now, or None when they batch: ``--no-batch``,
        or a model loaded now whose cache the batch cannot hold (asked per request, so a later load counts)."""
        from shardbook.kernel.api.batch import batch_refusal

        return "--no-batch" if not self.options.batch else batch_refusal(self.runtime)

    def batch_limits(self) -> BatchLimits:
        """The batch's size and waiting line: the loaded model's (``batch_sizing``), with ``--max-waiting`` when
        the server was given one."""
        from shardbook.kernel.api.batch import scheduler_for

        return scheduler_for(self.runtime).limits.with_waiting(self.options.max_waiting)

    def batch_text(self) -> str:
        """The batch's size and waiting line, where they come from, and its cache's layout (for the start-up line
        and the status)."""
        from shardbook.kernel.api.batch import cache_layout

        if self.model_id() is None:
            return "sized from the KV budget when a model is loaded"
        return f"{self.batch_limits().describe()}; {cache_layout(self.runtime)}"

    def chat_text(self) -> str:
        refusal = self.chat_refusal()
        if refusal is not None:
            return f"one at a time ({refusal})"
        scheduler = self.runtime.ctx0.state.get("batch_scheduler")
        running, waiting = scheduler.occupancy() if scheduler is not None else (0, 0)
        return f"continuous batch, {running} sequences running, {waiting} waiting"
