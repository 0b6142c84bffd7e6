"""Prefix reuse on two gloo ranks: a next turn and a shared prefix take kept blocks instead of prefilling them, and
for a model whose cache cannot be cut into blocks (a sliding window, a linear-attention state) a next turn takes
its history's kept end state.

A tiny llama (float32, context 256) and token-id prompts. Every rank runs the same batches one after another (rank 0
leads, the follower follows), so each rank's prefix store outlives a batch as it does between two cells. The
forwards every rank ran are recorded (rows, tokens, first position) with rank 0's last-position logits, and the
follower's store is compared with rank 0's block for block.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from shardbook.rankd.generation import decode_attention
from tests.tiny import make_tiny_llama

pytestmark = pytest.mark.timeout(300)

BLOCK = 16
REPLY = 12


def _scenarios(rank: int, path: Path, layout: str, turns_only: bool = False) -> dict[str, Any]:
    import torch

    from shardbook.rankd.config.schema import ModelConfig, ParallelConfig, ShardbookConfig
    from shardbook.rankd.generation.batching import BatchScheduler, SequenceRequest, follow_batch
    from shardbook.rankd.generation.prefix_store import prefix_store, reuse_kind
    from shardbook.rankd.loading.load_sharded import load_sharded

    config = ShardbookConfig(
        model=ModelConfig(model_name_or_path=str(path), dtype="float32"), parallel=ParallelConfig(decode=layout)
    )
    loaded = load_sharded(config, device="cpu")
    model, tokenizer = loaded.model, loaded.tokenizer
    store, layers = prefix_store(model), model.config.num_hidden_layers
    ids = torch.randint(10, 200, (200,), generator=torch.Generator().manual_seed(1)).tolist()

    def batch(prompts: list[list[int]], prefix_tokens: int) -> dict:
        forwards: list[tuple] = []

        def record(_module, _args, kwargs, out) -> None:
            rows, tokens = kwargs["input_ids"].shape
            forwards.append((rows, tokens, int(kwargs["position_ids"][0, 0]), out.logits[0, -1].float().clone()))

        hook = model.register_forward_hook(record, with_kwargs=True)
        try:
            if rank != 0:
                follow_batch(model, "cpu")
                return {
                    "forwards": [f[:3] for f in forwards],
                    "blocks": _blocks(store, layers),
                    "ends": _ends(store),
                }
            scheduler = BatchScheduler(tokenizer, context=256, prefix_tokens=prefix_tokens)
            requests = [SequenceRequest(prompt_ids=p, max_new_tokens=REPLY, ignore_eos=True) for p in prompts]
            handles = [scheduler.submit(r) for r in requests]
            scheduler.run(model, "cpu")
        finally:
            hook.remove()
        results = [h.wait(0) for h in handles]
        return {
            "forwards": [f[:3] for f in forwards],
            "prefill_logits": forwards[0][3],
            "results": [(r.token_ids, r.cached_tokens, r.error) for r in results],
            "blocks": _blocks(store, layers),
            "ends": _ends(store),
            "store": dict(store.stats),
            "stats": {k: scheduler.stats[k] for k in ("prefix_hits", "cached_tokens")},
        }

    with torch.no_grad():
        out: dict[str, Any] = {}
        first = ids[:40]
        out["turn1"] = batch([first], 4096)
        second = first + out["turn1"]["results"][0][0] if rank == 0 else None
        second = _shared(second, rank) + ids[40:50]
        out["second_len"] = len(second)
        out["turn2"] = batch([second], 4096)
        store.trim(0)
        out["cold"] = batch([second], 0)
        if turns_only:
            return out
        if reuse_kind(model) == "ends":
            return {**out, **_end_scenarios(batch, store, ids)}
        system = ids[100:148]  # three whole blocks
        out["shared_a"] = batch([system + ids[150:160]], 4096)
        out["shared_b"] = batch([system + ids[160:175]], 4096)
        out["shared_pair"] = batch([system + ids[176:186], system + ids[186:190]], 4096)
        store.trim(0)
        out["evictions_before_tiny"] = store.stats["evictions"]
        out["tiny_a"] = batch([ids[:60]], 2 * BLOCK)
        out["tiny_b"] = batch([ids[100:140]], 2 * BLOCK)
        out["tiny_a_again"] = batch([ids[:60]], 2 * BLOCK)
        return out


def _end_scenarios(batch: Any, store: Any, ids: list[int]) -> dict[str, Any]:
    """End states: a prompt that starts with an earlier prompt but not with its reply reuses the prompt's; one that
    shares only a beginning reuses nothing; beyond the budget the least recently used go."""
    out: dict[str, Any] = {}
    batch([ids[:40]], 4096)
    out["edited"] = batch([ids[:40] + ids[60:80]], 4096)
    system = ids[100:148]
    out["shared_a"] = batch([system + ids[150:160]], 4096)
    out["shared_b"] = batch([system + ids[160:175]], 4096)
    store.trim(0)
    out["lru_a"] = batch([ids[:60]], 4096)
    out["budget"] = store.size + 1
    out["lru_b"] = batch([ids[100:140]], out["budget"] * BLOCK)
    out["lru_a_again"] = batch([ids[:60] + ids[60:70]], out["budget"] * BLOCK)
    return out


def _shared(value: Any, rank: int) -> Any:
    """Rank 0's `value` on every rank (a follower cannot know rank 0's reply)."""
    import torch.distributed as dist

    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _blocks(store: Any, layers: int) -> list[tuple[int, tuple[int, ...], list[list[str]], bool]]:
    """The store's keys in least-recently-used order, with one block's key shape, what it holds per layer of
    `layers`, and whether it is a pool block (kept from a paged batch, not copied)."""
    kept = []
    for key, entry in store.blocks.items():
        parts = [store.block_parts(key, layer) for layer in range(layers)]
        kept.append((key, tuple(parts[0]["keys"].shape), [sorted(part) for part in parts], isinstance(entry, int)))
    return kept


def _ends(store: Any) -> list[tuple[int, int, int]]:
    """The store's end states in least-recently-used order: (key, tokens held, cost in blocks)."""
    return [(key, end.tokens, end.cost) for key, end in store.ends.items()]


