"""One step of the continuous batch on every rank: its plan, each rank's cache of the batch, and how it ended.

Rank 0 broadcasts a :class:`StepPlan`; every rank runs it with :func:`execute_step` on its own
:class:`BatchState` (the followers in :func:`follow_batch`). A step that raises on any rank is not left
to the ranks one by one: each rank says how its step ended in one small all-reduce (`_agree`, every
step), so every rank knows the same outcome and stays in the loop, receiving plans until the end plan.

* The joining prompts' prefill failed (an out-of-range token, a forward that raised; the whole prompts' or the
  chunk of a prompt prefilled in chunks) and nothing else: only the joining rows fail, the chunked one
  included; every rank leaves its batch as it was before the prefill, drops the chunked prompt's cache, and
  the running rows go on.
* Anything else failed (dropping rows, the decode forward, adding the prefilled rows): the batch's cache
  is no longer the same on every rank, so every row of the step fails and every rank empties its batch.
  Waiting requests then start a new batch at the next step.

An intervention (`%intervene`) that fails in a step, on any rank, fails the rows it applied to in that step (the
plan names them: `intervened`, `join_intervened`, `Chunk.intervened`); the batch itself is sound (the function was
skipped, its rows computed untouched from then on), so the other rows go on.

The prefill forward runs on every rank even after its decode failed, so when a step fails on every rank
at the same place (the usual case: the same code on the same inputs) the forwards' collectives still
line up. A step that raises on one rank *inside* a forward whose layers hold collectives (`tp`) leaves
the others in that collective; no agreement after the forward can reach them.
"""

from __future__ import annotations

import weakref
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from shardbook.rankd.control import user_calls
from shardbook.rankd.generation.cache_keyword import cache_keyword
from shardbook.rankd.generation.cache_rows import (
    append_rows,
    check_batchable,
    config_refusal,
    layer_refusal,
    select_rows,
)
from shardbook.rankd.generation.growing_layers import grow_in_place, kept_order
from shardbook.rankd.generation.intervention_state import Rows, applied_to, take_failure
from shardbook.rankd.generation.paged_layers import block_table, page, paged_refusal
from shardbook.rankd.generation.prefix_store import BLOCK_TOKENS, prefix_store
from shardbook.rankd.generation.row_attention import by_rows, over_latents
from shardbook.rankd.parallel.tp_modules import logits_on_first_rank_only

STEP_OK, JOIN_FAILED, STEP_FAILED = 0, 1, 2
"""How a step ended on a rank; the worst over the ranks is the step's outcome."""


@dataclass(frozen=True)
class Chunk:
    """A piece of a prompt too long for one step: each step feeds the next piece into the prompt's own one-row
    cache (the batch's rows decode meanwhile); after the last, that cache joins the batch as a new row."""

    tokens: list[int]
    start: int
    """Where the piece starts in its prompt (0: a new prompt, whose cache starts empty)."""
    last: bool
    """The prompt's last piece: its row joins the batch at this step."""
    all_logits: bool
    """Keep the logits of every position (the prompt is scored), not only the last piece's last one."""
    prefix: list[int] = field(default_factory=list)
    """The kept blocks (prefix_store keys) a new prompt's cache starts from; `start` is where they end."""
    end: int | None = None
    """The kept end state (prefix_store key) a new prompt's cache starts from instead; it holds `start` tokens."""
    intervened: bool = False
    """The model's interventions apply to this prompt (a notebook cell's)."""


