"""Tool calls on /v1/chat/completions through the `openai` client, on the batch and on ``--no-batch``.

The ranks are scripted as in ``test_reasoning_endpoint.py`` (the reply depends on the prompt the chat template
rendered, so the tools, tool results and earlier calls are seen to reach the template), here with a hermes
template (``qwen3``'s format). ``tool_serve_check.py`` runs a taught model and agent frameworks on real tokens.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import requests

from shardbook.kernel.server.openai_api import ApiError
from shardbook.kernel.server.state import ServeOptions
from shardbook.kernel.server.tool_reply import request_tool_format
from shardbook.kernel.server.tool_request import ToolRequest
from shardbook.rankd.config.schema import InferenceConfig
from tests.checks import run_check
from tests.taught import FAMILY_CALLS
from tests.taught import TOOL as WEATHER_TOOL
from tests.tiny import TOOLS_TEMPLATE, make_tokenizer
from tests.unit import test_reasoning_endpoint as scripted
from tests.unit.test_reasoning_endpoint import serve  # noqa: F401  (the fixture: a server on each path)

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.timeout(60)

CALL = FAMILY_CALLS["hermes"]
REPLIES = {
    "weather": ["Let me check.\n<tool", "_call>\n" + CALL[12:30], CALL[30:]],
    "twice": ["<tool_call>", CALL[11:] + CALL.replace("Paris", "Rome")],
    "bad": ['<tool_call>\n{"name": "get_weather", "arguments": {"city": Paris}}\n</tool_call>'],
    "nowhere": ['<tool_call>\n{"name": "get_weather", "arguments": {"town": "Paris"}}\n</tool_call>'],
}
ASK = [{"role": "user", "content": "weather"}]


def reply_to(prompt: str) -> list[str]:
    """The scripted model: it answers a tool result, calls when it sees its tool offered, else greets."""
    if "<tool_response>" in prompt:
        return ["Sunny, ", "says the tool (" + prompt.split("<tool_call>")[1].split("</tool_call>")[0] + ")."]
    asked = prompt.rsplit("<|im_start|>user\n", 1)[-1].split("<|im_end|>")[0]
    if "Tools: get_weather" in prompt and asked in REPLIES:
        return REPLIES[asked]
    return ["Hello!"]


@pytest.fixture
def client(serve, monkeypatch):  # noqa: F811
    monkeypatch.setattr(scripted, "reply_to", reply_to)
    client, tokenizer = serve("think")  # a qwen3 model: hermes calls, think tags
    tokenizer.chat_template = TOOLS_TEMPLATE
    return client


def streamed(client, **fields):
    """The stream's content, its calls as the openai client accumulates them, and its finish reason."""
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(model="m", stream=True, **fields):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or ():
            entry = calls.setdefault(call.index, {"id": call.id, "name": call.function.name, "arguments": ""})
            entry["arguments"] += call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


def test_a_call_whole_and_streamed_then_the_result_back(client):
    whole = client.chat.completions.create(model="m", messages=ASK, tools=[WEATHER_TOOL])
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check."
    (call,) = choice.message.tool_calls
    assert (call.type, call.function.name, json.loads(call.function.arguments)) == (
        "function",
        "get_weather",
        {"city": "Paris"},
    )
    content, calls, finish = streamed(client, messages=ASK, tools=[WEATHER_TOOL])
    assert (content, finish) == ("Let me check.", "tool_calls")
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("get_weather", {"city": "Paris"})]
    assert calls[0]["id"].startswith("call_")
    chunks = client.chat.completions.create(model="m", messages=ASK, tools=[WEATHER_TOOL], stream=True)
    pieces = [
        (c.id, c.type, c.function.name, c.function.arguments)
        for k in chunks
        for c in k.choices[0].delta.tool_calls or ()
    ]
    # as the OpenAI API streams a call: id, type and name with empty arguments, then the arguments in pieces
    assert pieces[0][0].startswith("call_") and pieces[0][1:] == ("function", "get_weather", "")
    assert len(pieces) > 2 and all(piece[:3] == (None, None, None) for piece in pieces[1:])
    assert json.loads("".join(piece[3] for piece in pieces[1:])) == {"city": "Paris"}
    turns = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"},
    ]
    answer = client.chat.completions.create(model="m", messages=turns, tools=[WEATHER_TOOL])
    assert answer.choices[0].message.content == "Sunny, says the tool (get_weather city=Paris)."
    assert answer.choices[0].finish_reason == "stop" and answer.choices[0].message.tool_calls is None


