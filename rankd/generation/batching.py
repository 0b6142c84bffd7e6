"""Continuous batching: many sequences decoded together, every rank running the same forward steps.

Rank 0 owns a :class:`BatchScheduler`. Requests are submitted to it from any thread (each a
`SequenceRequest` with its `SequenceHandle`, and once admitted its `RunningSequence`: `sequences.py`);
its loop (:meth:`BatchScheduler.run`) decides each step's composition (which sequences leave, the
token each remaining one feeds, the next chunk of a prompt prefilled in chunks, which waiting
requests join with their prompts) and broadcasts that :class:`StepPlan` to every rank, then every
rank executes it with :func:`execute_step` on its own :class:`BatchState` (the followers in
:func:`follow_batch`; both in `batch_steps.py`, with how every rank agrees that a step failed and
which rows that fails). Only rank 0 looks at the logits: it samples every sequence's next token
(`sampling.py`; each request with its own seeded `torch.Generator`, so a sampled reply does not
depend on its batch-mates), checks stop strings, token limits and stop requests, and streams text,
decoded incrementally. A row whose token cannot be taken (scores that are not numbers) fails alone.
Nothing a follower does depends on time, memory or randomness, so every rank's forwards have the
same shapes by construction.

The KV cache is one transformers `DynamicCache` of the running batch: the prompts joining at a step
are prefilled together in one forward (left-padded to the longest, with their own cache), then their
rows join the batch's, and a leaving sequence's row leaves it (`cache_rows`). Full-attention layers
are paged where the CPU kernel is built (`paged_layers`: each row in blocks of its own); the others
are left-padded to the longest row (`growing_layers`), columns that are padding in every row cut.
Each row carries its own attention mask (0 on padding) and position ids (its own count of real
tokens), so a row's attention sees exactly its own tokens, at its own positions. A padding query sees
no key at all; PyTorch's attention gives such a row zeros (and eager attention a finite average),
so nothing not-a-number reaches the cache.

Chunked prefill: a prompt longer than a step has room for (`max_step_tokens` less one token per
decoding row) is not prefilled in one forward. Each step the running rows decode one token, then the
prompt's next chunk (the rest of the step's room) is fed into its own one-row cache at its own
positions; after the last chunk that cache joins the batch as above. So a long prompt never stalls
the others for its whole prefill, it is accepted up to the model's context, and a stop ends it after
the chunk that is running. One prompt is prefilled in chunks at a time; the waiting line is first
come, first served, so the requests after it join with its last chunk or after it.

Prefix reuse (`prefix_store.py`): rank 0 looks each joining prompt up in its store of kept blocks (or, for a model
whose cache cannot be cut into blocks, of kept end states); a hit is fed through the chunked path from the end of
what was kept (its first chunk names the blocks or the end state every rank seeds its cache from), and a leaving
row's blocks (its end state, and a just prefilled row's) are kept; the plan carries both, and the store's size.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import torch

from shardbook.rankd.generation.batch_steps import (
    JOIN_FAILED,
    STEP_FAILED,
    BatchState,
    Chunk,
    StepPlan,
    broadcast_plan,
    cache_refusal,
    end_batch,
    execute_step,
    follow_batch,
)
from shardbook.rankd.generation.growing_layers import kept_order
from shardbook.rankd.generation.paged_layers import PAGE_TOKENS, paged_refusal
from shardbook.rankd.generation.prefix_store import BLOCK_TOKENS, block_keys, end_cost, end_key, reuse_kind
from shardbook.rankd.generation.reply_text import reply_decoder
from shardbook.rankd.generation.sampling import NonFiniteScores, next_token, pick_tokens
from shardbook.rankd.generation.sequences import (
    BatchLimitError,
    RunningSequence,
    SequenceHandle,
    SequenceRequest,
    SequenceResult,
    StreamDelta,
    admit,
    next_delta,
    reach,
)
from shardbook.rankd.generation.streaming import INCOMPLETE, IncrementalText, find_stop

__all__ = [
    "BatchLimitError",
    "BatchScheduler",
    "SequenceHandle",
    "SequenceRequest",
    "SequenceResult",
    "StepPlan",
    "StreamDelta",
    "cache_refusal",
    "follow_batch",
]


@dataclass
class _Joiners:
    """Who joins at the step rank 0 plans: the chunked prompt and its chunk, the seeded prompts with theirs, the
    prompts prefilled together (padded to `width`), and the step's tokens left (`budget`)."""

    chunked: RunningSequence | None
    chunk: Chunk | None
    budget: int
    seeded: list[tuple[RunningSequence, Chunk]] = field(default_factory=list)
    joining: list[RunningSequence] = field(default_factory=list)
    width: int = 0
    keys: set[int] = field(default_factory=set)
    """The block keys of the prompts whose rows join at this step (kept as they join, a paged cache)."""

    @property
    def sequences(self) -> list[RunningSequence]:
        """In the order their rows join: the chunked prompt's, the seeded ones', the joining ones'."""
        return ([self.chunked] if self.chunked else []) + [seq for seq, _ in self.seeded] + self.joining


