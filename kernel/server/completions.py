"""The HTTP handlers of the OpenAI-compatible server: /health, /v1/models and /v1/chat/completions.

A chat completion is checked (``openai_api``), waits for its turn in the generation queue (429
with ``Retry-After`` when the line is full), then streams from the ranks through an
``AsyncChatStream``: as server-sent events when ``stream`` is true, else as one JSON reply. A
client that disconnects stops its reply on every rank at the next step (or leaves the line).
Every response says how long the request waited in line (``X-Shardbook-Queue-Wait-Ms``).
"""

from __future__ import annotations

import hmac
import json
import logging
from typing import Any

import tornado.web
from tornado.iostream import StreamClosedError

from shardbook.kernel.api.chat import AsyncChatStream, ChatModel, LeftQueue, ModelChanged
from shardbook.kernel.ranks.generation_queue import QueueFull
from shardbook.kernel.ranks.pool import PoolError
from shardbook.kernel.server.openai_api import (
    ApiError,
    check_fits_context,
    chunk_body,
    completion_body,
    models_body,
    new_completion_id,
    parse_request,
    usage_body,
)
from shardbook.kernel.server.state import ServerState

log = logging.getLogger(__name__)
BODY_READ_LIMIT = 64 * 1024 * 1024
"""Bodies past the server's limit are read and dropped (so the client gets its 413) up to this;
beyond, the connection closes."""


class ApiHandler(tornado.web.RequestHandler):
    """JSON in and out, errors in OpenAI's shape, the API key checked when the server has one."""

    def initialize(self, server: ServerState) -> None:
        self.server = server

    def prepare(self) -> None:
        key = self.server.options.api_key
        if key is None or self.request.path == "/health":
            return
        auth = self.request.headers.get("Authorization", "")
        if not auth.startswith("Bearer "):
            raise ApiError(
                401,
                "missing API key: send the header 'Authorization: Bearer KEY'",
                code="invalid_api_key",
                type="authentication_error",
            )
        if not hmac.compare_digest(auth[len("Bearer ") :].strip().encode(), key.encode()):
            raise ApiError(401, "invalid API key", code="invalid_api_key", type="authentication_error")

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
        try:
            generation = model.build_request(request.messages, stop=request.stop, **request.settings)
            context = getattr(loaded.model.config.get_text_config(), "max_position_embeddings", None)
            num_prompt_tokens = prompt_length(loaded.tokenizer, generation.messages)
        except (ValueError, PoolError) as e:
            raise ApiError(400, str(e)) from None
        check_fits_context(context, num_prompt_tokens, request.settings.get("max_new_tokens"))
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
        self.write_json(completion_body(new_completion_id(), request.model, stream.response))

    async def stream_reply(self, request, stream: AsyncChatStream) -> None:
        completion_id, sent_any = new_completion_id(), False
        self.set_header("Content-Type", "text/event-stream")
        self.set_header("Cache-Control", "no-cache")
        try:
            async for text in stream:
                if not sent_any:
                    self.open_stream(request, stream, completion_id)
                    sent_any = True
                self.send_event(
                    chunk_body(completion_id, request.model, {"content": text}, include_usage=request.include_usage)
                )
                await self.flush()
        except StreamClosedError:
            stream.stop()  # the client left: free the ranks at the next step
            return
        except Exception as e:
            if not sent_any:
                self.fail(e)
                return
            self.server.stats.errors += 1
            self.send_event(ApiError(500, f"generation failed: {e}", type="server_error").body())
            self.finish()
            return
        self.finish_stream(request, stream, completion_id, sent_any)

    def finish_stream(self, request, stream: AsyncChatStream, completion_id: str, sent_any: bool) -> None:
        if self.client_left():
            return
        response = stream.response
        if not sent_any:
            self.open_stream(request, stream, completion_id)
        finish = completion_body(completion_id, request.model, response)["choices"][0]["finish_reason"]
        self.send_event(chunk_body(completion_id, request.model, {}, finish, include_usage=request.include_usage))
        if request.include_usage:
            self.send_event(
                chunk_body(completion_id, request.model, None, usage=usage_body(response), include_usage=True)
            )
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
        if isinstance(error, PoolError):  # e.g. a %%all cell holds the ranks
            self.send_api_error(
                ApiError(
                    503, f"the ranks cannot generate now: {error}", type="server_error", headers={"Retry-After": "5"}
                )
            )
        else:
            self.send_api_error(ApiError(500, f"generation failed: {error}", type="server_error"))

    def client_left(self) -> bool:
        stream = getattr(self.request.connection, "stream", None)
        return stream is None or stream.closed()

    def on_connection_close(self) -> None:
        if self.stream is not None:
            self.stream.stop()


def prompt_length(tokenizer: Any, messages: list[dict[str, str]]) -> int:
    from shardbook.rankd.generation.engine import build_prompt_ids

    return int(build_prompt_ids(tokenizer, messages).shape[1])
