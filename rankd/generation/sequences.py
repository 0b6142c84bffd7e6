"""One sequence of the continuous batch as rank 0 sees it: its request, the submitter's handle, its result and
its running state (`batching.py`'s scheduler drives them)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import torch

from shardbook.rankd.generation.sampling import check_sampling
from shardbook.rankd.generation.streaming import IncrementalText

MAX_LOGPROBS = 5
"""Most alternatives per token a request may ask for (OpenAI's legacy completions limit)."""


class BatchLimitError(ValueError):
    """A request that can never run under the batch limits (or the model's context); `param` names the
    request field to change (``prompt`` or ``max_tokens``)."""

    def __init__(self, message: str, param: str = "prompt"):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class SequenceRequest:
    """One sequence to decode: its prompt as token ids and its own settings."""

    prompt_ids: list[int]
    max_new_tokens: int = 16
    """Most tokens to generate; 0 only scores the prompt (with `prompt_logprobs`)."""
    do_sample: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    repetition_penalty: float = 1.0
    seed: int = 0
    """Seeds this request's own generator (only used when sampling)."""
    stop: list[str] = field(default_factory=list)
    eos_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    """Do not end on an end-of-text token (vLLM's extension)."""
    suppress_ids: list[int] = field(default_factory=list)
    """Tokens never generated: the checkpoint's `generation_config.suppress_tokens`, as transformers' generate."""
    min_tokens: int = 0
    """End-of-text tokens are forbidden before this many tokens (vLLM's extension)."""
    logprobs: int | None = None
    """Record each generated token's log-probability and this many most likely alternatives (0-5)."""
    prompt_logprobs: bool = False
    """Also score every prompt token after the first (`echo` with `logprobs`)."""
    intervene: bool = False
    """The model's interventions (`%intervene`) apply to this sequence: a notebook cell's, never an HTTP client's."""

    def __post_init__(self) -> None:
        _check(len(self.prompt_ids) >= 1, "the prompt must have at least one token")
        _check(all(isinstance(t, int) and t >= 0 for t in self.prompt_ids), "prompt token ids must be ints >= 0")
        _check(self.max_new_tokens >= 0, f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        _check(
            self.max_new_tokens >= 1 or self.prompt_logprobs,
            "max_new_tokens=0 only scores the prompt: ask for prompt log-probabilities (echo with logprobs)",
        )
        _check(self.temperature > 0, f"temperature must be > 0, got {self.temperature}")
        wrong = check_sampling(self.do_sample, self.temperature, self.repetition_penalty, "use do_sample=False")
        _check(wrong is None, wrong)
        _check(0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}")
        _check(self.top_k >= 0, f"top_k must be >= 0, got {self.top_k}")
        _check(self.min_tokens >= 0, f"min_tokens must be >= 0, got {self.min_tokens}")
        _check(
            self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
            f"logprobs must be in 0..{MAX_LOGPROBS}, got {self.logprobs}",
        )
        _check(all(isinstance(s, str) and s for s in self.stop), "stop must be a list of non-empty strings")


@dataclass
class SequenceResult:
    """What one sequence produced (rank 0 only)."""

    token_ids: list[int]
    text: str
    finish_reason: str
    """"stop" (end-of-text or a stop string), "length", "interrupted" (stopped) or "error"."""
    prompt_tokens: int
    token_logprobs: list[float] | None = None
    top_logprobs: list[dict[int, float]] | None = None
    prompt_logprobs: list[float | None] | None = None
    """Log-probability of each prompt token given those before it (None for the first)."""
    prompt_top_logprobs: list[dict[int, float] | None] | None = None
    queue_s: float = 0.0
    time_to_first_token_s: float = 0.0
    total_s: float = 0.0
    """Seconds from submission to the end."""
    error: str | None = None
    cached_tokens: int = 0
    """Prompt tokens taken from kept blocks (prefix reuse) instead of prefilled."""
    failed_alone: bool = False
    """The error is this sequence's (its step, its intervention, its scores) and the batch went on."""

    @property
    def generated_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class StreamDelta:
    """What one streamed piece of a reply holds (``on_delta``): its text, and the tokens generated since the
    previous piece with their log-probabilities (when the request asks for them). The first piece also
    carries the prompt's log-probabilities (with `prompt_logprobs`)."""

    text: str
    token_ids: list[int]
    token_logprobs: list[float]
    top_logprobs: list[dict[int, float]]
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[dict[int, float] | None] | None = None


class SequenceHandle:
    """Rank 0's handle on a submitted sequence: stop it, wait for its result."""

    def __init__(
        self,
        request: SequenceRequest,
        on_text: Callable[[str], None] | None,
        on_done: Callable[[SequenceResult], None] | None = None,
        on_delta: Callable[[StreamDelta], None] | None = None,
        owner: Hashable | None = None,
    ):
        self.request = request
        self.on_text = on_text
        self.on_done = on_done
        self.on_delta = on_delta
        self.owner = owner
        """Who submitted it (a notebook cell, say), for :meth:`BatchScheduler.stop_owned`; None for nobody."""
        self.submitted_at = time.perf_counter()
        self.stop_requested = threading.Event()
        self.done = threading.Event()
        self.result: SequenceResult | None = None
        self.starts_loop = False
        """True when the submitter must start the batch loop (none was running)."""

    def complete(self, result: SequenceResult) -> None:
        """Set the result, wake the waiters and call `on_done` (whose errors are not the batch's)."""
        self.result = result
        self.done.set()
        if self.on_done is not None:
            try:
                self.on_done(result)
            except Exception:
                pass

    def stop(self) -> None:
        """Stop this sequence: it leaves the batch at the next step; the others keep running."""
        self.stop_requested.set()

    def wait(self, timeout: float | None = None) -> SequenceResult:
        if not self.done.wait(timeout):
            raise TimeoutError("the sequence did not finish in time")
        assert self.result is not None
        return self.result


@dataclass
class RunningSequence:
    """A sequence the batch has admitted: what it generated so far and what was handed on of it."""

    handle: SequenceHandle
    generator: torch.Generator | None
    tokens: list[int] = field(default_factory=list)
    next_token: int = -1
    text: IncrementalText | None = None
    """The reply's text so far, decoded as tokens come (when it has stop strings or a consumer)."""
    emitted: int = 0
    """Characters of the reply already handed to `on_text`."""
    streamed: int = 0
    """Tokens already handed to `on_delta`."""
    finished: bool = False
    token_logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] = field(default_factory=list)
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[dict[int, float] | None] | None = None
    first_token_at: float = 0.0
    admitted_at: float = 0.0
    prefilled: int = 0
    """Prompt tokens planned into its cache so far, when its prompt is prefilled in chunks."""
    cached: int = 0
    """Prompt tokens its cache starts with from kept blocks (prefix reuse)."""


def next_delta(seq: RunningSequence, text: str) -> StreamDelta:
    """`text` with the tokens generated since the last piece (and, on the first, the prompt's log-probabilities)."""
    first, start, seq.streamed = seq.emitted == len(text), seq.streamed, len(seq.tokens)
    return StreamDelta(
        text,
        seq.tokens[start:],
        seq.token_logprobs[start:],
        seq.top_logprobs[start:],
        seq.prompt_logprobs if first else None,
        seq.prompt_top_logprobs if first else None,
    )


def reach(request: SequenceRequest) -> int:
    """The most tokens a sequence holds in the cache: its prompt and every token it may generate."""
    return len(request.prompt_ids) + max(request.max_new_tokens, 1)


def admit(handle: SequenceHandle) -> RunningSequence:
    """`handle`'s sequence as it enters the batch, with its own seeded generator when it samples."""
    request = handle.request
    generator = None
    if request.do_sample:
        generator = torch.Generator(device="cpu")
        generator.manual_seed(request.seed)
    return RunningSequence(handle=handle, generator=generator, admitted_at=time.perf_counter())


def _check(condition: Any, message: str) -> None:
    if not condition:
        raise ValueError(message)
