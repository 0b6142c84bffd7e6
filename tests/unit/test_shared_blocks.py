"""Kept prefix blocks shared, not copied, by a paged batch (`block_pool`, `prefix_store`): a prompt that starts
with kept blocks takes the store's pool blocks as its row's first blocks, rows running together hold the same
ones, a block the store evicts stays its row's until the row leaves, and a pool left mostly free after a batch
shrinks to what the store keeps. Every reply's log-probabilities equal its prompt's decoded alone with nothing kept.

One process (no process group: the plan is not broadcast), a tiny random llama and GLM-5, rank 0's scheduler, on a
CPU where the decode kernel is built (the batch is paged).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shardbook.rankd.generation import decode_attention
from shardbook.rankd.generation.batch_steps import BatchState
from shardbook.rankd.generation.batching import BatchScheduler, SequenceRequest
from shardbook.rankd.generation.paged_layers import block_table
from shardbook.rankd.generation.prefix_store import BLOCK_TOKENS, block_keys, prefix_store
from tests.tiny import make_tiny_llama, make_tiny_mla

pytestmark = pytest.mark.skipif(not decode_attention.available(), reason="no C compiler here: nothing is paged")

SYSTEM = 3 * BLOCK_TOKENS


MAKERS = {
    "llama": lambda path: make_tiny_llama(path, hidden_size=72, num_heads=9, num_kv_heads=3),
    # MLA latents and the indexer's keys in the shared blocks (16 indexer heads: no exact ties in its top-k)
    "glm_moe_dsa": lambda path: make_tiny_mla(path, "glm_moe_dsa", index_n_heads=16),
}


@pytest.fixture(scope="module", params=list(MAKERS))
def model_and_tokenizer(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = MAKERS[request.param](tmp_path_factory.mktemp(request.param) / "model")
    model = AutoModelForCausalLM.from_pretrained(Path(path), dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(path)


@pytest.fixture
def joins(monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    """After every join of a paged batch: each row's blocks, each pool block's holders, the keys the store keeps."""
    seen: list[dict] = []
    append = BatchState.append

    def recording(self, cache, mask, shared=None) -> None:
        append(self, cache, mask, shared)
        table = block_table(self.cache)
        held = {"blocks": [list(blocks) for blocks in table.blocks], "holders": list(table.pool.holders)}
        seen.append({**held, "kept": set(self.prefixes.blocks)})

    monkeypatch.setattr(BatchState, "append", recording)
    return seen


def _ids(start: int, length: int) -> list[int]:
    return torch.randint(10, 200, (start + length,), generator=torch.Generator().manual_seed(7)).tolist()[start:]


def _request(prompt: list[int], tokens: int) -> SequenceRequest:
    return SequenceRequest(prompt_ids=prompt, max_new_tokens=tokens, ignore_eos=True, logprobs=1)


def _serve(
    model, tokenizer, prefix_tokens: int, schedule: list[tuple[int, SequenceRequest]], rows: list[int] | None = None
) -> list:
    """Run one batch: each (forward, request) of `schedule` is submitted once the batch has run that many forwards
    (0: before it starts). Each request's result; `rows` gets each forward's rows, where given. The KV budget: 200
    tokens where `rows` is given, else none."""
    budget = (200, "a test budget") if rows is not None else None
    scheduler = BatchScheduler(tokenizer, context=256, prefix_tokens=prefix_tokens, cache_tokens=budget)
    handles, forwards = {}, [0]

    def submit_due(_module, _args, kwargs) -> None:
        if rows is not None and kwargs:
            rows.append(kwargs["input_ids"].shape[0])
        for i, (due, request) in enumerate(schedule):
            if due == forwards[0] and i not in handles:
                handles[i] = scheduler.submit(request)
        forwards[0] += 1

    hook = model.register_forward_pre_hook(submit_due, with_kwargs=True)
    try:
        submit_due(model, (), {})
        with torch.no_grad():
            scheduler.run(model, "cpu")
    finally:
        hook.remove()
    results = [handles[i].wait(0) for i in range(len(schedule))]
    assert all(result.error is None for result in results), [result.error for result in results]
    return results


def _alone(model, tokenizer, request: SequenceRequest):
    """`request` decoded alone, nothing kept (the store empties)."""
    return _serve(model, tokenizer, 0, [(0, request)])[0]


def _assert_alike(got, want) -> None:
    assert got.token_ids == want.token_ids
    worst = max(abs(a - b) for a, b in zip(got.token_logprobs, want.token_logprobs, strict=True))
    assert worst <= 1e-5, worst


def test_rows_that_start_with_kept_blocks_hold_the_stores_blocks_not_copies(model_and_tokenizer, joins) -> None:
    model, tokenizer = model_and_tokenizer
    store, system = prefix_store(model), _ids(0, SYSTEM)
    first, second, third = (_request(system + _ids(50 + 20 * i, 10 + i), 12) for i in range(3))
    want = [_alone(model, tokenizer, request) for request in (second, third)]
    _serve(model, tokenizer, 4096, [(0, first)])
    kept = [store.blocks[key] for key in block_keys(system)]
    assert all(isinstance(block, int) for block in kept)  # the leaving row's own pool blocks
    stored, shared = store.stats["stored_blocks"], store.stats["shared_blocks"]
    joins.clear()
    got = _serve(model, tokenizer, 4096, [(0, second), (3, third)])  # the third joins while the second decodes
    assert [result.cached_tokens for result in got] == [SYSTEM, SYSTEM]
    assert [join["blocks"][-1][:3] for join in joins] == [kept, kept]  # both rows' first blocks: the store's
    assert [joins[-1]["holders"][block] for block in kept] == [3, 3, 3]  # the store and both rows
    assert store.stats["shared_blocks"] - shared == 2 * 3
    assert (
        store.stats["stored_blocks"] - stored
        == sum(  # the system prompt's blocks were not kept again
            len(block_keys(request.prompt_ids + result.token_ids[:-1])) - 3
            for request, result in zip((second, third), got)
        )
    )
    for result, alone in zip(got, want):
        _assert_alike(result, alone)


def test_a_block_the_store_evicts_stays_its_rows_until_the_row_leaves(model_and_tokenizer, joins) -> None:
    """A three-block store: a prompt seeded from the system prompt's blocks decodes while another request leaves
    and its blocks evict them; a third request's join then takes no block the running row holds."""
    model, tokenizer = model_and_tokenizer
    store, system = prefix_store(model), _ids(0, SYSTEM)
    store.trim(0)
    running, leaving, later = _request(system + _ids(60, 9), 16), _request(_ids(100, 60), 1), _request(_ids(170, 40), 2)
    want = _alone(model, tokenizer, running)
    _serve(model, tokenizer, SYSTEM, [(0, _request(system + _ids(80, 5), 2))])
    kept = [store.blocks[key] for key in block_keys(system)]
    joins.clear()
    got = _serve(model, tokenizer, SYSTEM, [(0, running), (2, leaving), (6, later)])
    assert got[0].cached_tokens == SYSTEM
    assert not set(block_keys(system)) & joins[-1]["kept"]  # evicted while the row still ran
    running_blocks, later_blocks = joins[-1]["blocks"]  # when the third joined
    assert [joins[-1]["holders"][block] for block in kept] == [1, 1, 1]  # the row's alone
    assert running_blocks[:3] == kept and not set(running_blocks) & set(later_blocks)
    _assert_alike(got[0], want)


