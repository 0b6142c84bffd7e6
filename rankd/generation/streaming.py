"""Token-to-text streaming: turns the token ids `model.generate` produces into whole-character text chunks.

A byte-level tokenizer can split one character (a Chinese character, an emoji) across
several tokens; decoding a prefix of those tokens ends in U+FFFD. :class:`TextDeltaStreamer`
holds such an incomplete tail back until the next token completes it, so every chunk it
hands on is whole text and the chunks concatenate to the decoded reply.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from transformers.generation.streamers import BaseStreamer

INCOMPLETE = "\ufffd"
"""What a decoder yields for the bytes of a character it has not seen all of yet."""


class TextDeltaStreamer(BaseStreamer):
    """A `model.generate` streamer that passes each new piece of whole text to `sink`.

    Unlike transformers' `TextStreamer`, it does not wait for a word boundary: text goes out
    as soon as it ends in a whole character. It decodes the tokens since the last newline
    together (some tokenizers decode a lone token differently, e.g. dropping a leading
    space), so decoding stays cheap for long replies.
    """

    def __init__(
        self,
        tokenizer: Any,
        sink: Callable[[str], None],
        *,
        skip_prompt: bool = True,
        decode: Callable[[list[int]], str] | None = None,
        **decode_kwargs: Any,
    ):
        self.tokenizer = tokenizer
        self.sink = sink
        self.decode = decode
        """How to decode tokens (a reply's decoder, keeping a format's special tags); else `tokenizer.decode`."""
        self.decode_kwargs = decode_kwargs
        self.skip_next = skip_prompt
        self.token_cache: list[int] = []
        self.num_sent = 0
        """Characters of `decode(token_cache)` already given to `sink`."""

    def put(self, value: torch.Tensor) -> None:
        """Take the next token ids (the prompt first, which is skipped when `skip_prompt`)."""
        if value.dim() > 1 and value.shape[0] > 1:
            raise ValueError(
                f"TextDeltaStreamer streams one sequence, got a batch of {value.shape[0]}; "
                "generate one request at a time"
            )
        if self.skip_next:
            self.skip_next = False
            return
        self.token_cache.extend(value.reshape(-1).tolist())
        text = self._decode(self.token_cache)
        if text.endswith(INCOMPLETE):
            return
        self._send(text[self.num_sent :])
        if text.endswith("\n"):
            # Restart the cache at the newline, keeping its token as context for the next decode.
            self.token_cache = self.token_cache[-1:]
            self.num_sent = len(self._decode(self.token_cache))
        else:
            self.num_sent = len(text)

    def end(self) -> None:
        """Send whatever is still held back (an incomplete character stays U+FFFD for good)."""
        text = self._decode(self.token_cache)
        self._send(text[self.num_sent :])
        self.token_cache = []
        self.num_sent = 0

    def _decode(self, token_ids: list[int]) -> str:
        if self.decode is not None:
            return self.decode(token_ids)
        return self.tokenizer.decode(token_ids, **self.decode_kwargs)

    def _send(self, text: str) -> None:
        if text:
            self.sink(text)


def find_stop(text: str, stops: list[str]) -> int | None:
    """Where the earliest of the ``stops`` strings begins in ``text``, or None."""
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(found) if found else None


class StopTextFilter:
    """Passes streamed text on to ``sink`` up to (never including) the first stop string.

    Text that could be the beginning of a stop string is held back until the next chunk shows
    whether it is; :meth:`close` sends what is still held back when no stop string came.
    """

    def __init__(self, sink: Callable[[str], None], stops: list[str]):
        self.sink = sink
        self.stops = stops
        self.text = ""
        self.num_sent = 0
        self.stopped = False

    def __call__(self, chunk: str) -> None:
        if self.stopped:
            return
        self.text += chunk
        cut = find_stop(self.text, self.stops)
        if cut is not None:
            self.stopped = True
            self._send_up_to(cut)
        else:
            self._send_up_to(len(self.text) - self._held_back())

    def close(self) -> None:
        if not self.stopped:
            self._send_up_to(len(self.text))

    def _held_back(self) -> int:
        """Length of the longest end of the text that begins some stop string."""
        return max(
            (n for s in self.stops for n in range(min(len(s) - 1, len(self.text)), 0, -1) if self.text.endswith(s[:n])),
            default=0,
        )

    def _send_up_to(self, end: int) -> None:
        if end > self.num_sent:
            self.sink(self.text[self.num_sent : end])
            self.num_sent = end


class IncrementalText:
    """A reply's text as its tokens come, decoding only the newest ones (transformers' and vLLM's incremental
    detokenization): each step decodes the tokens since the last whole piece together with the piece before
    (as context: some tokenizers decode a lone token differently, e.g. dropping a leading space) and keeps
    what that context does not already give. While the newest tokens end inside a character (U+FFFD), the
    piece stays pending and is decoded again with the next token.

    ``decoded + pending`` equals ``decode(tokens)``, at a cost per token that does not grow with the reply.
    """

    def __init__(self, decode: Callable[[list[int]], str]):
        self.decode = decode
        self.decoded = ""
        """The text of the tokens up to `read` (whole characters)."""
        self.pending = ""
        """The text of the tokens after `read` (it ends inside a character)."""
        self.prefix = 0
        """Where the context of the next decode starts (the piece before `read`)."""
        self.read = 0
        self.prefix_text = ""
        """decode(tokens[prefix:read])."""
        self.restarts = 0
        """How often the context decoded otherwise than before, so the text was decoded again from the start."""

    def update(self, tokens: list[int]) -> None:
        """Take `tokens`, the reply's tokens so far (the earlier ones unchanged)."""
        text = self.decode(tokens[self.prefix :])
        if not text.startswith(self.prefix_text):  # the context decodes otherwise now: start again from the first token
            self.decoded, self.prefix, self.read, self.prefix_text = "", 0, 0, ""
            self.restarts += 1
            text = self.decode(tokens)
        new = text[len(self.prefix_text) :]
        if not new or new.endswith(INCOMPLETE):
            self.pending = new
            return
        self.decoded += new
        self.pending = ""
        self.prefix, self.read = self.read, len(tokens)
        self.prefix_text = self.decode(tokens[self.prefix : self.read])

    def __len__(self) -> int:
        return len(self.decoded) + len(self.pending)

    def tail(self, start: int) -> str:
        """The text from character `start` on (cheap when `start` is near the end)."""
        if start >= len(self.decoded):
            return self.pending[start - len(self.decoded) :]
        return self.decoded[start:] + self.pending
