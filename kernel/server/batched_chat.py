"""``POST /v1/chat/completions`` over the continuous batch (a server started with ``--batch``).

Concurrent chat requests then decode together, and a request may ask for ``n`` > 1 replies and for
``logprobs`` / ``top_logprobs`` (the chat shape: ``{"content": [{token, logprob, bytes, top_logprobs}]}``).
The messages, the config's system prompt and the settings are those of the single-reply path.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from dataclasses import dataclass
from typing import Any

from tornado.iostream import StreamClosedError

from shardbook.kernel.api.batch import scheduler_for, sequence_request
from shardbook.kernel.server.openai_api import FINISH_REASONS, ApiError, parse_request
from shardbook.kernel.server.text_completions import MAX_N, TextCompletionsHandler
from shardbook.rankd.generation.batching import BatchLimitError, SequenceRequest, SequenceResult

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
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
        return raw, {}  # parse_request names the error
    if not isinstance(body, dict):
        return raw, {}
    extra = {k: body.pop(k) for k in EXTRA if k in body}
    options = body.get("stream_options")
    if isinstance(options, dict) and "continuous_usage_stats" in options:
        extra["continuous_usage_stats"] = options.pop("continuous_usage_stats")
        if not options:
            body.pop("stream_options")
    return json.dumps(body).encode(), extra


class BatchedChatCompletionsHandler(TextCompletionsHandler):
    def plan(self) -> tuple[ChatBatchRequest, list[tuple[int, SequenceRequest]]]:
        if self.too_large:
            raise ApiError(413, "the request body is too large", code="request_too_large")
        raw, extra = split_body(bytes(self.body))
        parsed = parse_request(raw)
        self.server.served_model(parsed.model)
        n = _int(extra, "n", 1)
        if not 1 <= n <= MAX_N:
            raise ApiError(400, f"'n' must be in 1..{MAX_N}, got {n}", param="n")
        logprobs = extra.get("logprobs") or False
        if not isinstance(logprobs, bool):
            raise ApiError(400, "'logprobs' must be a boolean", param="logprobs")
        top = _int(extra, "top_logprobs", 0)
        if not 0 <= top <= 5 or (top and not logprobs):
            raise ApiError(400, "'top_logprobs' must be in 0..5, and needs 'logprobs': true", param="top_logprobs")
        ignore_eos = bool(extra.get("ignore_eos") or False)
        min_tokens = _int(extra, "min_tokens", 0)
        request = ChatBatchRequest(
            model=parsed.model,
            n=n,
            logprobs=logprobs,
            top_logprobs=top,
            stream=parsed.stream,
            include_usage=parsed.include_usage,
            continuous_usage=bool(extra.get("continuous_usage_stats")),
        )
        settings = dict(parsed.settings)
        base_seed = settings.pop("seed", None)
        if base_seed is None:
            base_seed = secrets.randbits(62)
        planned = []
        runtime = self.server.runtime
        for c in range(n):
            try:
                base = sequence_request(
                    runtime, parsed.messages, chat=True, stop=parsed.stop, seed=(base_seed + c) % 2**63, **settings
                )
                sequence = SequenceRequest(
                    **{
                        **base.__dict__,
                        "ignore_eos": ignore_eos,
                        "min_tokens": min_tokens,
                        "logprobs": top if logprobs else None,
                    }
                )
                scheduler_for(runtime).check(sequence)
            except (ValueError, BatchLimitError) as e:
                raise ApiError(400, str(e), param="messages") from None
            planned.append((0, sequence))
        return request, planned

    async def reply(self, request, planned, events: asyncio.Queue, metrics) -> None:
        completion_id, created = "chatcmpl-" + secrets.token_hex(12), int(time.time())
        results: dict[int, SequenceResult] = {}
        generated = [0] * len(planned)
        opened = False
        if request.stream:
            self.set_header("Content-Type", "text/event-stream")
            self.set_header("Cache-Control", "no-cache")
        try:
            while len(results) < len(planned):
                kind, index, value = await events.get()
                if request.stream and not opened:
                    self.open(completion_id, created, request)
                    opened = True
                if kind == "done":
                    results[index] = value
                    if metrics is not None:
                        metrics.finished(value)
                    if request.stream:
                        reason = FINISH_REASONS.get(value.finish_reason, "length")
                        self.event(completion_id, created, request, index, {}, reason, self.usage(planned, results))
                        await self.flush()
                elif request.stream:
                    generated[index] += 1
                    usage = None
                    if request.continuous_usage:
                        prompt = sum(len(s.prompt_ids) for _, s in planned)
                        usage = {"prompt_tokens": prompt, "completion_tokens": sum(generated)}
                        usage["total_tokens"] = prompt + usage["completion_tokens"]
                    self.event(completion_id, created, request, index, {"content": value}, None, usage)
                    await self.flush()
        except StreamClosedError:
            for handle in self.handles:
                handle.stop()
            return
        if request.stream:
            if request.include_usage:
                body = self.chunk_of(completion_id, created, request, [])
                body["usage"] = self.usage(planned, results)
                self.write(f"data: {json.dumps(body)}\n\n")
            self.write("data: [DONE]\n\n")
            self.finish()
            return
        errors = [r.error for r in results.values() if r.finish_reason == "error"]
        if errors:
            self.send_api_error(ApiError(500, f"generation failed: {errors[0]}", type="server_error"))
            return
        tokenizer = scheduler_for(self.server.runtime).tokenizer
        choices = []
        for index in range(len(planned)):
            result = results[index]
            choice = {
                "index": index,
                "message": {"role": "assistant", "content": result.text},
                "finish_reason": FINISH_REASONS.get(result.finish_reason, "length"),
                "logprobs": {"content": chat_logprobs(tokenizer, result)} if request.logprobs else None,
            }
            choices.append(choice)
        self.set_header("X-Shardbook-Queue-Wait-Ms", f"{max(r.queue_s for r in results.values()) * 1000:.0f}")
        self.server.stats.served += 1
        self.write_json(
            {
                "id": completion_id,
                "object": "chat.completion",
                "created": created,
                "model": request.model,
                "choices": choices,
                "usage": self.usage(planned, results),
            }
        )

    def open(self, completion_id: str, created: int, request) -> None:
        self.set_header("X-Shardbook-Queue-Wait-Ms", "0")
        for index in range(request.n):
            self.event(completion_id, created, request, index, {"role": "assistant", "content": ""}, None, None)

    def chunk_of(self, completion_id: str, created: int, request, choices: list) -> dict[str, Any]:
        return {
            "id": completion_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": request.model,
            "choices": choices,
        }

    def event(self, completion_id, created, request, index, delta, finish_reason, usage) -> None:
        choice = {"index": index, "delta": delta, "finish_reason": finish_reason, "logprobs": None}
        body = self.chunk_of(completion_id, created, request, [choice])
        if request.continuous_usage and usage is not None:
            body["usage"] = usage
        elif request.include_usage:
            body["usage"] = None
        self.write(f"data: {json.dumps(body)}\n\n")


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
