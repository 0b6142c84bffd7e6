"""Each family's test template (``tests/family_templates.py``) against its documented format and shardbook's parsers.

Per family: the thinking switch shows at the prompt's end (and shardbook's reasoning parser sees a block the
prompt opened); earlier assistant ``tool_calls`` render in the family's own call format and read back as the same
calls through its tool-call parser, whole and streamed a character at a time; an assistant turn as the template
renders it, read as a reply, splits into the same reasoning and calls; and the prompts shardbook builds (the
endpoint's request with ``tool_calls``, ``role: "tool"`` and ``reasoning_content``, the notebook's conversation)
render through the template, keeping or dropping earlier reasoning as the family does.

A template joining an earlier call's arguments as text (DeepSeek-V3.1's own) gets the text the client sent, and a
template that cannot render a request is a 400 naming the template, on both of the endpoint's paths.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import requests

from shardbook.kernel.api.conversation import Conversation, template_options_for
from shardbook.kernel.api.reasoning import reasoning_format
from shardbook.kernel.api.replies import assistant_message
from shardbook.kernel.api.tool_calls import FORMATS, split_reply
from shardbook.kernel.api.tools import template_call
from shardbook.kernel.server.openai_api import parse_request
from shardbook.kernel.server.reasoning_reply import prompt_ids, template_options
from shardbook.kernel.server.tool_reply import request_tool_format, with_tools
from shardbook.rankd.generation.engine import build_prompt_ids
from tests.family_templates import FAMILIES
from tests.unit.test_reasoning_endpoint import serve  # noqa: F401  (the fixture: an in-process server per path)

NAMES = list(FAMILIES)
HELLO = [{"role": "user", "content": "Hello"}]
QUESTION = {"role": "user", "content": "Weather in Paris and Rome?"}
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
SCHEMAS = {"get_weather": TOOL["function"]["parameters"]}
CALLS = [("get_weather", {"city": "Paris", "days": 3}), ("get_weather", {"city": "Rome"})]
IDS = ["functions.get_weather:0", "functions.get_weather:1"]
"""Kimi-K2's ids (``functions.NAME:IDX``, the head of its calls); the other families ignore them."""
THOUGHT = "Two cities: two calls."
RESULTS = ["sunny", "rainy"]

