"""Many sequences at once from rank 0: submit to the continuous batch, and drive the ``batch`` command.

The scheduler (:class:`~shardbook.rankd.generation.batching.BatchScheduler`) lives in rank 0's
``ctx0.state`` beside the loaded model, so the ``batch`` handler finds it. A submission that finds no
batch loop running starts one: a thread takes a turn in the generation queue (so a ``%load_sharded``
or a single-sequence reply never interleaves with it) and runs the ``batch`` command on every rank;
the command ends by itself when nothing runs or waits.
"""

from __future__ import annotations

import secrets
import threading
from collections.abc import Callable, Hashable
from dataclasses import replace
from pathlib import Path
from typing import Any

from shardbook.kernel.api.batch_sizing import batch_limits, device_kind
from shardbook.kernel.api.conversation import with_system_prompt
from shardbook.kernel.ranks import foreground
from shardbook.kernel.ranks.pool import PoolError
from shardbook.kernel.ranks.runtime import Runtime
from shardbook.rankd.generation.batching import BatchScheduler, SequenceHandle, SequenceRequest, StreamDelta
from shardbook.rankd.generation.engine import build_prompt_ids, check_template_options

BATCH_SOURCE = "batch"
CALLER = object()
"""`submit`'s default owner: the cell the calling thread runs, if any."""


def scheduler_for(runtime: Runtime) -> BatchScheduler:
    """Rank 0's scheduler for the model loaded now (a new one after a reload)."""
    state = runtime.ctx0.state
    loaded, config = state.get("loaded"), state.get("config")
    if loaded is None or config is None:
        raise PoolError("no model is loaded: run `%load_sharded configs/smollm2-135m.yaml` (or your config) first")
    scheduler = state.get("batch_scheduler")
    if scheduler is None or scheduler.loaded is not loaded:
        inference = config.inference
        context = getattr(loaded.model.config.get_text_config(), "max_position_embeddings", None)
        budget = cache_budget(inference.max_cache_tokens, loaded.summary)
        weight = next(loaded.model.parameters())
        device = device_kind(weight.device.type, str(weight.dtype).removeprefix("torch."))
        limits = batch_limits(
            inference.max_batch_sequences,
            budget,
            max_new_tokens=inference.max_new_tokens,
            context=context,
            device=device,
        )
        scheduler = BatchScheduler(
            loaded.tokenizer,
            max_sequences=limits.max_sequences,
            max_step_tokens=inference.max_step_tokens,
            context=context,
            cache_tokens=budget,
            join_window=inference.join_window_ms / 1000,
            prefix_tokens=int(budget[0] * inference.prefix_cache_share) if budget else 0,
        )
        scheduler.limits, scheduler.loaded = limits, loaded
        state["batch_scheduler"] = scheduler
    return scheduler


def cache_budget(configured: int | None, summary: dict) -> tuple[int, str] | None:
    """The batch's KV cache limit in tokens and where it comes from: the config's, else the load's measure."""
    if configured is not None:
        return configured, "inference.max_cache_tokens"
    if "kv_cache_tokens" in summary:
        return summary["kv_cache_tokens"], summary["kv_cache_tokens_reason"]
    return None


def submit(
    runtime: Runtime,
    request: SequenceRequest,
    on_text: Callable[[str], None] | None = None,
    on_done: Callable[[Any], None] | None = None,
    on_delta: Callable[[StreamDelta], None] | None = None,
    owner: Hashable | None | object = CALLER,
) -> SequenceHandle:
    """Queue one sequence in the continuous batch (starting the batch on the ranks if none runs); `on_text` gets
    each piece of text, `on_delta` the same pieces with their tokens and log-probabilities.

    `owner` is whom the stop button stops it for: by default (`CALLER`) the cell running when the main thread
    submits it, and nobody when another thread does (an HTTP request's: its client or the server stops it). The
    `%intervene` functions apply to an owned sequence (a cell's), never to another (an HTTP client's).
    """
    if owner is CALLER:
        owner = foreground.running_cell() if threading.current_thread() is threading.main_thread() else None
    scheduler = scheduler_for(runtime)
    if owner is not None and interventions_set(scheduler):  # a cell's rows: its %intervene functions apply to them
        request = replace(request, intervene=True)
    handle = scheduler.submit(request, on_text, on_done, on_delta, owner=owner)
    if handle.starts_loop:
        scheduler.driven.clear()
        threading.Thread(target=_drive, args=(runtime, scheduler), name="shardbook-batch", daemon=True).start()
    return handle


def batch_refusal(runtime: Runtime) -> str | None:
    """Why a reply should take the single-sequence path by default with the model loaded now, or None: the batch
    cannot hold a cache kind `cache_rows` has no row operations for."""
    from shardbook.rankd.generation.batching import cache_refusal

    loaded = runtime.ctx0.state.get("loaded")
    return None if loaded is None else cache_refusal(loaded.model)


def cache_layout(runtime: Runtime) -> str:
    """How the batch holds its rows' cache with the model loaded now (rank 0's view; every rank decides alike)."""
    from shardbook.rankd.generation.paged_layers import PAGE_TOKENS, paged_refusal

    loaded = runtime.ctx0.state.get("loaded")
    if loaded is None:
        return "no model is loaded"
    refusal = paged_refusal(loaded.model, next(loaded.model.parameters()).device)
    if refusal is None:
        return f"the cache paged, {PAGE_TOKENS}-token blocks per row"
    return f"the cache left-padded to the longest row ({refusal})"


def interventions_set(scheduler: BatchScheduler) -> bool:
    """Whether `%intervene` functions are set on the model `scheduler` serves."""
    from shardbook.rankd.generation.intervention_state import registry

    loaded = scheduler.loaded
    return loaded is not None and bool(registry(loaded.model))


