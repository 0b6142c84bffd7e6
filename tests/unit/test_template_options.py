"""Chat-template options as the user gives them: `--template-arg KEY=VALUE`, `--thinking` / `--no-thinking`,
the family's thinking switch, the conversation that keeps them, `ChatModel`'s keywords, the terminal's flag."""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest

from shardbook.kernel.api.chat import ChatModel
from shardbook.kernel.api.conversation import Conversation, parse_template_arg, parse_template_args, thinking_keys
from shardbook.kernel.cli.chat import split_template_args
from shardbook.kernel.cli.main import build_parser
from shardbook.magics.arguments import parse_line
from shardbook.magics.chat import ChatMagics
from shardbook.rankd.config.schema import InferenceConfig

QWEN3 = "{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>{% endif %}"
DEEPSEEK = "{%- if thinking %}<think>{% else %}</think>{% endif %}"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("enable_thinking=false", ("enable_thinking", False)),
        ("enable_thinking=False", ("enable_thinking", False)),  # Python's spelling: never the truthy text 'False'
        ("reasoning_effort=low", ("reasoning_effort", "low")),
        ('persona="a pirate"', ("persona", "a pirate")),
        ("budget=0.5", ("budget", 0.5)),
        ("n=3", ("n", 3)),
        ("tools=[]", ("tools", [])),
        ("note=a=b", ("note", "a=b")),
        ("empty=", ("empty", "")),
    ],
)
def test_template_arg_values_are_json_when_they_parse_else_text(text, expected):
    assert parse_template_arg(text) == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("enable_thinking", "--template-arg needs KEY=VALUE .* e.g. --template-arg enable_thinking=false"),
        ("=false", "needs KEY=VALUE"),
        ("tokenize=false", "'tokenize' is set by shardbook itself; drop it"),
        ("add_generation_prompt=false", "set by shardbook itself"),
        ("not a name=1", "must be identifiers"),
    ],
)
def test_a_bad_template_arg_names_the_fix(text, message):
    with pytest.raises(ValueError, match=message):
        parse_template_arg(text)


def test_later_template_args_win():
    assert parse_template_args(["a=1", "b=2", "a=3"]) == {"a": 3, "b": 2}


def test_the_thinking_switch_is_the_one_the_template_reads():
    assert thinking_keys(QWEN3) == ("enable_thinking",)
    assert thinking_keys(DEEPSEEK) == ("thinking",)
    assert thinking_keys({"default": DEEPSEEK, "tool_use": QWEN3}) == ("enable_thinking", "thinking")
    assert thinking_keys("{{ messages }}") == ("enable_thinking", "thinking")  # unsure: both
    assert thinking_keys(None) == ("enable_thinking", "thinking")


def test_chat_flags_parse():
    args = parse_line(ChatMagics.chat, "--no-thinking --template-arg reasoning_effort=low --template-arg 'x=a b'")
    assert args.thinking is False and args.template_arg == ["reasoning_effort=low", "x=a b"]
    assert parse_line(ChatMagics.chat, "--thinking").thinking is True
    plain = parse_line(ChatMagics.chat, "--max-new-tokens 5")
    assert plain.thinking is None and plain.template_arg is None and not plain.clear_template_args
    assert parse_line(ChatMagics.chat, "--clear-template-args").clear_template_args


def chat_model(chat_template: str | None) -> ChatModel:
    config = SimpleNamespace(inference=InferenceConfig(system_prompt=None))
    loaded = SimpleNamespace(tokenizer=SimpleNamespace(chat_template=chat_template))
    return ChatModel(SimpleNamespace(ctx0=SimpleNamespace(state={"config": config, "loaded": loaded})))


def test_chat_model_sets_the_familys_switch_and_options_win():
    assert chat_model(QWEN3).build_request("hi", thinking=False).template_options == {"enable_thinking": False}
    assert chat_model(DEEPSEEK).build_request("hi", thinking=True).template_options == {"thinking": True}
    assert chat_model(None).build_request("hi", thinking=False).template_options == {
        "enable_thinking": False,
        "thinking": False,
    }
    both = chat_model(QWEN3).build_request("hi", thinking=False, template_options={"enable_thinking": True, "k": 1})
    assert both.template_options == {"enable_thinking": True, "k": 1}
    assert chat_model(QWEN3).build_request("hi").template_options == {}
    with pytest.raises(ValueError, match="set by shardbook itself"):
        chat_model(QWEN3).build_request("hi", template_options={"tokenize": True})


def test_options_the_template_never_reads_get_a_notice():
    assert chat_model(QWEN3).template_notice({"enable_thinking": False}) is None
    assert chat_model(QWEN3).template_notice({"thinking": False, "persona": "x"}) == (
        "the model's chat template does not read thinking, persona: passed to it, they change nothing in the prompt"
    )
    assert "does not read enable_thinking, thinking:" in chat_model("{{ messages }}").template_notice(
        chat_model("{{ messages }}").resolve_template_options(False)
    )


def test_the_conversation_keeps_and_saves_its_template_options(tmp_path):
    conversation = Conversation(thinking=False, template_options={"persona": "pirate"})
    conversation.add_turn("hi", "ahoy", "stop")
    conversation.reset()
    assert conversation.thinking is False and conversation.template_options == {"persona": "pirate"}
    assert conversation.history_text() == '[template] thinking off, persona="pirate"'
    loaded = Conversation.load(conversation.save(tmp_path / "c.json"))
    assert (loaded.thinking, loaded.template_options) == (False, {"persona": "pirate"})
    assert Conversation().history_text() == "(empty conversation)"
    (tmp_path / "bad.json").write_text('{"turns": [], "template_options": {"tokenize": 1}}')
    with pytest.raises(ValueError, match="not a saved conversation: template option 'tokenize'"):
        Conversation.load(tmp_path / "bad.json")


def test_the_terminal_takes_template_args_before_and_after_the_config():
    args = build_parser().parse_args(
        ["chat", "--template-arg", "a=1", "demo", "--inference.max_new_tokens", "4", "--template-arg=b=x"]
    )
    assert split_template_args(args) == {"a": 1, "b": "x"}
    assert args.overrides == ["--inference.max_new_tokens", "4"] and args.template_arg == ["a=1", "b=x"]
    with pytest.raises(ValueError, match="needs KEY=VALUE"):
        split_template_args(argparse.Namespace(template_arg=None, overrides=["--template-arg", "oops"]))
