"""The HTTP handlers of the OpenAI-compatible server: /health, /v1/models and /v1/chat/completions.

A chat completion is checked (``openai_api``), waits for its turn in the generation queue (429
with ``Retry-After`` when the line is full), then streams from the ranks through an
``AsyncChatStream``: as server-sent events when ``stream`` is true, else as one JSON reply. A
client that disconnects stops its reply on every rank at the next step (or leaves the line).
Every response says how long the request waited in line (``X-Shardbook-Queue-Wait-Ms``).
"""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from typing import Any

import tornado.web
from tornado.iostream import StreamClosedError

from shardbook.kernel.api.chat import AsyncChatStream, ChatModel, GenerationFailed, LeftQueue, ModelChanged
from shardbook.kernel.ranks.generation_queue import QueueFull
from shardbook.kernel.ranks.pool import PoolError
from shardbook.kernel.server.access import (
    CORS_HEADERS,
    CORS_METHODS,
    check_api_key,
    check_host,
    check_json_body,
    check_origin,
)
from shardbook.kernel.server.openai_api import (
    FINISH_REASONS,
    ApiError,
    check_fits_context,
    chunk_body,
    completion_body,
    generation_failed,
    models_body,
    new_completion_id,
    parse_request,
    usage_body,
)
from shardbook.kernel.server.reasoning_reply import prompt_ids, reply_format, template_options, with_reasoning_tokens
from shardbook.kernel.server.state import ServerState
from shardbook.kernel.server.tool_reply import call_pieces, reply_splitter, request_tool_format, with_tools

log = logging.getLogger(__name__)
BODY_READ_LIMIT = 64 * 1024 * 1024
"""Bodies past the server's limit are read and dropped (so the client gets its 413) up to this;
beyond, the connection closes."""


class ApiHandler(tornado.web.RequestHandler):
    """JSON in and out, errors in OpenAI's shape; who may ask is checked first (``access``): the Host and a
    browser page's Origin, then the API key when the server has one (except for ``/health``)."""

    def initialize(self, server: ServerState) -> None:
        self.server = server
        self.origin_allowed = False

    def prepare(self) -> None:
        options = self.server.options
        check_host(self.request.host, options.host, options.allowed_hosts, self.server.url)
        check_origin(self.request.headers.get("Origin"), options.allowed_origins)
        self.origin_allowed = True
        self.maybe_allow_origin()
        if self.request.path != "/health" and self.request.method != "OPTIONS":  # a CORS preflight has no key
            check_api_key(options.api_key, self.request.headers.get("Authorization", ""))

    def maybe_allow_origin(self) -> None:
        """CORS headers for a page whose origin was allowed (``--allowed-origin``), so its browser lets it read."""
        origin = self.request.headers.get("Origin")
        if origin is not None and self.origin_allowed:
            self.set_header("Access-Control-Allow-Origin", origin)
            self.set_header("Vary", "Origin")

    def options(self, *args: str) -> None:
        """A browser's CORS preflight, from an allowed origin (``prepare`` refused the others)."""
        self.set_header("Access-Control-Allow-Methods", CORS_METHODS)
        self.set_header("Access-Control-Allow-Headers", CORS_HEADERS)
        self.set_header("Access-Control-Max-Age", "600")
        self.set_status(204)
        self.finish()

    def write_json(self, body: dict[str, Any], status: int = 200) -> None:
        self.set_status(status)
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps(body))

    def send_api_error(self, error: ApiError) -> None:
        self.server.stats.errors += 1
        for name, value in error.headers.items():
            self.set_header(name, value)
        self.write_json(error.body(), error.status)

    def write_error(self, status_code: int, **kwargs: Any) -> None:
        error = kwargs.get("exc_info", (None, None))[1]
        if not isinstance(error, ApiError):
            error = ApiError(
                status_code, self._reason, type="server_error" if status_code >= 500 else "invalid_request_error"
            )
        self.clear()
        self.maybe_allow_origin()  # an allowed page may read why it was refused
        self.send_api_error(error)

    def log_exception(self, typ, value, tb) -> None:
        if not isinstance(value, ApiError):
            super().log_exception(typ, value, tb)


class NotFoundHandler(ApiHandler):
    def prepare(self) -> None:
        super().prepare()
        raise ApiError(
            404, f"no endpoint {self.request.method} {self.request.path}; see /v1/models, /v1/chat/completions, /health"
        )


