"""Reasoning parsers: think tags and harmony channels, whole and streamed at every chunk boundary."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from shardbook.kernel.api.reasoning import (
    ReasoningFormat,
    Split,
    parser_name,
    partial_suffix,
    reasoning_format,
)

THINK = ReasoningFormat("think")
THINK_OPENED = ReasoningFormat("think", in_reasoning=True)  # the prompt ends with <think> (DeepSeek-R1, V3.1)
HARMONY = ReasoningFormat("harmony")
NONE = ReasoningFormat("none")

CASES = [
    (THINK, "<think>\nLet me see.\n</think>\n\nParis.", Split("Let me see.", "Paris.")),
    (THINK, "<think>a < b, so</think>b.", Split("a < b, so", "b.")),
    (THINK, "<think>\n\n</think>\n\nNo thinking.", Split("", "No thinking.")),  # thinking off: an empty block
    (THINK, "Plain answer, no tags.", Split("", "Plain answer, no tags.")),
    (THINK, "<think>one</think>A <think>two</think>B", Split("onetwo", "A B")),  # interleaved (MiniMax-M2)
    (THINK, "<think>never closed, cut at max_tokens </th", Split("never closed, cut at max_tokens </th", "")),
    (THINK, "\n<think>Greet.</think>\nHi!", Split("Greet.", "Hi!")),  # GLM-4.5's newlines are the format's
    (THINK, " \n\nHi, no block.", Split("", " \n\nHi, no block.")),  # leading space kept when no block follows
    (THINK, "\n<thinking aloud", Split("", "\n<thinking aloud")),
    (THINK, "\n<thi", Split("", "\n<thi")),  # cut short: a tag's start is text after all
    (THINK_OPENED, "Hmm, 2+2.\n</think>\n\n4", Split("Hmm, 2+2.", "4")),
    (THINK_OPENED, "all reasoning, no close", Split("all reasoning, no close", "")),
    (THINK_OPENED, "", Split("", "")),
    (
        HARMONY,
        "<|channel|>analysis<|message|>User asks 2+2.<|end|><|start|>assistant<|channel|>final<|message|>4<|return|>",
        Split("User asks 2+2.", "4"),
    ),
    (HARMONY, "<|channel|>final<|message|>Only the answer.", Split("", "Only the answer.")),
    (HARMONY, "<|channel|>analysis<|message|>thinking, cut short <|en", Split("thinking, cut short <|en", "")),
    (HARMONY, "no harmony at all <| yes", Split("", "no harmony at all <| yes")),
    (
        HARMONY,
        (
            "<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>commentary<|message|>b<|end|>"
            "<|start|>assistant<|channel|>final<|message|>c"
        ),
        Split("a", "bc"),
    ),
    (NONE, "<think>kept as text</think>", Split("", "<think>kept as text</think>")),
]


@pytest.mark.parametrize("fmt, text, expected", CASES)
def test_whole_reply(fmt, text, expected):
    assert fmt.split(text) == expected


@pytest.mark.parametrize("fmt, text, expected", CASES)
def test_streamed_at_every_boundary(fmt, text, expected):
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1):
            parser = fmt.stream()
            parts = [parser.feed(text[:i]), parser.feed(text[i:j]), parser.feed(text[j:]), parser.finish()]
            got = sum(parts, Split())
            assert got == expected, (i, j)


def test_a_stream_holds_back_only_what_could_start_a_tag():
    parser = THINK.stream()
    assert parser.feed("<think>Let me") == Split("Let me", "")
    assert parser.feed(" see </th") == Split(" see", "")  # the space waits: it may end the block
    assert parser.feed("ink>\n\nPar") == Split("", "Par")
    assert parser.feed("is <") == Split("", "is ")
    assert parser.feed("b>") == Split("", "<b>")
    assert parser.finish() == Split()
    harmony = HARMONY.stream()
    assert harmony.feed("<|channel|>analysis<|mess") == Split()
    assert harmony.feed("age|>Two plus two<|") == Split("Two plus two", "")
    assert harmony.feed("end|><|start|>assistant<|channel|>final<|message|>4") == Split("", "4")
    assert harmony.finish() == Split()
    cut = THINK_OPENED.stream()
    assert cut.feed("unfinished <") == Split("unfinished", "")
    assert cut.finish() == Split(" <", "")  # the reply ended: a tag cut short is text, and all of it reasoning


def test_partial_suffix():
    assert partial_suffix("abc</th", ("</think>",)) == 4
    assert partial_suffix("abc<", ("<think>",)) == 1
    assert partial_suffix("abc", ("<think>",)) == 0
    assert partial_suffix("x<|e", ("<|end|>", "<|message|>")) == 3


class Vocab:
    def __init__(self, *tokens):
        self.tokens = {t: i for i, t in enumerate(tokens)}

    unk_token_id = None

    def convert_tokens_to_ids(self, token):
        return self.tokens.get(token)

    def decode(self, ids, skip_special_tokens=False):
        names = {i: t for t, i in self.tokens.items()}
        return "".join(names[i] for i in ids)


def test_the_parser_follows_the_config_and_the_vocabulary():
    qwen3 = Vocab("a", "<think>", "</think>", "\n")
    assert parser_name(SimpleNamespace(model_type="qwen3"), qwen3) == "think"
    assert parser_name(SimpleNamespace(model_type="gpt_oss"), Vocab("a")) == "harmony"
    assert parser_name(SimpleNamespace(model_type="llama"), Vocab("<|channel|>", "<|message|>")) == "harmony"
    assert parser_name(SimpleNamespace(model_type="llama"), Vocab("a", "b")) == "none"
    assert parser_name(SimpleNamespace(model_type="llama"), Vocab("a"), override="think") == "think"
    assert parser_name(SimpleNamespace(model_type="qwen3"), qwen3, override="none") == "none"
    with pytest.raises(ValueError, match="unknown reasoning parser 'r1'"):
        parser_name(None, qwen3, override="r1")
    config = SimpleNamespace(model_type="deepseek_v3")
    assert reasoning_format(config, qwen3, [0, 1, 3]).in_reasoning is True  # the template opened the block
    assert reasoning_format(config, qwen3, [0, 3]).in_reasoning is False
    assert reasoning_format(config, qwen3, [0, 1, 2, 3]).in_reasoning is False  # thinking off: <think></think>