def test_a_pool_left_mostly_free_after_a_batch_shrinks_to_the_kept_blocks(model_and_tokenizer, joins) -> None:
    model, tokenizer = model_and_tokenizer
    store, start = prefix_store(model), _ids(0, 2 * BLOCK_TOKENS)
    store.trim(0)
    again = _request(start + _ids(40, 20), 6)
    want = _alone(model, tokenizer, again)
    _serve(model, tokenizer, 2 * BLOCK_TOKENS, [(0, _request(start + _ids(60 + 5 * i, 118), 2)) for i in range(8)])
    assert len(joins[-1]["holders"]) >= 8 * 10  # eight rows of ten blocks
    pooled = [store.blocks[key] for key in block_keys(start)]
    assert store.pool.capacity == 2 and sorted(pooled) == [0, 1]  # the rows' blocks went; the kept two moved
    assert {pool.shape[0] for pools in store.pool.pools.values() for pool in pools.values()} == {2}
    got = _serve(model, tokenizer, 2 * BLOCK_TOKENS, [(0, again)])[0]
    assert got.cached_tokens == 2 * BLOCK_TOKENS
    _assert_alike(got, want)


def test_a_prompt_arriving_while_another_with_its_beginning_runs_shares_that_rows_blocks(
    model_and_tokenizer, joins
) -> None:
    """Nothing is kept before: a joining row's prompt blocks are kept as it joins (held, no copy), so a request
    with the same document that arrives while it decodes starts from them."""
    model, tokenizer = model_and_tokenizer
    store, document = prefix_store(model), _ids(0, SYSTEM)
    first, second = _request(document + _ids(90, 7), 12), _request(document + _ids(110, 12), 6)
    want = _alone(model, tokenizer, second)
    assert not store.blocks
    joins.clear()
    got = _serve(model, tokenizer, 4096, [(0, first), (3, second)])
    assert [result.cached_tokens for result in got] == [0, SYSTEM]
    first_blocks, second_blocks = joins[-1]["blocks"]
    assert second_blocks[:3] == first_blocks[:3] and not set(second_blocks[3:]) & set(first_blocks)
    _assert_alike(got[1], want)