class HealthHandler(ApiHandler):
    def get(self) -> None:
        code, body = self.server.health()
        self.set_header("Cache-Control", "no-store")
        self.write_json(body, code)


class ModelsHandler(ApiHandler):
    def get(self) -> None:
        self.write_json(models_body(self.server.model_id(), self.server.started_at))


@tornado.web.stream_request_body
class BodyHandler(ApiHandler):
    """Reads the request body as it streams in, keeping at most the server's limit (``too_large`` beyond)."""

    def prepare(self) -> None:
        super().prepare()
        check_json_body(self.request.method, self.request.headers.get("Content-Type"))
        self.body = bytearray()
        self.too_large = False

    def data_received(self, chunk: bytes) -> None:
        if len(self.body) + len(chunk) > self.server.options.max_body_bytes:
            self.too_large = True  # keep reading (and dropping) so the client gets the 413
        else:
            self.body += chunk


class ChatCompletionsHandler(BodyHandler):
    """``--no-batch``: one reply at a time through the generation queue and transformers' ``generate``."""

    def prepare(self) -> None:
        super().prepare()
        self.stream: AsyncChatStream | None = None

    async def post(self) -> None:
        try:
            request, stream = self.start_reply()
        except ApiError as e:
            self.send_api_error(e)
            return
        self.server.streams.add(stream)
        self.server.stats.in_flight += 1
        try:
            await (self.stream_reply(request, stream) if request.stream else self.whole_reply(request, stream))
        finally:
            self.server.stats.in_flight -= 1
            self.server.streams.discard(stream)

    def start_reply(self):
        if self.too_large:
            raise ApiError(
                413, f"the request body is over {self.server.options.max_body_bytes} bytes", code="request_too_large"
            )
        request = parse_request(bytes(self.body))
        loaded = self.server.served_model(request.model)
        model = ChatModel(self.server.runtime)
        override = self.server.parser("reasoning_parser")
        try:
            parser = reply_format(loaded, [], override).name
            options = template_options(parser, loaded.tokenizer, request.chat_template_kwargs, request.reasoning_effort)
            options = with_tools(options, request.tools)
            self.tool_fmt = request_tool_format(loaded, request.tools, self.server.parser("tool_call_parser"))
            generation = model.build_request(
                request.messages, stop=request.stop, template_options=options, **request.settings
            )
            generation = replace(generation, intervene=False)  # a client's reply: the notebook's %intervene is not
            context = getattr(loaded.model.config.get_text_config(), "max_position_embeddings", None)
            prompt = prompt_ids(loaded.tokenizer, generation.messages, options)
        except (ValueError, PoolError) as e:
            raise ApiError(400, str(e)) from None
        check_fits_context(context, len(prompt), request.settings.get("max_new_tokens"))
        self.fmt, self.tokenizer = reply_format(loaded, prompt, override), loaded.tokenizer
        try:
            turn = self.server.runtime.generation_queue.enter("http", bounded=True)
        except QueueFull as e:
            raise ApiError(
                429, str(e), code="queue_full", type="rate_limit_error", headers={"Retry-After": str(e.retry_after_s)}
            ) from None
        self.stream = AsyncChatStream(self.server.runtime, generation, on_notice=log.warning, turn=turn)
        return request, self.stream

    async def whole_reply(self, request, stream: AsyncChatStream) -> None:
        try:
            async for _ in stream:
                pass
        except Exception as e:
            self.fail(e)
            return
        if self.client_left():
            return
        self.set_header("X-Shardbook-Queue-Wait-Ms", f"{stream.waited_s * 1000:.0f}")
        self.server.stats.served += 1
        response = stream.response
        reply, finish = self.splitter_for(request).reply(response.text, FINISH_REASONS[response.finish_reason])
        usage = with_reasoning_tokens(
            usage_body(response), self.fmt, self.tokenizer, [reply.get("reasoning_content") or ""]
        )
        self.write_json(completion_body(new_completion_id(), request.model, response, reply, usage, finish))

    def splitter_for(self, request):
        """The reply's splitter: reasoning apart, and the calls when the request offers tools."""
        return reply_splitter(self.fmt, self.tool_fmt, request.tools, self.server.metrics)

    async def stream_reply(self, request, stream: AsyncChatStream) -> None:
        completion_id, sent_any = new_completion_id(), False
        self.splitter = self.splitter_for(request)
        self.set_header("Content-Type", "text/event-stream")
        self.set_header("Cache-Control", "no-cache")
        try:
            async for text in stream:
                if not sent_any:
                    self.open_stream(request, stream, completion_id)
                    sent_any = True
                delta = self.splitter.delta(text)
                if delta:  # empty while a tag may be starting
                    self.send_event(
                        chunk_body(completion_id, request.model, delta, include_usage=request.include_usage)
                    )
                await self.flush()
        except StreamClosedError:
            stream.stop()  # the client left: free the ranks at the next step
            return
        except Exception as e:
            if not sent_any:
                self.fail(e)
                return
            self.fail_stream(request, completion_id, e)
            return
        self.finish_stream(request, stream, completion_id, sent_any)

    def fail_stream(self, request, completion_id: str, error: Exception) -> None:
        """An error once chunks were sent: the choice ends with ``finish_reason: "error"``, then the error event
        OpenAI's clients raise on, then ``[DONE]`` (never a reply that looks cut at max_tokens)."""
        if self.client_left():
            return
        log.warning("chat completion failed mid-stream: %s", error)
        self.server.stats.errors += 1
        self.send_event(chunk_body(completion_id, request.model, {}, "error", include_usage=request.include_usage))
        self.send_event(failure_error(error).body())
        self.write("data: [DONE]\n\n")
        self.finish()

    def finish_stream(self, request, stream: AsyncChatStream, completion_id: str, sent_any: bool) -> None:
        if self.client_left():
            return
        response = stream.response
        if not sent_any:
            self.open_stream(request, stream, completion_id)
        rest = self.splitter.delta("", final=True)  # a tag cut short at the end is text after all; the calls
        finish = self.splitter.finish_reason(FINISH_REASONS[response.finish_reason])
        *pieces, last = call_pieces(rest)
        for piece in pieces:
            self.send_event(chunk_body(completion_id, request.model, piece, include_usage=request.include_usage))
        self.send_event(chunk_body(completion_id, request.model, last, finish, include_usage=request.include_usage))
        if request.include_usage:
            usage = with_reasoning_tokens(
                usage_body(response), self.fmt, self.tokenizer, [self.splitter.whole.reasoning]
            )
            self.send_event(chunk_body(completion_id, request.model, None, usage=usage, include_usage=True))
        self.write("data: [DONE]\n\n")
        self.server.stats.served += 1
        self.finish()

    def open_stream(self, request, stream: AsyncChatStream, completion_id: str) -> None:
        """The headers (with the time waited in line) and the first chunk, which names the role."""
        self.set_header("X-Shardbook-Queue-Wait-Ms", f"{stream.waited_s * 1000:.0f}")
        delta = {"role": "assistant", "content": ""}
        self.send_event(chunk_body(completion_id, request.model, delta, include_usage=request.include_usage))

    def send_event(self, body: dict[str, Any]) -> None:
        self.write(f"data: {json.dumps(body)}\n\n")

    def fail(self, error: Exception) -> None:
        """An error before anything was sent: an OpenAI-style error reply."""
        if isinstance(error, LeftQueue) or self.client_left():
            return
        log.warning("chat completion failed: %s", error)
        if isinstance(error, ModelChanged):  # never answered by a model other than the one it asked for
            self.send_api_error(ApiError(409, str(error), param="model", code="model_changed"))
            return
        self.send_api_error(failure_error(error))

    def client_left(self) -> bool:
        stream = getattr(self.request.connection, "stream", None)
        return stream is None or stream.closed()

    def on_connection_close(self) -> None:
        if self.stream is not None:
            self.stream.stop()


def failure_error(error: Exception) -> ApiError:
    """The error a reply that failed on the ranks answers with: 503 when the ranks cannot generate now (a
    ``%%all`` cell holds them, a rank is dead), else 500 naming every failed rank's error."""
    if isinstance(error, PoolError):
        return ApiError(
            503, f"the ranks cannot generate now: {error}", type="server_error", headers={"Retry-After": "5"}
        )
    return generation_failed(str(error) if isinstance(error, GenerationFailed) else f"generation failed: {error}")


class MetricsHandler(ApiHandler):
    """``/metrics`` in Prometheus' format; checked as every endpoint but ``/health`` is: with an API key, a scrape
    sends it (Prometheus' ``authorization: {credentials: KEY}``)."""

    def get(self) -> None:
        from prometheus_client import CONTENT_TYPE_LATEST

        scheduler = self.server.runtime.ctx0.state.get("batch_scheduler")
        self.set_header("Content-Type", CONTENT_TYPE_LATEST)
        self.finish(self.server.metrics.render(scheduler))
