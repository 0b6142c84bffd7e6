"""The tornado application: every endpoint of the OpenAI-compatible server."""

from __future__ import annotations

import tornado.web

from shardbook.kernel.api.batch import batch_refusal
from shardbook.kernel.server.batched_chat import BatchedChatCompletionsHandler
from shardbook.kernel.server.completions import (
    ChatCompletionsHandler,
    HealthHandler,
    ModelsHandler,
    NotFoundHandler,
)
from shardbook.kernel.server.metrics import MetricsHandler
from shardbook.kernel.server.state import ServerState
from shardbook.kernel.server.text_completions import TextCompletionsHandler


def make_app(server: ServerState) -> tornado.web.Application:
    if server.options.batch and batch_refusal(server.runtime, interventions=False) is not None:
        server.options.batch = False  # a model the batch cannot hold (GLM-5's indexer cache): replies take turns
    handlers = [
        (r"/health", HealthHandler, {"server": server}),
        (r"/v1/models", ModelsHandler, {"server": server}),
        (
            r"/v1/chat/completions",
            BatchedChatCompletionsHandler if server.options.batch else ChatCompletionsHandler,
            {"server": server},
        ),
        (r"/v1/completions", TextCompletionsHandler, {"server": server}),
        (r"/metrics", MetricsHandler, {"server": server}),
    ]
    return tornado.web.Application(
        handlers,
        default_handler_class=NotFoundHandler,
        default_handler_args={"server": server},
        log_function=lambda handler: None,
    )
