"""The config's ``inference.reasoning_parser`` and ``inference.tool_call_parser`` on the notebook's paths: what
``%%chat``, the terminal chat and ``ChatModel`` read a reply with (``request_format``, ``tool_format``), on real
parsers over a real tokenizer and config. The server's flags against the config: test_tool_endpoint.py."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from shardbook.kernel.api.chat import ChatResponse
from shardbook.kernel.api.replies import ReplyParts, request_format
from shardbook.kernel.api.tool_calls import FORMATS
from shardbook.kernel.api.tools import ModelReply, ToolLoop, tool_format
from shardbook.rankd.config.parsing import load_config
from shardbook.rankd.config.schema import TOOL_CALL_PARSERS
from shardbook.rankd.generation.engine import GenerationRequest
from tests.tiny import make_tokenizer
from tests.unit.test_tool_loop import add

HERMES_CALL = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'


def runtime_with(model_type: str, *overrides: str):
    """A rank 0 whose loaded model is `model_type` (a vocabulary with think tags and no call tokens), loaded with
    the config `overrides` (``--inference.tool_call_parser hermes``)."""
    tokenizer = make_tokenizer()
    tokenizer.add_tokens(["<think>", "</think>"])
    loaded = SimpleNamespace(tokenizer=tokenizer, model=SimpleNamespace(config=SimpleNamespace(model_type=model_type)))
    return SimpleNamespace(ctx0=SimpleNamespace(state={"config": load_config(None, list(overrides)), "loaded": loaded}))


def run_loop(runtime, text: str):
    """The tool loop as ChatModel.chat and %%chat --tools run it, the model answering `text`, then "Done."."""
    loop = ToolLoop([add], tool_format(runtime))
    texts = iter([text, "Done."])

    def reply(messages):
        request = GenerationRequest(messages=messages, template_options={"tools": loop.schemas})
        response = ChatResponse(next(texts), 10, 5, "stop", 0.1, 10.0, 1)
        return ModelReply(response, loop.reply_parts(request_format(runtime, request)), messages, "prompt")

    return loop.run([{"role": "user", "content": "2+3?"}], reply)


def test_the_config_names_every_tool_format_the_kernel_reads():
    assert TOOL_CALL_PARSERS == ("auto", "none", *FORMATS)


def test_tool_call_parser_in_the_config_decides_how_the_loop_reads_calls():
    """A GLM model (auto: glm45) told hermes by the config reads the hermes call; left on auto it reads the same
    text as a glm45 call of a tool whose name is the JSON (which the loop reports as no such tool)."""
    told = runtime_with("glm4_moe", "--inference.tool_call_parser", "hermes")
    assert tool_format(told).name == "hermes"
    assert [s.describe() for s in run_loop(told, HERMES_CALL).steps] == ['add({"a": 2, "b": 3}) -> 5']
    auto = runtime_with("glm4_moe")
    assert tool_format(auto).name == "glm45"
    v32_exp = runtime_with("deepseek_v32", "--inference.tool_call_parser", "deepseek_v31")  # V3.2-Exp's calls
    assert (tool_format(runtime_with("deepseek_v32")).name, tool_format(v32_exp).name) == (
        "deepseek_v32",
        "deepseek_v31",
    )
    (misread,) = run_loop(auto, HERMES_CALL).steps
    assert misread.failed and misread.name == json.dumps({"name": "add", "arguments": {"a": 2, "b": 3}})


def test_tool_call_parser_none_refuses_tools_naming_the_key():
    with pytest.raises(ValueError, match=r"inference.tool_call_parser is none.*set it to auto"):
        tool_format(runtime_with("qwen3", "--inference.tool_call_parser", "none"))
    with pytest.raises(ValueError, match=r"no tool-call format.*inference.tool_call_parser"):
        tool_format(runtime_with("llama"))


def test_reasoning_parser_in_the_config_decides_what_is_reasoning():
    """A think-tag model's reply: apart by default, all of it answer (the tags as text) under ``none``."""
    request = GenerationRequest(messages=[{"role": "user", "content": "Hi"}])
    reply = ChatResponse("<think>Greet back.</think>Hello!", 10, 5, "stop", 0.1, 10.0, 1)
    auto = ReplyParts(request_format(runtime_with("qwen3"), request)).apart(reply)
    assert (auto.reasoning, auto.text) == ("Greet back.", "Hello!")
    told = runtime_with("qwen3", "--inference.reasoning_parser", "none")
    as_text = ReplyParts(request_format(told, request)).apart(reply)
    assert (as_text.reasoning, as_text.text) == ("", "<think>Greet back.</think>Hello!")
