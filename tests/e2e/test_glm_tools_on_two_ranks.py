"""GLM-5's reasoning and tool calls on 2 ranks, on real generated tokens: a tiny model taught under the GLM-5 test
template (``tests/family_templates.py``, whose prompt opens ``<think>``) to think, then call in GLM's format, and to
answer the call's result; served by ``shardbook serve --nproc 2 --tool-call-parser glm45`` and read back by the
openai client as ``reasoning_content`` and ``message.tool_calls``, whole and streamed, with thinking on and off,
then the call's result sent back (with the reasoning the template keeps inside a tool loop) to the final answer."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from openai import OpenAI

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from tool_serve_check import MODEL, read

from tests.e2e.test_terminal_serve import serving_float32
from tests.family_templates import FAMILIES
from tests.taught import ANSWER, QUESTION, RESULT, TOOL, get_weather, rendered, save_taught, teach

pytestmark = pytest.mark.timeout(420)
THOUGHT = "A city: call the tool."
CALL = "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value></tool_call>"
CALL_TURN = {
    "role": "assistant",
    "content": "",
    "reasoning_content": THOUGHT,
    "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
}
SECOND_THOUGHT = "It said sunny."
EXAMPLES = [
    (QUESTION, {"tools": [TOOL]}, f"{THOUGHT}</think>{CALL}"),  # the prompt opened <think>
    (QUESTION, {"tools": [TOOL], "enable_thinking": False}, CALL),  # the prompt closed an empty block
    ([*QUESTION, CALL_TURN, RESULT], {"tools": [TOOL]}, f"{SECOND_THOUGHT}</think>{ANSWER}"),
]
"""What the model is taught: (messages, template options, reply), rendered by the GLM-5 template."""
PARIS = [("get_weather", {"city": "Paris"})]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tokenizer = FAMILIES["glm5"].tokenizer()
    model = teach(tokenizer, rendered(tokenizer, EXAMPLES), max_steps=600)
    checkpoint = save_taught(tmp_path_factory.mktemp("glm-tools") / MODEL, model, tokenizer)
    with serving_float32(checkpoint, "--tool-call-parser", "glm45") as server:
        yield server


def test_glm5_reasoning_and_call_read_back_then_the_answer(served):
    client = OpenAI(base_url=served.url, api_key="none", max_retries=0)
    whole, streamed = read(client, QUESTION)
    assert whole == ["tool_calls", THOUGHT, None, PARIS], whole
    assert streamed == ["tool_calls", THOUGHT, "", PARIS], streamed
    ask = dict(model=MODEL, messages=QUESTION, tools=[TOOL], temperature=0, max_tokens=80)
    off = client.chat.completions.create(**ask, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    message = off.choices[0].message
    assert getattr(message, "reasoning_content", None) is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == PARIS
    call = client.chat.completions.create(**ask).choices[0].message
    result = get_weather(**json.loads(call.tool_calls[0].function.arguments))
    sent_back = call.model_dump(exclude_none=True)
    assert sent_back["reasoning_content"] == THOUGHT  # the template keeps it: the step is inside the tool loop
    turns = [
        *QUESTION,
        sent_back,
        {"role": "tool", "tool_call_id": call.tool_calls[0].id, "content": result},
    ]
    answer = client.chat.completions.create(**{**ask, "messages": turns}).choices[0]
    assert (answer.finish_reason, answer.message.reasoning_content, answer.message.content) == (
        "stop",
        SECOND_THOUGHT,
        ANSWER,
    )
