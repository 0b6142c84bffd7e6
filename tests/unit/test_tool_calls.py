"""Tool-call formats: every family's calls read whole and streamed at every chunk boundary, malformed calls,
text around calls, calls after reasoning, and the choice of a format from a model's config and vocabulary."""

from __future__ import annotations

import json

import pytest

from shardbook.kernel.api.reasoning import ReasoningFormat
from shardbook.kernel.api.tool_calls import FORMATS, ReplyStream, ToolCall, split_reply, tool_format_for

WEATHER = ("get_weather", {"city": "Paris"})
TIME = ("get_time", {"zone": "UTC", "precise": True})
DS_CALL = "<｜tool▁call▁begin｜>{}<｜tool▁sep｜>{}<｜tool▁call▁end｜>"
DS_CALLS = "<｜tool▁calls▁begin｜>{}<｜tool▁calls▁end｜>"
KIMI_CALL = "<|tool_call_begin|>functions.{}:{}<|tool_call_argument_begin|>{}<|tool_call_end|>"
KIMI_CALLS = "<|tool_calls_section_begin|>{}<|tool_calls_section_end|>"
HARMONY_CALL = "<|start|>assistant<|channel|>commentary to=functions.{} <|constrain|>json<|message|>{}<|call|>"


def hermes(name, args):
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(args)}}}\n</tool_call>'


def glm(name, args):
    pairs = "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{json.dumps(v)}</arg_value>\n" for k, v in args.items())
    return f"<tool_call>{name}\n{pairs}</tool_call>"


def minimax(*calls):
    invokes = "".join(
        f'<invoke name="{n}">\n'
        + "".join(
            f'<parameter name="{k}">{v if isinstance(v, str) else json.dumps(v)}</parameter>\n' for k, v in a.items()
        )
        + "</invoke>\n"
        for n, a in calls
    )
    return f"<minimax:tool_call>\n{invokes}</minimax:tool_call>"


def ds(*calls):
    return DS_CALLS.format("".join(DS_CALL.format(n, json.dumps(a)) for n, a in calls))


def kimi(*calls):
    return KIMI_CALLS.format("".join(KIMI_CALL.format(n, i, json.dumps(a)) for i, (n, a) in enumerate(calls)))


def harmony(name, args):
    return HARMONY_CALL.format(name, json.dumps(args))


def dsml(*calls):
    """DeepSeek-V3.2's calls as its encoding writes them: strings bare with string="true", others JSON."""

    def parameter(key, value):
        string = isinstance(value, str)
        text = value if string else json.dumps(value)
        return f'<｜DSML｜parameter name="{key}" string="{str(string).lower()}">{text}</｜DSML｜parameter>'

    invokes = [
        f'<｜DSML｜invoke name="{n}">\n' + "\n".join(parameter(k, v) for k, v in a.items()) + "\n</｜DSML｜invoke>"
        for n, a in calls
    ]
    return "\n\n<｜DSML｜function_calls>\n" + "\n".join(invokes) + "\n</｜DSML｜function_calls>"


DSML_WEATHER = (
    '<｜DSML｜invoke name="get_weather">\n<｜DSML｜parameter name="city" {}</｜DSML｜parameter>\n</｜DSML｜invoke>'
)
CITY = 'string="true">Paris</｜DSML｜parameter><｜DSML｜parameter name="city" string="true">Rome'
"""Two values of the city parameter, as DSML_WEATHER's argument."""
NOTE = ("take_note", {"text": "a < b\n  </think> 007", "id": "007", "tags": ["x"], "due": None})