@pytest.fixture(scope="module")
def llama_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny") / "model", hidden_size=72, num_heads=9, num_kv_heads=3)


@pytest.fixture(scope="module", params=["gather", "tp"])
def answer(request: pytest.FixtureRequest, llama_path: Path) -> dict:
    return _answer(llama_path, request.param)


@pytest.fixture(scope="module")
def glm5_answer(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """GLM-5's architecture (MLA, a sparse-attention indexer choosing 4 positions, a layer sharing another's
    choice) under tp: its cache layers keep the indexer's keys beside the attention's. 8 indexer heads, not the
    tiny models' 2: with 2, a position's score is often exactly 0 (both heads' ReLU at 0), and `topk` orders such
    ties by the forward's shape, so even transformers' own prefill in two chunks differs from one (by up to 1.3 in
    the logits here); with 8 a chunked prefill equals a whole one within 2e-6."""
    from tests.tiny import make_tiny_mla

    path = make_tiny_mla(tmp_path_factory.mktemp("glm5") / "model", "glm_moe_dsa", index_n_heads=8)
    return _answer(path, "tp", turns_only=True)


def _answer(path: Path, layout: str, turns_only: bool = False) -> dict:
    from tests.ranks import run_ranks

    leader, follower = run_ranks(_scenarios, path, layout, turns_only, deadline=240)
    for name, got in leader.items():
        if isinstance(got, dict):  # every rank ran the same forwards and keeps the same blocks, in the same order
            assert follower[name]["forwards"] == got["forwards"], name
            assert [block[0] for block in follower[name]["blocks"]] == [block[0] for block in got["blocks"]], name
            assert follower[name]["ends"] == got["ends"], name
    leader["layout"] = layout
    leader["follower"] = follower
    return leader


@pytest.fixture(scope="module", params=["gpt_oss", "qwen3_next"])
def ends_answer(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """gpt-oss (a sliding window of 16 positions on every other layer: shorter than the history it keeps, longer than
    turn 2's 10 new tokens, so their window reaches into the kept state) and Qwen3-Next (a Gated DeltaNet layer,
    then attention) under tp: their caches are kept as end states."""
    from tests.tiny import TP_FAMILIES, make_tiny_lm, random_biases

    path = tmp_path_factory.mktemp(request.param) / "model"
    window = {"sliding_window": 16} if request.param == "gpt_oss" else {}
    make_tiny_lm(path, family=request.param, init=random_biases, **window, **TP_FAMILIES[request.param])
    return _answer(path, "tp")


def test_a_next_turn_prefills_only_its_new_tokens_and_its_logits_equal_a_cold_prefill(answer: dict) -> None:
    _assert_next_turn_reuses_its_history(answer)


def test_a_next_turn_continues_its_history_end_state_past_a_sliding_window_or_a_linear_state(ends_answer: dict) -> None:
    """The whole history is reused, not only its whole blocks: 51 tokens (40 of the prompt, 11 of the reply)."""
    _assert_next_turn_reuses_its_history(ends_answer, kept=40 + REPLY - 1)
    assert ends_answer["turn2"]["blocks"] == []
    n = ends_answer["second_len"]  # each turn's prompt alone, then the whole turn, is kept
    assert [tokens for _, tokens, _ in ends_answer["turn2"]["ends"]] == [40, 40 + REPLY - 1, n, n + REPLY - 1]


def test_a_next_turn_whose_history_differs_from_the_reply_reuses_the_last_prompt(ends_answer: dict) -> None:
    """A history rendered otherwise than the reply was generated (a reasoning model's thinking dropped): the next
    prompt starts with the last prompt, not with the whole last turn."""
    edited = ends_answer["edited"]
    assert edited["results"][0][1] == 40
    assert edited["forwards"][0] == (1, 20, 40)


def test_end_states_are_not_shared_by_prompts_that_only_begin_alike(ends_answer: dict) -> None:
    a, b = ends_answer["shared_a"], ends_answer["shared_b"]
    assert a["results"][0][1] == 0 and b["results"][0][1] == 0
    assert b["forwards"][0] == (1, 48 + 15, 0)  # prefilled whole
    assert [tokens for _, tokens, _ in b["ends"]][-4:] == [58, 58 + REPLY - 1, 63, 63 + REPLY - 1]


def test_end_states_are_evicted_least_recently_used_by_their_cost(ends_answer: dict) -> None:
    """A budget one block over what a's prompt and whole sequence cost: b's two end states take a's place."""
    a, b, again = ends_answer["lru_a"], ends_answer["lru_b"], ends_answer["lru_a_again"]
    assert [tokens for _, tokens, _ in a["ends"]] == [60, 60 + REPLY - 1]
    assert [tokens for _, tokens, _ in b["ends"]] == [40, 40 + REPLY - 1]
    assert sum(cost for _, _, cost in b["ends"]) <= ends_answer["budget"]
    assert b["store"]["evictions"] - a["store"]["evictions"] == sum(cost for _, _, cost in a["ends"])
    assert again["results"][0][1] == 0 and again["forwards"][0] == (1, 70, 0)  # a's prompt was evicted


def test_glm5_next_turn_reuses_its_history_indexer_included(glm5_answer: dict) -> None:
    _assert_next_turn_reuses_its_history(glm5_answer)


def _assert_next_turn_reuses_its_history(answer: dict, kept: int = (40 + REPLY - 1) // BLOCK * BLOCK) -> None:
    """`kept`: what turn 2 reuses of turn 1's cache (its prompt and its reply but the last token): by default its
    whole blocks."""
    n = answer["second_len"]
    warm, cold = answer["turn2"], answer["cold"]
    assert warm["forwards"][0] == (1, n - kept, kept)  # one row, only the new tokens, at their own positions
    assert cold["forwards"][0] == (1, n, 0)
    assert warm["results"][0][1] == kept and cold["results"][0][1] == 0
    assert warm["stats"] == {"prefix_hits": 1, "cached_tokens": kept}
    assert (warm["prefill_logits"] - cold["prefill_logits"]).abs().max() <= 1e-5
    assert warm["results"][0][0] == cold["results"][0][0]


def test_requests_that_share_a_prefix_share_its_blocks(answer: dict) -> None:
    a, b = answer["shared_a"], answer["shared_b"]
    assert a["results"][0][1] == 0 and b["results"][0][1] == 3 * BLOCK
    assert b["forwards"][0] == (1, 48 + 15 - 48, 48)
    blocks_b = (48 + 15 + REPLY - 1) // BLOCK
    assert b["store"]["stored_blocks"] - a["store"]["stored_blocks"] == blocks_b - 3  # the system prompt's: once
    keys_a, keys_b = [block[0] for block in a["blocks"]], [block[0] for block in b["blocks"]]
    assert len(set(keys_a) & set(keys_b)) == len(keys_a)
    heads = {block[1] for block in b["blocks"]} | {block[1] for block in answer["follower"]["shared_b"]["blocks"]}
    for blocks in (b["blocks"], answer["follower"]["shared_b"]["blocks"]):  # a paged batch keeps its own blocks
        assert {pooled for *_, pooled in blocks} == {decode_attention.available()}
    if answer["layout"] == "gather":
        assert heads == {(3, BLOCK, 8)}
    else:  # under tp each rank keeps its own heads' keys and values only
        assert all(shape[0] < 3 and shape[1:] == (BLOCK, 8) for shape in heads), heads


def test_requests_sent_together_are_all_seeded_from_kept_blocks_at_one_step(answer: dict) -> None:
    pair = answer["shared_pair"]
    assert [cached for _, cached, _ in pair["results"]] == [3 * BLOCK, 3 * BLOCK]
    assert pair["forwards"][:3] == [(1, 10, 48), (1, 4, 48), (2, 1, 58)]  # each its rest, then decoded together


def test_blocks_are_evicted_least_recently_used_within_a_tiny_budget(answer: dict) -> None:
    from shardbook.rankd.generation.prefix_store import block_keys

    a, b, again = answer["tiny_a"], answer["tiny_b"], answer["tiny_a_again"]
    assert [len(x["blocks"]) for x in (a, b, again)] == [2, 2, 2]
    evicted = a["store"]["evictions"] - answer["evictions_before_tiny"]
    if decode_attention.available():  # paged: its prompt's blocks were kept as it joined (its third evicted), then
        assert evicted == (60 // BLOCK - 2) + ((60 + REPLY - 1) // BLOCK - 2)  # its reply's at its leave
    else:
        assert evicted == (60 + REPLY - 1) // BLOCK - 2
    ids = torch.randint(10, 200, (200,), generator=torch.Generator().manual_seed(1)).tolist()
    assert {block[0] for block in a["blocks"]} == set(block_keys(ids[: 2 * BLOCK]))  # its last blocks went first
    assert b["results"][0][1] == 0
    # b kept its three blocks (paged: its prompt's two as it joined, a's two going), and three went: a's two, b's last
    assert b["store"]["evictions"] - a["store"]["evictions"] == (40 + REPLY - 1) // BLOCK
    assert {block[0] for block in b["blocks"]} == set(block_keys(ids[100 : 100 + 2 * BLOCK]))
    assert again["results"][0][1] == 0  # a's blocks were evicted: prefilled whole
    assert again["forwards"][0] == (1, 60, 0)


def test_glm5_blocks_keep_the_indexer_keys_of_the_layers_that_choose(glm5_answer: dict) -> None:
    """Layers 0 and 1 run their own indexer (their blocks hold its keys); layer 2 reuses layer 1's choice and holds
    keys and values only, on both ranks."""
    for blocks in (glm5_answer["turn2"]["blocks"], glm5_answer["follower"]["turn2"]["blocks"]):
        assert blocks and all(
            held == [["indexer_keys", "keys", "values"]] * 2 + [["keys", "values"]] for _, _, held, _ in blocks
        )
