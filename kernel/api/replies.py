"""A chat reply's reasoning apart from its answer, as it streams and once finished, for rank 0's own chat callers
(``%%chat``, the terminal chat, ``ChatModel.chat``): the same parsers as the endpoint's ``reasoning_content``."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from shardbook.kernel.api.reasoning import ReasoningFormat, Split, reasoning_format

REASONING_MARK, ANSWER_MARK = "[reasoning]", "[answer]"
"""How plain text marks a reply's reasoning apart from its answer (``%%chat --output text``, the terminal)."""

if TYPE_CHECKING:
    from shardbook.kernel.api.responses import ChatResponse
    from shardbook.kernel.api.tool_calls import ParsedReply, Schemas, ToolFormat
    from shardbook.kernel.ranks.runtime import Runtime
    from shardbook.rankd.generation.engine import GenerationRequest


def configured_parser(runtime: Runtime, key: str) -> str:
    """The loaded config's ``inference.reasoning_parser`` or ``inference.tool_call_parser`` (`key`); ``auto``
    before a config is loaded."""
    config = runtime.ctx0.state.get("config")
    return "auto" if config is None else getattr(config.inference, key)


def request_format(runtime: Runtime, request: GenerationRequest) -> ReasoningFormat:
    """How the loaded model's reply to `request` carries its reasoning (its prompt may open a think block), read
    by the config's ``inference.reasoning_parser``."""
    from shardbook.rankd.generation.engine import build_prompt_ids

    loaded = runtime.ctx0.state["loaded"]
    prompt = build_prompt_ids(loaded.tokenizer, request.messages, request.template_options)[0].tolist()
    override = configured_parser(runtime, "reasoning_parser")
    return reasoning_format(getattr(loaded.model, "config", None), loaded.tokenizer, prompt, override)


class ReplyParts:
    """One reply's text chunks split as they stream (``feed``, then ``finish``): its reasoning apart from its
    content, and, given a tool format, its calls held out of the content (values the format writes bare typed by
    the tools' parameter `schemas`); ``split`` reads the finished response."""

    def __init__(self, fmt: ReasoningFormat, tools: ToolFormat | None = None, schemas: Schemas | None = None):
        from shardbook.kernel.api.tool_calls import ReplyStream

        self.fmt = fmt
        self.tools = tools
        self.schemas = schemas
        self.stream = ReplyStream(fmt, tools, schemas)
        self.in_reasoning: bool | None = None
        """Which part :func:`marked` wrote last (None: neither yet)."""

    def feed(self, chunk: str) -> Split:
        return self.stream.feed(chunk)

    def finish(self) -> Split:
        return self.stream.finish()

    def split(self, response: ChatResponse) -> tuple[ChatResponse, ParsedReply]:
        """The response with ``text`` its content and ``reasoning`` apart, and its calls (none without tools)."""
        from shardbook.kernel.api.tool_calls import split_reply

        reasoning, parsed = split_reply(response.text, self.fmt, self.tools, schemas=self.schemas)
        return replace(response, text=parsed.content, reasoning=reasoning), parsed

    def apart(self, response: ChatResponse) -> ChatResponse:
        return self.split(response)[0]


def prompt_text(runtime: Runtime, request: GenerationRequest) -> str:
    """The request's prompt as text, rendered as every rank renders it (what ``%trace`` reads as a prompt)."""
    from shardbook.rankd.generation.chat_template import apply_chat_template

    tokenizer = runtime.ctx0.state["loaded"].tokenizer
    return apply_chat_template(
        tokenizer, request.messages, add_generation_prompt=True, tokenize=False, **request.template_options
    )


def assistant_message(answer: str, reasoning: str = "", **extra: Any) -> dict[str, Any]:
    """The assistant's turn as chat templates read it back: the answer as ``content``, the reasoning as
    ``reasoning_content`` (Qwen3's and GLM's templates read it; most drop it from earlier turns)."""
    message: dict[str, Any] = {"role": "assistant", "content": answer}
    if reasoning:
        message["reasoning_content"] = reasoning
    return {**message, **extra}


def marked(piece: Split, state) -> str:
    """A piece as streamed text: ``[reasoning]`` opens the reasoning and ``[answer]`` the answer after it, each
    on a line of its own; `state.in_reasoning` (a view, the terminal) remembers which part is being written
    (None before either: the first mark needs no line break before it)."""
    out = ""
    if piece.reasoning:
        if state.in_reasoning is None:
            out += f"{REASONING_MARK}\n"
        elif not state.in_reasoning:  # interleaved thinking: reasoning again after some answer
            out += f"\n{REASONING_MARK}\n"
        out += piece.reasoning
        state.in_reasoning = True
    if piece.content:
        out += f"\n{ANSWER_MARK}\n" if state.in_reasoning else ""
        out += piece.content
        state.in_reasoning = False
    return out
