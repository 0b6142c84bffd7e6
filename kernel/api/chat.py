"""``ChatModel``: chat with the sharded model from rank 0 — blocking, streaming and asyncio APIs.

Each call sends the whole request (messages, settings, a seed chosen here) to every rank as one
``generate`` command; every rank runs the engine together and rank 0 streams the text. The
command runs in a worker thread so that :meth:`ChatModel.stream_chat` can hand out chunks as
they arrive; the consumer waits with a deadline.

Interrupts stop every rank at its next step and the partial reply is returned
(``finish_reason="interrupted"``). :meth:`ChatStream.stop` is idempotent and may come at
any moment, even before the command has reached the ranks. Callers that must not lose the
reply (the magic, the terminal chat, :meth:`ChatStream.wait`) hold
:func:`~shardbook.kernel.ranks.foreground.sigint_calls` for as long as the stream lives, so no
interrupt raises KeyboardInterrupt in the middle of their own code and the kernel's stop button
calls the stream's stop directly; a consumer that leaves the iteration early (an exception,
``break``) stops the ranks too.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any, NoReturn

from shardbook.kernel.api.conversation import template_options_for, unread_template_options, with_system_prompt
from shardbook.kernel.api.replies import ReplyParts, request_format
from shardbook.kernel.api.responses import ChatResponse
from shardbook.kernel.api.tools import MAX_TOOL_STEPS
from shardbook.kernel.ranks.foreground import sigint_calls
from shardbook.kernel.ranks.generation_queue import CHAT_SOURCE, Turn
from shardbook.kernel.ranks.pool import Command, Outcome, PoolError
from shardbook.kernel.ranks.runtime import Runtime, get_runtime
from shardbook.rankd.control import protocol
from shardbook.rankd.generation.engine import GenerationRequest

STREAM_DEADLINE_S = 660.0
"""Longest silence from the ranks while a reply is generated (the engine itself gives up after 600 s)."""
CONFIG_SYSTEM_PROMPT = object()
"""``ChatModel.build_request``'s default: the loaded config's ``inference.system_prompt``."""
SETTINGS = ("max_new_tokens", "do_sample", "temperature", "top_p", "top_k", "repetition_penalty", "seed", "want_scores")


class GenerationFailed(RuntimeError):
    """One or more ranks failed while generating; ``outcome`` holds every rank's reply."""

    def __init__(self, outcome: Outcome):
        failed = {
            r: (x.get("error") or {}).get("evalue", x.get("status"))
            for r, x in outcome.replies.items()
            if x.get("status") != "ok"
        }
        super().__init__(f"generation failed on ranks {sorted(failed) or outcome.stuck}: {failed}")
        self.outcome = outcome


class LeftQueue(PoolError):
    """The reply left the queue (its cell interrupted, its client gone) while it waited for its turn on the ranks."""


class ModelChanged(PoolError):
    """Another model was loaded while the reply waited for its turn.

    The reply was checked against (and built for) the old one, so it must not run on the new one.
    """


def _loaded_model(runtime: Runtime) -> tuple[Any, str | None]:
    """The loaded model object (None when none is) and its name, as rank 0 knows them now."""
    state = runtime.ctx0.state
    config = state.get("config")
    return state.get("loaded"), (Path(config.model.model_name_or_path).name if config is not None else None)