BAD_JSON = '{"city": Paris}'
CASES = [
    ("hermes", hermes(*WEATHER), "", [WEATHER]),
    ("hermes", "Let me look.\n\n" + hermes(*WEATHER) + "\n" + hermes(*TIME), "Let me look.", [WEATHER, TIME]),
    ("hermes", hermes(*WEATHER) + "\nDone calling.", "Done calling.", [WEATHER]),
    ("hermes", "No call here, a < b <tool", "No call here, a < b <tool", []),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": ' + BAD_JSON + "}\n</tool_call>", None, []),
    ("hermes", "Sure. " + hermes(*WEATHER) + '<tool_call>{"name": "x"', None, []),  # the second never closes
    ("glm45", "Checking.\n" + glm(*WEATHER) + glm(*TIME), "Checking.", [WEATHER, TIME]),
    ("glm45", "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value></tool_call>", "", [WEATHER]),
    ("glm45", "<tool_call>get_time\n</tool_call>", "", [("get_time", {})]),
    ("glm45", "<tool_call>get_weather\n<arg_key>city</arg_key>\n</tool_call>", None, []),  # a key with no value
    ("deepseek_v31", "On it." + ds(WEATHER, TIME), "On it.", [WEATHER, TIME]),
    ("deepseek_v31", ds(("get_weather", {}))[:-20], None, []),  # cut inside the call
    ("deepseek_v31", DS_CALLS.format(DS_CALL.format("get_weather", BAD_JSON)), None, []),
    ("deepseek_v32", "On it." + dsml(WEATHER, TIME), "On it.", [WEATHER, TIME]),
    ("deepseek_v32", dsml(NOTE, ("get_time", {})) + "\nDone.", "Done.", [NOTE, ("get_time", {})]),
    ("deepseek_v32", DSML_WEATHER.format('string="true">Paris'), "", [WEATHER]),  # no function_calls around it
    ("deepseek_v32", "<｜DSML｜function_calls>\n" + DSML_WEATHER.format('string="false">Paris'), None, []),
    ("deepseek_v32", dsml(WEATHER).replace(' string="true"', ""), None, []),  # a parameter without its type
    ("deepseek_v32", dsml(WEATHER).replace("</｜DSML｜invoke>", "").rstrip(), None, []),  # never closed
    ("deepseek_v32", dsml(("get_weather", {"city": "Paris", "days": 2}))[:-60], None, []),  # cut short
    ("deepseek_v32", "<｜DSML｜function_calls>\n</｜DSML｜function_calls>", None, []),  # no call inside
    ("deepseek_v32", "<｜DSML｜function_calls>" + DSML_WEATHER.format(CITY), None, []),  # city twice
    ("deepseek_v32", dsml(WEATHER).replace("</｜DSML｜parameter>", "</｜DSML｜parameter>" * 2), None, []),
    ("deepseek_v32", "A <｜DSML｜ mention, and <｜DSML｜invoke", "A <｜DSML｜ mention, and <｜DSML｜invoke", []),
    ("kimi_k2", "Let me see." + kimi(WEATHER, TIME), "Let me see.", [WEATHER, TIME]),
    ("kimi_k2", KIMI_CALLS.format("<|tool_call_begin|>get_weather<|tool_call_end|>"), None, []),
    ("minimax_m2", "Looking.\n" + minimax(("get_weather", {"city": "Paris"}), TIME), "Looking.", [WEATHER, TIME]),
    ("minimax_m2", '<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Paris', None, []),
    ("harmony", harmony(*WEATHER)[len("<|start|>assistant") :], "", [WEATHER]),  # the prompt opened the message
    (
        "harmony",
        "<|channel|>analysis<|message|>Need the weather.<|end|>" + harmony(*WEATHER),
        "<|channel|>analysis<|message|>Need the weather.<|end|>",
        [WEATHER],
    ),
    (
        "harmony",
        "<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{}",
        "",
        [("get_weather", {})],
    ),
    (
        "harmony",
        "<|channel|>final<|message|>Just text.<|return|>",
        "<|channel|>final<|message|>Just text.<|return|>",
        [],
    ),
    ("harmony", "<|channel|>commentary to=functions.get_weather<|message|>" + BAD_JSON + "<|call|>", None, []),
]
"""(format, reply, expected content or None for a malformed reply, which is then all content, expected calls)."""


def plain(content, calls, malformed=False):
    return content, [(c.name, json.loads(c.arguments)) for c in calls], malformed


def expected(text, content, calls):
    return (text, [], True) if content is None else (content, [(n, a) for n, a in calls], False)


@pytest.mark.parametrize("name, text, content, calls", CASES)
def test_whole_reply(name, text, content, calls):
    reply = FORMATS[name].parse(text)
    assert plain(reply.content, reply.calls, reply.malformed) == expected(text, content, calls)