@dataclass(frozen=True)
class StepPlan:
    """One step as rank 0 broadcasts it: every rank executes exactly this."""

    leave: list[int]
    """Rows (of the batch before this step) that leave, dropped first; the others are then in `kept_order`."""
    decode: list[int]
    """The token each remaining row feeds, in row order."""
    join: list[tuple[list[int], bool]]
    """Prompts prefilled together (one left-padded forward) then appended as new rows, each with whether all its
    logits are wanted."""
    chunk: Chunk | None = None
    """The next piece of the prompt prefilled in chunks (one forward into its own cache), run before `join`."""
    seeded: list[Chunk] = field(default_factory=list)
    """Prompts that start with kept blocks (or an end state) and whose rest fits the step: each its one piece, fed
    into its own one-row cache seeded from them, after `chunk` and before `join` (their rows join in that order)."""
    abandon: bool = False
    """The prompt prefilled in chunks was stopped: every rank drops its cache, first."""
    end: bool = False
    """The batch is empty and nothing waits: every rank leaves its loop."""
    keep: list[tuple[int, list[int]]] = field(default_factory=list)
    """Leaving rows whose blocks the prefix store keeps, first: (row, the keys of its whole blocks from its start)."""
    keep_ends: list[tuple[int, int, int]] = field(default_factory=list)
    """Leaving rows the prefix store keeps whole as end states, first: (row, its key, the blocks it counts for)."""
    keep_joined: list[tuple[int, list[int]]] = field(default_factory=list)
    """Rows joining at this step whose prompts' blocks the prefix store keeps once every rank agreed the step went
    well (a paged cache: their pool blocks are held, not copied), so prompts arriving while they run share them:
    (row after the step, the keys of its prompt's whole blocks)."""
    prefix_blocks: int = 0
    """Blocks the prefix store holds after this step (0: prefix reuse is off, the store empties)."""
    intervened: list[int] = field(default_factory=list)
    """Rows of `decode` (by index) that the model's interventions apply to (a notebook cell's; never a client's)."""
    join_intervened: list[int] = field(default_factory=list)
    """Prompts of `join` (by index) that the model's interventions apply to."""


@dataclass
class StepOutcome:
    """How one step ended, the same on every rank, and (when logits are kept) the logits rank 0 samples from."""

    decoded: torch.Tensor | None = None
    """The decode rows' next-token logits (rows, vocab), float32."""
    joined: list[torch.Tensor] = field(default_factory=list)
    """Per joining prompt, its logits (all its prompt's positions when wanted, else the last one)."""
    chunked: torch.Tensor | None = None
    """The chunk's logits (every position of it when its prompt is scored, else the last piece's last one)."""
    seeded: list[torch.Tensor | None] = field(default_factory=list)
    """Per seeded prompt, its last logits."""
    failure: int = STEP_OK
    """STEP_OK, JOIN_FAILED (the joining rows failed, the batch is as before) or STEP_FAILED (the batch is empty)."""
    errors: dict[int, str] = field(default_factory=dict)
    """Each failed rank's error, by rank."""
    intervention_error: str | None = None
    """An intervention failed in this step on some rank (each such rank's first failure): the rows it applied to
    fail, the others go on."""

    def error_text(self) -> str:
        """The failed ranks' errors, those failing alike once with their ranks."""
        by_text: dict[str, list[int]] = {}
        for rank, text in sorted(self.errors.items()):
            by_text.setdefault(text, []).append(rank)
        what = "the prefill of the joining prompts" if self.failure == JOIN_FAILED else "a batch step"
        parts = [f"rank(s) {', '.join(map(str, ranks))}: {text}" for text, ranks in by_text.items()]
        return f"{what} failed ({'; '.join(parts)})"