class BatchScheduler:
    """Rank 0's side of continuous batching: the waiting requests, the running batch and its loop."""

    def __init__(
        self,
        tokenizer: Any,
        *,
        max_sequences: int = 8,
        max_step_tokens: int = 2048,
        context: int | None = None,
        cache_tokens: tuple[int, str] | None = None,
        join_window: float = 0.0,
        prefix_tokens: int = 0,
    ):
        if max_sequences < 1 or max_step_tokens < 1 or join_window < 0:
            raise ValueError("max_sequences and max_step_tokens must be >= 1, join_window >= 0")
        self.tokenizer = tokenizer
        self.max_sequences, self.max_step_tokens, self.context = max_sequences, max_step_tokens, context
        self.cache_tokens = cache_tokens
        """(most tokens the batch's KV cache may hold, where that limit comes from), or None for no limit."""
        self.join_window = join_window
        """Seconds without a new arrival that an empty batch waits for before its first prefill (see `_settle`)."""
        self.prefix_tokens = prefix_tokens
        """Most tokens the prefix store keeps for reuse (`prefix_store.py`); 0 turns prefix reuse off."""
        self.prefix_store: Any = None
        """The model's prefix store on rank 0, the one `run` plans from (None before the first run)."""
        self._prefix_blocks = 0
        self._reuse: str | None = None
        """How the running model reuses kept caches (`prefix_store.reuse_kind`), None when it does not."""
        self._paged = False
        """Whether the running model's batch cache is paged (`paged_layers`): each row holds its own blocks."""
        self.lock = threading.Lock()
        self.arrived = threading.Condition(self.lock)
        """Notified by `submit` (under `lock`), for `_settle`."""
        self.waiting: list[SequenceHandle] = []
        self.running = False
        self.rows: list[RunningSequence] = []
        """The sequences of the step planned last, joining ones included (set under `lock`)."""
        self.prefilling: RunningSequence | None = None
        """The sequence whose prompt is being prefilled in chunks, one chunk a step (the loop's own)."""
        self.stats = {"steps": 0, "largest_batch": 0, "prefix_hits": 0, "cached_tokens": 0}
        self.limits: Any = None
        """Where `max_sequences` and the waiting line's length come from (rank 0's driver sets it)."""
        self.failure: Any = None
        """What the last failed batch command left (rank 0's driver sets it: every rank's reply)."""
        self._loaded: Any = None
        self.command: Any = None
        """The batch command running on the ranks (rank 0's driver sets it), whose user functions a stop reaches."""
        self.driven = threading.Event()
        """Set while no batch command runs on the ranks (rank 0's driver clears it for the command's span)."""
        self.driven.set()

    @property
    def loaded(self) -> Any:
        """The loaded model this scheduler serves (rank 0's driver sets it; a reload makes a new scheduler).

        Held weakly: the scheduler of the previous model stays in the kernel's state until the next request
        replaces it, and must not keep that model's memory (0.3 GB of the demo model's) until then. (A
        `LoadedModel` takes a weak reference; a stand-in that cannot, in tests, is held as it is.)
        """
        return self._loaded() if callable(self._loaded) else self._loaded

    @loaded.setter
    def loaded(self, loaded: Any) -> None:
        try:
            self._loaded = weakref.ref(loaded)
        except TypeError:
            self._loaded = loaded

    def check(self, request: SequenceRequest) -> None:
        """Raise :class:`BatchLimitError` if `request` could never run."""
        n = len(request.prompt_ids)
        if self.context is not None and n > self.context:
            raise BatchLimitError(
                f"the prompt has {n} tokens but the model's context is {self.context} tokens "
                "(max_position_embeddings): shorten the prompt"
            )
        if self.cache_tokens is not None and reach(request) > self.cache_tokens[0]:
            raise BatchLimitError(
                f"the prompt ({n} tokens) plus max_tokens ({request.max_new_tokens}) needs {reach(request)} tokens "
                f"of KV cache, but the batch may hold {self.cache_tokens[0]} ({self.cache_tokens[1]}): shorten the "
                "prompt, lower max_tokens, or set inference.max_cache_tokens if the ranks have room",
                param="max_tokens",
            )
        if self.context is not None and n + max(request.max_new_tokens, 1) > self.context + 1:
            raise BatchLimitError(
                f"the prompt ({n} tokens) plus max_tokens ({request.max_new_tokens}) exceeds the model's context "
                f"of {self.context} tokens",
                param="max_tokens",
            )

    def submit(
        self,
        request: SequenceRequest,
        on_text: Callable[[str], None] | None = None,
        on_done: Callable[[SequenceResult], None] | None = None,
        on_delta: Callable[[StreamDelta], None] | None = None,
        owner: Hashable | None = None,
    ) -> SequenceHandle:
        """Queue `request`; when `handle.starts_loop`, no loop was running and the caller must start one.
        `owner` says who asked (see :meth:`stop_owned`)."""
        self.check(request)
        handle = SequenceHandle(request, on_text, on_done, on_delta, owner)
        with self.lock:
            self.waiting.append(handle)
            handle.starts_loop = not self.running
            self.running = True
            self.arrived.notify_all()
        return handle

    def run(
        self, model: Any, device: torch.device | str, group: Any = None, stop_event: threading.Event | None = None
    ) -> int:
        """Rank 0's batch loop: plan, broadcast and run steps until nothing runs or waits; returns the steps.

        Setting `stop_event` stops every sequence, running or waiting, at the next step.
        """
        device = torch.device(device)
        state, rows, steps = BatchState(model, device), [], 0
        self.prefilling = None
        self.prefix_store = state.prefixes
        self._reuse = reuse_kind(model) if self.prefix_tokens >= BLOCK_TOKENS else None
        self._paged = paged_refusal(model, device) is None
        self._prefix_blocks = self.prefix_tokens // BLOCK_TOKENS if self._reuse else 0
        with torch.no_grad():
            while True:
                if stop_event is not None and stop_event.is_set():
                    self.stop_all()
                if not rows and self.prefilling is None:
                    self._settle()
                try:
                    plan, rows, joining = self._plan(rows, state.cache)
                except BaseException:
                    broadcast_plan(StepPlan([], [], [], end=True), device, group)
                    state.abandon()
                    self._fail_all(rows, "the batch loop failed")
                    raise
                broadcast_plan(plan, device, group)
                if plan.end:
                    end_batch(state, plan)
                    self.stats["rows"] = 0
                    return steps
                try:
                    rows = self._step(state, plan, rows, joining, group)
                    steps += 1
                except BaseException as exc:
                    self._fail_all(rows + joining, f"{type(exc).__name__}: {exc}")
                    broadcast_plan(StepPlan(list(range(state.rows)), [], [], end=True), device, group)
                    state.abandon()
                    raise

    def _step(
        self, state: BatchState, plan: StepPlan, rows: list[RunningSequence], joining: list[RunningSequence], group: Any
    ) -> list[RunningSequence]:
        """Run `plan` on every rank and take its logits: each row's next token, the chunk's (its prompt's scores,
        the first token after its last piece), each joining prompt's first. The rows of the batch after it. A
        step that failed (on any rank) fails the rows it must (`batch_steps`)."""
        outcome = execute_step(state, plan, group=group)
        self.stats["steps"] += 1
        self.stats["largest_batch"] = max(self.stats["largest_batch"], state.rows)
        self.stats["rows"] = state.rows
        chunked = [self.prefilling] if plan.chunk is not None and self.prefilling is not None else []
        seeded, joining = joining[: len(plan.seeded)], joining[len(plan.seeded) :]
        if outcome.failure == STEP_FAILED:  # every rank emptied its batch and dropped the chunked prompt
            failed = rows + seeded + joining + ([self.prefilling] if self.prefilling else [])
            self.prefilling = None
            for seq in failed:
                self._fail(seq, outcome.error_text())
            return []
        decoding = rows[: len(plan.decode)]
        if outcome.intervention_error is not None:  # before their tokens are taken: they came from a failed function
            for seq in decoding + chunked + seeded + joining:
                if seq.handle.request.intervene:
                    self._fail(seq, outcome.intervention_error)
        if decoding:
            requests = [seq.handle.request for seq in decoding]
            picked = pick_tokens(
                outcome.decoded, requests, [seq.tokens for seq in decoding], [seq.generator for seq in decoding]
            )
            for i, (seq, token) in enumerate(zip(decoding, picked)):
                self._take(lambda s, logits, token=token: self._advance(s, logits, token), seq, outcome.decoded[i])
        if outcome.failure == JOIN_FAILED:  # the batch is as it was before the prefill, the chunked prompt dropped
            if chunked:
                self.prefilling = None
            for seq in chunked + seeded + joining:
                self._fail(seq, outcome.error_text())
            return rows
        for seq in chunked:
            self._take(lambda s, logits: self._chunk_fed(s, logits, plan.chunk), seq, outcome.chunked)
        if plan.chunk is not None and plan.chunk.last:  # its row joined the batch
            self.prefilling = None
        else:
            chunked = []
        for seq, logits, chunk in zip(seeded, outcome.seeded, plan.seeded):
            self._take(lambda s, logits, chunk=chunk: self._chunk_fed(s, logits, chunk), seq, logits)
        for seq, logits in zip(joining, outcome.joined):
            self._take(self._prefilled, seq, logits)
        return rows + chunked + seeded + joining

    def _settle(self) -> None:
        """Before an empty batch's first prefill, wait until no request has arrived for `join_window` (at most
        ten windows, or until the batch would be full).

        Clients that send together reach rank 0 a few milliseconds apart (each request is parsed and tokenized
        first). Without the wait the first is prefilled alone and the others join one prefill and one decode
        step later; with it they share the first prefill forward. Only rank 0 waits (its plan is broadcast),
        so the ranks stay in step whatever the clock says.
        """
        if self.join_window <= 0:
            return
        deadline = time.monotonic() + 10 * self.join_window
        with self.arrived:
            seen = len(self.waiting)
            while 0 < seen < self.max_sequences:
                left = deadline - time.monotonic()
                if left <= 0 or not self.arrived.wait(min(self.join_window, left)) and len(self.waiting) == seen:
                    return
                seen = len(self.waiting)

    def occupancy(self) -> tuple[int, int]:
        """(sequences in the batch, sequences waiting to join it) now."""
        with self.lock:
            return sum(not seq.finished for seq in self.rows), len(self.waiting)

    def stop_all(self) -> None:
        """Stop every running and waiting sequence (an interrupt of the batch command), from any thread."""
        with self.lock:
            handles = [seq.handle for seq in self.rows] + list(self.waiting)
        for handle in handles:
            handle.stop()

    def stop_owned(self, owner: Hashable | None) -> int:
        """Stop the running and waiting sequences `owner` submitted (a cell's, on the stop button), from any
        thread; the others run on. None stops nothing. Returns how many were stopped."""
        owned = self.owned(owner)
        for handle in owned:
            handle.stop()
        return len(owned)

    def owned(self, owner: Hashable | None) -> list[SequenceHandle]:
        """The running and waiting sequences `owner` submitted (none for None), from any thread."""
        if owner is None:
            return []
        with self.lock:
            handles = [seq.handle for seq in self.rows if not seq.finished] + list(self.waiting)
        return [handle for handle in handles if handle.owner == owner]

    # ------------------------------------------------------------------ rank 0 only

    def _plan(
        self, rows: list[RunningSequence], cache: Any
    ) -> tuple[StepPlan, list[RunningSequence], list[RunningSequence]]:
        """The next step: who leaves, the running rows' tokens, the next chunk of the prompt prefilled in chunks,
        and who joins (in arrival order, within `max_sequences` rows and `max_step_tokens` tokens). `cache`, rank
        0's batch cache, is only measured (an end state's cost); the scheduler never holds it, nor its model."""
        leave = [i for i, seq in enumerate(rows) if seq.finished or seq.handle.stop_requested.is_set()]
        for i in leave:
            if not rows[i].finished:
                self._finish(rows[i], "interrupted")
        kept = [rows[i] for i in kept_order(len(rows), leave)]  # the batch's rows after the leave, as on every rank
        chunked, abandon = self.prefilling, False
        if chunked is not None and (chunked.finished or chunked.handle.stop_requested.is_set()):
            if not chunked.finished:  # stopped mid-prefill: the chunk it was fed last is its last
                self._finish(chunked, "interrupted")
            chunked, abandon, self.prefilling = None, True, None
        with self.lock:
            budget = self.max_step_tokens - len(kept)
            chunk = None if chunked is None else self._next_chunk(chunked, budget)
            new = _Joiners(chunked, chunk, budget - (0 if chunk is None else len(chunk.tokens)))
            self._admit(kept, new)
            end = not kept and not new.sequences and not self.waiting
            self.rows = kept + new.sequences
            if end:
                self.running = False
        plan = StepPlan(
            leave=leave,
            decode=[seq.next_token for seq in kept],
            join=[(list(s.handle.request.prompt_ids), s.handle.request.prompt_logprobs) for s in new.joining],
            chunk=new.chunk,
            seeded=[chunk for _, chunk in new.seeded],
            abandon=abandon,
            end=end,
            keep=[(i, self._kept_keys(rows[i])) for i in leave] if self._reuse == "blocks" else [],
            keep_ends=self._kept_ends(rows, cache) if self._reuse == "ends" else [],
            keep_joined=self._joined_keys(len(kept), new),
            prefix_blocks=self._prefix_blocks,
            intervened=[i for i, seq in enumerate(kept) if seq.handle.request.intervene],
            join_intervened=[i for i, seq in enumerate(new.joining) if seq.handle.request.intervene],
        )
        return plan, kept, [seq for seq, _ in new.seeded] + new.joining

    def _admit(self, kept: list[RunningSequence], new: _Joiners) -> None:
        """Take waiting requests into `new` in arrival order while the step has rows, tokens and cache for them: a
        prompt that starts with kept blocks and whose rest fits is seeded (each in its own forward), a prompt too
        long for the step becomes the chunked one (one at a time), the others join in one padded forward."""
        while self.waiting and len(kept) + len(new.sequences) < self.max_sequences:
            handle = self.waiting[0]
            request = handle.request
            if handle.stop_requested.is_set():  # left before it ran
                self.waiting.pop(0)
                handle.complete(SequenceResult([], "", "interrupted", len(request.prompt_ids)))
                continue
            room = new.budget - len(new.joining) * new.width
            hit = self._kept_tokens(request) if room >= 1 else 0
            if not self._cache_holds(kept + new.sequences, request, hit):
                break
            if hit and len(request.prompt_ids) - hit <= room:  # seeded from kept blocks, its rest fed at this step
                seq = self._admit_first(hit)
                new.seeded.append((seq, self._next_chunk(seq, room)))
                new.budget -= len(request.prompt_ids) - hit
                self._joins_now(new, request)
                continue
            if self._shares_with_joining(request, new):
                break  # seeded from the blocks of a prompt joining now at the next step, not prefilled whole beside it
            if hit and new.chunked is not None:  # prefilled whole, beside the chunked one: its blocks its own
                hit = 0
                if not self._cache_holds(kept + new.sequences, request):
                    break
            fits = (len(new.joining) + 1) * max(new.width, len(request.prompt_ids)) <= new.budget
            if not fits and (new.joining or new.chunked is not None or new.budget < 1):
                break
            if hit or not fits:  # its rest is too long for a step: fed as a chunk a step, then joins
                new.chunked = self.prefilling = self._admit_first(hit)
                new.chunk = self._next_chunk(new.chunked, room)
                if not new.chunk.last:
                    break
                new.budget -= len(new.chunk.tokens)  # it joins at this step: the others may join beside it
                self._joins_now(new, request)
                continue
            self.waiting.pop(0)
            new.width = max(new.width, len(request.prompt_ids))
            new.joining.append(admit(handle))
            self._joins_now(new, request)

    def _joins_now(self, new: _Joiners, request: SequenceRequest) -> None:
        """Note the block keys of `request`, whose row joins at this step, where joining rows' blocks are kept."""
        if self._paged and self._reuse == "blocks":
            new.keys.update(block_keys(list(request.prompt_ids)))

    def _shares_with_joining(self, request: SequenceRequest, new: _Joiners) -> bool:
        """Whether kept blocks would hold most of `request`'s prompt at the next step: those of a prompt joining
        now (its blocks are kept as it joins) begin at least half of it (requests with one new document sent
        together: the first is prefilled, the others a step later from its blocks)."""
        if not new.keys or request.prompt_logprobs or not self._prefix_blocks:
            return False
        keys = block_keys(request.prompt_ids[:-1])
        shared = next((i for i, key in enumerate(keys) if key not in new.keys), len(keys))
        return 2 * shared * BLOCK_TOKENS >= len(request.prompt_ids)

    def _admit_first(self, hit: int) -> RunningSequence:
        """The first waiting request, admitted with `hit` of its prompt's tokens taken from kept caches."""
        self._count_hit(hit)
        seq = admit(self.waiting.pop(0))
        seq.prefilled = seq.cached = hit
        return seq

    def _kept_tokens(self, request: SequenceRequest) -> int:
        """The prompt tokens of `request` that kept blocks hold (whole blocks, its last token always prefilled for
        its first logits; none when its prompt is scored, whose every position needs logits)."""
        if not self._prefix_blocks or request.prompt_logprobs:
            return 0
        if self._reuse == "ends":
            return self.prefix_store.end_hit(list(request.prompt_ids[:-1]))[0]
        return self.prefix_store.cached_blocks(block_keys(request.prompt_ids[:-1])) * BLOCK_TOKENS

    def _count_hit(self, hit: int) -> None:
        if hit:
            self.stats["prefix_hits"] += 1
            self.stats["cached_tokens"] += hit

    def _joined_keys(self, kept: int, new: _Joiners) -> list:
        """The plan's `keep_joined`: where the cache is paged and reuse keeps blocks, each row joining at this step
        (after the `kept` rows: the chunked prompt's after its last piece, the seeded ones', then the joining
        ones'), with its prompt's block keys. Keeping them costs no copy there, and prompts that arrive while they
        run share them."""
        if not self._paged or self._reuse != "blocks":
            return []
        joined = new.sequences if new.chunk is not None and new.chunk.last else new.sequences[new.chunked is not None :]
        return [(kept + i, block_keys(list(seq.handle.request.prompt_ids))) for i, seq in enumerate(joined)]

    def _kept_keys(self, seq: RunningSequence) -> list[int]:
        """The block keys of what a leaving row's cache holds (`_held_tokens`)."""
        return block_keys(self._held_tokens(seq))

    def _kept_ends(self, rows: list[RunningSequence], cache: Any) -> list[tuple[int, int, int]]:
        """The end states to keep, as the plan names them (row, key, cost): each leaving row's, and each row's that
        joined at the last step (its cache holds its prompt alone: a conversation's next prompt starts with it
        even where the history is not rendered as the reply was generated, such as a reasoning model's dropped
        thinking); none of a row that failed."""
        held = [(row, self._held_tokens(seq)) for row, seq in enumerate(rows) if seq.finished or len(seq.tokens) == 1]
        return [(row, end_key(tokens), end_cost(cache, row, len(tokens))) for row, tokens in held if tokens]

    @staticmethod
    def _held_tokens(seq: RunningSequence) -> list[int]:
        """The tokens a leaving row's cache holds (its prompt, and its reply but the token sampled last, never fed);
        none for a row that failed (its cache may hold what made it fail)."""
        if seq.handle.result is not None and seq.handle.result.finish_reason == "error":
            return []
        return list(seq.handle.request.prompt_ids) + seq.tokens[:-1]

    def _next_chunk(self, seq: RunningSequence, budget: int) -> Chunk | None:
        """The next piece of `seq`'s prompt, of at most `budget` tokens (none when the step has no room)."""
        if budget < 1:
            return None
        prompt, start = seq.handle.request.prompt_ids, seq.prefilled
        seq.prefilled = min(len(prompt), start + budget)
        seeded = bool(start) and start == seq.cached  # its first piece, after what kept caches hold
        ends = seeded and self._reuse == "ends"
        return Chunk(
            list(prompt[start : seq.prefilled]),
            start,
            seq.prefilled == len(prompt),
            seq.handle.request.prompt_logprobs,
            prefix=block_keys(list(prompt[:start])) if seeded and not ends else [],
            end=end_key(list(prompt[:start])) if ends else None,
            intervened=seq.handle.request.intervene,
        )

    def _cache_holds(self, rows: list[RunningSequence], request: SequenceRequest, kept: int = 0) -> bool:
        """Whether the batch's KV cache stays within `cache_tokens` with `request` joining `rows` (its first `kept`
        prompt tokens from kept blocks), until each row has its prompt and all its max_tokens (no row grows beyond
        its reach). A paged cache holds each row's blocks (`_paged_tokens`); a left-padded one (rows) x (the
        longest row) tokens. An empty batch takes any request `check` let through."""
        if self.cache_tokens is None or not rows:
            return True
        if self._paged:
            held = [(request, kept), *((seq.handle.request, seq.cached) for seq in rows)]
            return self._paged_tokens(held) <= self.cache_tokens[0]
        reaches = [reach(request), *(reach(seq.handle.request) for seq in rows)]
        return len(reaches) * max(reaches) <= self.cache_tokens[0]

    def _paged_tokens(self, held: list[tuple[SequenceRequest, int]]) -> int:
        """Tokens of the blocks that rows of these (request, prompt tokens it started with from kept blocks) hold at
        their reach: each row's own blocks, and the kept blocks rows start with once for all the rows holding
        them (shared, not copied, where reuse keeps blocks). A row prefilled whole whose blocks others then share
        is counted as their holder too: one copy more than there is, never less."""
        shared: set = set()
        own = 0
        for request, kept in held:
            kept = kept if self._reuse == "blocks" else 0  # kept end states are copied into the row's blocks
            shared.update(block_keys(list(request.prompt_ids[:kept])))
            own += -(-reach(request) // PAGE_TOKENS) - kept // PAGE_TOKENS
        return (own + len(shared)) * PAGE_TOKENS

    def _prefilled(self, seq: RunningSequence, logits: torch.Tensor) -> None:
        """Take a whole prompt's logits (every position's when it is scored, else the last one)."""
        self._score_prompt(seq, logits, 0)
        request = seq.handle.request
        if request.max_new_tokens == 0:
            self._finish(seq, "length")
            return
        self._advance(seq, logits[-1])

    def _chunk_fed(self, seq: RunningSequence, logits: torch.Tensor | None, chunk: Chunk) -> None:
        """Take a chunk's logits: the prompt tokens they score, and after the last piece the first token."""
        if logits is None:  # a piece before the last, of a prompt not scored
            return
        if chunk.all_logits:
            self._score_prompt(seq, logits, chunk.start)
        if chunk.last:
            if seq.handle.request.max_new_tokens == 0:
                self._finish(seq, "length")
                return
            self._advance(seq, logits[-1])

    def _score_prompt(self, seq: RunningSequence, logits: torch.Tensor, start: int) -> None:
        """Log-probabilities of the prompt tokens that `logits` (at the prompt's positions from `start` on)
        predict, after those already scored (a prompt prefilled in chunks is scored a chunk at a time)."""
        request = seq.handle.request
        if not request.prompt_logprobs:
            return
        if start == 0:
            seq.prompt_logprobs, seq.prompt_top_logprobs = [None], [None]
        ids = torch.tensor(request.prompt_ids[start + 1 : start + 1 + len(logits)])
        logp = torch.log_softmax(logits, dim=-1)[: len(ids)]
        seq.prompt_logprobs += logp.gather(1, ids.view(-1, 1)).view(-1).tolist() if len(ids) else []
        k = request.logprobs or 0
        if k and len(ids):
            values, indices = torch.topk(logp, k, dim=-1)
            seq.prompt_top_logprobs += [dict(zip(i.tolist(), v.tolist())) for i, v in zip(indices, values)]
        else:
            seq.prompt_top_logprobs += [{} for _ in range(len(ids))]

    def _take(
        self, method: Callable[[RunningSequence, torch.Tensor], None], seq: RunningSequence, logits: torch.Tensor
    ) -> None:
        """`method(seq, logits)`; if it raises (scores that are not numbers, a tokenizer's error), `seq` fails
        alone: its row leaves at the next step and the others go on. A row that failed already is left as it is."""
        if seq.finished:
            return
        try:
            method(seq, logits)
        except Exception as exc:
            self._fail(seq, f"{type(exc).__name__}: {exc}")

    def _fail(self, seq: RunningSequence, why: str) -> None:
        """Finish `seq` alone with an error (even if its text cannot be decoded); the batch goes on."""
        if seq.finished:
            return
        try:
            self._finish(seq, "error", error=why, alone=True)
        except Exception:
            seq.finished = True
            request = seq.handle.request
            seq.handle.complete(
                SequenceResult(list(seq.tokens), "", "error", len(request.prompt_ids), error=why, failed_alone=True)
            )

    def _advance(self, seq: RunningSequence, logits: torch.Tensor, token: int | NonFiniteScores | None = None) -> None:
        """Take `seq`'s next token (`token` when the step's picks gave it, else picked from its logits); finish it
        if it is done. A pick that is an error fails `seq` (through `_take`)."""
        request = seq.handle.request
        seq.first_token_at = seq.first_token_at or time.perf_counter()
        if isinstance(token, NonFiniteScores):
            raise token
        token = next_token(logits, request, seq.tokens, seq.generator) if token is None else token
        if request.logprobs is not None:
            logp = torch.log_softmax(logits, dim=-1)
            seq.token_logprobs.append(float(logp[token]))
            if request.logprobs:
                values, indices = torch.topk(logp, request.logprobs)
                seq.top_logprobs.append(dict(zip(indices.tolist(), values.tolist())))
            else:
                seq.top_logprobs.append({})
        seq.tokens.append(token)
        seq.next_token = token
        if not request.ignore_eos and token in request.eos_ids:
            self._finish(seq, "stop")
            return
        if seq.text is None and (request.stop or seq.handle.on_text is not None or seq.handle.on_delta is not None):
            seq.text = IncrementalText(reply_decoder(self.tokenizer))
        if seq.text is not None:
            checked, restarts = len(seq.text.decoded), seq.text.restarts
            seq.text.update(seq.tokens)
            if request.stop:  # no stop string lies in the text that was whole before this token: look after it
                start = max(0, checked - max(map(len, request.stop)) + 1) if restarts == seq.text.restarts else 0
                if find_stop(seq.text.tail(start), request.stop) is not None:
                    self._finish(seq, "stop")
                    return
        if len(seq.tokens) >= request.max_new_tokens:
            self._finish(seq, "length")
            return
        if seq.text is not None:
            self._stream(seq, seq.text, final=False)

    def _stream(self, seq: RunningSequence, text: IncrementalText | str, *, final: bool) -> None:
        """Hand the reply's text after what was handed on so far to its consumers; unless `final`, hold back an
        incomplete character and what could begin a stop string."""
        if seq.handle.on_text is None and seq.handle.on_delta is None:
            return
        end = total = len(text)
        tail = text.tail(seq.emitted) if isinstance(text, IncrementalText) else text[seq.emitted :]
        if not final:
            while end > seq.emitted and tail[end - seq.emitted - 1] == INCOMPLETE:
                end -= 1
            if seq.handle.request.stop:  # hold back what could start a stop string
                end = min(end, total - max(map(len, seq.handle.request.stop)) + 1)
        if end > seq.emitted:
            chunk, seq.emitted = tail[: end - seq.emitted], end
            try:
                if seq.handle.on_text is not None:
                    seq.handle.on_text(chunk)
                if seq.handle.on_delta is not None:
                    seq.handle.on_delta(next_delta(seq, chunk))
            except Exception:  # a consumer that fails stops its own sequence only
                seq.handle.stop()

    def _finish(self, seq: RunningSequence, reason: str, error: str | None = None, alone: bool = False) -> None:
        request = seq.handle.request
        tokens = seq.tokens
        if reason == "stop" and tokens and tokens[-1] in request.eos_ids:
            shown = tokens[:-1]
        else:
            shown = tokens
        text = reply_decoder(self.tokenizer)(shown)  # once, whole, without a final end-of-text token
        cut = find_stop(text, request.stop) if request.stop else None
        text = text[:cut]
        self._stream(seq, text, final=True)
        seq.finished = True
        now = time.perf_counter()
        seq.handle.complete(
            SequenceResult(
                token_ids=list(tokens),
                text=text,
                finish_reason=reason,
                prompt_tokens=len(request.prompt_ids),
                token_logprobs=seq.token_logprobs if request.logprobs is not None else None,
                top_logprobs=seq.top_logprobs if request.logprobs is not None else None,
                prompt_logprobs=seq.prompt_logprobs,
                prompt_top_logprobs=seq.prompt_top_logprobs,
                queue_s=seq.admitted_at - seq.handle.submitted_at,
                time_to_first_token_s=(seq.first_token_at or now) - seq.handle.submitted_at,
                total_s=now - seq.handle.submitted_at,
                error=error,
                cached_tokens=seq.cached,
                failed_alone=alone,
            )
        )

    def _fail_all(self, rows: list[RunningSequence], why: str) -> None:
        """Fail `rows`, every row of the last planned step and every waiting sequence: whatever raised (a step, a
        broadcast that a failed follower never joined, the command around it), no submitter is left waiting."""
        with self.lock:
            planned, waiting = self.rows, self.waiting
            self.waiting, self.running, self.rows, self.prefilling = [], False, [], None
        for seq in rows + planned:
            if not seq.finished:
                self._finish(seq, "error", error=why)
        for handle in waiting:
            handle.complete(SequenceResult([], "", "error", len(handle.request.prompt_ids), error=why))