@pytest.mark.parametrize("name, text, content, calls", CASES)
def test_streamed_at_every_boundary(name, text, content, calls):
    """Cut in two at every boundary, and fed a character at a time."""
    want = FORMATS[name].parse(text)
    for pieces in [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]:
        stream = FORMATS[name].stream()
        deltas = [stream.feed(piece) for piece in pieces] + [stream.finish()]
        got = plain("".join(d.content for d in deltas), [c for d in deltas for c in d.calls], stream.malformed)
        assert got == plain(want.content, want.calls, want.malformed), pieces


def test_a_stream_holds_back_only_what_could_start_a_call():
    stream = FORMATS["hermes"].stream()
    assert stream.feed("Let me check <tool").content == "Let me check"
    assert stream.feed("ing> it.").content == " <tooling> it."
    assert stream.feed("\n<tool_call>").content == ""
    assert stream.in_call
    assert stream.feed('{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>').content == ""
    end = stream.finish()
    assert end.content == "" and [c.name for c in end.calls] == ["get_weather"]
    header = FORMATS["harmony"].stream()
    assert header.feed("<|channel|>analysis<|message|>Hmm").content == "<|channel|>analysis<|message|>Hmm"
    assert header.feed("<|end|><|start|>assistant<|channel|>commentary").content == "<|end|>"  # may name a tool
    assert header.feed("<|message|>Preamble.").content == "<|start|>assistant<|channel|>commentary<|message|>Preamble."


def test_calls_after_reasoning():
    think = ReasoningFormat("think")
    text = "<think>Maybe <tool_call>no</tool_call> here.</think>\n\nSure.\n" + hermes(*WEATHER)
    reasoning, reply = split_reply(text, think, FORMATS["hermes"])
    assert reasoning == "Maybe <tool_call>no</tool_call> here."  # a call inside the reasoning is thought, not made
    assert plain(reply.content, reply.calls) == ("Sure.", [WEATHER], False)
    gpt_oss = "<|channel|>analysis<|message|>Need the weather.<|end|>" + harmony(*WEATHER)
    reasoning, reply = split_reply(gpt_oss, ReasoningFormat("harmony"), FORMATS["harmony"])
    assert (reasoning, plain(reply.content, reply.calls)) == ("Need the weather.", ("", [WEATHER], False))
    for i in range(len(text) + 1):
        stream = ReplyStream(think, FORMATS["hermes"])
        parts = stream.feed(text[:i]) + stream.feed(text[i:]) + stream.finish()
        assert (parts.reasoning, parts.content) == ("Maybe <tool_call>no</tool_call> here.", "Sure."), i
        assert plain("", stream.reply().calls)[1] == [WEATHER]
    v32 = "The user wants Paris.</think>Checking." + dsml(WEATHER)  # the prompt opened the block (thinking mode)
    reasoning, reply = split_reply(v32, ReasoningFormat("think", in_reasoning=True), FORMATS["deepseek_v32"])
    assert (reasoning, plain(reply.content, reply.calls)) == ("The user wants Paris.", ("Checking.", [WEATHER], False))
    reasoning, reply = split_reply("<think>never closed <tool_call>", think, FORMATS["hermes"])
    assert (reasoning, reply.content, reply.calls) == ("never closed <tool_call>", "", ())


