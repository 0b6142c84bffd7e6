"""Tool calls on the chat endpoint: the model's tool-call format for a request, the tools given to its chat
template, and a reply's calls as ``message.tool_calls`` / ``delta.tool_calls`` with ``finish_reason:
"tool_calls"``.

Streamed, calls come at the reply's end as the OpenAI API streams them (``call_pieces``): a chunk with each
call's index, id, type and name and empty arguments, then the arguments in pieces. They wait for the end since a
call is only sure once the reply has ended: a call that cannot be read, or that does not answer the request (a
tool not offered, a required argument missing, ``tool_choice`` not followed), turns the reply back into text,
with ``finish_reason: "stop"``, a warning in the log and ``shardbook_tool_call_parse_failures_total`` counted in
``/metrics``. Decoding is not constrained: ``tool_choice: "required"`` or a named function asks, it cannot
force.
"""

from __future__ import annotations

import logging
from typing import Any

from shardbook.kernel.api.reasoning import ReasoningFormat, Split
from shardbook.kernel.api.tool_calls import ReplyStream, ToolCall, ToolFormat, tool_format_for
from shardbook.kernel.server.openai_api import ApiError
from shardbook.kernel.server.reasoning_reply import ReplySplitter
from shardbook.kernel.server.tool_request import ToolRequest

log = logging.getLogger(__name__)


def request_tool_format(loaded: Any, tools: ToolRequest, override: str) -> ToolFormat | None:
    """The format the loaded model writes calls in, when the request offers tools (None otherwise); ApiError
    400 when the model has none, or when its template cannot show the tools or its replies cannot show calls."""
    if not tools.wanted:
        return None
    tokenizer = loaded.tokenizer
    model_type = getattr(getattr(loaded.model, "config", None), "model_type", None)
    fmt = tool_format_for(model_type, tokenizer.get_vocab(), override)
    if fmt is None and override == "none":
        raise ApiError(
            400,
            "this server reads no tool calls (its tool_call_parser is none, by --tool-call-parser or the config's "
            "inference.tool_call_parser): send the request without 'tools'",
            param="tools",
        )
    if fmt is None:
        raise ApiError(
            400,
            f"this model has no tool-call format: neither its model_type ({model_type}) nor its vocabulary shows "
            "one this server reads (hermes <tool_call>, GLM <arg_key>, DeepSeek <｜tool▁calls▁begin｜>, Kimi "
            "<|tool_calls_section_begin|>, <minimax:tool_call>, harmony), so its calls could not be read. Send "
            "the request without 'tools', or start the server with --tool-call-parser (or the config's "
            "inference.tool_call_parser) set to the format the model's chat template writes.",
            param="tools",
        )
    if "tools" not in str(getattr(tokenizer, "chat_template", None) or ""):
        raise ApiError(
            400,
            "this model's chat template does not read 'tools', so the model would never see them: load the "
            "model with a chat template that renders tools (the config's model.chat_template, a Jinja file), or "
            "send the request without 'tools'",
            param="tools",
        )
    return fmt


def with_tools(options: dict[str, Any], tools: ToolRequest) -> dict[str, Any]:
    """The template's keywords with ``tools`` (when offered; ``tool_choice: "none"`` renders none)."""
    if "tools" in options:
        raise ApiError(
            400, "give tools in the request's 'tools' field, not in chat_template_kwargs", param="chat_template_kwargs"
        )
    return {**options, "tools": tools.template_tools()} if tools.wanted else options


class ToolReplySplitter(ReplySplitter):
    """A choice's reply split into reasoning, content and (at its end) the calls that answer the request."""

    def __init__(self, fmt: ReasoningFormat, tool_fmt: ToolFormat, tools: ToolRequest, metrics: Any):
        super().__init__(fmt)
        self.stream = ReplyStream(fmt, tool_fmt, tools.schemas())
        self.tools, self.metrics = tools, metrics
        self.calls: tuple[ToolCall, ...] = ()

    def delta(self, text: str, final: bool = False) -> dict[str, Any]:
        piece = self.stream.feed(text) if text else Split()
        if not final:
            return self.as_delta(piece)
        delta: dict[str, Any] = self.as_delta(piece + self.stream.finish(self.tools.check_calls))
        parsed = self.stream.reply()
        if parsed.malformed:
            log.warning("a tool call in the reply is returned as text: %s", self.stream.tools.error)
            self.metrics.tool_call_failures.inc()
        self.calls = self.tools.kept(parsed.calls)
        if self.calls:
            delta["tool_calls"] = [{"index": i, **call.as_openai()} for i, call in enumerate(self.calls)]
        return delta

    def finish_reason(self, reason: str) -> str:
        """``tool_calls`` for a reply that ended on its calls; the engine's reason otherwise."""
        return "tool_calls" if self.calls and reason == "stop" else reason

    def message(self) -> dict[str, Any]:
        message = super().message()
        if self.calls:
            message["content"] = message["content"] or None  # OpenAI's shape: null beside calls
            message["tool_calls"] = [call.as_openai() for call in self.calls]
        return message


ARGUMENTS_PIECE = 16
"""Characters of a call's arguments per streamed chunk (the OpenAI API streams them a few tokens at a time)."""


def call_pieces(delta: dict[str, Any]) -> list[dict[str, Any]]:
    """A reply's last delta as the chunks' deltas the OpenAI API would stream: its text and each call's index, id,
    type and name with empty arguments first, then each call's arguments in pieces of ARGUMENTS_PIECE
    characters (clients join them by index); a delta without calls as it is."""
    calls = delta.get("tool_calls")
    if not calls:
        return [delta]
    heads = [{**call, "function": {"name": call["function"]["name"], "arguments": ""}} for call in calls]
    pieces = [{**delta, "tool_calls": heads}]
    for call in calls:
        arguments = call["function"]["arguments"]
        for at in range(0, len(arguments), ARGUMENTS_PIECE):
            piece = {"index": call["index"], "function": {"arguments": arguments[at : at + ARGUMENTS_PIECE]}}
            pieces.append({"tool_calls": [piece]})
    return pieces


def reply_splitter(
    fmt: ReasoningFormat, tool_fmt: ToolFormat | None, tools: ToolRequest, metrics: Any
) -> ReplySplitter:
    """The splitter of one choice: with the calls when the request offers tools, else reasoning and content."""
    return ReplySplitter(fmt) if tool_fmt is None else ToolReplySplitter(fmt, tool_fmt, tools, metrics)