class ChatStream:
    """Iterate to get text chunks as they are generated; ``response`` is set once it is finished.

    The reply first waits for its turn in the runtime's generation queue (``turn``, or a new
    unbounded one), so %%chat cells and HTTP requests take the ranks one at a time. ``events``
    receives ``(kind, value)`` pairs from the worker thread (``queue.Queue`` by default;
    :class:`AsyncChatStream` passes one that feeds an event loop). The reply enters the line and
    its worker starts at once, or at :meth:`start` when ``start=False`` (so a caller can hold
    :func:`sigint_calls` before anything is queued).
    """

    def __init__(
        self,
        runtime: Runtime,
        request: GenerationRequest,
        on_notice=None,
        *,
        turn: Turn | None = None,
        events=None,
        start: bool = True,
    ):
        self.runtime = runtime
        self.request = request
        self.response: ChatResponse | None = None
        self.turn: Turn | None = turn
        self._events = events if events is not None else queue.Queue()
        self._on_notice = on_notice or (lambda text: None)
        self._lock = threading.Lock()
        self._command: Command | None = None
        self._stopped = False
        self._delivered = False
        self._thread = threading.Thread(target=self._run, name="shardbook-chat", daemon=True)
        self.loaded, self.model_name = _loaded_model(runtime)
        """The model the request was checked against and built for; its turn runs only if it is still loaded."""
        if start:
            self.start()

    def start(self) -> ChatStream:
        if self._thread.ident is None:
            self.turn = self.turn or self.runtime.generation_queue.enter(CHAT_SOURCE)
            self.turn.on_stop = self.stop
            self._thread.start()
        return self

    def _run(self) -> None:
        pool = self.runtime.pool
        args = {"request": self.request.to_dict(), "stream_rank": 0}
        try:
            if not self.turn.wait():
                raise LeftQueue(
                    "the reply left the queue while it waited for its turn on the ranks (they were busy with another "
                    "reply, e.g. an HTTP request to %serve); run the cell again to queue it again"
                )
            try:
                self._check_same_model()
                self._events.put(("started", self.turn.waited_s))
                outcome = pool.run(
                    "generate",
                    args,
                    list(range(pool.world.world_size)),
                    self._on_output,
                    self._on_notice,
                    on_start=self._on_start,
                )
            finally:
                self.turn.finish()
            self._events.put(("done", outcome))
        except BaseException as e:  # handed to the consumer, which raises it
            self._events.put(("error", e))

    def _check_same_model(self) -> None:
        """ModelChanged when the model loaded now is not the one this request was checked against (a
        ``%load_sharded`` took its turn in the queue while this one waited): never answer with another model."""
        loaded, name = _loaded_model(self.runtime)
        if loaded is not self.loaded:
            now = (
                f"'{name}' is loaded now; send it again to be answered by '{name}'" if loaded else "none is loaded now"
            )
            raise ModelChanged(
                f"the model changed while this request waited for its turn: it was checked against "
                f"'{self.model_name}', and {now}"
            )

    def _on_output(self, rank: int, msg_type: str, payload: dict[str, Any]) -> None:
        if msg_type == protocol.TEXT:
            self._events.put(("text", payload["text"]))

    def _on_start(self, command: Command) -> None:
        """The command is on its way to every rank: a stop that came before it applies now."""
        with self._lock:
            self._command = command
        if self._stopped:
            self._deliver_stop()

    def stop(self) -> None:
        """Leave the queue if still waiting; else stop every rank at its next step (the stream ends with the
        partial reply). Repeats do nothing, so it is safe from a signal handler that fires again meanwhile."""
        if self._stopped:
            return
        self._stopped = True
        if self.turn is not None and not self.turn.leave():  # not waiting in line any more: running, or about to
            self._deliver_stop()

    def _deliver_stop(self) -> None:
        with self._lock:
            command, deliver = self._command, self._command is not None and not self._delivered
            self._delivered = self._delivered or deliver
        if deliver:
            self.runtime.pool.interrupt(command)

    def __iter__(self) -> Iterator[str]:
        self.start()
        finished = False
        try:
            while True:
                try:
                    kind, value = self._next_event()
                except KeyboardInterrupt:
                    self.stop()
                    continue
                if kind == "text":
                    yield value
                elif kind == "error":
                    finished = True
                    raise value
                elif kind == "done":
                    finished = True
                    self._finish(value)
                    return
        finally:
            if not finished:  # the consumer left early (an exception or an interrupt in its code, break)
                self.stop()

    def _next_event(self) -> tuple[str, Any]:
        try:
            return self._events.get(timeout=self._deadline())
        except queue.Empty:
            self._next_event_timed_out()

    def _deadline(self) -> float | None:
        """No deadline while waiting in line (the turn ahead has its own); STREAM_DEADLINE_S once running."""
        return None if self.turn.state == "waiting" else STREAM_DEADLINE_S

    def _next_event_timed_out(self) -> NoReturn:
        self.stop()
        raise TimeoutError(
            f"no output from the ranks for {STREAM_DEADLINE_S:.0f} s while generating; every rank was told to "
            "stop. Check %dist: a busy or dead rank needs a kernel restart."
        ) from None

    def _finish(self, outcome: Outcome) -> None:
        own = outcome.replies.get(0, {})
        if own.get("status") == "ok":  # rank 0's reply, even when another rank failed: a stopped turn keeps it
            self.response = ChatResponse.from_result(own["value"])
        if not outcome.ok:
            raise GenerationFailed(outcome)

    @property
    def stopped(self) -> bool:
        """Whether :meth:`stop` was called (the stop button, a client gone, the consumer left early)."""
        return self._stopped

    def wait(self) -> ChatResponse:
        """The finished reply; an interrupt meanwhile stops it (the partial reply is returned)."""
        with sigint_calls(self.stop):
            for _ in self:
                pass
        assert self.response is not None
        return self.response


