"""The tool loop's pieces that need no kernel: schemas from functions, running a call, and the loop itself fed
scripted replies in the hermes format (as a model writes them; the 2-rank run is in tests/e2e/test_chat_tools.py)."""

from __future__ import annotations

import json

import pytest

from shardbook.kernel.api.chat import ChatResponse
from shardbook.kernel.api.reasoning import ReasoningFormat
from shardbook.kernel.api.replies import ReplyParts
from shardbook.kernel.api.tool_calls import FORMATS, make_call
from shardbook.kernel.api.tools import ModelReply, ToolLoop, call_tool, tool_schemas

HERMES = FORMATS["hermes"]


def add(a: int, b: int) -> int:
    """Add two numbers.

    Args:
        a: the first number
        b: the second number
    """
    return a + b


def divide(a: float, b: float) -> float:
    """Divide a by b.

    Args:
        a: the dividend
        b: the divisor
    """
    return a / b


def undocumented(a):
    return a


def call(name: str, **arguments) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def scripted(*texts: str, finish_reason: str = "stop"):
    """A `reply` for ToolLoop.run that answers with `texts` in turn and records what it was asked."""
    asked: list[list[dict]] = []

    def reply(messages):
        asked.append(messages)
        text = texts[len(asked) - 1]
        response = ChatResponse(text, 10, 5, finish_reason, 0.1, 10.0, 1)
        return ModelReply(response, ReplyParts(ReasoningFormat("think"), HERMES), messages, f"prompt {len(asked)}")

    return reply, asked


def test_schemas_come_from_signatures_and_docstrings():
    [schema] = tool_schemas([add])
    assert schema["function"]["name"] == "add" and schema["function"]["description"] == "Add two numbers."
    assert schema["function"]["parameters"]["properties"]["a"] == {"type": "integer", "description": "the first number"}
    with pytest.raises(ValueError, match="cannot describe the tool 'undocumented'.*type hints on every argument"):
        tool_schemas([undocumented])
    with pytest.raises(ValueError, match="two tools are named 'add'"):
        tool_schemas([add, add])
    with pytest.raises(ValueError, match="non-empty list of Python functions"):
        tool_schemas([])


def test_a_call_that_raises_or_names_no_tool_becomes_the_error_text():
    functions = {"add": add, "divide": divide}
    assert call_tool(functions, make_call("add", {"a": 2, "b": 3})) == ({"a": 2, "b": 3}, "5", False)
    assert call_tool(functions, make_call("divide", {"a": 1, "b": 0}))[1:] == (
        "error: ZeroDivisionError: division by zero",
        True,
    )
    assert call_tool(functions, make_call("mul", {"a": 1}))[1:] == (
        "error: there is no tool named 'mul'; the tools are add, divide",
        True,
    )
    _, text, failed = call_tool(functions, make_call("add", {"a": 1, "c": 2}))
    assert failed and text.startswith("error: TypeError: ") and "'c'" in text


def test_two_calls_then_an_answer_with_every_step_kept():
    reply, asked = scripted(
        "<think>Add first.</think>" + call("add", a=2, b=3),
        call("divide", a=5, b=0),
        "<think>Done.</think>It is 5, and 5/0 fails.",
    )
    shown = []
    loop = ToolLoop([add, divide], HERMES, on_step=shown.append)
    response = loop.run([{"role": "user", "content": "2+3, then /0?"}], reply)
    assert (response.text, response.reasoning, response.finish_reason) == ("It is 5, and 5/0 fails.", "Done.", "stop")
    assert [s.describe() for s in response.steps] == [
        'add({"a": 2, "b": 3}) -> 5',
        'divide({"a": 5, "b": 0}) -> error: ZeroDivisionError: division by zero',
    ]
    assert shown == list(response.steps) and [s.failed for s in shown] == [False, True]
    assert response.steps[1].prompt == "prompt 2" and response.steps[1].messages == tuple(asked[1])
    first_call, first_result = asked[1][1:]
    assert first_call["role"] == "assistant" and first_call["content"] == ""
    assert first_call["reasoning_content"] == "Add first."
    assert first_call["tool_calls"][0]["function"] == {"name": "add", "arguments": {"a": 2, "b": 3}}
    assert first_result == {
        "role": "tool",
        "tool_call_id": first_call["tool_calls"][0]["id"],
        "name": "add",
        "content": "5",
    }
    assert asked[2][-1]["content"] == "error: ZeroDivisionError: division by zero"


def test_the_cap_on_steps_stops_the_loop_with_a_message():
    reply, asked = scripted(call("add", a=1, b=1), call("add", a=2, b=2), call("add", a=3, b=3))
    loop = ToolLoop([add], HERMES, max_steps=2)
    response = loop.run([{"role": "user", "content": "count"}], reply)
    assert len(asked) == 3 and len(response.steps) == 2
    assert "stopped after 2 tool calls" in loop.limit_message and "max-tool-steps" in loop.limit_message
    with pytest.raises(ValueError, match="max_tool_steps must be at least 1"):
        ToolLoop([add], HERMES, max_steps=0)


def test_an_interrupt_in_a_tool_ends_the_loop_with_the_steps_so_far():
    def slow(n: int) -> int:
        """Wait.

        Args:
            n: how long
        """
        raise KeyboardInterrupt

    reply, asked = scripted(call("add", a=1, b=2), call("slow", n=9), "never")
    response = ToolLoop([add, slow], HERMES).run([{"role": "user", "content": "go"}], reply)
    assert response.finish_reason == "interrupted" and len(asked) == 2
    assert [(s.name, s.result) for s in response.steps] == [("add", "3"), ("slow", "error: interrupted")]


def test_a_reply_cut_short_is_not_read_for_calls():
    reply, _ = scripted(call("add", a=1, b=2), finish_reason="length")
    response = ToolLoop([add], HERMES).run([{"role": "user", "content": "go"}], reply)
    assert response.finish_reason == "length" and response.steps == ()


def test_a_stop_between_two_steps_ends_the_loop_before_the_next_reply():
    reply, asked = scripted(call("add", a=1, b=2), "never")
    loop = ToolLoop([add], HERMES, on_step=lambda step: loop.stop())  # as the stop button between two steps
    response = loop.run([{"role": "user", "content": "go"}], reply)
    assert response.finish_reason == "interrupted" and len(asked) == 1
    assert [s.result for s in response.steps] == ["3"]


def test_the_loop_types_bare_values_by_the_tools_schemas():
    """glm45 writes values bare: a string parameter's ``123`` reaches the tool as the string "123", an integer's
    ``7`` as 7 (read by the tools' parameter schemas, as the endpoint reads them)."""

    def repeat(code: str, times: int) -> str:
        """Repeat a code.

        Args:
            code: the code, digits or letters
            times: how many times
        """
        return type(code).__name__ + ":" + code * times

    loop = ToolLoop([repeat], FORMATS["glm45"])
    glm_call = (
        "<tool_call>repeat\n<arg_key>code</arg_key>\n<arg_value>123</arg_value>\n"
        "<arg_key>times</arg_key>\n<arg_value>2</arg_value>\n</tool_call>"
    )
    texts = iter([glm_call, "Done."])

    def reply(messages):
        response = ChatResponse(next(texts), 10, 5, "stop", 0.1, 10.0, 1)
        return ModelReply(response, loop.reply_parts(ReasoningFormat("none")), messages, "prompt")

    response = loop.run([{"role": "user", "content": "repeat 123 twice"}], reply)
    assert [(s.arguments, s.result) for s in response.steps] == [({"code": "123", "times": 2}, "str:123123")]