ENDINGS = {
    "hermes": {True: "<|im_start|>assistant\n", False: "<|im_start|>assistant\n<think>\n\n</think>\n\n"},
    "glm45": {True: "<|user|>\nHello<|assistant|>", False: "<|user|>\nHello/nothink<|assistant|>\n<think></think>"},
    "glm5": {True: "<|user|>Hello<|assistant|><think>", False: "<|user|>Hello<|assistant|><think></think>"},
    **dict.fromkeys(
        ("deepseek_v31", "deepseek_v32"),
        {True: "<｜User｜>Hello<｜Assistant｜><think>", False: "<｜User｜>Hello<｜Assistant｜></think>"},
    ),
    "kimi_k2": dict.fromkeys(
        (True, False), "<|im_user|>user<|im_middle|>Hello<|im_end|><|im_assistant|>assistant<|im_middle|>"
    ),
    "minimax_m2": dict.fromkeys((True, False), "]~b]user\nHello[e~[\n]~b]ai\n<think>\n"),
}
"""Each family's documented prompt end for "Hello", thinking on and off: Kimi-K2-Instruct has no switch and
MiniMax-M2 always thinks."""
OPENS_REASONING = {"glm5": {True}, "deepseek_v31": {True}, "deepseek_v32": {True}, "minimax_m2": {True, False}}
"""Where the prompt itself opens the think block (so the reply starts inside reasoning), by thinking on/off."""
CALL_ENDS = {
    "hermes": "</tool_call>",
    "glm45": "</tool_call>",
    "deepseek_v31": "<｜tool▁calls▁end｜>",
    "deepseek_v32": "</｜DSML｜function_calls>",
    "kimi_k2": "<|tool_calls_section_end|>",
    "minimax_m2": "</minimax:tool_call>",
}
"""What ends the last call of a turn, by parser."""
CALL_TURNS = {
    "hermes": "<|im_start|>assistant\n<think>\nTwo cities: two calls.\n</think>\n\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>\n<tool_call>\n'
    '{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call><|im_end|>\n',
    "glm45": "<|assistant|>\n<think>Two cities: two calls.</think>\n<tool_call>get_weather\n<arg_key>city</arg_key>\n"
    "<arg_value>Paris</arg_value>\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>\n"
    "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Rome</arg_value>\n</tool_call><|observation|>",
    "glm5": "<|assistant|><think>Two cities: two calls.</think><tool_call>get_weather<arg_key>city</arg_key>"
    "<arg_value>Paris</arg_value><arg_key>days</arg_key><arg_value>3</arg_value></tool_call><tool_call>get_weather"
    "<arg_key>city</arg_key><arg_value>Rome</arg_value></tool_call><|observation|>",
    "deepseek_v31": "<｜Assistant｜></think><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
    '{"city": "Paris", "days": 3}<｜tool▁call▁end｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Rome"}'
    "<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜><｜tool▁output▁begin｜>",
    "deepseek_v32": '<｜Assistant｜></think>\n\n<｜DSML｜function_calls>\n<｜DSML｜invoke name="get_weather">\n'
    '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n'
    '<｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>\n</｜DSML｜invoke>\n'
    '<｜DSML｜invoke name="get_weather">\n<｜DSML｜parameter name="city" string="true">Rome</｜DSML｜parameter>\n'
    "</｜DSML｜invoke>\n</｜DSML｜function_calls><｜end▁of▁sentence｜>\n\n<function_results>\n<result>",
    "kimi_k2": "<|im_assistant|>assistant<|im_middle|><|tool_calls_section_begin|><|tool_call_begin|>"
    'functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris", "days": 3}<|tool_call_end|>'
    '<|tool_call_begin|>functions.get_weather:1<|tool_call_argument_begin|>{"city": "Rome"}<|tool_call_end|>'
    "<|tool_calls_section_end|><|im_end|><|im_system|>get_weather<|im_middle|>",
    "minimax_m2": "]~b]ai\n<think>\nTwo cities: two calls.\n</think>\n\n\n<minimax:tool_call>\n"
    '<invoke name="get_weather">\n<parameter name="city">Paris</parameter>\n<parameter name="days">3</parameter>\n'
    '</invoke>\n<invoke name="get_weather">\n<parameter name="city">Rome</parameter>\n</invoke>\n'
    "</minimax:tool_call>[e~[\n]~b]tool",
}
"""The call turn inside a tool loop as each family writes it, to the character (its reasoning kept or not, the
calls, the turn's end and the next turn's start)."""
RESULT_SHAPES = {
    "hermes": "<tool_response>\n{}\n</tool_response>",
    "glm45": "<tool_response>\n{}\n</tool_response>",
    "glm5": "<tool_response>{}</tool_response>",
    "deepseek_v31": "<｜tool▁output▁begin｜>{}<｜tool▁output▁end｜>",
    "deepseek_v32": "<result>{}</result>",
    "kimi_k2": "## Return of {id}\n{}<|im_end|>",
    "minimax_m2": "<response>{}</response>",
}
KEEPS_LOOP_REASONING = {"hermes", "glm45", "glm5", "deepseek_v32", "minimax_m2"}
"""Families whose template, thinking on, keeps the reasoning of the assistant turns after the last user message (a
tool loop's steps); DeepSeek-V3.1 drops all earlier reasoning, Kimi-K2-Instruct has none."""
TURN_ENDS = {
    "hermes": "<|im_end|>\n",
    "deepseek_v31": "<｜end▁of▁sentence｜>",
    "deepseek_v32": "<｜end▁of▁sentence｜>",
    "kimi_k2": "<|im_end|>",
    "minimax_m2": "[e~[\n",
}
"""The end-of-turn marker a rendered assistant turn closes with (a model stops on it; it is no part of a reply)."""


def call_turn(reasoning: str | None = THOUGHT) -> dict:
    """The assistant's turn calling get_weather twice, as templates read it (arguments as mappings)."""
    calls = [
        {"id": i, "type": "function", "function": {"name": name, "arguments": args}}
        for i, (name, args) in zip(IDS, CALLS, strict=True)
    ]
    turn = {"role": "assistant", "content": "", "tool_calls": calls}
    return {**turn, "reasoning_content": reasoning} if reasoning else turn