class BatchState:
    """One rank's view of the running batch: the cache, each row's attention mask and next position."""

    def __init__(self, model: Any, device: torch.device):
        self.model, self.device = model, torch.device(device)
        self.prefixes = prefix_store(model)
        self.paged = paged_refusal(model, self.device) is None
        """Whether the batch's full-attention layers are paged (`paged_layers`), in the store's pool."""
        self.cache: Any = None
        self.chunked_shared: list[int] = []
        self.clear()
        self.drop_chunked()

    def clear(self) -> None:
        """Empty the batch (not the prompt being prefilled in chunks): a paged batch's rows give their blocks back."""
        table = None if self.cache is None else block_table(self.cache)
        if table is not None:
            table.keep([])
        self.cache: Any = None
        self.mask: torch.Tensor | None = None  # (rows, columns), 1 on real tokens
        self.next_pos: torch.Tensor | None = None  # (rows,)

    def abandon(self) -> None:
        """After a failure: empty the batch, drop the chunked prompt and empty the store (what a failed step kept may
        differ between ranks); then no block of the store's pool is held, whatever the failure left half done."""
        self.cache, self.chunked_shared = None, []
        self.clear()
        self.drop_chunked()
        self.prefixes.trim(0)
        self.prefixes.forget_rows()

    def drop_chunked(self) -> None:
        """Forget the prompt being prefilled in chunks: its one-row cache, how many of its tokens it holds, and the
        kept blocks held for its row (given back)."""
        self.prefixes.pool.release(self.chunked_shared)
        self.chunked_cache: Any = None
        self.chunked_tokens, self.chunked_shared = 0, []

    @property
    def rows(self) -> int:
        return 0 if self.mask is None else self.mask.shape[0]

    def drop(self, leave: list[int]) -> None:
        if not leave:
            return
        order = kept_order(self.rows, leave)
        if not order:
            self.clear()
            return
        index = torch.tensor(order, device=self.device)
        self.mask, self.next_pos = self.mask[index], self.next_pos[index]
        first = int(torch.nonzero(self.mask.sum(0))[0])  # columns that are padding in every row are cut
        self.mask = self.mask[:, first:]
        select_rows(self.cache, order, self.mask.shape[1])

    def append(self, cache: Any, mask: torch.Tensor, shared: list[list[int]] | None = None) -> None:
        """Add the rows of `cache` (a left-padded prefill; `mask` (rows, columns) is 1 on its real tokens; a paged
        batch's rows start with their `shared` blocks, held for them, which hold their first positions)."""
        lengths = mask.sum(1).tolist()
        if self.cache is None:
            if self.paged:  # each row's positions in blocks: its memory follows its own length
                page(cache, lengths, self.model, self.prefixes.pool, shared)
            grow_in_place(cache)  # decode steps write into room after each layer's positions, not copy them
            self.cache, self.mask, self.next_pos = cache, mask, mask.sum(1)
            return
        columns = max(self.mask.shape[1], mask.shape[1])
        pad_batch, pad_new = columns - self.mask.shape[1], columns - mask.shape[1]
        append_rows(self.cache, cache, columns, lengths, shared)
        self.mask = torch.cat(
            [torch.nn.functional.pad(self.mask, (pad_batch, 0)), torch.nn.functional.pad(mask, (pad_new, 0))]
        )
        self.next_pos = torch.cat([self.next_pos, mask.sum(1)])


def execute_step(state: BatchState, plan: StepPlan, *, keep_logits: bool = True, group: Any = None) -> StepOutcome:
    """Run one step on this rank: drop the leaving rows, decode the others, feed the chunk, prefill the joining
    prompts, then agree with every rank on how the step ended (see the module). Every rank runs this with the
    same plan, so the forwards match. Only rank 0 keeps logits (`keep_logits`): a follower makes no float32
    copy of them.
    """
    code, error, outcome, appended = STEP_OK, None, StepOutcome(), 0
    with _logits_where_sampled(plan):
        try:
            if plan.abandon:
                state.drop_chunked()
            keep_blocks(state, plan)
            state.drop(plan.leave)
            if plan.decode:
                outcome.decoded = _decode(state, plan.decode, plan.intervened, keep_logits)
        except Exception as exc:
            code, error = STEP_FAILED, exc
        for prefill in (_chunk_step, _seeded_step, _join_step):  # each runs even after a failure: forwards line up
            try:
                new_rows = prefill(state, plan, outcome, keep_logits)
            except Exception as exc:
                code, error = max(code, JOIN_FAILED), error or exc
                continue
            for cache, mask, shared in new_rows:
                if code != STEP_OK:  # not appended: the kept blocks held for its rows are given back
                    state.prefixes.pool.release([block for held in shared or [] for block in held])
                    continue
                try:
                    state.append(cache, mask, shared)
                    appended += mask.shape[0]
                except Exception as exc:
                    code, error = STEP_FAILED, exc
    failed = take_failure(state.model)
    outcome.failure, outcome.errors, outcome.intervention_error = _agree(code, error, failed, state.device, group)
    if outcome.failure == STEP_OK:  # only then: every rank's store keeps the same keys
        for row, keys in plan.keep_joined:
            state.prefixes.keep(state.cache, row, int(state.next_pos[row]), keys)
    if not _intervenes(plan):
        user_calls.begin_command()  # no row calls the functions now: a stop pressed for earlier rows no longer holds
    if outcome.failure == JOIN_FAILED:
        if appended:  # this rank's prefill worked, another's did not: back to the batch before it
            state.drop(list(range(state.rows - appended, state.rows)))
        if plan.chunk is not None:
            state.drop_chunked()
        outcome.joined, outcome.chunked, outcome.seeded = [], None, []
    elif outcome.failure == STEP_FAILED:
        state.abandon()
        outcome.decoded, outcome.joined, outcome.chunked, outcome.seeded = None, [], None, []
    state.prefixes.trim(plan.prefix_blocks)
    return outcome


