"""The config's system prompt reaches every way of asking: HTTP requests and ChatModel as %%chat."""

from __future__ import annotations

from types import SimpleNamespace

from shardbook.kernel.api.chat import ChatModel
from shardbook.kernel.api.conversation import Conversation
from shardbook.kernel.server.openai_api import parse_request
from shardbook.rankd.config.schema import InferenceConfig

SYSTEM = "Always answer in one word."


def chat_model(system_prompt: str | None = SYSTEM) -> ChatModel:
    config = SimpleNamespace(inference=InferenceConfig(system_prompt=system_prompt))
    return ChatModel(SimpleNamespace(ctx0=SimpleNamespace(state={"config": config, "loaded": object()})))


def test_an_http_request_gets_the_configs_system_prompt_as_a_chat_cell_does():
    body = b'{"model": "m", "messages": [{"role": "user", "content": "What is the capital of France?"}]}'
    http = parse_request(body)
    over_http = chat_model().build_request(http.messages, stop=http.stop, **http.settings).messages
    cell = Conversation(system_prompt=SYSTEM).request_messages("What is the capital of France?")  # what %%chat sends
    assert (
        over_http
        == cell
        == [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": "What is the capital of France?"},
        ]
    )


def test_a_system_message_of_the_request_or_a_removed_prompt_is_kept():
    own = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert chat_model().build_request(own).messages == own
    assert chat_model(None).build_request("hi").messages == [{"role": "user", "content": "hi"}]
    removed = Conversation(system_prompt=None).request_messages("hi")  # /system alone in the terminal chat
    assert chat_model().build_request(removed, system_prompt=None).messages == [{"role": "user", "content": "hi"}]
