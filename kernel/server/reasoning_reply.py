"""Reasoning on the chat endpoint: a request's thinking switches for the template, and a reply's reasoning apart.

``reasoning_effort`` becomes the switch of the model's own format (harmony's ``reasoning_effort``; for
think-tag templates thinking on, by the switch the template reads, unless ``chat_template_kwargs`` sets it), and
a reply's reasoning goes to ``reasoning_content`` (vLLM's field), its answer to ``content``, with
``usage.completion_tokens_details.reasoning_tokens`` counting the reasoning's tokens.
"""

from __future__ import annotations

import logging
from typing import Any

from shardbook.kernel.api.conversation import THINKING_KEYS, template_options_for
from shardbook.kernel.api.reasoning import ReasoningFormat, Split, StreamParser, reasoning_format
from shardbook.rankd.generation.engine import build_prompt_ids

log = logging.getLogger(__name__)


def template_options(
    parser: str, tokenizer: Any, chat_template_kwargs: dict[str, Any], reasoning_effort: str | None
) -> dict[str, Any]:
    """The chat template's keywords for a request to a model whose replies `parser` reads."""
    options = dict(chat_template_kwargs)
    if reasoning_effort is None:
        return options
    if parser == "think":
        given = [k for k in THINKING_KEYS if k in options]
        if given:
            log.warning("reasoning_effort %r ignored: chat_template_kwargs sets %s", reasoning_effort, given[0])
            return options
        return template_options_for(getattr(tokenizer, "chat_template", None), True, options)
    if "reasoning_effort" in options and options["reasoning_effort"] != reasoning_effort:
        log.warning("reasoning_effort %r ignored: chat_template_kwargs sets reasoning_effort", reasoning_effort)
        return options
    return {**options, "reasoning_effort": reasoning_effort}


def prompt_ids(tokenizer: Any, messages: list[dict[str, str]], options: dict[str, Any]) -> list[int]:
    return build_prompt_ids(tokenizer, messages, options)[0].tolist()


def reply_format(loaded: Any, prompt: list[int], override: str | None) -> ReasoningFormat:
    """How the loaded model's reply to `prompt` carries its reasoning (``reasoning_parser`` overrides)."""
    fmt = reasoning_format(getattr(loaded.model, "config", None), loaded.tokenizer, prompt, override)
    return fmt


class ReplySplitter:
    """One choice's reply split as it streams: each piece of text becomes a delta with ``content`` and/or
    ``reasoning_content`` (an empty dict while a tag is held back), and the whole is kept for usage."""

    def __init__(self, fmt: ReasoningFormat):
        self.fmt = fmt
        self.parser: StreamParser = fmt.stream()
        self.whole = Split()

    def delta(self, text: str, final: bool = False) -> dict[str, str]:
        """The delta of a piece of text; the `final` one also has what was held back (a tag cut short is text)."""
        piece = self.parser.feed(text) if text else Split()
        return self.as_delta(piece + self.parser.finish() if final else piece)

    def finish_reason(self, reason: str) -> str:
        """The reply's finish reason in OpenAI's words, from the engine's (translated)."""
        return reason

    def message(self) -> dict[str, Any]:
        """The whole reply's ``message``, once its final delta was taken."""
        if self.fmt.name == "none":
            return {"role": "assistant", "content": self.whole.content}
        return {"role": "assistant", "content": self.whole.content, "reasoning_content": self.whole.reasoning or None}

    def reply(self, text: str, reason: str) -> tuple[dict[str, Any], str]:
        """A whole reply's ``message`` and finish reason, through this (unused) splitter."""
        self.delta(text, final=True)
        return self.message(), self.finish_reason(reason)

    def as_delta(self, piece: Split) -> dict[str, str]:
        self.whole += piece
        delta = {}
        if piece.reasoning:
            delta["reasoning_content"] = piece.reasoning
        if piece.content:
            delta["content"] = piece.content
        return delta


def with_reasoning_tokens(usage: dict[str, Any], fmt: ReasoningFormat, tokenizer: Any, reasoning: list[str]) -> dict:
    """`usage` with ``completion_tokens_details.reasoning_tokens`` (the tokens of the reasoning texts), for a
    reasoning format; unchanged otherwise."""
    if fmt.name == "none" or usage is None:
        return usage
    count = sum(len(tokenizer(text, add_special_tokens=False)["input_ids"]) for text in reasoning if text)
    return {**usage, "completion_tokens_details": {"reasoning_tokens": count}}