def results() -> list[dict]:
    return [
        {"role": "tool", "tool_call_id": i, "name": "get_weather", "content": r}
        for i, r in zip(IDS, RESULTS, strict=True)
    ]


def render(name: str, messages: list[dict], generation: bool = True, **options) -> str:
    return (
        FAMILIES[name]
        .tokenizer()
        .apply_chat_template(messages, tools=[TOOL], add_generation_prompt=generation, tokenize=False, **options)
    )


def read(calls) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


def call_text(name: str, prompt: str) -> str:
    """The calls of the assistant's turn in a rendered prompt: from the first call's start after the question (the
    tools' instructions before it show the format too) to the end of the last call."""
    fmt = FORMATS[FAMILIES[name].parser]
    after = prompt[prompt.index(QUESTION["content"]) :]
    start, end = fmt.call_start(after), after.rindex(CALL_ENDS[fmt.name]) + len(CALL_ENDS[fmt.name])
    assert start is not None, after
    return after[start:end]


def test_every_family_has_a_template_and_its_parser():
    assert set(ENDINGS) == set(CALL_TURNS) == set(FAMILIES) and {f.parser for f in FAMILIES.values()} <= set(FORMATS)


@pytest.mark.parametrize("name", NAMES)
def test_the_thinking_switch_shows_at_the_prompts_end(name):
    family = FAMILIES[name]
    tokenizer = family.tokenizer()
    prompts = {}
    for on in (True, False):
        # shardbook's choice of switch: the one the template reads, both where it reads neither
        options = template_options_for(family.template, on, {})
        assert list(options) == ([family.thinking] if family.thinking else ["enable_thinking", "thinking"])
        ids = build_prompt_ids(tokenizer, HELLO, options)[0].tolist()
        text = tokenizer.apply_chat_template(HELLO, add_generation_prompt=True, tokenize=False, **options)
        assert text.endswith(ENDINGS[name][on]), text
        assert tokenizer.decode(ids, skip_special_tokens=False) == text  # the ids are the text's
        in_reasoning = reasoning_format(SimpleNamespace(model_type=family.model_type), tokenizer, ids).in_reasoning
        assert in_reasoning == (on in OPENS_REASONING.get(name, ())), text
        prompts[on] = ids
    assert (prompts[True] != prompts[False]) == (family.thinking is not None)


def test_deepseek_thinks_only_when_asked():
    """DeepSeek's ``thinking`` defaults to off (GLM's and Qwen3's ``enable_thinking`` to on)."""
    assert render("deepseek_v31", HELLO).endswith("<｜Assistant｜></think>")
    assert render("deepseek_v32", HELLO).endswith("<｜Assistant｜></think>")
    assert render("glm5", HELLO).endswith("<|assistant|><think>")


@pytest.mark.parametrize("name", NAMES)
def test_earlier_calls_render_in_the_family_format_and_read_back_whole_and_streamed(name):
    prompt = render(name, [QUESTION, call_turn(), *results()])
    assert CALL_TURNS[name] in prompt, prompt
    text = call_text(name, prompt)
    fmt = FORMATS[FAMILIES[name].parser]
    whole = fmt.parse(text, SCHEMAS)
    assert not whole.malformed and read(whole.calls) == CALLS, text
    stream = fmt.stream(SCHEMAS)
    assert all(stream.feed(ch).content == "" for ch in text)  # a call's text never leaks as content
    streamed = stream.finish()
    assert read(streamed.calls) == CALLS and streamed.content == ""
    if name == "kimi_k2":  # the call's head is its id, and the id survives the round trip
        assert [c.id for c in whole.calls] == [c.id for c in streamed.calls] == IDS
    for call_id, result in zip(IDS, RESULTS, strict=True):
        assert prompt.count(RESULT_SHAPES[name].format(result, id=call_id)) == 1, prompt


ANSWER = {"role": "assistant", "content": "Hi!", "reasoning_content": THOUGHT}