def _intervenes(plan: StepPlan) -> bool:
    """Whether an intervention's functions run in this step (on some row's tokens)."""
    pieces = [plan.chunk] if plan.chunk is not None else []
    return bool(plan.intervened or plan.join_intervened or any(piece.intervened for piece in pieces + plan.seeded))


def _logits_where_sampled(plan: StepPlan) -> AbstractContextManager:
    """Only rank 0 samples, so under `tp` a step gathers the logits there alone (`logits_on_first_rank_only`);
    a step that runs an intervention's functions gathers them on every rank, as outside the batch, since a
    function may read the output layer's output on any rank."""
    return nullcontext() if _intervenes(plan) else logits_on_first_rank_only()


def keep_blocks(state: BatchState, plan: StepPlan) -> None:
    """Keep the plan's leaving rows' blocks or end states in the prefix store (before they are dropped); a row's
    real tokens are the last positions of its cache."""
    for row, keys in plan.keep:
        tokens = int(state.next_pos[row])
        assert len(keys) * BLOCK_TOKENS <= tokens, "the plan keeps more blocks than the row holds"
        state.prefixes.keep(state.cache, row, tokens, keys)
    for row, key, cost in plan.keep_ends:
        state.prefixes.keep_end(state.cache, row, int(state.next_pos[row]), key, cost)


def _chunk_step(state: BatchState, plan: StepPlan, outcome: StepOutcome, keep_logits: bool) -> list[tuple]:
    """Feed the plan's chunk (if any) into its prompt's cache; after the last piece, the new row: that cache, its
    mask and the kept blocks held for it."""
    chunk = plan.chunk
    if chunk is None:
        return []
    seeded = bool(chunk.prefix) or chunk.end is not None
    assert seeded or chunk.start == state.chunked_tokens, "the plan's chunk does not continue this rank's prompt"
    if chunk.start == 0 or seeded:
        state.drop_chunked()
        state.chunked_cache, state.chunked_shared = _start_cache(state, chunk)
        state.chunked_tokens = chunk.start
    outcome.chunked = _feed_piece(state, state.chunked_cache, chunk, keep_logits)
    state.chunked_tokens = chunk.start + len(chunk.tokens)
    if not chunk.last:
        return []
    cache, columns, shared = state.chunked_cache, state.chunked_tokens, state.chunked_shared
    state.chunked_shared = []  # the row holds them now
    state.drop_chunked()
    return [(cache, torch.ones(1, columns, dtype=torch.long, device=state.device), [shared])]


def _seeded_step(state: BatchState, plan: StepPlan, outcome: StepOutcome, keep_logits: bool) -> list[tuple]:
    """Feed each seeded prompt's rest into its own one-row cache, seeded from what was kept: the new rows, as
    `_chunk_step`'s (a failure gives back the kept blocks held for those fed before it)."""
    rows: list[tuple] = []
    try:
        for chunk in plan.seeded:
            cache, shared = _start_cache(state, chunk)
            columns = chunk.start + len(chunk.tokens)
            rows.append((cache, torch.ones(1, columns, dtype=torch.long, device=state.device), [shared]))
            outcome.seeded.append(_feed_piece(state, cache, chunk, keep_logits))
    except Exception:
        state.prefixes.pool.release([block for _, _, (shared,) in rows for block in shared])
        raise
    return rows


def _join_step(state: BatchState, plan: StepPlan, outcome: StepOutcome, keep_logits: bool) -> list[tuple]:
    """Prefill the plan's joining prompts (if any) together: their cache and mask (no kept blocks held)."""
    if not plan.join:
        return []
    cache, mask, outcome.joined = _prefill(state, plan.join, plan.join_intervened, keep_logits)
    return [(cache, mask, None)]


