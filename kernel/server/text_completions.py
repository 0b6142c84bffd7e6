"""``POST /v1/completions`` (OpenAI's legacy completions) over the continuous batch.

Every prompt (times ``n``) becomes one sequence in rank 0's batch scheduler, so concurrent requests,
and the prompts of one request, decode together. ``echo`` with ``logprobs`` and ``max_tokens: 0`` scores
the prompt alone (what lm-eval's log-likelihood tasks send). Log-probabilities are those of the model's
own distribution (log-softmax of the logits, before temperature or top-p).
"""

from __future__ import annotations

import json
import secrets
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from shardbook.kernel.api.batch import model_token_rules, scheduler_for
from shardbook.kernel.server.batch_reply import BatchReplyHandler
from shardbook.kernel.server.openai_api import ApiError, check_temperature, load_body, parse_stop
from shardbook.rankd.generation.batching import BatchLimitError, SequenceRequest, SequenceResult, StreamDelta
from shardbook.rankd.generation.sampling import MAX_REPETITION_PENALTY, MIN_REPETITION_PENALTY

FIELDS = {
    "model",
    "prompt",
    "max_tokens",
    "echo",
    "logprobs",
    "n",
    "stop",
    "seed",
    "temperature",
    "top_p",
    "top_k",
    "stream",
    "stream_options",
    "ignore_eos",
    "min_tokens",
    "user",
    "frequency_penalty",
    "presence_penalty",
    "best_of",
    "repetition_penalty",
}
MAX_N = 16
FINISH = {"stop": "stop", "length": "length", "interrupted": "length", "error": "error"}


@dataclass
class TextCompletionRequest:
    model: str
    prompts: list[str | list[int]]
    max_tokens: int
    echo: bool
    logprobs: int | None
    n: int
    stop: list[str]
    seed: int | None
    sampling: dict[str, Any]
    ignore_eos: bool
    min_tokens: int
    stream: bool
    include_usage: bool
    continuous_usage: bool


def parse_text_request(raw: bytes) -> TextCompletionRequest:
    """The checked body of a ``/v1/completions`` request, or ApiError(400) naming what is wrong."""
    body = load_body(raw)
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object with 'model' and 'prompt'")
    unknown = sorted(set(body) - FIELDS)
    if unknown:
        raise ApiError(400, f"unsupported field '{unknown[0]}': this server does not implement it", param=unknown[0])
    for key, harmless in (("frequency_penalty", 0), ("presence_penalty", 0), ("best_of", 1)):
        if body.get(key) not in (None, harmless):
            raise ApiError(400, f"unsupported value for '{key}': only {harmless} is implemented", param=key)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError(400, "'model' is required: the id that GET /v1/models lists", param="model")
    prompts = _prompts(body.get("prompt"))
    echo = _get(body, "echo", bool, False)
    max_tokens = _get(body, "max_tokens", int, 16)
    logprobs = _get(body, "logprobs", int, None)
    if logprobs is not None and not 0 <= logprobs <= 5:
        raise ApiError(400, f"'logprobs' must be in 0..5, got {logprobs}", param="logprobs")
    if max_tokens < 0 or (max_tokens == 0 and not echo):
        raise ApiError(400, "'max_tokens' must be >= 1 (0 only with 'echo')", param="max_tokens")
    n = _get(body, "n", int, 1)
    if not 1 <= n <= MAX_N:
        raise ApiError(400, f"'n' must be in 1..{MAX_N}, got {n}", param="n")
    seed = _get(body, "seed", int, None)
    if seed is not None and not 0 <= seed < 2**63:
        raise ApiError(400, f"'seed' must be in [0, 2**63), got {seed}", param="seed")
    temperature = _get(body, "temperature", (int, float), 1.0)
    check_temperature(temperature)
    top_p = _get(body, "top_p", (int, float), 1.0)
    if not 0 < top_p <= 1:
        raise ApiError(400, f"'top_p' must be in (0, 1], got {top_p}", param="top_p")
    top_k = _get(body, "top_k", int, -1)
    repetition_penalty = _get(body, "repetition_penalty", (int, float), 1.0)
    if not MIN_REPETITION_PENALTY <= repetition_penalty <= MAX_REPETITION_PENALTY:
        raise ApiError(
            400,
            f"'repetition_penalty' must be in [{MIN_REPETITION_PENALTY:g}, {MAX_REPETITION_PENALTY:g}] (1 is none), "
            f"got {repetition_penalty}",
            param="repetition_penalty",
        )
    sampling: dict[str, Any] = {"do_sample": temperature > 0, "repetition_penalty": float(repetition_penalty)}
    if temperature > 0:
        sampling.update(temperature=float(temperature), top_p=float(top_p), top_k=max(top_k, 0))
    stream = _get(body, "stream", bool, False)
    options = _get(body, "stream_options", dict, {})
    if options and not stream:
        raise ApiError(400, "'stream_options' is only allowed with 'stream': true", param="stream_options")
    if set(options) - {"include_usage", "continuous_usage_stats"}:
        raise ApiError(400, f"unsupported stream_options {sorted(options)}", param="stream_options")
    min_tokens = _get(body, "min_tokens", int, 0)
    if min_tokens < 0:
        raise ApiError(400, f"'min_tokens' must be >= 0, got {min_tokens}", param="min_tokens")
    return TextCompletionRequest(
        model=model,
        prompts=prompts,
        max_tokens=max_tokens,
        echo=echo,
        logprobs=logprobs,
        n=n,
        stop=parse_stop(body.get("stop")),
        seed=seed,
        sampling=sampling,
        ignore_eos=_get(body, "ignore_eos", bool, False),
        min_tokens=min_tokens,
        stream=stream,
        include_usage=bool(options.get("include_usage")),
        continuous_usage=bool(options.get("continuous_usage_stats")),
    )


