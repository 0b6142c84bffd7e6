"""``POST /v1/chat/completions`` over the continuous batch (the default; ``--no-batch`` takes turns instead).

Concurrent chat requests then decode together, and a request may ask for ``n`` > 1 replies and for
``logprobs`` / ``top_logprobs`` (the chat shape: ``{"content": [{token, logprob, bytes, top_logprobs}]}``).
The messages, the config's system prompt and the settings are those of the single-reply path.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, replace
from typing import Any

from shardbook.kernel.api.batch import scheduler_for, sequence_request
from shardbook.kernel.server.batch_reply import BatchReplyHandler
from shardbook.kernel.server.openai_api import FINISH_REASONS, ApiError, load_body, parse_request
from shardbook.kernel.server.reasoning_reply import reply_format, template_options, with_reasoning_tokens
from shardbook.kernel.server.text_completions import MAX_N
from shardbook.kernel.server.tool_reply import call_pieces, reply_splitter, request_tool_format, with_tools
from shardbook.rankd.generation.batching import BatchLimitError, SequenceRequest, SequenceResult, StreamDelta

EXTRA = ("n", "logprobs", "top_logprobs", "ignore_eos", "min_tokens")


@dataclass
class ChatBatchRequest:
    model: str
    n: int
    logprobs: bool
    top_logprobs: int
    stream: bool
    include_usage: bool
    continuous_usage: bool


def split_body(raw: bytes) -> tuple[bytes, dict[str, Any]]:
    """The body without the fields only the batched path handles (for ``parse_request``), and those fields."""
    body = load_body(raw)
    if not isinstance(body, dict):
        return raw, {}
    extra = {k: body.pop(k) for k in EXTRA if k in body}
    options = body.get("stream_options")
    if isinstance(options, dict) and "continuous_usage_stats" in options:
        extra["continuous_usage_stats"] = options.pop("continuous_usage_stats")
        if not options:
            body.pop("stream_options")
    return json.dumps(body).encode(), extra


class BatchedChatCompletionsHandler(BatchReplyHandler):
    OBJECT, CHUNK_OBJECT, ID_PREFIX = "chat.completion", "chat.completion.chunk", "chatcmpl-"

    def plan(self) -> tuple[ChatBatchRequest, list[tuple[int, SequenceRequest]]]:
        raw, extra = split_body(bytes(self.body))
        parsed = parse_request(raw)
        loaded = self.server.served_model(parsed.model)
        request = chat_batch_request(parsed, extra)
        override = self.server.parser("reasoning_parser")
        try:
            parser = reply_format(loaded, [], override).name
        except ValueError as e:
            raise ApiError(400, str(e)) from None
        options = template_options(parser, loaded.tokenizer, parsed.chat_template_kwargs, parsed.reasoning_effort)
        options = with_tools(options, parsed.tools)
        tool_fmt = request_tool_format(loaded, parsed.tools, self.server.parser("tool_call_parser"))
        settings = dict(parsed.settings)
        base_seed = settings.pop("seed", None)
        if base_seed is None:
            base_seed = secrets.randbits(62)
        planned = []
        runtime = self.server.runtime
        for c in range(request.n):
            try:
                base = sequence_request(
                    runtime,
                    parsed.messages,
                    chat=True,
                    stop=parsed.stop,
                    seed=(base_seed + c) % 2**63,
                    template_options=options,
                    **settings,
                )
                sequence = replace(
                    base,
                    ignore_eos=bool(extra.get("ignore_eos") or False),
                    min_tokens=_int(extra, "min_tokens", 0),
                    logprobs=request.top_logprobs if request.logprobs else None,
                )
                scheduler_for(runtime).check(sequence)
            except BatchLimitError as e:
                raise ApiError(400, str(e), param="messages" if e.param == "prompt" else e.param) from None
            except ValueError as e:
                raise ApiError(400, str(e), param="messages") from None
            planned.append((0, sequence))
        self.fmt, self.tokenizer = reply_format(loaded, list(planned[0][1].prompt_ids), override), loaded.tokenizer
        metrics = self.server.metrics
        self.splitters = [reply_splitter(self.fmt, tool_fmt, parsed.tools, metrics) for _ in planned]
        return request, planned

    def open_stream(self, ids: tuple[str, int], request) -> None:
        super().open_stream(ids, request)
        for index in range(request.n):
            self.send_chunk(ids, request, [self.delta(index, {"role": "assistant", "content": ""})])

    def stream_choice(self, request, planned, index: int, delta: StreamDelta, final: bool = False) -> dict[str, Any]:
        """A piece of choice `index`: its text as ``content`` and ``reasoning_content`` (the model's format)."""
        choice = self.delta(index, self.splitters[index].delta(delta.text, final=final))
        if request.logprobs:
            choice["logprobs"] = {"content": chat_logprobs(scheduler_for(self.server.runtime).tokenizer, delta)}
        return choice

    def finish_choice(self, request, planned, index: int, delta: StreamDelta) -> dict[str, Any]:
        return self.stream_choice(request, planned, index, delta, final=True)

    def send_chunk(self, ids: tuple[str, int], request, choices: list, usage: dict[str, int] | None = None) -> None:
        """A choice that ends on its tool calls finishes with ``tool_calls``; its calls go first in chunks of their
        own, as ``call_pieces`` streams them."""
        for choice in choices:
            if choice.get("finish_reason") is not None:
                choice["finish_reason"] = self.splitters[choice["index"]].finish_reason(choice["finish_reason"])
        if len(choices) == 1 and choices[0]["delta"].get("tool_calls"):
            choice = choices[0]
            first, *pieces, last = call_pieces(choice["delta"])  # the text's logprobs go with the first
            super().send_chunk(ids, request, [{**choice, "delta": first, "finish_reason": None}], usage)
            for piece in pieces:
                piece_choice = {**choice, "delta": piece, "finish_reason": None, "logprobs": None}
                super().send_chunk(ids, request, [piece_choice], usage)
            choices = [{**choice, "delta": last, "logprobs": None}]
        super().send_chunk(ids, request, choices, usage)

    def usage(self, planned, results: dict[int, SequenceResult]) -> dict[str, Any]:
        reasoning = [self.fmt.split(r.text).reasoning for r in results.values()]
        return with_reasoning_tokens(super().usage(planned, results), self.fmt, self.tokenizer, reasoning)

    def delta(self, index: int, delta: dict[str, Any]) -> dict[str, Any]:
        return {"index": index, "delta": delta, "finish_reason": None, "logprobs": None}

    def choices(self, request, planned, results: dict[int, SequenceResult]) -> list[dict[str, Any]]:
        tokenizer = scheduler_for(self.server.runtime).tokenizer
        choices = []
        for index in range(len(planned)):
            result = results[index]
            message, finish = self.splitters[index].reply(result.text, FINISH_REASONS[result.finish_reason])
            logprobs = {"content": chat_logprobs(tokenizer, result)} if request.logprobs else None
            choices.append({"index": index, "message": message, "finish_reason": finish, "logprobs": logprobs})
        return choices


def chat_batch_request(parsed: Any, extra: dict[str, Any]) -> ChatBatchRequest:
    """The batch-only fields of a chat request, checked (ApiError 400 naming the field)."""
    n = _int(extra, "n", 1)
    if not 1 <= n <= MAX_N:
        raise ApiError(400, f"'n' must be in 1..{MAX_N}, got {n}", param="n")
    logprobs = extra.get("logprobs") or False
    if not isinstance(logprobs, bool):
        raise ApiError(400, "'logprobs' must be a boolean", param="logprobs")
    top = _int(extra, "top_logprobs", 0)
    if not 0 <= top <= 5 or (top and not logprobs):
        raise ApiError(400, "'top_logprobs' must be in 0..5, and needs 'logprobs': true", param="top_logprobs")
    return ChatBatchRequest(
        model=parsed.model,
        n=n,
        logprobs=logprobs,
        top_logprobs=top,
        stream=parsed.stream,
        include_usage=parsed.include_usage,
        continuous_usage=bool(extra.get("continuous_usage_stats")),
    )


def chat_logprobs(tokenizer: Any, result: SequenceResult) -> list[dict[str, Any]]:
    content = []
    for i, (token_id, logprob) in enumerate(zip(result.token_ids, result.token_logprobs or [])):
        token = tokenizer.decode([token_id])
        tops = (result.top_logprobs or [{}] * (i + 1))[i]
        content.append(
            {
                "token": token,
                "logprob": logprob,
                "bytes": list(token.encode("utf-8")),
                "top_logprobs": [
                    {"token": (t := tokenizer.decode([k])), "logprob": v, "bytes": list(t.encode("utf-8"))}
                    for k, v in tops.items()
                ],
            }
        )
    return content


def _int(extra: dict[str, Any], key: str, default: int) -> int:
    value = extra.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(400, f"'{key}' must be an integer", param=key)
    return value
