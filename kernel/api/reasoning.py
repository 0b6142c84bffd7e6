"""Reasoning parsers: a reply's text split into its reasoning and its answer, whole or as it streams.

One parser per format: ``think`` (``<think>...</think>``: Qwen3, Qwen3-Next, DeepSeek-R1/V3.1/V3.2,
GLM-4.5/5, MiniMax-M2), ``harmony`` (gpt-oss: the ``analysis`` channel is reasoning, the others the
answer) and ``none`` (everything is the answer). ``parser_for`` picks one from the model's config and
vocabulary; a stream parser is fed text deltas in any pieces and returns ``(reasoning, content)`` deltas,
holding back only what could be the start of a tag. A block never closed is all reasoning.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from shardbook.rankd.config.schema import REASONING_PARSERS
from shardbook.rankd.generation.reply_text import FORMAT_TAGS

THINK_OPEN, THINK_CLOSE = FORMAT_TAGS["think"]
HARMONY_MARKERS = FORMAT_TAGS["harmony"]
CHANNEL, START, MESSAGE, END, RETURN, CALL, CONSTRAIN = HARMONY_MARKERS
"""Harmony's markers by name: ``<|channel|>``, ``<|start|>``, ``<|message|>``, ``<|end|>``, ... ."""
HARMONY_ENDS = (END, RETURN, CALL)
"""The markers that end a harmony message."""
HARMONY_REASONING_CHANNEL = "analysis"
HARMONY_MODEL_TYPES = ("gpt_oss",)
PARSERS = tuple(name for name in REASONING_PARSERS if name != "auto")
"""The reasoning formats the config (``inference.reasoning_parser``) or a server can name, besides ``auto``."""


@dataclass(frozen=True)
class Split:
    """A reply, or a piece of one, as its reasoning and its answer."""

    reasoning: str = ""
    content: str = ""

    def __add__(self, other: Split) -> Split:
        return Split(self.reasoning + other.reasoning, self.content + other.content)


class StreamParser:
    """Splits a reply fed as text deltas; ``feed`` and ``finish`` return what each part gained."""

    def feed(self, delta: str) -> Split:
        raise NotImplementedError

    def finish(self) -> Split:
        """The rest, once the reply has ended (a tag cut short is text after all)."""
        raise NotImplementedError


class NoReasoning(StreamParser):
    def feed(self, delta: str) -> Split:
        return Split(content=delta)

    def finish(self) -> Split:
        return Split()


class ThinkParser(StreamParser):
    """``<think>reasoning</think>answer``; blocks may repeat (interleaved thinking). Whitespace is the format's,
    not the text's, where the families' templates write it around the tags: before a reply's first ``<think>``
    (GLM-4.5 writes ``\n<think>...</think>\nHi!``), where a part opens after a tag, and where a reasoning block
    ends. So that reply's answer is ``Hi!``, as the template renders it back (``'\n' + content.strip()``);
    vLLM's think parsers keep the ``\n`` after ``</think>`` in the answer.

    `ends` are texts that end a reasoning block without ``</think>`` and stay in the answer: Kimi-K2-Thinking may
    open its tool-call section inside the block (vLLM's ``kimi_k2`` reasoning parser ends the reasoning there)."""

    def __init__(self, in_reasoning: bool = False, ends: tuple[str, ...] = ()):
        self.in_reasoning = in_reasoning
        self.ends = ends
        self.buffer = ""
        self.leading = not in_reasoning
        """Nothing but whitespace has come yet: held until it shows whether a ``<think>`` follows."""
        self.strip_start = in_reasoning
        self.held_space = ""
        """Whitespace at the end of the reasoning so far: shown only if more reasoning follows."""

    def feed(self, delta: str) -> Split:
        self.buffer += delta
        out = Split()
        if self.leading and not self.maybe_drop_leading_space():
            return out
        while True:
            tags = (THINK_CLOSE, *self.ends) if self.in_reasoning else (THINK_OPEN,)
            found = [(at, tag) for at, tag in ((self.buffer.find(t), t) for t in tags) if at >= 0]
            if not found:
                keep = partial_suffix(self.buffer, tags)
                text, self.buffer = self.buffer[: len(self.buffer) - keep], self.buffer[len(self.buffer) - keep :]
                return out + self.emit(text)
            at, tag = min(found)
            out += self.emit(self.buffer[:at])
            self.buffer = self.buffer[at + (len(tag) if tag in (THINK_OPEN, THINK_CLOSE) else 0) :]
            self.in_reasoning, self.strip_start, self.held_space = not self.in_reasoning, True, ""

    def maybe_drop_leading_space(self) -> bool:
        """At a reply's start, drop the whitespace before a first ``<think>``; False while the reply so far is
        whitespace, or whitespace and the start of ``<think>`` (it must wait)."""
        rest = self.buffer.lstrip()
        if THINK_OPEN.startswith(rest):
            return False
        if rest.startswith(THINK_OPEN):
            self.buffer = rest
        self.leading = False
        return True

    def emit(self, text: str) -> Split:
        if self.strip_start:
            text = text.lstrip()
            self.strip_start = not text
        if not self.in_reasoning:
            return Split(content=text)
        text = self.held_space + text
        body = text.rstrip()
        self.held_space = text[len(body) :]
        return Split(reasoning=body)

    def finish(self) -> Split:
        text, self.buffer, self.leading = self.buffer, "", False
        out = self.emit(text)
        self.held_space = ""
        return out


