"""The tornado application: every endpoint of the OpenAI-compatible server."""

from __future__ import annotations

import tornado.web
from tornado.httputil import HTTPServerRequest
from tornado.routing import PathMatches

from shardbook.kernel.server.batched_chat import BatchedChatCompletionsHandler
from shardbook.kernel.server.completions import (
    ChatCompletionsHandler,
    HealthHandler,
    MetricsHandler,
    ModelsHandler,
    NotFoundHandler,
)
from shardbook.kernel.server.state import ServerState
from shardbook.kernel.server.text_completions import TextCompletionsHandler


class WhileChatBatches(PathMatches):
    """Matches `path` while chat completions join the batch. Decided per request, since a model loaded after the
    server started may have a cache the batch cannot hold (gpt-oss's sliding windows): its requests then take turns."""

    def __init__(self, path: str, server: ServerState):
        super().__init__(path)
        self.server = server

    def match(self, request: HTTPServerRequest) -> dict | None:
        return super().match(request) if self.server.chat_refusal() is None else None


def make_app(server: ServerState) -> tornado.web.Application:
    handlers = [
        (r"/health", HealthHandler, {"server": server}),
        (r"/v1/models", ModelsHandler, {"server": server}),
        (WhileChatBatches(r"/v1/chat/completions", server), BatchedChatCompletionsHandler, {"server": server}),
        (r"/v1/chat/completions", ChatCompletionsHandler, {"server": server}),
        (r"/v1/completions", TextCompletionsHandler, {"server": server}),
        (r"/metrics", MetricsHandler, {"server": server}),
    ]
    return tornado.web.Application(
        handlers,
        default_handler_class=NotFoundHandler,
        default_handler_args={"server": server},
        log_function=lambda handler: None,
    )
