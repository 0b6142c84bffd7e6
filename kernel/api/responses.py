"""``ChatResponse``: a finished chat reply as rank 0's chat callers hand it out, apart from ``ChatModel`` so that
the reply's readers (``replies.py``, the tool loop) need not import the chat machinery that uses them."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from shardbook.rankd.generation.engine import GenerationResult


@dataclass(frozen=True)
class ChatResponse(GenerationResult):
    """A finished reply with its measurements (rank 0's ``GenerationResult``, received as a dict).

    ``scores``, when asked for, arrive as plain dicts: ``{token_id, text, prob, alternatives}``. Once split by
    the model's reasoning format (``ChatModel.chat``, ``%%chat``), ``text`` is the answer and ``reasoning`` the
    reasoning; after a tool loop ``steps`` holds each tool call (:class:`~shardbook.kernel.api.tools.ToolStep`).
    """

    reasoning: str = ""
    """The reply's reasoning, apart from its answer (``text``); empty when the model wrote none."""
    steps: tuple = ()
    """The tool calls run before this reply, in order (``ChatModel.chat(tools=...)``, ``%%chat --tools``)."""
    cached_tokens: int = 0
    """Prompt tokens taken from kept blocks instead of prefilled (prefix reuse, in the batch)."""

    @classmethod
    def from_result(cls, result: dict[str, Any]) -> ChatResponse:
        return cls(**{f.name: result[f.name] for f in fields(cls) if f.name in result})

    def status_line(self) -> str:
        return (
            f"{self.prompt_tokens} prompt tokens{f' ({self.cached_tokens} cached)' if self.cached_tokens else ''}, "
            f"{self.generated_tokens} generated, first token "
            f"{self.time_to_first_token_s * 1000:.0f} ms, {self.tokens_per_s:.1f} tok/s, {self.finish_reason}"
        )
