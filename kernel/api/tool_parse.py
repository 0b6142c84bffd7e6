"""Reading tool calls from a reply's text, whole or as it streams: the calls, the format's base and its stream.

A format finds where a call starts (``hermes``'s ``<tool_call>``, DeepSeek's ``<｜tool▁calls▁begin｜>``,
a harmony header addressed ``to=functions.NAME``, ...) and reads the calls from there to the end of the reply
(``tool_formats.py`` has the families' formats, ``tool_calls.py`` the choice of one). Text before the first call
is the reply's content and streams as it comes; from the first call on the text is held until the reply ends,
because a call that cannot be read turns the whole reply back into text (``ParsedReply.malformed``) and calls
are only sure once they are all read.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from shardbook.kernel.api.reasoning import partial_suffix


@dataclass(frozen=True)
class ToolCall:
    """One call of a function tool: ``arguments`` is the JSON text of an object."""

    id: str
    name: str
    arguments: str

    def as_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ParsedReply:
    """A reply's text as its content and its calls; a reply whose call could not be read is all content."""

    content: str
    calls: tuple[ToolCall, ...] = ()
    malformed: bool = False


class MalformedCall(ValueError):
    """A call whose text does not follow its format (the message says where)."""


Accept = Callable[[tuple[ToolCall, ...]], str | None]
"""Checks a reply's calls: None to accept them, else why not."""
Schemas = Mapping[str, Any]
"""A function's name -> the JSON schema of its parameters (an OpenAI tool's ``function.parameters``)."""


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def make_call(name: str, arguments: Any, call_id: str | None = None) -> ToolCall:
    """A call of `name` with `arguments` (an object, or JSON text of one), or MalformedCall saying why not."""
    name = name.strip() if isinstance(name, str) else ""
    if not name:
        raise MalformedCall("a call without a function name")
    if isinstance(arguments, str):
        arguments = load_json(arguments, f"the arguments of {name}")
    if not isinstance(arguments, dict):
        raise MalformedCall(f"the arguments of {name} are not a JSON object")
    return ToolCall(call_id or new_call_id(), name, json.dumps(arguments, ensure_ascii=False))


def load_json(text: str, what: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise MalformedCall(f"{what} are not valid JSON: {e}") from None


class ToolFormat:
    """How one family writes tool calls. Subclasses say where a call starts (``call_start``), how much of a
    stream's end to hold back (``held_suffix``) and how to read the calls (``read_calls``)."""

    name = ""
    markers: tuple[str, ...] = ()
    """The texts that start a call (a stream holds back an end of text that could begin one)."""
    before_reasoning = False
    """Read from the raw reply, before the reasoning is split off (harmony: a call's header names the tool)."""
    ends_reasoning: tuple[str, ...] = ()
    """Texts that end a think block left open and start the calls (Kimi-K2-Thinking's section); elsewhere a call
    written inside a think block is thought, not called."""

    def call_start(self, text: str) -> int | None:
        """Where the first call in `text` starts, None if no call starts in it (yet)."""
        found = [at for at in (text.find(m) for m in self.markers) if at >= 0]
        return min(found) if found else None

    def held_suffix(self, text: str) -> int:
        """How many characters at the end of `text` (which holds no call start) could begin one."""
        return partial_suffix(text, self.markers)

    def read_calls(self, tail: str, schemas: Schemas | None = None) -> tuple[str, list[ToolCall]]:
        """The calls in `tail` (which starts with one) and the text around them; MalformedCall if one is bad.
        `schemas` (function name -> its parameters' JSON schema) types values a format writes bare."""
        raise NotImplementedError

    def parse(self, text: str, schemas: Schemas | None = None) -> ParsedReply:
        stream = self.stream(schemas)
        stream.feed(text)
        stream.finish()
        return stream.reply()

    def stream(self, schemas: Schemas | None = None) -> ToolStreamParser:
        return ToolStreamParser(self, schemas)


@dataclass(frozen=True)
class ToolDelta:
    """What a piece of a streamed reply gave: content, and (at the end) the calls."""

    content: str = ""
    calls: tuple[ToolCall, ...] = ()


class ToolStreamParser:
    """A reply fed as text deltas in any pieces. ``feed`` returns content as soon as it cannot be the start of a
    call (whitespace just before a call is dropped); ``finish`` returns the rest: the calls, and the text around
    them, or, when a call is malformed, all the held text as content. ``in_call`` says a call is being read."""

    def __init__(self, fmt: ToolFormat, schemas: Schemas | None = None):
        self.fmt, self.schemas = fmt, schemas
        self.pending = ""
        """Text not yet given out: a possible start of a call, trailing whitespace, or (in_call) the calls."""
        self.in_call = False
        self.content = ""
        self.calls: tuple[ToolCall, ...] = ()
        self.held_space = ""
        """Whitespace between the content and the first call: content again if the calls are malformed."""
        self.malformed = False
        self.error = ""

    def feed(self, delta: str) -> ToolDelta:
        self.pending += delta
        if self.in_call:
            return ToolDelta()
        at = self.fmt.call_start(self.pending)
        if at is not None:
            before, self.pending, self.in_call = self.pending[:at], self.pending[at:], True
            self.held_space = before[len(before.rstrip()) :]
            return self.give(before.rstrip())
        keep = self.fmt.held_suffix(self.pending)
        text = self.pending[: len(self.pending) - keep]
        body = text.rstrip()
        self.pending = self.pending[len(body) :]
        return self.give(body)

    def finish(self, accept: Accept | None = None) -> ToolDelta:
        """The rest of the reply; `accept` may refuse calls that were read (a tool the request did not offer):
        they are then malformed too, and text."""
        tail, self.pending = self.pending, ""
        if not self.in_call:
            return self.give(tail)
        try:
            around, calls = self.fmt.read_calls(tail, self.schemas)
            refusal = accept(tuple(calls)) if accept else None
            if refusal:
                raise MalformedCall(refusal)
        except MalformedCall as e:
            self.malformed, self.error = True, str(e)
            return self.give(self.held_space + tail)
        self.calls = tuple(calls)
        return ToolDelta(self.give(around).content, self.calls)

    def give(self, text: str) -> ToolDelta:
        self.content += text
        return ToolDelta(content=text)

    def reply(self) -> ParsedReply:
        """The whole reply, once finished."""
        return ParsedReply(self.content, self.calls, self.malformed)
