"""The text of a reply as the kernel's parsers read it.

Replies are decoded without special tokens (end-of-text, padding, a template's role tokens), except the tags a
reasoning or tool-call format writes with special tokens: gpt-oss's harmony channels (``<|channel|>``,
``<|message|>``, ``<|end|>``, ``<|call|>``, ...), Kimi-K2's ``<|tool_call_begin|>`` and its kin, DeepSeek's
``<｜tool▁calls▁begin｜>`` where a tokenizer marks them special. Dropped, they would leave the reasoning and the
calls unreadable; kept, the kernel's reasoning and tool-call parsers read them and take them out of the content
users get. Every path that turns reply tokens into text (the batch's incremental decode, the single path's
streamer, its stop check and its result) decodes through :func:`reply_decoder`, so they agree.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

__all__ = ["DECODE_KWARGS", "FORMAT_TAGS", "kept_tags", "reply_decoder"]

DECODE_KWARGS = {"skip_special_tokens": True, "clean_up_tokenization_spaces": False}
"""How a reply is decoded when its tokenizer marks none of the format tags special."""

FORMAT_TAGS: dict[str, tuple[str, ...]] = {
    "think": ("<think>", "</think>"),
    "harmony": ("<|channel|>", "<|start|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>", "<|constrain|>"),
    "hermes": ("<tool_call>", "</tool_call>"),
    "glm45": ("<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"),
    "deepseek_v31": (
        "<｜tool▁calls▁begin｜>",
        "<｜tool▁call▁begin｜>",
        "<｜tool▁sep｜>",
        "<｜tool▁call▁end｜>",
        "<｜tool▁calls▁end｜>",
    ),
    "kimi_k2": (
        "<|tool_calls_section_begin|>",
        "<|tool_call_begin|>",
        "<|tool_call_argument_begin|>",
        "<|tool_call_end|>",
        "<|tool_calls_section_end|>",
    ),
    "minimax_m2": ("<minimax:tool_call>", "</minimax:tool_call>"),
}
"""The tags each reasoning or tool-call format reads, its telltale first: a format's tags are kept only in a
vocabulary that has its telltale, so a generic name (harmony's ``<|end|>``) stays dropped in other families."""

_decoders: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def kept_tags(tokenizer: Any) -> dict[str, int]:
    """The format tags that are special tokens of `tokenizer` (tag -> id): what a reply's text keeps."""
    vocab = tokenizer.get_vocab()
    special = set(getattr(tokenizer, "all_special_tokens", ()))
    special |= {t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values() if t.special}
    kept = {}
    for tags in FORMAT_TAGS.values():
        if tags[0] in vocab:
            kept.update({tag: vocab[tag] for tag in tags if tag in special and tag in vocab})
    return kept


def reply_decoder(tokenizer: Any) -> Callable[[list[int]], str]:
    """``ids -> text`` for replies of `tokenizer`: special tokens dropped, the format tags kept (one per
    tokenizer, cached)."""
    try:
        return _decoders[tokenizer]
    except (KeyError, TypeError):
        pass
    decoder = _make_decoder(tokenizer)
    try:
        _decoders[tokenizer] = decoder
    except TypeError:  # a tokenizer that takes no weak reference is decoded without the cache
        pass
    return decoder


def _make_decoder(tokenizer: Any) -> Callable[[list[int]], str]:
    kept = set(kept_tags(tokenizer).values())
    if not kept:
        return lambda ids: tokenizer.decode(ids, **DECODE_KWARGS)
    special_ids = set(getattr(tokenizer, "all_special_ids", ()))
    special_ids |= {i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if t.special}
    dropped = special_ids - kept

    def decode(ids: list[int]) -> str:
        shown = [i for i in ids if i not in dropped]
        return tokenizer.decode(shown, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    return decode