def stop_sequences(runtime: Runtime, handles: list[SequenceHandle]) -> None:
    """Stop `handles` (they leave at the next step); when interventions apply to any of them, also interrupt the
    functions running now on every rank (and those called until a step has no such row), so a function that
    blocks inside the forward on its rank lets the step, and the other rows, go on."""
    for handle in handles:
        handle.stop()
    scheduler = runtime.ctx0.state.get("batch_scheduler")
    command = None if scheduler is None else scheduler.command
    if command is not None and any(handle.request.intervene for handle in handles):
        runtime.pool.interrupt_user_calls(command)


MODEL_CHANGED = "model_changed"
"""Starts the `error` of a sequence that waited while another model was loaded (never run on the new one)."""


def _drive(runtime: Runtime, scheduler: BatchScheduler) -> None:
    pool, scheduler.failure = runtime.pool, None
    try:
        with runtime.generation_queue.take_turn(BATCH_SOURCE) as turn:
            if runtime.ctx0.state.get("loaded") is not scheduler.loaded:  # a %load_sharded went first
                scheduler._fail_all([], f"{MODEL_CHANGED}: {model_changed(runtime, scheduler)}")
                return
            turn.on_stop = lambda: stop_sequences(runtime, scheduler.owned(foreground.running_cell()))  # its own
            outcome = pool.run(
                "batch",
                {},
                list(range(pool.world.world_size)),
                lambda *a: None,
                lambda text: None,
                on_start=lambda command: setattr(scheduler, "command", command),
            )
        if not outcome.ok:
            scheduler.failure = outcome  # every rank's reply, for an error report per rank
            errors = {r: reply.get("evalue", reply.get("status")) for r, reply in outcome.replies.items()}
            scheduler._fail_all([], f"the batch failed on the ranks: {errors or outcome.stuck}")
    except BaseException as exc:
        scheduler._fail_all([], f"{type(exc).__name__}: {exc}")
    finally:
        scheduler.command = None
        scheduler.driven.set()


def batch_failure(runtime: Runtime, timeout: float) -> Any:
    """The failed batch command's outcome (every rank's reply) once the batch has ended; None if it did not fail."""
    scheduler = scheduler_for(runtime)
    scheduler.driven.wait(timeout)
    return scheduler.failure


def model_changed(runtime: Runtime, scheduler: BatchScheduler) -> str:
    config = runtime.ctx0.state.get("config")
    now = f"'{Path(config.model.model_name_or_path).name}' is loaded now" if config is not None else "none is"
    return f"another model was loaded while this request waited to join the batch ({now}); send it again"


def sequence_request(
    runtime: Runtime,
    prompt: str | list[dict[str, str]] | list[int],
    *,
    chat: bool,
    stop: list[str] | None = None,
    template_options: dict[str, Any] | None = None,
    **settings: Any,
) -> SequenceRequest:
    """A request with the loaded config's defaults: a conversation (or a string, as one user message, when
    `chat`) goes through the chat template; a string with `chat=False` is tokenized as is; ids are kept."""
    state = runtime.ctx0.state
    scheduler = scheduler_for(runtime)
    tokenizer, inference = scheduler.tokenizer, state["config"].inference
    if isinstance(prompt, str) and chat:
        prompt = [{"role": "user", "content": prompt}]
    if chat and prompt and isinstance(prompt[0], dict):  # as ChatModel.chat: the config's system prompt first
        prompt = with_system_prompt(list(prompt), inference.system_prompt)
    if isinstance(prompt, str):
        ids = tokenizer(prompt, add_special_tokens=True)["input_ids"]
    elif prompt and isinstance(prompt[0], dict):
        check_template_options(template_options or {})
        ids = build_prompt_ids(tokenizer, prompt, template_options)[0].tolist()
    else:
        ids = list(prompt)
    defaults = {
        "max_new_tokens": inference.max_new_tokens,
        "do_sample": inference.do_sample,
        "temperature": inference.temperature,
        "top_p": inference.top_p,
        "top_k": inference.top_k,
        "repetition_penalty": inference.repetition_penalty,
        "seed": inference.seed,
    }
    given = {k: v for k, v in settings.items() if v is not None}
    merged = {**defaults, **given}
    if merged["seed"] is None:
        merged["seed"] = secrets.randbits(63)
    return SequenceRequest(prompt_ids=ids, stop=list(stop or []), **model_token_rules(runtime), **merged)


def model_token_rules(runtime: Runtime) -> dict[str, list[int]]:
    """The loaded model's own token rules for every request: the tokens that end a sequence (its generation
    config's and its tokenizer's end of text) and the ones it never generates (`suppress_tokens`)."""
    scheduler = scheduler_for(runtime)
    config, tokenizer = scheduler.loaded.model.generation_config, scheduler.tokenizer
    eos = config.eos_token_id
    eos_ids = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in eos_ids:
        eos_ids.append(tokenizer.eos_token_id)
    return {"eos_ids": eos_ids, "suppress_ids": list(getattr(config, "suppress_tokens", None) or [])}


def score_requests(runtime: Runtime, prompt: str, continuations: list[str]) -> list[SequenceRequest]:
    """One scoring request per continuation: the prompt's ids then the continuation's, encoded apart (as lm-eval)."""
    tokenizer = scheduler_for(runtime).tokenizer
    context = tokenizer(prompt, add_special_tokens=True)["input_ids"]
    requests = []
    for continuation in continuations:
        ids = tokenizer(continuation, add_special_tokens=False)["input_ids"]
        if not ids:
            raise ValueError(f"the continuation {continuation!r} has no tokens")
        requests.append(SequenceRequest(prompt_ids=context + ids, max_new_tokens=0, prompt_logprobs=True, logprobs=0))
    return requests
