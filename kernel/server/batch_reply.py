"""The handler both OpenAI endpoints over the continuous batch share: admission (429), submission, the reply.

A request is planned into sequences (``plan``, per endpoint), admitted if the batch and its waiting line
have room, submitted to rank 0's scheduler, and answered as one JSON body or as server-sent events. While
it is in flight the handler is one of the server's ``streams``, so stopping the server stops its sequences
(and no other sequence of the batch, such as a ``%%chat`` cell's) and waits for its last chunk.
The endpoints differ only in the shape of a choice (``stream_choice``, ``finish_choice``, ``choices``) and
of a chunk (``OBJECT``, ``CHUNK_OBJECT``). A client that leaves stops its sequences at the next step.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from typing import Any

from tornado.iostream import StreamClosedError

from shardbook.kernel.api.batch import MODEL_CHANGED, batch_refusal, scheduler_for, submit
from shardbook.kernel.ranks.pool import PoolError
from shardbook.kernel.server.completions import BodyHandler
from shardbook.kernel.server.openai_api import FINISH_REASONS, ApiError, generation_failed
from shardbook.rankd.generation.batching import BatchLimitError, SequenceRequest, SequenceResult, StreamDelta


def batch_room(server: Any) -> int:
    """How many sequences the batch and its waiting line hold at most."""
    limits = server.batch_limits()
    return limits.max_sequences + limits.max_waiting


class BatchReplyHandler(BodyHandler):
    OBJECT = CHUNK_OBJECT = ID_PREFIX = ""
    FINISH = FINISH_REASONS
    """The scheduler's finish reasons in the endpoint's words."""

    def prepare(self) -> None:
        super().prepare()
        self.handles: list[Any] = []

    async def post(self) -> None:
        try:
            if self.too_large:
                raise ApiError(413, "the request body is too large", code="request_too_large")
            request, planned = self.plan()
            self.check_batch_serves()
            self.check_room(len(planned))
        except ApiError as e:
            self.send_api_error(e)
            return
        self.server.streams.add(self)
        try:
            await self.submit_and_reply(request, planned)
        finally:
            self.server.streams.discard(self)

    async def submit_and_reply(self, request, planned: list[tuple[int, SequenceRequest]]) -> None:
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        for index, (_, sequence) in enumerate(planned):

            def on_delta(delta: StreamDelta, index: int = index) -> None:
                loop.call_soon_threadsafe(events.put_nowait, ("text", index, delta))

            def on_done(result: SequenceResult, index: int = index) -> None:
                loop.call_soon_threadsafe(events.put_nowait, ("done", index, result))

            try:
                streamed = on_delta if request.stream else None
                self.handles.append(submit(self.server.runtime, sequence, on_done=on_done, on_delta=streamed))
            except (BatchLimitError, ValueError, PoolError) as e:
                self.stop()
                self.send_api_error(ApiError(400, str(e)))
                return
        self.server.metrics.submitted(len(planned), sum(len(s.prompt_ids) for _, s in planned))
        self.server.stats.in_flight += 1
        try:
            await self.reply(request, planned, events)
        finally:
            self.server.stats.in_flight -= 1

    def plan(self) -> tuple[Any, list[tuple[int, SequenceRequest]]]:
        """The checked request and its sequences, each with the index of its prompt; ApiError when wrong."""
        raise NotImplementedError

    def check_batch_serves(self) -> None:
        """ApiError 501 when the model loaded now has a cache the batch cannot hold (chat then takes turns)."""
        refusal = batch_refusal(self.server.runtime)
        if refusal is not None:
            raise ApiError(
                501,
                f"{self.request.path} runs on the continuous batch, which cannot serve the model loaded now "
                f"({refusal}); /v1/chat/completions answers it one request at a time",
                type="server_error",
                code="batch_unsupported",
            )

    def check_room(self, count: int) -> None:
        """ApiError 429 when `count` more sequences would overfill the batch and its waiting line."""
        running, waiting = scheduler_for(self.server.runtime).occupancy()
        if running + waiting + count > batch_room(self.server):
            self.server.metrics.error("queue_full")
            raise ApiError(
                429,
                f"the batch is full ({running} sequences running, {waiting} waiting): retry shortly, or start the "
                "server with a longer --max-waiting or a larger inference.max_batch_sequences",
                code="queue_full",
                type="rate_limit_error",
                headers={"Retry-After": "1"},
            )

    async def reply(self, request, planned, events: asyncio.Queue) -> None:
        ids = (self.ID_PREFIX + secrets.token_hex(12), int(time.time()))
        results: dict[int, SequenceResult] = {}
        self.streamed, opened = [0] * len(planned), False
        if request.stream:
            self.set_header("Content-Type", "text/event-stream")
            self.set_header("Cache-Control", "no-cache")
        try:
            while len(results) < len(planned):
                kind, index, value = await events.get()
                if request.stream and not opened and kind == "done" and value.finish_reason == "error":
                    self.stop()  # failed before anything was sent: a plain error reply, with its status
                    self.server.metrics.finished(value)
                    self.send_api_error(failure(value))
                    return
                if request.stream and not opened:
                    self.open_stream(ids, request)
                    opened = True
                if kind == "done":
                    results[index] = value
                    self.server.metrics.finished(value)
                    if request.stream:
                        choice = self.finish_choice(request, planned, index, rest_of(value, self.streamed[index]))
                        choice["finish_reason"] = self.FINISH[value.finish_reason]
                        self.send_chunk(ids, request, [choice], self.usage(planned, results))
                elif request.stream:
                    choice = self.stream_choice(request, planned, index, value)
                    self.streamed[index] += len(value.token_ids)
                    self.send_chunk(ids, request, [choice], self.so_far(planned))
                if request.stream:
                    await self.flush()
        except StreamClosedError:
            self.stop()
            return
        failed = next((r for r in results.values() if r.finish_reason == "error"), None)
        if request.stream:
            if request.include_usage:
                self.write(
                    f"data: {json.dumps({**self.chunk(ids, request, []), 'usage': self.usage(planned, results)})}\n\n"
                )
            if failed is not None:  # the event OpenAI's clients raise on, after the choices that say "error"
                self.server.stats.errors += 1
                self.write(f"data: {json.dumps(failure(failed).body())}\n\n")
            else:
                self.server.stats.served += 1
            self.write("data: [DONE]\n\n")
            self.finish()
            return
        if failed is not None:
            self.send_api_error(failure(failed))
            return
        self.set_header("X-Shardbook-Queue-Wait-Ms", f"{max(r.queue_s for r in results.values()) * 1000:.0f}")
        self.server.stats.served += 1
        body = {"id": ids[0], "object": self.OBJECT, "created": ids[1], "model": request.model}
        self.write_json(
            {**body, "choices": self.choices(request, planned, results), "usage": self.usage(planned, results)}
        )

    def open_stream(self, ids: tuple[str, int], request) -> None:
        """The headers, before the first chunk (the chat endpoint also names the role)."""
        self.set_header("X-Shardbook-Queue-Wait-Ms", "0")

    def stream_choice(self, request, planned, index: int, delta: StreamDelta) -> dict[str, Any]:
        """One streamed choice: a piece of sequence `index`'s text and its tokens' log-probabilities, unfinished."""
        raise NotImplementedError

    def finish_choice(self, request, planned, index: int, delta: StreamDelta) -> dict[str, Any]:
        """The last streamed choice of sequence `index` (what its pieces left out), before its finish reason."""
        return self.stream_choice(request, planned, index, delta)

    def choices(self, request, planned, results: dict[int, SequenceResult]) -> list[dict[str, Any]]:
        raise NotImplementedError

    def usage(self, planned, results: dict[int, SequenceResult]) -> dict[str, Any]:
        prompt = sum(len(s.prompt_ids) for _, s in planned)
        completion = sum(r.generated_tokens for r in results.values())
        cached = sum(r.cached_tokens for r in results.values())
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    def so_far(self, planned) -> dict[str, int]:
        """Usage up to this chunk (``stream_options.continuous_usage_stats``)."""
        prompt, completion = sum(len(s.prompt_ids) for _, s in planned), sum(self.streamed)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def chunk(self, ids: tuple[str, int], request, choices: list) -> dict[str, Any]:
        return {
            "id": ids[0],
            "object": self.CHUNK_OBJECT,
            "created": ids[1],
            "model": request.model,
            "choices": choices,
        }

    def send_chunk(self, ids: tuple[str, int], request, choices: list, usage: dict[str, int] | None = None) -> None:
        """One event; with ``include_usage`` every chunk but the last has ``usage: null`` (OpenAI's shape)."""
        body = self.chunk(ids, request, choices)
        if request.continuous_usage and usage is not None:
            body["usage"] = usage
        elif request.include_usage:
            body["usage"] = None
        self.write(f"data: {json.dumps(body)}\n\n")

    def stop(self) -> None:
        """Stop this reply's sequences (the server stops): each ends with what it generated."""
        for handle in self.handles:
            handle.stop()

    def on_connection_close(self) -> None:
        self.stop()


def failure(result: SequenceResult) -> ApiError:
    """The error a failed sequence answers with: 409 when it waited while another model was loaded (never
    answered by a model it did not ask for), else 500 naming what failed (a rank's error, a dead rank)."""
    error = result.error or "no error was reported"
    if error.startswith(MODEL_CHANGED):
        return ApiError(409, error.split(": ", 1)[-1], param="model", code=MODEL_CHANGED)
    return generation_failed(f"generation failed: {error}")


def rest_of(result: SequenceResult, streamed: int) -> StreamDelta:
    """What the pieces streamed so far left out of a finished sequence: its last tokens (an end-of-text token,
    say), or all of it (with the prompt's log-probabilities) when no piece was streamed."""
    return StreamDelta(
        "",
        result.token_ids[streamed:],
        (result.token_logprobs or [])[streamed:],
        (result.top_logprobs or [])[streamed:],
        result.prompt_logprobs,
        result.prompt_top_logprobs,
    )