def test_requests_with_one_new_document_sent_together_share_the_first_ones_blocks(model_and_tokenizer, joins) -> None:
    """Nothing kept and all sent at once: the first is prefilled whole, the others wait one step and are seeded
    from its blocks (each prefills only its question), every row holding the same document blocks."""
    model, tokenizer = model_and_tokenizer
    store, document = prefix_store(model), _ids(0, SYSTEM)
    store.trim(0)
    batch = [_request(document + _ids(130 + 10 * i, 9), 4) for i in range(3)]
    want = [_alone(model, tokenizer, request) for request in batch]
    joins.clear()
    got = _serve(model, tokenizer, 4096, [(0, request) for request in batch])
    assert [result.cached_tokens for result in got] == [0, SYSTEM, SYSTEM]
    assert len(joins) == 3 and len({tuple(blocks[:3]) for blocks in joins[-1]["blocks"]}) == 1
    for result, alone in zip(got, want):
        _assert_alike(result, alone)


def test_the_kv_budget_counts_kept_blocks_once_for_all_the_rows_holding_them(model_and_tokenizer) -> None:
    """Four requests starting with the same kept 64-token document, each reaching 80 tokens (5 blocks), under a
    budget of 200 tokens: counted per row they need 320 and two at a time would decode; their rows share the
    document's 4 blocks, so they hold 4 + 4 x 1 blocks (128 tokens) and all four decode together."""
    model, tokenizer = model_and_tokenizer
    prefix_store(model).trim(0)
    document = _ids(0, 4 * BLOCK_TOKENS)
    _serve(model, tokenizer, 4096, [(0, _request(document + _ids(290, 8), 2))])  # keeps the document's blocks
    rows: list[int] = []
    questions = [(0, _request(document + _ids(300 + 10 * i, 8), 8)) for i in range(4)]
    got = _serve(model, tokenizer, 4096, questions, rows)
    assert [result.cached_tokens for result in got] == [4 * BLOCK_TOKENS] * 4
    assert max(rows) == 4, rows