@pytest.mark.parametrize("turn", ["calls", "answer"])
@pytest.mark.parametrize("name", NAMES)
def test_a_rendered_assistant_turn_read_as_a_reply_gives_its_reasoning_content_and_calls(name, turn):
    """What the template writes for an earlier turn is what the model was taught to write after the generation
    prompt: the history renders as a prefix of the turn, and the rest, read by shardbook's reasoning and tool
    parsers (the reply starting inside reasoning where the prompt opened the block), is the same turn; kept as the
    notebook's tool loop keeps it, it renders back to the very same text."""
    family = FAMILIES[name]
    tokenizer = family.tokenizer()
    thinking = name != "deepseek_v31"  # DeepSeek-V3.1 renders earlier turns (and calls tools) in non-thinking mode
    options = template_options_for(family.template, thinking, {})
    message, content, calls = (call_turn(), "", CALLS) if turn == "calls" else (ANSWER, "Hi!", [])
    asked = render(name, [QUESTION], **options)
    rendered = render(name, [QUESTION, message], generation=False, **options)
    assert rendered.startswith(asked), (asked, rendered)
    reply = rendered[len(asked) :].removesuffix(TURN_ENDS.get(name, ""))
    ids = build_prompt_ids(tokenizer, [QUESTION], {**options, "tools": [TOOL]})[0].tolist()
    fmt = reasoning_format(SimpleNamespace(model_type=family.model_type), tokenizer, ids)
    reasoning, parsed = split_reply(reply, fmt, FORMATS[family.parser], schemas=SCHEMAS)
    expected = THOUGHT if name in KEEPS_LOOP_REASONING else ""
    assert (reasoning, parsed.content, read(parsed.calls)) == (expected, content, calls), reply
    calls_kept = {"tool_calls": [template_call(c) for c in parsed.calls]} if parsed.calls else {}
    kept = assistant_message(parsed.content, reasoning, **calls_kept)  # as the loop keeps a step or its answer
    assert render(name, [QUESTION, kept], generation=False, **options) == rendered


def endpoint_prompt(name: str, reasoning: str | None) -> tuple[list[int], str]:
    """The prompt shardbook's endpoint builds for a client's request with thinking on, carrying an assistant's calls
    (arguments as JSON text, content null), their results and the assistant's reasoning: parsed, its template
    options and tools added, rendered; with the text."""
    family = FAMILIES[name]
    tokenizer = family.tokenizer()
    turn = call_turn(reasoning)
    for call in turn["tool_calls"]:
        call["function"]["arguments"] = json.dumps(call["function"]["arguments"])
    body = {"model": "m", "messages": [QUESTION, {**turn, "content": None}, *results()], "tools": [TOOL]}
    if family.thinking:  # thinking on, where a family switches it
        body["chat_template_kwargs"] = {family.thinking: True}
    request = parse_request(json.dumps(body).encode())
    loaded = SimpleNamespace(
        tokenizer=tokenizer, model=SimpleNamespace(config=SimpleNamespace(model_type=family.model_type))
    )
    assert request_tool_format(loaded, request.tools, "auto") is FORMATS[family.parser]  # chosen by model_type
    parser = reasoning_format(loaded.model.config, tokenizer).name
    options = with_tools(template_options(parser, tokenizer, request.chat_template_kwargs, None), request.tools)
    ids = prompt_ids(tokenizer, request.messages, options)
    return ids, tokenizer.decode(ids, skip_special_tokens=False)


@pytest.mark.parametrize("name", NAMES)
def test_the_endpoints_prompt_renders_calls_results_and_the_loops_reasoning_as_the_family_does(name):
    with_reasoning, text = endpoint_prompt(name, THOUGHT)
    without, _ = endpoint_prompt(name, None)
    assert read(FORMATS[FAMILIES[name].parser].parse(call_text(name, text), SCHEMAS).calls) == CALLS
    assert all(RESULT_SHAPES[name].format(r, id=i) in text for i, r in zip(IDS, RESULTS, strict=True))
    # the call turn comes after the last user message: a tool loop's step, whose reasoning most families keep
    assert (THOUGHT in text) == (name in KEEPS_LOOP_REASONING)
    assert (len(with_reasoning) > len(without)) == (name in KEEPS_LOOP_REASONING)