def _prompts(prompt: Any) -> list[str | list[int]]:
    def is_ids(value: Any) -> bool:
        return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)

    if isinstance(prompt, str):
        prompts: list[Any] = [prompt]
    elif is_ids(prompt) and prompt:
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) or is_ids(p) for p in prompt):
        prompts = list(prompt)
    else:
        raise ApiError(
            400, "'prompt' must be a string, a list of strings, a list of token ids, or a list of such lists", "prompt"
        )
    for p in prompts:
        if len(p) == 0:
            raise ApiError(400, "'prompt' must not be empty", param="prompt")
    return prompts


def _get(body: dict[str, Any], key: str, kind: Any, default: Any) -> Any:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) and kind is not bool or not isinstance(value, kind):
        raise ApiError(400, f"'{key}' has the wrong type: {json.dumps(value)}", param=key)
    return value


def logprobs_body(
    tokenizer: Any, prompt_ids: list[int], result: SequenceResult, echo: bool, text_start: int = 0
) -> dict[str, Any]:
    """OpenAI's legacy shape: tokens, token_logprobs, top_logprobs, text_offset (prompt tokens first with echo)."""
    ids: list[int] = []
    token_lp: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    if echo:
        ids += prompt_ids
        token_lp += result.prompt_logprobs or [None] * len(prompt_ids)
        tops += [None if t is None else _named(tokenizer, t) for t in (result.prompt_top_logprobs or [None] * len(ids))]
    ids += result.token_ids
    token_lp += result.token_logprobs or []
    tops += [_named(tokenizer, t) for t in (result.top_logprobs or [])]
    tokens = [tokenizer.decode([i]) for i in ids]
    offsets, at = [], text_start
    for token in tokens:
        offsets.append(at)
        at += len(token)
    return {"tokens": tokens, "token_logprobs": token_lp, "top_logprobs": tops, "text_offset": offsets}


def _named(tokenizer: Any, top: dict[int, float]) -> dict[str, float]:
    return {tokenizer.decode([i]): lp for i, lp in top.items()}


class TextCompletionsHandler(BatchReplyHandler):
    OBJECT = CHUNK_OBJECT = "text_completion"
    ID_PREFIX = "cmpl-"
    FINISH = FINISH

    def prepare(self) -> None:
        super().prepare()
        self.echoed: set[int] = set()
        self.sent: defaultdict[int, int] = defaultdict(int)
        """Characters streamed so far per choice (the next piece's text offset)."""

    def plan(self) -> tuple[TextCompletionRequest, list[tuple[int, SequenceRequest]]]:
        request = parse_text_request(bytes(self.body))
        self.server.served_model(request.model)
        tokenizer = scheduler_for(self.server.runtime).tokenizer
        token_rules = model_token_rules(self.server.runtime)
        seed = request.seed if request.seed is not None else secrets.randbits(62)
        planned = []
        for p, prompt in enumerate(request.prompts):
            ids = tokenizer(prompt)["input_ids"] if isinstance(prompt, str) else list(prompt)
            if any(i >= len(tokenizer) for i in ids):
                raise ApiError(400, "'prompt' has a token id outside the vocabulary", param="prompt")
            for c in range(request.n):
                try:
                    sequence = SequenceRequest(
                        prompt_ids=ids,
                        max_new_tokens=request.max_tokens,
                        seed=(seed + p * request.n + c) % 2**63,
                        stop=request.stop,
                        **token_rules,
                        ignore_eos=request.ignore_eos,
                        min_tokens=request.min_tokens,
                        logprobs=request.logprobs,
                        prompt_logprobs=request.echo and request.logprobs is not None or request.max_tokens == 0,
                        **request.sampling,
                    )
                    scheduler_for(self.server.runtime).check(sequence)
                except BatchLimitError as e:
                    raise ApiError(400, str(e), param=e.param) from None
                except ValueError as e:
                    raise ApiError(400, str(e), param="prompt") from None
                planned.append((p, sequence))
        return request, planned

    def stream_choice(self, request, planned, index: int, delta: StreamDelta) -> dict[str, Any]:
        p, sequence = planned[index]
        echo = request.echo and index not in self.echoed  # the prompt comes first, once
        self.echoed.add(index)
        text = (self.prompt_text(request.prompts[p]) if echo else "") + delta.text
        logprobs = None
        if request.logprobs is not None:
            prompt_ids = sequence.prompt_ids if echo else []
            tokenizer = scheduler_for(self.server.runtime).tokenizer
            logprobs = logprobs_body(tokenizer, prompt_ids, delta, echo, text_start=self.sent[index])
        self.sent[index] += len(text)
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": None}

    def prompt_text(self, prompt: str | list[int]) -> str:
        return prompt if isinstance(prompt, str) else scheduler_for(self.server.runtime).tokenizer.decode(prompt)

    def choices(self, request, planned, results: dict[int, SequenceResult]) -> list[dict[str, Any]]:
        tokenizer = scheduler_for(self.server.runtime).tokenizer
        choices = []
        for index, (p, sequence) in enumerate(planned):
            result = results[index]
            prompt = request.prompts[p]
            prompt_text = self.prompt_text(prompt) if request.echo else ""
            choice = {"index": index, "text": prompt_text + result.text, "logprobs": None}
            if request.logprobs is not None:
                choice["logprobs"] = logprobs_body(tokenizer, sequence.prompt_ids, result, request.echo)
            choice["finish_reason"] = FINISH[result.finish_reason]
            choices.append(choice)
        return choices