def test_tool_choice_and_parallel_calls(client):
    both = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "twice"}], tools=[WEATHER_TOOL]
    )
    assert [json.loads(c.function.arguments)["city"] for c in both.choices[0].message.tool_calls] == ["Paris", "Rome"]
    first = streamed(
        client, messages=[{"role": "user", "content": "twice"}], tools=[WEATHER_TOOL], parallel_tool_calls=False
    )
    assert [json.loads(c["arguments"])["city"] for c in first[1]] == ["Paris"]
    none = client.chat.completions.create(model="m", messages=ASK, tools=[WEATHER_TOOL], tool_choice="none")
    assert none.choices[0].message.content == "Hello!"  # no tools rendered: the model did not see them
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert (
        client.chat.completions.create(model="m", messages=ASK, tools=[WEATHER_TOOL], tool_choice=named)
        .choices[0]
        .message.tool_calls
    )
    required = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}], tools=[WEATHER_TOOL], tool_choice="required"
    )
    assert (required.choices[0].message.content, required.choices[0].finish_reason) == ("Hello!", "stop")


@pytest.mark.parametrize("asked", ["bad", "nowhere"])
def test_a_call_that_cannot_be_used_is_text_and_counted(client, asked):
    messages = [{"role": "user", "content": asked}]
    whole = client.chat.completions.create(model="m", messages=messages, tools=[WEATHER_TOOL])
    assert whole.choices[0].finish_reason == "stop" and whole.choices[0].message.tool_calls is None
    assert whole.choices[0].message.content == REPLIES[asked][0]
    assert streamed(client, messages=messages, tools=[WEATHER_TOOL]) == (REPLIES[asked][0], [], "stop")
    metrics = requests.get(str(client.base_url).replace("/v1/", "/metrics"), timeout=10).text
    assert "shardbook_tool_call_parse_failures_total 2.0" in metrics


@pytest.mark.parametrize(
    "fields, param, why",
    [
        ({"tools": [{"type": "retrieval"}]}, "tools[0]", "function tools only"),
        (
            {"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice",
            "not one of",
        ),
        ({"tool_choice": "required"}, "tool_choice", "offers no 'tools'"),
        ({"tools": [WEATHER_TOOL], "parallel_tool_calls": "yes"}, "parallel_tool_calls", "boolean"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id", "id of the call"),
        (
            {
                "messages": [
                    {
                        "role": "assistant",
                        "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{x"}}],
                    }
                ]
            },
            "messages[0].tool_calls[0].function.arguments",
            "JSON text of an object",
        ),
        (
            {"tools": [WEATHER_TOOL], "extra_body": {"chat_template_kwargs": {"tools": "x"}}},
            "chat_template_kwargs",
            "'tools' field",
        ),
    ],
)
def test_tool_fields_that_are_refused(client, fields, param, why):
    body = {"messages": ASK, **fields}
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="m", **body)
    assert refused.value.body["param"] == param and why in refused.value.body["message"]


def test_tools_the_model_cannot_take_are_refused_naming_why(serve, monkeypatch):  # noqa: F811
    monkeypatch.setattr(scripted, "reply_to", reply_to)
    client, tokenizer = serve("harmony")  # gpt-oss, with a template that does not render tools
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="m", messages=ASK, tools=[WEATHER_TOOL])
    assert "does not read 'tools'" in refused.value.body["message"]
    assert client.chat.completions.create(model="m", messages=ASK, tools=[WEATHER_TOOL], tool_choice="none")


def test_tools_for_a_model_with_no_tool_format_are_a_400_naming_why(serve, monkeypatch):  # noqa: F811
    """A Llama model whose vocabulary has no call tokens: a request with tools is a 400 over HTTP, on the batch
    and on --no-batch, saying the model writes no format the server reads and what to do; without tools it is
    answered."""
    monkeypatch.setattr(scripted, "reply_to", reply_to)
    fake_model = scripted.FakeModel
    monkeypatch.setattr(scripted, "FakeModel", lambda model_type: fake_model("llama"))
    client, tokenizer = serve("think")
    tokenizer.chat_template = TOOLS_TEMPLATE
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="m", messages=ASK, tools=[WEATHER_TOOL])
    assert refused.value.status_code == 400 and refused.value.body["param"] == "tools"
    message = refused.value.body["message"]
    assert "this model has no tool-call format" in message and "model_type (llama)" in message
    assert "without 'tools'" in message and "tool_call_parser" in message
    with pytest.raises(openai.BadRequestError):
        streamed(client, messages=ASK, tools=[WEATHER_TOOL])
    assert client.chat.completions.create(model="m", messages=ASK).choices[0].message.content == "Hello!"