@pytest.mark.parametrize("name", NAMES)
def test_the_next_turn_drops_the_reasoning_of_earlier_turns(name):
    """The notebook's conversation sends an answered turn's reasoning back (``reasoning_content``); every family's
    template drops it once a new user message follows, and GLM-5 keeps it when told ``clear_thinking=false``."""
    family = FAMILIES[name]
    tokenizer = family.tokenizer()
    prompts = {}
    for reasoning in (THOUGHT, ""):
        conversation = Conversation(thinking=True)
        conversation.add_turn("Hello", "Hi!", "stop", reasoning=reasoning)
        options = template_options_for(family.template, conversation.thinking, {})
        prompts[reasoning] = build_prompt_ids(tokenizer, conversation.request_messages("And you?"), options)
    assert prompts[THOUGHT].tolist() == prompts[""].tolist()
    if name == "glm5":
        kept = Conversation(thinking=True, template_options={"clear_thinking": False})
        kept.add_turn("Hello", "Hi!", "stop", reasoning=THOUGHT)
        options = template_options_for(family.template, True, kept.template_options)
        ids = build_prompt_ids(tokenizer, kept.request_messages("And you?"), options)[0].tolist()
        assert THOUGHT in tokenizer.decode(ids) and len(ids) > prompts[""].shape[1]


TEXT_ARGUMENTS = (
    "{% if tools %}{{ tools | length }} tools{% endif %}{% for m in messages %}{{ m.content }}"
    "{% for c in m.tool_calls or [] %}{{ c.function.name + '<｜tool▁sep｜>' + c.function.arguments }}{% endfor %}"
    "{% endfor %}"
)
"""A template that joins an earlier call's arguments as text, as DeepSeek-V3's and V3.1's own templates do
(``... + tool['function']['arguments'] + ...``), where transformers' convention hands templates a mapping."""
REFUSING_TEMPLATES = {
    "raise_exception": "{{ tools | length }}{% for m in messages %}{% if m.role == 'tool' %}"
    "{{ raise_exception('Tool results are not supported') }}{% endif %}{{ m.content }}{% endfor %}",
    "TypeError": "{{ tools | length }}{% for m in messages %}{{ m.content + 1 }}{% endfor %}",
}
"""Templates that cannot render the tool loop's request: one refusing it with its own message, one failing on a
value's type."""
SENT_ARGUMENTS = '{"city":"Paris"}'
"""A call's arguments as a client may write them (compact: not as ``json.dumps`` would)."""


def tool_loop_body() -> dict:
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": SENT_ARGUMENTS}}
    messages = [QUESTION, {"role": "assistant", "content": None, "tool_calls": [call]}]
    return {"model": "m", "messages": [*messages, {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]}


def test_a_template_joining_call_arguments_as_text_gets_the_text_the_client_sent():
    """The endpoint's messages, as every rank receives them (JSON), render through such a template with the
    arguments as the client wrote them; a template reading them as a mapping still gets one."""
    request = parse_request(json.dumps({**tool_loop_body(), "tools": [TOOL]}).encode())
    messages = json.loads(json.dumps(request.messages))
    tokenizer = FAMILIES["deepseek_v31"].tokenizer()
    tokenizer.chat_template = TEXT_ARGUMENTS
    ids = build_prompt_ids(tokenizer, messages, with_tools({}, request.tools))[0].tolist()
    assert f"get_weather<｜tool▁sep｜>{SENT_ARGUMENTS}" in tokenizer.decode(ids)
    hermes = FAMILIES["hermes"].tokenizer()
    text = hermes.decode(build_prompt_ids(hermes, messages, with_tools({}, request.tools))[0].tolist())
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in text


@pytest.mark.timeout(60)
def test_a_template_that_cannot_render_the_request_is_a_400_naming_the_template(serve):  # noqa: F811
    client, tokenizer = serve("think")
    tokenizer.chat_template = TEXT_ARGUMENTS
    url = f"{client.base_url}chat/completions"
    joined = requests.post(url, json={**tool_loop_body(), "tools": [TOOL]}, timeout=30)
    assert joined.status_code == 200, joined.text  # DeepSeek-V3.1's way of writing arguments renders
    for kind, template in REFUSING_TEMPLATES.items():
        tokenizer.chat_template = template
        for stream in (False, True):
            reply = requests.post(url, json={**tool_loop_body(), "tools": [TOOL], "stream": stream}, timeout=30)
            assert reply.status_code == 400, (kind, reply.text)
            error = reply.json()["error"]
            assert error["type"] == "invalid_request_error" and "chat template" in error["message"], error
            cause = "Tool results are not supported" if kind == "raise_exception" else "can only concatenate str"
            assert cause in error["message"] and "change the conversation" in error["message"], error