class _LoopQueue:
    """What :class:`ChatStream`'s worker thread puts events into, handing them to an asyncio queue."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()

    def put(self, item: tuple[str, Any]) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the loop is closed: its consumer is gone (and stopped the reply), nobody to tell
            pass


class AsyncChatStream(ChatStream):
    """``async for chunk in stream``: the same stream, awaited on the caller's event loop (no thread per chunk).

    ``started`` is set when the turn begins, ``waited_s`` then says how long it waited in line.
    """

    def __init__(self, runtime: Runtime, request: GenerationRequest, on_notice=None, *, turn: Turn | None = None):
        self._loop_queue = _LoopQueue(asyncio.get_running_loop())
        self.started = asyncio.Event()
        self.waited_s = 0.0
        super().__init__(runtime, request, on_notice, turn=turn, events=self._loop_queue)

    async def __aiter__(self) -> AsyncIterator[str]:
        finished = False
        try:
            while True:
                try:
                    kind, value = await asyncio.wait_for(self._loop_queue.queue.get(), self._deadline())
                except asyncio.TimeoutError:
                    finished = True  # _next_event_timed_out stops the ranks itself
                    self._next_event_timed_out()
                if kind == "started":
                    self.waited_s = value
                    self.started.set()
                elif kind == "text":
                    yield value
                elif kind == "error":
                    finished = True
                    raise value
                else:
                    finished = True
                    self._finish(value)
                    return
        finally:
            if not finished:  # the consumer left early (break, an exception, a cancelled task): as ChatStream.__iter__
                self.stop()


def settle(runtime: Runtime, timeout: float = 30) -> None:
    """When nothing else runs or waits in the batch, wait for it to end on every rank, so that a cell ends
    with the ranks idle (as the single-reply path does)."""
    from shardbook.kernel.api.batch import scheduler_for

    scheduler = scheduler_for(runtime)
    if scheduler.occupancy() == (0, 0):
        scheduler.driven.wait(timeout)


class BatchChatStream:
    """A chat reply that joins the continuous batch (``%%chat``, the default; ``ChatModel.stream_chat(batch=True)``):
    iterate for text chunks; ``response`` is set once it is finished; :meth:`stop` stops it alone, the other
    sequences of the batch keep running. Same interface as :class:`ChatStream` for the views."""

    def __init__(self, runtime: Runtime, request: GenerationRequest, on_notice=None, *, start: bool = True):
        self.runtime = runtime
        self.request = request
        self.response: ChatResponse | None = None
        self.handle: Any = None
        self._events: queue.Queue = queue.Queue()
        self._stopped = False
        if start:
            self.start()

    def start(self) -> BatchChatStream:
        from shardbook.kernel.api.batch import scheduler_for, sequence_request, submit
        from shardbook.rankd.generation.engine import fit_max_new_tokens

        if self.handle is not None:
            return self
        r = self.request
        sequence = sequence_request(
            self.runtime,
            r.messages,
            chat=False,
            stop=r.stop,
            max_new_tokens=r.max_new_tokens,
            do_sample=r.do_sample,
            temperature=r.temperature,
            top_p=r.top_p,
            top_k=r.top_k,
            repetition_penalty=r.repetition_penalty,
            seed=r.seed,
            template_options=r.template_options,
        )
        loaded = self.runtime.ctx0.state["loaded"]
        fitted = fit_max_new_tokens(loaded.model, len(sequence.prompt_ids), sequence.max_new_tokens)
        sequence = replace(sequence, max_new_tokens=fitted, logprobs=5 if r.want_scores else None)
        scheduler_for(self.runtime).check(sequence)
        self.handle = submit(
            self.runtime,
            sequence,
            on_text=lambda text: self._events.put(("text", text)),
            on_done=lambda result: self._events.put(("done", result)),
        )
        if self._stopped:
            self.handle.stop()
        return self

    def stop(self) -> None:
        from shardbook.kernel.api.batch import stop_sequences

        self._stopped = True
        if self.handle is not None:
            stop_sequences(self.runtime, [self.handle])  # and the interventions on its row, on every rank

    @property
    def stopped(self) -> bool:
        return self._stopped

    def __iter__(self) -> Iterator[str]:
        self.start()
        while True:
            kind, value = self._events.get()
            if kind == "text":
                yield value
                continue
            if value.finish_reason == "error" and value.failed_alone:  # its step or its intervention: no rank's batch
                raise PoolError(f"the reply failed: {value.error}")
            if value.finish_reason == "error":
                from shardbook.kernel.api.batch import batch_failure

                failure = batch_failure(self.runtime, timeout=30)
                if failure is not None:  # a rank failed: report each rank's error
                    raise GenerationFailed(failure)
                raise PoolError(f"the batch failed: {value.error}")
            self.response = self._response(value)
            settle(self.runtime)
            return

    def wait(self) -> ChatResponse:
        """The finished reply; an interrupt meanwhile stops it (the partial reply is returned), as ChatStream.wait."""
        with sigint_calls(self.stop):
            for _ in self:
                pass
        return self.response

    def _response(self, result: Any) -> ChatResponse:
        import math

        tokenizer = self.runtime.ctx0.state["loaded"].tokenizer
        decoding_s = result.total_s - result.time_to_first_token_s
        scores = None
        if self.request.want_scores and result.token_logprobs is not None:
            scores = []
            for token_id, logprob, top in zip(result.token_ids, result.token_logprobs, result.top_logprobs):
                alternatives = [
                    {"token_id": k, "text": tokenizer.decode([k]), "prob": math.exp(v)} for k, v in top.items()
                ]
                scores.append(
                    {
                        "token_id": token_id,
                        "text": tokenizer.decode([token_id]),
                        "prob": math.exp(logprob),
                        "alternatives": alternatives,
                    }
                )
        n = result.generated_tokens
        return ChatResponse(
            text=result.text,
            prompt_tokens=result.prompt_tokens,
            cached_tokens=result.cached_tokens,
            generated_tokens=n,
            finish_reason=result.finish_reason,
            time_to_first_token_s=result.time_to_first_token_s,
            tokens_per_s=(n - 1) / decoding_s if n > 1 and decoding_s > 0 else 0.0,
            seed=self.request.seed,
            scores=scores,
        )


class ChatModel:
    """Chat with the model loaded by ``%load_sharded``, from notebook code or a server.

    Example::

        from shardbook.kernel import ChatModel
        chat = ChatModel()
        print(chat.chat("What is the capital of France?").text)
        print(chat.chat("Why is the sky blue?", thinking=False, template_options={"reasoning_effort": "low"}).text)
        for chunk in chat.stream_chat([{"role": "user", "content": "Tell me a story"}], max_new_tokens=64):
            print(chunk, end="")
    """

    def __init__(self, runtime: Runtime | None = None):
        self.runtime = runtime or get_runtime()

    def build_request(
        self,
        messages: str | list[dict[str, str]],
        *,
        stop: list[str] | None = None,
        system_prompt: str | None | object = CONFIG_SYSTEM_PROMPT,
        thinking: bool | None = None,
        template_options: dict[str, Any] | None = None,
        **settings: Any,
    ) -> GenerationRequest:
        """A request with defaults from the loaded config's ``inference`` section and a seed.

        The config's ``inference.system_prompt`` opens the conversation unless the messages have a system
        message (``with_system_prompt``); a caller that keeps its own conversation (``%%chat``, the terminal
        chat, whose system prompt may have been changed or removed) passes ``system_prompt=None``.
        ``thinking`` turns the family's switch on or off (``enable_thinking`` or ``thinking``, whichever the
        chat template reads); ``template_options`` are any other chat-template keywords, and win over it.
        """
        config = self.runtime.ctx0.state.get("config")
        if config is None or "loaded" not in self.runtime.ctx0.state:
            raise PoolError("no model is loaded: run `%load_sharded configs/smollm2-135m.yaml` (or your config) first")
        unknown = sorted(set(settings) - set(SETTINGS))
        if unknown:
            raise ValueError(f"unknown generation settings {unknown}; valid: {', '.join(SETTINGS)}")
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        if system_prompt is CONFIG_SYSTEM_PROMPT:
            system_prompt = config.inference.system_prompt
        messages = with_system_prompt(list(messages), system_prompt)
        defaults = {k: getattr(config.inference, k) for k in SETTINGS if hasattr(config.inference, k)}
        given = {k: v for k, v in settings.items() if v is not None}
        options = self.resolve_template_options(thinking, template_options)
        return GenerationRequest(
            messages=list(messages), stop=list(stop or []), template_options=options, **{**defaults, **given}
        ).with_seed()

    def resolve_template_options(
        self, thinking: bool | None = None, options: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """The chat-template keywords for ``thinking`` (the loaded template's own switch) and ``options``."""
        return template_options_for(self._chat_template(), thinking, dict(options or {}))

    def template_notice(self, options: dict[str, Any]) -> str | None:
        """What to tell the user when the loaded chat template reads none of some ``options`` (else None)."""
        unread = unread_template_options(self._chat_template(), options)
        if not unread:
            return None
        return (
            f"the model's chat template does not read {', '.join(unread)}: passed to it, "
            f"{'it changes' if len(unread) == 1 else 'they change'} nothing in the prompt"
        )

    def _chat_template(self) -> str | dict | None:
        loaded = self.runtime.ctx0.state.get("loaded")
        return getattr(getattr(loaded, "tokenizer", None), "chat_template", None)

    def stream_chat(
        self, messages: str | list[dict[str, str]], *, on_notice=None, batch: bool = False, **settings: Any
    ) -> ChatStream | BatchChatStream:
        """A streamed reply; with ``batch=True`` it joins the continuous batch (decoded with other requests)."""
        return self.stream_request(self.build_request(messages, **settings), batch, on_notice)

    def stream_request(self, request: GenerationRequest, batch: bool, on_notice=None) -> ChatStream | BatchChatStream:
        """The streamed reply to a request already built (``build_request``), in the batch or on its own."""
        return (BatchChatStream if batch else ChatStream)(self.runtime, request, on_notice)

    def chat(self, messages, *, batch=False, tools: list | None = None, max_tool_steps=MAX_TOOL_STEPS, **settings):
        """The finished reply, its ``reasoning`` apart from its answer (``text``). With ``tools`` (functions with
        type hints and a docstring) the model may call them until it answers: ``kernel/api/tools.py``."""
        if tools is not None:
            from shardbook.kernel.api.tools import chat_with_tools

            return chat_with_tools(self, messages, tools, max_tool_steps, batch=batch, **settings)
        request = self.build_request(messages, **settings)
        parts = ReplyParts(request_format(self.runtime, request))  # renders the prompt on rank 0 before any rank
        return parts.apart(self.stream_request(request, batch).wait())

    async def achat(self, messages: str | list[dict[str, str]], **settings: Any) -> ChatResponse:
        """``chat`` without blocking the caller's event loop (the ranks are driven from a worker thread)."""
        request = self.build_request(messages, **settings)
        parts = ReplyParts(request_format(self.runtime, request))  # renders the prompt on rank 0 before any rank
        stream = AsyncChatStream(self.runtime, request)
        async for _ in stream:
            pass
        return parts.apart(stream.response)

    def generate_many(
        self,
        prompts: list[str | list[dict[str, str]]],
        *,
        stop: list[str] | None = None,
        timeout_s: float | None = None,
        thinking: bool | None = None,
        template_options: dict[str, Any] | None = None,
        **settings: Any,
    ) -> list[Any]:
        """Replies to many prompts (strings as user messages, or conversations), decoded together in the
        continuous batch; each item is a :class:`~shardbook.rankd.generation.batching.SequenceResult`.

        Settings are those of :meth:`chat` (``max_new_tokens``, ``do_sample``, ``temperature``, ``top_p``,
        ``top_k``, ``repetition_penalty``, ``seed``, ``thinking``, ``template_options``); a given seed seeds
        every prompt's own generator alike.
        A KeyboardInterrupt stops them all (the replies so far are kept, marked interrupted).
        """
        from shardbook.kernel.api.batch import sequence_request, submit

        options = self.resolve_template_options(thinking, template_options)
        requests = [
            sequence_request(self.runtime, p, chat=True, stop=stop, template_options=options, **settings)
            for p in prompts
        ]
        handles = [submit(self.runtime, r) for r in requests]
        try:
            return [h.wait(timeout_s) for h in handles]
        except KeyboardInterrupt:
            for h in handles:
                h.stop()
            return [h.wait(timeout_s) for h in handles]

    def score(self, prompt: str, continuations: list[str], *, timeout_s: float | None = None) -> list[float]:
        """Each continuation's log-likelihood after `prompt` (plain text, no chat template): the sum of its
        tokens' log-probabilities, the numbers `/v1/completions` gives with `echo` and `logprobs`."""
        from shardbook.kernel.api.batch import score_requests, submit

        handles = [submit(self.runtime, r) for r in score_requests(self.runtime, prompt, continuations)]
        scores = []
        for handle, continuation in zip(handles, continuations):
            result = handle.wait(timeout_s)
            if result.error:
                raise PoolError(f"scoring {continuation!r} failed: {result.error}")
            n = len(self.runtime.ctx0.state["loaded"].tokenizer(continuation, add_special_tokens=False)["input_ids"])
            scores.append(float(sum(result.prompt_logprobs[-n:])))
        return scores

    async def astream_chat(self, messages: str | list[dict[str, str]], **settings: Any) -> AsyncIterator[str]:
        """Async iterator of text chunks; the reply's ``ChatResponse`` is not returned (use ``achat``)."""
        async for chunk in AsyncChatStream(self.runtime, self.build_request(messages, **settings)):
            yield chunk
