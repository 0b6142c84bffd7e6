"""Tool calls: the format of a model's calls chosen from its config and vocabulary, and a reply split into its
reasoning, its content and its calls, whole or as it streams.

The public face of ``tool_parse.py`` (calls, formats, their stream) and ``tool_formats.py`` (the families:
``hermes``, ``glm45``, ``deepseek_v31``, ``deepseek_v32``, ``kimi_k2``, ``minimax_m2``, ``harmony``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from shardbook.kernel.api.reasoning import ReasoningFormat, Split
from shardbook.kernel.api.tool_formats import FORMATS, MODEL_TYPES, TELLTALES
from shardbook.kernel.api.tool_parse import (
    Accept,
    MalformedCall,
    ParsedReply,
    Schemas,
    ToolCall,
    ToolDelta,
    ToolFormat,
    ToolStreamParser,
    make_call,
)

__all__ = [
    "FORMATS",
    "Accept",
    "MalformedCall",
    "ParsedReply",
    "ReplyStream",
    "Schemas",
    "ToolCall",
    "ToolDelta",
    "ToolFormat",
    "ToolStreamParser",
    "make_call",
    "split_reply",
    "tool_format_for",
]


class ReplyStream:
    """A reply split into reasoning, content and calls as it streams, in the order its formats need: the
    reasoning split first (a ``<tool_call>`` inside a think block is thought, not called; a format's
    ``ends_reasoning``, Kimi-K2's call section, ends the block), except for formats read from the raw text
    (harmony), whose calls are taken out before the reasoning is split."""

    def __init__(self, reasoning: ReasoningFormat, tools: ToolFormat | None, schemas: Schemas | None = None):
        self.reasoning = reasoning.stream(tools.ends_reasoning if tools else ())
        self.tools = tools.stream(schemas) if tools else None
        self.first = tools is not None and tools.before_reasoning
        self.accept: Accept | None = None

    def feed(self, delta: str) -> Split:
        return self.step(delta, final=False)

    def finish(self, accept: Accept | None = None) -> Split:
        """The rest of the reasoning and content; the calls (those `accept` accepts) are in ``reply()``."""
        self.accept = accept
        return self.step("", final=True)

    def step(self, delta: str, final: bool) -> Split:
        if self.tools is None:
            return self.reasoning.feed(delta) + (self.reasoning.finish() if final else Split())
        if self.first:
            return self.reasoning.feed(self.call_text(delta, final)) + (self.reasoning.finish() if final else Split())
        split = self.reasoning.feed(delta) + (self.reasoning.finish() if final else Split())
        return Split(split.reasoning, self.call_text(split.content, final))

    def call_text(self, text: str, final: bool) -> str:
        """The content the tool parser gives out of `text` (all it held, at the end)."""
        return self.tools.feed(text).content + (self.tools.finish(self.accept).content if final else "")

    def reply(self) -> ParsedReply:
        return self.tools.reply() if self.tools else ParsedReply("")


def split_reply(
    text: str,
    reasoning: ReasoningFormat,
    tools: ToolFormat | None,
    accept: Accept | None = None,
    schemas: Schemas | None = None,
) -> tuple[str, ParsedReply]:
    """A whole reply's reasoning, and its content and calls (those `accept` accepts; values typed by `schemas`)."""
    stream = ReplyStream(reasoning, tools, schemas)
    split = stream.feed(text) + stream.finish(accept)
    parsed = stream.reply()
    return split.reasoning, ParsedReply(split.content, parsed.calls, parsed.malformed)


def tool_format_for(
    model_type: str | None, vocab: set[str] | Mapping[str, Any], override: str | None = None
) -> ToolFormat | None:
    """The tool format of a model: `override` (a name of FORMATS, or ``none``) if given, else the one of its
    config's ``model_type``, else the first whose telltale tokens are all in `vocab`, else None (no format)."""
    if override not in (None, "auto"):
        if override == "none":
            return None
        if override not in FORMATS:
            raise ValueError(f"unknown tool-call parser {override!r}; use one of auto, none, {', '.join(FORMATS)}")
        return FORMATS[override]
    if model_type in MODEL_TYPES:
        return FORMATS[MODEL_TYPES[model_type]]
    for name, tokens in TELLTALES:
        if all(token in vocab for token in tokens):
            return FORMATS[name]
    return None