def _start_cache(state: BatchState, chunk: Chunk) -> tuple[Any, list[int]]:
    """The one-row cache a prompt whose first piece is `chunk` starts from: empty, or seeded from the kept blocks
    or end state it names; and the kept pool blocks now held for its row (a paged batch's)."""
    from transformers import DynamicCache

    cache, shared = DynamicCache(config=state.model.config), []
    if chunk.prefix:
        assert chunk.start == len(chunk.prefix) * BLOCK_TOKENS, "the chunk does not start after its prefix"
        shared = state.prefixes.seed(cache, chunk.prefix, share=state.paged)
    if chunk.end is not None:
        held = state.prefixes.seed_end(cache, chunk.end)
        assert chunk.start == held, "the chunk does not start after its end state"
    return cache, shared


def _feed_piece(state: BatchState, cache: Any, chunk: Chunk, keep_logits: bool) -> torch.Tensor | None:
    """One forward of `chunk` into its prompt's one-row `cache`, at its own positions; the logits it keeps
    (float32, one row per position kept) when `keep_logits` and they are wanted."""
    device, end = state.device, chunk.start + len(chunk.tokens)
    rows = Rows((0,) if chunk.intervened else (), 1, len(chunk.tokens))
    with applied_to(state.model, rows), over_latents(state.model):  # a few new tokens over a long history
        out = state.model(
            input_ids=torch.tensor([chunk.tokens], device=device),
            attention_mask=torch.ones(1, end, dtype=torch.long, device=device),
            position_ids=torch.arange(chunk.start, end, device=device).view(1, -1),
            **{cache_keyword(state.model): cache},
            use_cache=True,
            cache_position=torch.arange(chunk.start, end, device=device),
            logits_to_keep=0 if chunk.all_logits else 1,  # alike on every rank
        )
    check_batchable(cache)
    if not keep_logits or not (chunk.all_logits or chunk.last):
        return None
    return out.logits[0].float()


def _decode(state: BatchState, tokens: list[int], intervened: list[int], keep_logits: bool) -> torch.Tensor | None:
    """One forward of one token per row (the interventions on the `intervened` rows only); the rows' next-token
    logits (float32) when `keep_logits`."""
    assert state.cache is not None and len(tokens) == state.rows, "the plan does not match the batch"
    device, columns = state.device, state.mask.shape[1]
    state.mask = torch.cat([state.mask, torch.ones(state.rows, 1, dtype=torch.long, device=device)], dim=1)
    table = block_table(state.cache)
    if table is not None:
        table.begin_step()
    with applied_to(state.model, Rows(tuple(intervened), state.rows, 1)), by_rows(), over_latents(state.model):
        out = state.model(
            input_ids=torch.tensor(tokens, device=device).view(-1, 1),
            attention_mask=state.mask,
            position_ids=state.next_pos.view(-1, 1),
            **{cache_keyword(state.model): state.cache},
            use_cache=True,
            cache_position=torch.arange(columns, columns + 1, device=device),
        )
    state.next_pos = state.next_pos + 1
    if table is not None:
        table.end_step()
    return out.logits[:, -1].float() if keep_logits else None


def _prefill(
    state: BatchState, join: list[tuple[list[int], bool]], intervened: list[int], keep_logits: bool
) -> tuple[Any, torch.Tensor, list[torch.Tensor]]:
    """One forward for every joining prompt, left-padded to the longest (the interventions on the `intervened`
    prompts only, cut to the longest of them): its cache and mask (for the batch to append) and, when
    `keep_logits`, each prompt's logits. The batch itself is not touched."""
    from transformers import DynamicCache

    width = max(len(prompt) for prompt, _ in join)
    ids = torch.zeros(len(join), width, dtype=torch.long)
    mask = torch.zeros(len(join), width, dtype=torch.long)
    for row, (prompt, _) in enumerate(join):
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    ids, mask = ids.to(state.device), mask.to(state.device)
    cache = DynamicCache(config=state.model.config)
    start = width - max((len(join[i][0]) for i in intervened), default=width)
    with applied_to(state.model, Rows(tuple(intervened), len(join), width, start)):
        out = state.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=(mask.cumsum(1) - 1).clamp(min=0),
            **{cache_keyword(state.model): cache},
            use_cache=True,
            cache_position=torch.arange(width, device=state.device),
            logits_to_keep=0 if any(all_logits for _, all_logits in join) else 1,  # alike on every rank
        )
    check_batchable(cache)
    if not keep_logits:
        return cache, mask, []
    logits = out.logits.float()
    return cache, mask, [logits[row, -len(prompt) if wanted else -1 :] for row, (prompt, wanted) in enumerate(join)]