class HarmonyParser(StreamParser):
    """gpt-oss's harmony messages: ``<|channel|>analysis<|message|>...<|end|>`` is reasoning, and the text of
    every other channel (``final``, ``commentary``) the answer. Headers (``<|start|>assistant<|channel|>final``)
    are dropped; text before any header is the answer."""

    def __init__(self):
        self.buffer = ""
        self.in_header = False
        self.header = ""
        self.channel: str | None = None

    def feed(self, delta: str) -> Split:
        self.buffer += delta
        out = Split()
        while self.buffer:
            found = [(self.buffer.find(m), m) for m in HARMONY_MARKERS if m in self.buffer]
            if not found:
                keep = partial_suffix(self.buffer, HARMONY_MARKERS)
                text, self.buffer = self.buffer[: len(self.buffer) - keep], self.buffer[len(self.buffer) - keep :]
                return out + self.emit(text)
            at, marker = min(found)
            out += self.emit(self.buffer[:at])
            self.buffer = self.buffer[at + len(marker) :]
            self.on_marker(marker)
        return out

    def on_marker(self, marker: str) -> None:
        if marker == MESSAGE:
            self.in_header = False
            name = self.header.rsplit(CHANNEL, 1)[-1] if CHANNEL in self.header else ""
            self.channel = name.split()[0] if name.split() else None
            self.header = ""
        elif marker in HARMONY_ENDS:
            self.in_header, self.header, self.channel = True, "", None
        else:  # <|start|>, <|channel|>, <|constrain|>: a header goes on until <|message|>
            self.in_header = True
            self.header += marker

    def emit(self, text: str) -> Split:
        if not text:
            return Split()
        if self.in_header:
            self.header += text
            return Split()
        if self.channel == HARMONY_REASONING_CHANNEL:
            return Split(reasoning=text)
        return Split(content=text)

    def finish(self) -> Split:
        text, self.buffer = self.buffer, ""
        return self.emit(text)


def partial_suffix(text: str, tags: Iterable[str]) -> int:
    """Length of the longest end of `text` that is the start of one of `tags` (what a stream must hold back)."""
    longest = 0
    for tag in tags:
        for n in range(min(len(tag) - 1, len(text)), longest, -1):
            if text.endswith(tag[:n]):
                longest = n
                break
    return longest


@dataclass(frozen=True)
class ReasoningFormat:
    """How a model's replies carry reasoning: the parser's name, and whether a reply starts inside a block."""

    name: str
    in_reasoning: bool = False

    def stream(self, ends: tuple[str, ...] = ()) -> StreamParser:
        """A stream parser; `ends` also end a think block, and stay in the answer (see ThinkParser)."""
        if self.name == "think":
            return ThinkParser(self.in_reasoning, ends)
        if self.name == "harmony":
            return HarmonyParser()
        return NoReasoning()

    def split(self, text: str) -> Split:
        parser = self.stream()
        return parser.feed(text) + parser.finish()


def parser_name(config: Any, tokenizer: Any, override: str | None = None) -> str:
    """The parser for a model: `override` (one of PARSERS) if given, else ``harmony`` for gpt-oss (by its config's
    ``model_type`` or harmony's tokens in the vocabulary), ``think`` when ``<think>`` and ``</think>`` are tokens
    of the vocabulary, else ``none``."""
    if override not in (None, "auto"):
        if override not in PARSERS:
            raise ValueError(f"unknown reasoning parser {override!r}; use one of {', '.join(('auto', *PARSERS))}")
        return override
    model_type = getattr(config, "model_type", None)
    if model_type in HARMONY_MODEL_TYPES or has_tokens(tokenizer, CHANNEL, MESSAGE):
        return "harmony"
    if has_tokens(tokenizer, THINK_OPEN, THINK_CLOSE):
        return "think"
    return "none"


def has_tokens(tokenizer: Any, *tokens: str) -> bool:
    """Whether each of `tokens` is one token of the tokenizer's vocabulary (not cut into pieces, not unknown)."""
    if tokenizer is None:
        return False
    ids = [tokenizer.convert_tokens_to_ids(token) for token in tokens]
    return all(i is not None and i != getattr(tokenizer, "unk_token_id", None) for i in ids)


def reasoning_format(
    config: Any, tokenizer: Any, prompt_ids: list[int] | None = None, override: str | None = None
) -> ReasoningFormat:
    """The format of a reply to `prompt_ids`: a think-tag prompt that ends with ``<think>`` (DeepSeek-R1's and
    V3.1's templates open the block themselves) makes the reply start inside reasoning."""
    name = parser_name(config, tokenizer, override)
    if name != "think" or not prompt_ids:
        return ReasoningFormat(name)
    tail = tokenizer.decode(prompt_ids[-8:], skip_special_tokens=False).rstrip()
    return ReasoningFormat(name, in_reasoning=tail.endswith(THINK_OPEN))