@pytest.mark.parametrize("in_reasoning", [False, True])
def test_kimi_k2_thinkings_call_section_ends_a_think_block_left_open(in_reasoning):
    """Kimi-K2-Thinking may start its call section inside the think block without closing it: the reasoning ends
    where the section begins, whole and at every boundary; a hermes call in an open block stays thought."""
    think = ReasoningFormat("think", in_reasoning=in_reasoning)
    text = ("" if in_reasoning else "<think>") + "Need the weather and the time.\n" + kimi(WEATHER, TIME)
    reasoning, reply = split_reply(text, think, FORMATS["kimi_k2"])
    assert (reasoning, plain(reply.content, reply.calls)) == (
        "Need the weather and the time.",
        ("", [WEATHER, TIME], False),
    )
    for i in range(len(text) + 1):
        stream = ReplyStream(think, FORMATS["kimi_k2"])
        parts = stream.feed(text[:i]) + stream.feed(text[i:]) + stream.finish()
        assert (parts.reasoning, parts.content) == ("Need the weather and the time.", ""), i
        assert plain("", stream.reply().calls)[1] == [WEATHER, TIME], i
    closed = "<think>Done thinking.</think>Checking." + kimi(WEATHER)
    assert split_reply(closed, ReasoningFormat("think"), FORMATS["kimi_k2"])[0] == "Done thinking."
    open_hermes = "<think>maybe " + hermes(*WEATHER)
    assert split_reply(open_hermes, ReasoningFormat("think"), FORMATS["hermes"])[1].calls == ()


def test_calls_in_openai_shape():
    call = FORMATS["kimi_k2"].parse(kimi(WEATHER)).calls[0]
    assert call.as_openai() == {
        "id": "functions.get_weather:0",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    assert FORMATS["hermes"].parse(hermes(*WEATHER)).calls[0].id.startswith("call_")
    assert isinstance(call, ToolCall)


def test_the_format_follows_the_config_and_the_vocabulary():
    assert tool_format_for("qwen3", set()).name == "hermes"
    assert tool_format_for("glm4_moe", {"<tool_call>"}).name == "glm45"
    assert tool_format_for("gpt_oss", {}).name == "harmony"
    assert tool_format_for("llama", {"<tool_call>": 5, "</tool_call>": 6}).name == "hermes"
    assert tool_format_for(None, {"<tool_call>", "</tool_call>", "<arg_key>", "<arg_value>"}).name == "glm45"
    assert tool_format_for(None, {"<｜tool▁calls▁begin｜>", "<｜tool▁sep｜>"}).name == "deepseek_v31"
    assert tool_format_for("deepseek_v32", set()).name == "deepseek_v32"  # V3.2's DSML
    assert tool_format_for("deepseek_v32", set(), override="deepseek_v31").name == "deepseek_v31"  # V3.2-Exp
    assert tool_format_for("llama", {"a", "b"}) is None
    assert tool_format_for("llama", {"a"}, override="minimax_m2").name == "minimax_m2"
    assert tool_format_for("qwen3", set(), override="none") is None
    with pytest.raises(ValueError, match="unknown tool-call parser 'openai'"):
        tool_format_for("qwen3", set(), override="openai")


def test_bare_values_take_their_type_from_the_schema():
    """GLM and MiniMax write a string argument bare: ``123`` is a string when the tool's schema says so."""
    text = "<tool_call>get_zip\n<arg_key>code</arg_key>\n<arg_value>007</arg_value>\n<arg_key>n</arg_key>\n"
    text += "<arg_value>123</arg_value>\n</tool_call>"
    assert json.loads(FORMATS["glm45"].parse(text).calls[0].arguments) == {"code": "007", "n": 123}
    schemas = {"get_zip": {"type": "object", "properties": {"n": {"type": "string"}}}}
    assert json.loads(FORMATS["glm45"].parse(text, schemas).calls[0].arguments) == {"code": "007", "n": "123"}
    invoke = (
        '<minimax:tool_call><invoke name="get_zip"><parameter name="n">123</parameter></invoke></minimax:tool_call>'
    )
    _, reply = split_reply(invoke, ReasoningFormat("none"), FORMATS["minimax_m2"], schemas=schemas)
    assert json.loads(reply.calls[0].arguments) == {"n": "123"}


def test_calls_the_caller_refuses_are_text():
    text = "Checking. " + hermes(*WEATHER)
    _, reply = split_reply(text, ReasoningFormat("none"), FORMATS["hermes"], accept=lambda calls: "not offered")
    assert (reply.content, reply.calls, reply.malformed) == (text, (), True)
    stream = FORMATS["hermes"].stream()
    parts = [stream.feed(text[:15]), stream.feed(text[15:]), stream.finish(lambda calls: None)]
    assert [c.name for p in parts for c in p.calls] == ["get_weather"] and stream.reply().content == "Checking."