@pytest.mark.timeout(400)
def test_a_taught_model_calls_its_tool_in_each_familys_format():
    """Real generated tokens (`tool_serve_check.py`), on the batch and the single path: the openai client's hermes
    round trip; the same call in GLM's, DeepSeek's, Kimi's, MiniMax's and gpt-oss's (harmony) formats, each read
    by a server told that family's parser, whole and streamed (Kimi's and harmony's tags are special tokens:
    kept for the parsers, kept out of the content); harmony's reasoning apart from its answer, on the endpoint
    and in ChatModel (the agent frameworks: test_agents_on_two_ranks.py)."""
    found = run_check(Path(__file__).with_name("tool_serve_check.py"), timeout=380)
    call = [["get_weather", {"city": "Paris"}]]
    for where in ("batch", "no_batch"):
        assert found[f"{where}_hermes"]["whole"] == ["tool_calls", call], found
        assert found[f"{where}_hermes"]["stream"] == ["tool_calls", call], found  # the client's own accumulation
        assert found[f"{where}_hermes"]["answer"] == ["stop", "It is sunny in Paris."], found
        for family in ("glm45", "deepseek_v31", "kimi_k2", "minimax_m2", "harmony"):
            for finish, reasoning, content, calls in found[f"{where}_{family}"]:  # whole, then streamed
                assert (finish, calls) == ("tool_calls", call) and not content, (family, found)
                assert (reasoning or "") == ("Need the weather." if family == "harmony" else ""), (family, found)
        for whole_or_streamed in found[f"{where}_harmony_answer"]:
            assert whole_or_streamed[:3] == ["stop", "It said sunny.", "Sunny."], found
        assert found[f"{where}_chat_model"] == ["A greeting.", "Hello!"], found


def test_the_tool_call_parser_is_chosen_at_the_server():
    from shardbook.kernel.cli.main import build_parser
    from shardbook.kernel.cli.serve import serve_options, split_flags

    args = build_parser().parse_args(["serve", "demo", "--tool-call-parser", "glm45"])
    split_flags(args)
    assert serve_options(args).tool_call_parser == "glm45"
    with pytest.raises(ValueError, match="unknown tool-call parser 'openai': use one of auto, none, hermes"):
        ServeOptions(tool_call_parser="openai").check()
    qwen = SimpleNamespace(
        tokenizer=make_tokenizer(), model=SimpleNamespace(config=SimpleNamespace(model_type="qwen3"))
    )
    qwen.tokenizer.chat_template = TOOLS_TEMPLATE
    assert request_tool_format(qwen, ToolRequest([WEATHER_TOOL]), "auto").name == "hermes"
    assert request_tool_format(qwen, ToolRequest([WEATHER_TOOL]), "minimax_m2").name == "minimax_m2"
    with pytest.raises(ApiError, match=r"reads no tool calls \(its tool_call_parser is none"):
        request_tool_format(qwen, ToolRequest([WEATHER_TOOL]), "none")


def test_the_configs_tool_call_parser_applies_unless_a_flag_is_given(serve, monkeypatch, caplog):  # noqa: F811
    """A Llama model (no format of its own) loaded with ``inference.tool_call_parser: hermes``: the server started
    without --tool-call-parser reads its hermes call; one started with ``--tool-call-parser none`` refuses tools,
    warning once that the flag overrides the config."""
    monkeypatch.setattr(scripted, "reply_to", reply_to)
    fake_model = scripted.FakeModel
    monkeypatch.setattr(scripted, "FakeModel", lambda model_type: fake_model("llama"))
    monkeypatch.setattr(scripted, "InferenceConfig", lambda: InferenceConfig(tool_call_parser="hermes"))
    client, tokenizer = serve("think")
    tokenizer.chat_template = TOOLS_TEMPLATE
    choice = client.chat.completions.create(model="m", messages=ASK, tools=[WEATHER_TOOL]).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls[0].function.name == "get_weather"
    client, tokenizer = serve("think", tool_call_parser="none")
    tokenizer.chat_template = TOOLS_TEMPLATE
    for _ in range(2):
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model="m", messages=ASK, tools=[WEATHER_TOOL])
        assert "its tool_call_parser is none" in refused.value.body["message"]
    overrides = [r for r in caplog.records if "overrides the config's inference.tool_call_parser hermes" in r.message]
    assert len(overrides) == 1 and "--tool-call-parser none" in overrides[0].message