def follow_batch(model: Any, device: torch.device | str, group: Any = None) -> int:
    """A follower's batch loop: execute the plans rank 0 broadcasts until it says the batch ended; returns the steps.

    A step that fails stays in the loop (every rank agreed on it, see the module): rank 0 fails its rows.
    """
    device = torch.device(device)
    state, steps = BatchState(model, device), 0
    with torch.no_grad():
        while True:
            plan = broadcast_plan(None, device, group)
            if plan.end:
                end_batch(state, plan)
                return steps
            execute_step(state, plan, keep_logits=False, group=group)
            steps += 1


def end_batch(state: BatchState, plan: StepPlan) -> None:
    """The end plan's work on every rank: keep the last rows' blocks (nothing is agreed after the last step; a
    rank whose copy fails empties its store, and a later prompt seeded from it fails on that rank, agreed)."""
    try:
        keep_blocks(state, plan)
    except Exception:
        state.prefixes.trim(0)
        raise
    finally:
        state.prefixes.trim(plan.prefix_blocks)
        state.clear()
        state.drop_chunked()
        state.prefixes.shrink_pool()  # an idle model holds about what its store keeps


def broadcast_plan(plan: StepPlan | None, device: torch.device, group: Any) -> StepPlan:
    """Rank 0's `plan`, on every rank."""
    if not _distributed(group):
        assert plan is not None
        return plan
    box = [plan]
    dist.broadcast_object_list(box, src=0, group=group, device=device if device.type != "cpu" else None)
    return box[0]


def _agree(
    code: int, error: BaseException | None, intervention: str | None, device: torch.device, group: Any
) -> tuple[int, dict[int, str], str | None]:
    """The worst of every rank's `code` and whether any rank's `intervention` failed (one all-reduce of two numbers
    per rank); each failed rank's error, and the failed interventions' texts (one all-gather, only when a rank
    failed)."""
    mine = None if error is None else _error_text(error)
    if not _distributed(group):
        return code, {} if mine is None else {0: mine}, intervention
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    codes = torch.zeros(2, world, dtype=torch.long, device=device)
    codes[0, rank], codes[1, rank] = code, intervention is not None
    try:
        dist.all_reduce(codes, group=group)
        codes, interventions = codes.tolist()
        if not any(codes) and not any(interventions):
            return STEP_OK, {}, None
        texts: list[Any] = [None] * world
        dist.all_gather_object(texts, (mine, intervention), group=group)
    except Exception as exc:
        if error is None:
            raise
        # the failure came first: the other ranks may still be in the step's own collectives (tp), and
        # the agreement then fails too; this rank's report must name the cause, not the timeout after it
        raise RuntimeError(f"{mine} (then the ranks could not agree on the failed step: {_error_text(exc)})") from error
    failed = "; ".join(text for _, text in texts if text is not None) or None
    return max(codes), {r: text for r, (text, _) in enumerate(texts) if text is not None}, failed


def _error_text(error: BaseException) -> str:
    try:
        return f"{type(error).__name__}: {error}"
    except Exception:  # a __str__ that raises must not hide the failure
        return type(error).__name__


def _distributed(group: Any) -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def cache_refusal(model: Any) -> str | None:
    """Why `model` cannot join the continuous batch (a cache layer kind `cache_rows` has no row operations for,
    chunked attention), or None when it can. Read from the cache the model's config
    describes, once per model (the server asks on every request)."""
    from transformers import DynamicCache

    if model not in _REFUSALS:
        _REFUSALS[model] = config_refusal(model.config) or layer_refusal(DynamicCache(config=model.config))
    return _REFUSALS[model]


_REFUSALS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
